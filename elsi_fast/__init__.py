"""elsi-fast: choose EAGLE3 draft layers from hidden-state entropy and CKA, in one streaming pass.

Metric functions and streaming accumulators import eagerly (torch only); the model-facing API
(`analyze`, `Eagle3Draft`, `speculative_generate`) imports transformers lazily on first use.
"""

from ._backends import backends
from .metrics import (
    cka_matrix,
    hsic,
    linear_cka,
    linear_token_entropy,
    matrix_entropy,
    spectrum_entropy,
    token_entropy,
)
from .streaming import MinibatchHSIC, StreamingCovariance

__version__ = "0.1.0"

_LAZY = {
    "analyze": "elsi_fast.analysis",
    "LayerReport": "elsi_fast.report",
    "Eagle3Draft": "elsi_fast.draft",
    "Eagle3Config": "elsi_fast.draft",
    "speculative_generate": "elsi_fast.spec",
}

__all__ = [
    "backends",
    "cka_matrix",
    "hsic",
    "linear_cka",
    "linear_token_entropy",
    "matrix_entropy",
    "spectrum_entropy",
    "token_entropy",
    "MinibatchHSIC",
    "StreamingCovariance",
    *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'elsi_fast' has no attribute {name!r}")
