"""EAGLE3 draft head: config, torch module with its KV cache, and the formats it is written in.

The torch module is imported on first use, so the CLI's argument checks can read a draft's
config (`Eagle3Config`, plain Python) before torch is imported. `write_draft` / `read_draft`
(`draft.formats`) write a draft as an eagle3 or speculators folder or a llama.cpp GGUF, and read
the folders back."""

from .config import Eagle3Config

__all__ = ["DraftKVCache", "Eagle3Config", "Eagle3Draft", "read_draft", "write_draft"]


def __getattr__(name: str):
    if name in ("DraftKVCache", "Eagle3Draft"):
        from . import model

        return getattr(model, name)
    if name in ("read_draft", "write_draft"):
        from . import formats

        return getattr(formats, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
