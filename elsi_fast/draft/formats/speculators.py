"""The "speculators" folder: config.json and model.safetensors as speculators 0.9 writes them and
`speculators.SpeculatorModel.from_pretrained` and vLLM's speculators path read them
(`Eagle3Config.to_speculators_dict`: the layer fields nested in `transformer_layer_config`, the
verifier named in `speculators_config`; the decoder layer's tensors under `layers.0.*`, `d2t` /
`t2d` only when the draft vocabulary is smaller than the target's). Read back by
`formats.folder.read`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from . import folder

if TYPE_CHECKING:
    from ..model import Eagle3Draft


def write(draft: "Eagle3Draft", path: str | os.PathLike, *, target_config: Any = None,
          include_embedding: bool = True, speculative_tokens: int = 3) -> None:
    """config.json + model.safetensors in directory `path`.

    target_config (required): the target's transformers config (or its dict), whose verifier block
    (name_or_path, architectures) it fills, checked against the draft (hidden size, vocabulary,
    layer ids within 0..N). include_embedding: also write the target's embedding, by default yes
    (speculators 0.9 fills a missing embedding from the verifier only when it is NaN, and
    transformers 5 can leave it as uninitialized memory instead). speculative_tokens: the proposal
    length the config advertises.
    """
    folder.check_include_embedding(include_embedding)
    target = folder.resolve_target(draft, target_config)
    if target is None:
        raise ValueError("format='speculators' needs target_config (the target's config): speculators names the "
                         "verifier and reads its layer count from it")
    config = draft.config
    verifier = {"name_or_path": target.get("_name_or_path") or target.get("name_or_path") or None,
                "architectures": target.get("architectures") or []}
    config_dict = config.to_speculators_dict(verifier, speculative_tokens)
    config_dict["dtype"] = folder.weights_dtype_name(draft)
    state = {_speculators_name(name): t for name, t in folder.cpu_state(draft).items()
             if config.draft_vocab_size != config.vocab_size or name not in ("d2t", "t2d")}
    if include_embedding:
        state[folder.EMBED_NAME] = folder.embedding_tensor(draft, "speculators")
    folder.write_folder(path, config_dict, state)


def _speculators_name(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name
