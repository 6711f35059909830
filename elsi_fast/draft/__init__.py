"""EAGLE3 draft head: config, torch module with its KV cache, and EAGLE3-format checkpoints."""

from .config import Eagle3Config
from .model import DraftKVCache, Eagle3Draft

__all__ = ["DraftKVCache", "Eagle3Config", "Eagle3Draft"]
