"""What the folder formats share: a directory with `config.json` and the weights, its reader, and
the check of a draft against its target's config.

The two folder formats are "eagle3" (`formats.eagle3`: SpecForge / EAGLE names `fc.weight`,
`midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`) and "speculators"
(`formats.speculators`: `layers.0.*` for the decoder layer, `d2t` / `t2d` only when the draft
vocabulary is smaller than the target's); `read` takes either, the format read from
`config.json` (`speculators_model_type`, see `draft.config`). Variant tensors: `input_norm.weight`
(norm_before_fc), `fc_norm.{i}.weight`, `*.self_attn.{q,k}_norm.weight` (qk_norm).

Weights: `model.safetensors`, a sharded `model.safetensors.index.json`, or `pytorch_model.bin`
read with `torch.load(weights_only=True)` (a checkpoint never gets to unpickle arbitrary objects).
The target's embedding `embed_tokens.weight` is written only on request (`include_embedding`):
speculators otherwise fills it from the verifier named in the config, or leaves it uninitialized
when it cannot; a checkpoint that carries it supplies it on load.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..config import Eagle3Config
from ..model import Eagle3Draft

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
EMBED_NAME = "embed_tokens.weight"
# Frozen copies of the target's final norm and lm_head that speculators keeps for its training loss;
# they are not part of the draft's computation.
_SPECULATORS_TRAINING_ONLY = ("verifier_norm.weight", "verifier_lm_head.weight")


def read_config_dict(path: str | os.PathLike) -> dict:
    """The raw `config.json` of a checkpoint directory."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in draft checkpoint directory {path}")
    with open(file) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object")
    return data


def read_config(path: str | os.PathLike, norm_output_meaning: str | None = None) -> Eagle3Config:
    """The `Eagle3Config` of a checkpoint directory of either format (see `Eagle3Config.from_dict`)."""
    return Eagle3Config.from_dict(read_config_dict(path), norm_output_meaning=norm_output_meaning)


def read_tensors(path: str | os.PathLike) -> dict[str, Tensor]:
    """All tensors of a checkpoint directory under canonical names (`midlayer.*`, no `model.` prefix)."""
    from safetensors.torch import load_file

    root = Path(path)
    if (root / SAFETENSORS_FILE).is_file():
        raw = load_file(root / SAFETENSORS_FILE)
    elif (root / SAFETENSORS_INDEX_FILE).is_file():
        with open(root / SAFETENSORS_INDEX_FILE) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        raw = {}
        for shard in shards:
            raw.update(load_file(root / shard))
    elif (root / BIN_FILE).is_file():
        try:
            raw = torch.load(root / BIN_FILE, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise ValueError(f"{root / BIN_FILE} holds more than tensors; refusing to unpickle it") from err
        if not isinstance(raw, dict) or not all(isinstance(v, Tensor) for v in raw.values()):
            raise ValueError(f"{root / BIN_FILE} must hold a dict of name -> tensor")
    else:
        raise FileNotFoundError(
            f"no weights in draft checkpoint directory {path}: expected {SAFETENSORS_FILE}, "
            f"{SAFETENSORS_INDEX_FILE} or {BIN_FILE}"
        )
    out: dict[str, Tensor] = {}
    for name, tensor in raw.items():
        if name in _SPECULATORS_TRAINING_ONLY:
            continue
        canonical = _canonical_name(name)
        if canonical in out:
            raise ValueError(f"checkpoint has tensor {canonical!r} twice (under two naming schemes)")
        out[canonical] = tensor
    return out


def _canonical_name(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model."):]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0."):]
    return name


