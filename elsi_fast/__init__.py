"""elsi-fast: choose EAGLE3 draft layers from hidden-state entropy and CKA, in one streaming pass.

Every public name imports on first use, so `import elsi_fast` (and `elsi-fast --help`) loads
neither torch nor transformers; the metric functions need torch only, the model-facing API
(`analyze`, `Eagle3Draft`, `speculative_generate`) transformers as well.
"""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "backends": "elsi_fast._infra._backends",
    "cka_matrix": "elsi_fast.metrics",
    "hsic": "elsi_fast.metrics",
    "linear_cka": "elsi_fast.metrics",
    "linear_token_entropy": "elsi_fast.metrics",
    "matrix_entropy": "elsi_fast.metrics",
    "spectrum_entropy": "elsi_fast.metrics",
    "token_entropy": "elsi_fast.metrics",
    "MinibatchHSIC": "elsi_fast.streaming",
    "StreamingCovariance": "elsi_fast.streaming",
    "analyze": "elsi_fast.analysis.analyze",
    "LayerReport": "elsi_fast.analysis.report",
    "Eagle3Draft": "elsi_fast.draft",
    "Eagle3Config": "elsi_fast.draft",
    "speculative_generate": "elsi_fast.decoding.speculative",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip __getattr__
        return value
    raise AttributeError(f"module 'elsi_fast' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
