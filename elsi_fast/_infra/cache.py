"""Where elsi-fast keeps what it builds once and reuses: ``$ELSI_FAST_CACHE`` or ``~/.cache/elsi-fast``.

Below it: ``targets/`` (the toy targets trained here), ``models/`` (assembled GGUF files of the
named targets), ``dequantized/`` (GGUF targets as plain transformers folders). Imports nothing
heavy.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$ELSI_FAST_CACHE`` if set, else ``~/.cache/elsi-fast``."""
    root = os.environ.get("ELSI_FAST_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "elsi-fast"