def read(path: str | os.PathLike, *, embed_tokens: Tensor | nn.Embedding | None = None,
         dtype: torch.dtype | None = None, device: torch.device | str | None = None,
         norm_output_meaning: str | None = None) -> Eagle3Draft:
    """The draft in a checkpoint directory of either folder format; every missing, unexpected or
    misshaped tensor is an error. Weights keep the checkpoint dtype unless `dtype` is given. The
    target embedding comes from `embed_tokens`, else from the checkpoint if it has one.
    `norm_output_meaning` ("vllm", "sglang" or "specforge") is needed only for an eagle3 config
    with a `norm_output` field, whose meaning differs between engines."""
    config = read_config(path, norm_output_meaning)
    tensors = read_tensors(path)
    stored_embed = tensors.pop(EMBED_NAME, None)
    with torch.device("meta"):
        model = Eagle3Draft(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    _complete_vocab_maps(tensors, config)
    _check_names_and_shapes(tensors, expected, config)
    if dtype is None:
        dtype = tensors["fc.weight"].dtype
    device = torch.device("cpu") if device is None else torch.device(device)
    state = {}
    for name, tensor in tensors.items():
        if name == "d2t":
            tensor = tensor.to(torch.int64)
        elif name == "t2d":
            tensor = tensor.to(torch.bool)
        else:
            tensor = tensor.to(dtype)
        state[name] = tensor.to(device)
    model.load_state_dict(state, strict=True, assign=True)
    _check_vocab_maps(model.d2t, model.t2d, config)
    embed = embed_tokens if embed_tokens is not None else stored_embed
    if embed is not None:
        model.attach_embedding(embed if embed_tokens is not None else embed.to(device))
    return model


def resolve_target(draft: Eagle3Draft, target_config: Any) -> dict | None:
    """target_config (the target's transformers config or its dict) as a dict, checked against the
    draft (hidden size, vocabulary, layer ids within 0..N); None stays None."""
    if target_config is None:
        return None
    target = _target_dict(target_config)
    _check_target(draft.config, target)
    return target


def check_include_embedding(include_embedding: Any) -> None:
    if not isinstance(include_embedding, bool):
        raise TypeError(f"include_embedding must be a bool, got {include_embedding!r}")


def weights_dtype_name(draft: Eagle3Draft) -> str:
    """The draft's weight dtype as config.json spells it ("float32", "bfloat16", ...)."""
    return str(draft.fc.weight.dtype).removeprefix("torch.")


def cpu_state(draft: Eagle3Draft) -> dict[str, Tensor]:
    """The draft's state dict (canonical `midlayer.*` names, `d2t`, `t2d`) as contiguous CPU tensors."""
    return {name: t.detach().to("cpu").contiguous() for name, t in draft.state_dict().items()}


def embedding_tensor(draft: Eagle3Draft, format: str) -> Tensor:
    """The target's embedding the draft holds, in the draft's weight dtype, to store as `EMBED_NAME`."""
    if draft.embed_tokens is None:
        raise ValueError(f"format={format!r} with include_embedding writes the target's embedding, but the draft "
                         f"has none attached: attach_embedding(target.get_input_embeddings().weight)"
                         + (", or pass include_embedding=False and check that your speculators version "
                            "loads it from the verifier" if format == "speculators" else ""))
    return draft.embed_tokens.weight.detach().to(device="cpu", dtype=draft.fc.weight.dtype).contiguous()


def write_folder(path: str | os.PathLike, config_dict: dict, state: dict[str, Tensor]) -> None:
    """config.json (indented, newline-terminated) and model.safetensors in directory `path`."""
    from safetensors.torch import save_file

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    save_file(state, root / SAFETENSORS_FILE, metadata={"format": "pt"})
    with open(root / CONFIG_FILE, "w") as f:
        json.dump(config_dict, f, indent=2)
        f.write("\n")


def _target_dict(target_config: Any) -> dict:
    data = target_config if isinstance(target_config, dict) else getattr(target_config, "to_dict", lambda: None)()
    if not isinstance(data, dict):
        raise TypeError(f"target_config must be a transformers config or a dict, got {type(target_config).__name__}")
    data = dict(data.get("text_config") or data)  # multimodal targets keep the decoder's config there
    name = getattr(target_config, "name_or_path", None)
    if name and not data.get("_name_or_path"):
        data["_name_or_path"] = name
    return data


def _check_target(config: Eagle3Config, target: dict) -> None:
    problems = []
    for ours, theirs in (("target_hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
        if theirs in target and getattr(config, ours) != target[theirs]:
            problems.append(f"draft {ours}={getattr(config, ours)} but the target has {theirs}={target[theirs]}")
    n = target.get("num_hidden_layers")
    if n is not None and config.aux_layer_ids is not None and max(config.aux_layer_ids) > n:
        problems.append(f"aux layer ids {list(config.aux_layer_ids)} exceed the target's N={n} blocks "
                        f"(input-to-layer ids run 0..N)")
    if problems:
        raise ValueError("target_config does not fit the draft: " + "; ".join(problems))


def _complete_vocab_maps(tensors: dict[str, Tensor], config: Eagle3Config) -> None:
    """Fill in the vocabulary maps a checkpoint may omit: without `d2t` only when the draft vocab is
    the full target vocab (identity), and `t2d` is implied by `d2t`."""
    if "d2t" not in tensors:
        if config.draft_vocab_size != config.vocab_size:
            raise ValueError(f"checkpoint lacks d2t [draft_vocab_size = {config.draft_vocab_size}], needed because "
                             f"the draft vocab is smaller than the target's ({config.vocab_size})")
        tensors["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in tensors and tuple(tensors["d2t"].shape) == (config.draft_vocab_size,):
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        targets = torch.arange(config.draft_vocab_size) + tensors["d2t"].to(torch.int64)
        if int(targets.min()) < 0 or int(targets.max()) >= config.vocab_size:
            raise ValueError(f"d2t maps draft ids outside the target vocab [0, {config.vocab_size})")
        t2d[targets] = True
        tensors["t2d"] = t2d


def _check_names_and_shapes(tensors: dict[str, Tensor], expected: dict[str, tuple[int, ...]],
                            config: Eagle3Config) -> None:
    fc = tensors.get("fc.weight")
    if fc is not None and fc.dim() == 2 and fc.shape[1] != config.fc_in_features:
        m = fc.shape[1] / config.target_hidden_size
        raise ValueError(
            f"fc.weight has input width {fc.shape[1]} but the config needs m * target_hidden_size = "
            f"{config.num_aux_layers} * {config.target_hidden_size} = {config.fc_in_features} "
            f"(the weights fit m = {m:g}; check eagle_aux_hidden_state_layer_ids and target_hidden_size)"
        )
    problems = [f"missing {name} {list(shape)}" for name, shape in expected.items() if name not in tensors]
    problems += [f"unexpected {name} {list(t.shape)}" for name, t in tensors.items() if name not in expected]
    problems += [
        f"{name} has shape {list(t.shape)}, expected {list(expected[name])}"
        for name, t in tensors.items() if name in expected and tuple(t.shape) != expected[name]
    ]
    problems += [
        f"{name} has dtype {t.dtype}, expected floating point"
        for name, t in tensors.items() if name not in ("d2t", "t2d") and not t.is_floating_point()
    ]
    if "d2t" in tensors and (tensors["d2t"].is_floating_point() or tensors["d2t"].dtype == torch.bool):
        problems.append(f"d2t has dtype {tensors['d2t'].dtype}, expected an integer type")
    if problems:
        raise ValueError("draft checkpoint does not match its config: " + "; ".join(problems))


def _check_vocab_maps(d2t: Tensor, t2d: Tensor, config: Eagle3Config) -> None:
    targets = torch.arange(config.draft_vocab_size, device=d2t.device) + d2t
    if int(targets.min()) < 0 or int(targets.max()) >= config.vocab_size:
        raise ValueError(f"d2t maps draft ids outside the target vocab [0, {config.vocab_size})")
    if int(targets.unique().numel()) != config.draft_vocab_size:
        raise ValueError("d2t maps two draft ids to the same target id")
    if int(t2d.sum()) != config.draft_vocab_size or not bool(t2d[targets].all()):
        raise ValueError("t2d does not mark exactly the target ids that d2t maps the draft vocab to")
