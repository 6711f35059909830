"""The "eagle3" folder: config.json and model.safetensors as SpecForge / EAGLE3 write them and
vLLM, SGLang and SpecForge read them (`Eagle3Config.to_dict`: the layer ids in both conventions
of `engines.layer_ids` and `num_aux_hidden_states`; tensors under their canonical names
`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`). Read back by
`formats.folder.read`."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from . import folder

if TYPE_CHECKING:
    from ..model import Eagle3Draft


def write(draft: "Eagle3Draft", path: str | os.PathLike, *, target_config: Any = None,
          include_embedding: bool = False) -> None:
    """config.json + model.safetensors in directory `path`.

    target_config: the target's transformers config (or its dict), optional; when given, the draft
    is checked against it (hidden size, vocabulary, layer ids within 0..N). include_embedding: also
    write the target's embedding (the draft must have one attached); engines share the target's,
    so by default it is left out.
    """
    folder.check_include_embedding(include_embedding)
    folder.resolve_target(draft, target_config)
    config_dict = draft.config.to_dict()
    config_dict["torch_dtype"] = folder.weights_dtype_name(draft)
    state = folder.cpu_state(draft)
    if include_embedding:
        state[folder.EMBED_NAME] = folder.embedding_tensor(draft, "eagle3")
    folder.write_folder(path, config_dict, state)
