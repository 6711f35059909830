"""EAGLE3 draft head: config, torch module with its KV cache, and EAGLE3-format checkpoints.

The torch module is imported on first use, so the CLI's argument checks can read a draft's
config (`Eagle3Config`, plain Python) before torch is imported."""

from .config import Eagle3Config

__all__ = ["DraftKVCache", "Eagle3Config", "Eagle3Draft"]


def __getattr__(name: str):
    if name in ("DraftKVCache", "Eagle3Draft"):
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
