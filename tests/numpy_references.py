"""float64 numpy references shared by the metric and streaming tests."""

import numpy as np


def np_hsic_song(K: np.ndarray, L: np.ndarray) -> float:
    """Song et al. (2012) unbiased HSIC, written out term by term."""
    n = K.shape[0]
    Kt, Lt = K.copy(), L.copy()
    np.fill_diagonal(Kt, 0)
    np.fill_diagonal(Lt, 0)
    one = np.ones(n)
    term1 = np.trace(Kt @ Lt)
    term2 = (one @ Kt @ one) * (one @ Lt @ one) / ((n - 1) * (n - 2))
    term3 = 2.0 / (n - 2) * (one @ Kt @ Lt @ one)
    return float((term1 + term2 - term3) / (n * (n - 3)))
