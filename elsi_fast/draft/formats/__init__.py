"""Draft formats: one module per format and one table, so the draft model knows no format.

* "eagle3" (`formats.eagle3`): a folder, config.json + model.safetensors as SpecForge / EAGLE3
  write them, which vLLM, SGLang and SpecForge read. Options: target_config, include_embedding.
* "speculators" (`formats.speculators`): a folder in speculators 0.9's layout, which speculators
  and vLLM read. Options: target_config (required), include_embedding, speculative_tokens.
* "gguf" (`formats.gguf`): one file llama.cpp serves with `--spec-type draft-eagle3 -md path`.
  Option: target (the target's .gguf file, required). Not read back.

`write_draft(draft, path, format="speculators", target_config=...)` writes; `read_draft(path)`
reads either folder format (told apart by config.json's `speculators_model_type`). Each writer is
a plain function `write(draft, path, **options)`; its keyword-only parameters are the options
the format takes.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from . import eagle3, folder, gguf, speculators

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

    from ..model import Eagle3Draft


@dataclass(frozen=True)
class DraftFormat:
    """A format's writer `write(draft, path, **options)` and, where the format is read back, its
    reader `read(path, *, embed_tokens, dtype, device, norm_output_meaning) -> Eagle3Draft`."""

    write: Callable[..., None]
    read: Callable[..., Eagle3Draft] | None = None

    @property
    def options(self) -> tuple[str, ...]:
        """The option names `write` takes (its keyword-only parameters)."""
        return tuple(name for name, p in inspect.signature(self.write).parameters.items()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY)


FORMATS: dict[str, DraftFormat] = {
    "eagle3": DraftFormat(eagle3.write, folder.read),
    "speculators": DraftFormat(speculators.write, folder.read),
    "gguf": DraftFormat(gguf.write),
}


def write_draft(draft: Eagle3Draft, path: str | os.PathLike, format: str = "eagle3", **options: Any) -> None:
    """Write `draft` at `path` in `format` (each format's options: the module docstring).

    An option the format does not take is an error naming the formats that take it.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {tuple(FORMATS)}, got {format!r}")
    taken = FORMATS[format].options
    for name in options:
        if name not in taken:
            takers = [f"{other!r}" for other, entry in FORMATS.items() if name in entry.options]
            who = (f"only format {takers[0]} takes it" if len(takers) == 1 else
                   f"only formats {', '.join(takers)} take it" if takers else "no format takes it")
            raise ValueError(f"{name}: {who}; format={format!r} takes {', '.join(taken)}")
    FORMATS[format].write(draft, path, **options)


def draft_format(path: str | os.PathLike) -> str:
    """The format of the draft folder `path`, from its config.json: "speculators" or "eagle3"."""
    return "speculators" if "speculators_model_type" in folder.read_config_dict(path) else "eagle3"


def read_draft(path: str | os.PathLike, embed_tokens: Tensor | nn.Embedding | None = None,
               dtype: torch.dtype | None = None, device: torch.device | str | None = None,
               norm_output_meaning: str | None = None) -> Eagle3Draft:
    """Load a draft folder in either folder format ("eagle3" or "speculators", detected from
    config.json; config.json + model.safetensors, sharded safetensors, or pytorch_model.bin read
    with weights_only=True). Weights keep the checkpoint dtype unless `dtype` is given. The target
    embedding comes from `embed_tokens`, else from the checkpoint if it has one.
    `norm_output_meaning` ("vllm", "sglang" or "specforge") is needed only for an eagle3 config
    with a `norm_output` field, whose meaning differs between engines."""
    reader = FORMATS[draft_format(path)].read
    return reader(path, embed_tokens=embed_tokens, dtype=dtype, device=device,
                  norm_output_meaning=norm_output_meaning)
