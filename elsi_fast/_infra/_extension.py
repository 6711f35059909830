"""The native extension `elsi_fast._C` (csrc/), imported in this one place: `_C` is None when it was
not built (ELSI_FAST_SKIP_NATIVE=1, or no build at all) and `IMPORT_ERROR` says why."""

from __future__ import annotations

import torch

from .native_names import NATIVE_WEIGHT_DTYPES

try:
    from elsi_fast import _C
except ImportError as exc:
    _C = None
    IMPORT_ERROR = str(exc)
else:
    IMPORT_ERROR = ""

# The torch dtype each native weight precision is packed from.
TORCH_WEIGHT_DTYPES = dict(zip(NATIVE_WEIGHT_DTYPES, (torch.float32, torch.bfloat16, torch.int8)))
