"""Streaming, mergeable layer statistics for dataset mode (docs/method.md section 3).

`StreamingCovariance` keeps per-layer second moments for the covariance entropy of each layer;
`MinibatchHSIC` keeps the L x L unbiased HSIC matrix (and per-layer traces) for CKA and the
closed-form Renyi-2 entropy of any layer set. Both merge across chunks and processes; accumulators
are float64 on CPU and float32 on CUDA, where the updates dispatch to the Triton kernels.

Mask policy: a mask that keeps no token raises ValueError (skip such batches before calling
`update`). MinibatchHSIC additionally skips, with a warning, minibatches that keep 1 to 3 tokens,
where the unbiased estimator is undefined.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ._infra._validation import check_alpha, check_choice, check_layer_list, check_mask, check_positive_int
from .metrics import (
    _cka_from_inner_products,
    _centered_gram_inner_products,
    _centered_stack,
    compute_dtype,
    spectrum_entropy,
    use_triton,
)

_NORMALIZE_MODES = ("l2", "none")
# Feature columns per tile of StreamingCovariance's upper-triangle update (see _add_upper_gram_).
_COV_TILE_COLS = 64


def _kept_rows(h: torch.Tensor, mask: torch.Tensor | None, l2: bool, dtype: torch.dtype) -> torch.Tensor:
    """Rows of h [n, d] kept by mask, in `dtype`, L2-normalized if asked (zero rows stay zero)."""
    y = (h if mask is None else h[mask]).to(dtype)
    if l2:
        y = y / torch.linalg.vector_norm(y, dim=1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
    return y


def _add_upper_gram_(out: torch.Tensor, y: torch.Tensor) -> None:
    """out [d, d] += y^T y for y [n, d], on the upper triangle only (diagonal tiles whole).

    Column tiles of y, each against itself and every column right of it: (1 + 1/T) / 2 of the
    full product's work for T tiles.
    """
    d = y.shape[1]
    for start in range(0, d, _COV_TILE_COLS):
        stop = min(d, start + _COV_TILE_COLS)
        out[start:stop, start:].addmm_(y[:, start:stop].T, y[:, start:])


def _symmetrize_upper(s: torch.Tensor) -> torch.Tensor:
    """Full symmetric matrices from the upper triangles of s [..., d, d] (the lower may be stale)."""
    upper = torch.triu(s)
    return upper + torch.triu(s, diagonal=1).transpose(-2, -1)


def _check_state(sd: Any, expected: dict[str, Any], tensors: dict[str, tuple[int, ...]]) -> None:
    if not isinstance(sd, dict):
        raise TypeError(f"state_dict must be a dict, got {type(sd).__name__}")
    missing = [k for k in (*expected, *tensors) if k not in sd]
    if missing:
        raise ValueError(f"state_dict is missing keys {missing}")
    for key, want in expected.items():
        if sd[key] != want:
            raise ValueError(f"state_dict[{key!r}] is {sd[key]!r} but this accumulator has {want!r}")
    for key, shape in tensors.items():
        t = sd[key]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"state_dict[{key!r}] must be a tensor of shape {shape}, got {got}")


class StreamingCovariance:
    """Per-layer running covariance of token vectors, exact under any chunking and merging.

    Keeps, per layer, shifted sums S_xx = sum (y - s)(y - s)^T, S_x = sum (y - s) and the count,
    where y is the token row (L2-normalized when normalize="l2", raw when "none") and s is a fixed
    per-layer shift (the first batch's mean, rounded to fp32): sums of near-centered values keep
    full accuracy when activations carry 1e4-scale offsets. Population covariance:
    C = (S_xx - S_x S_x^T / n) / n. Each update adds only the upper triangle of y^T y, in column
    tiles (about 0.6 of a full GEMM's work at d=256).

    Precision: float64 sums on the CPU (max abs error 2e-14 against torch.cov in float64 on
    1e4-offset data with covariances of order 1, where one GEMM x^T x is off by 9e-7 in float64
    and by 64 in float32), float32 on CUDA.

    num_layers: L; dim: d; device: where the accumulators live (hidden states are moved there).
    """

    def __init__(self, num_layers: int, dim: int, normalize: str = "l2", device: str | torch.device | None = None):
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.dim = check_positive_int("dim", dim)
        self.normalize = check_choice("normalize", normalize, _NORMALIZE_MODES)
        self.device = torch.device("cpu" if device is None else device)
        self.dtype = compute_dtype(self.device)
        self._count = 0
        self._shift = torch.zeros(num_layers, dim, dtype=self.dtype, device=self.device)
        # Only the upper triangle (diagonal included) is authoritative: the Triton update writes
        # only upper tiles. Read through _symmetrize_upper.
        self._sum_xx = torch.zeros(num_layers, dim, dim, dtype=self.dtype, device=self.device)
        self._sum_x = torch.zeros(num_layers, dim, dtype=self.dtype, device=self.device)

    @property
    def count(self) -> int:
        """Number of tokens accumulated so far."""
        return self._count

    def update(self, hidden: torch.Tensor | Sequence[torch.Tensor], mask: torch.Tensor | None = None) -> None:
        """Accumulate one batch: hidden [L, n, d] or a list of L [n, d]; mask [n] bool, True = keep.

        A mask keeping no token raises ValueError: skip such batches.
        """
        layers, n = check_layer_list("hidden", hidden, num_layers=self.num_layers, dim=self.dim)
        if layers[0].device != self.device:
            layers = [h.to(self.device) for h in layers]
            hidden = layers
        mask = check_mask("mask", mask, n, self.device)
        kept = n if mask is None else int(mask.sum())
        l2 = self.normalize == "l2"
        # The shift is the first batch's mean, rounded to fp32 so that the Triton path (fp32
        # shift) and this state agree exactly.
        first = self._count == 0
        if use_triton(layers[0]):
            if first:
                means = [_kept_rows(h, mask, l2, self.dtype).mean(0) for h in layers]
                self._shift = torch.stack(means).to(torch.float32).to(self.dtype)
            self._update_triton(hidden, mask, l2)
        else:
            for a, h in enumerate(layers):
                y = _kept_rows(h, mask, l2, self.dtype)
                if first:
                    self._shift[a] = y.mean(0).to(torch.float32)
                y = y - self._shift[a]
                _add_upper_gram_(self._sum_xx[a], y)
                self._sum_x[a] += y.sum(0)
        self._count += kept

    def _update_triton(self, hidden: torch.Tensor | list[torch.Tensor], mask: torch.Tensor | None, l2: bool) -> None:
        from .kernels.covariance import covariance_accumulate_

        shift = self._shift.to(torch.float32)
        if self.dtype == torch.float32:
            covariance_accumulate_(hidden, mask, shift, l2, self._sum_xx, self._sum_x)
            return
        # float64 accumulators (CPU through the interpreter): the kernel fills fp32 partial sums.
        sum_xx = torch.zeros_like(self._sum_xx, dtype=torch.float32)
        sum_x = torch.zeros_like(self._sum_x, dtype=torch.float32)
        covariance_accumulate_(hidden, mask, shift, l2, sum_xx, sum_x)
        self._sum_xx += sum_xx
        self._sum_x += sum_x

    def _sums_about(self, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(S_xx, S_x) re-expressed about another shift (Chan et al.): with delta = s - s',
        sum (y + delta)(y + delta)^T = S_xx + delta S_x^T + S_x delta^T + n delta delta^T."""
        delta = self._shift - shift
        sx = self._sum_x
        sum_xx = (
            self._sum_xx
            + delta[:, :, None] * sx[:, None, :]
            + sx[:, :, None] * delta[:, None, :]
            + self._count * delta[:, :, None] * delta[:, None, :]
        )
        return sum_xx, sx + self._count * delta

    def _require_count(self) -> int:
        if self._count == 0:
            raise ValueError("StreamingCovariance has no tokens yet: call update() first")
        return self._count

    def mean(self) -> torch.Tensor:
        """Per-layer mean token vector [L, d]."""
        n = self._require_count()
        return self._shift + self._sum_x / n

    def covariance(self) -> torch.Tensor:
        """Population covariance per layer [L, d, d] (divided by the count), accumulator dtype."""
        return self._covariance(self.dtype)

    def _covariance(self, dtype: torch.dtype) -> torch.Tensor:
        n = self._require_count()
        sum_xx = _symmetrize_upper(self._sum_xx).to(dtype)
        sum_x = self._sum_x.to(dtype)
        return (sum_xx - sum_x[:, :, None] * sum_x[:, None, :] / n) / n

    def entropy(self, alpha: float = 1.0) -> torch.Tensor:
        """Matrix entropy (nats) of each layer's covariance spectrum -> [L] float64."""
        alpha = check_alpha(alpha)
        cov = self._covariance(torch.float64)
        zero = torch.nonzero(cov.diagonal(dim1=-2, dim2=-1).sum(-1) <= 0).flatten().tolist()
        if zero:
            raise ValueError(f"layers {zero} have zero covariance (all accumulated tokens identical): entropy undefined")
        # The entries carry the accumulators' precision, not float64's.
        rtol = 10 * self.dim * torch.finfo(self.dtype).eps
        return spectrum_entropy(torch.linalg.eigvalsh(cov), alpha, rtol=rtol)

    def _check_compatible(self, other: object, name: str = "other") -> "StreamingCovariance":
        if not isinstance(other, StreamingCovariance):
            raise TypeError(f"{name} must be a StreamingCovariance, got {type(other).__name__}")
        for attr in ("num_layers", "dim", "normalize"):
            if getattr(other, attr) != getattr(self, attr):
                raise ValueError(f"{name} has {attr}={getattr(other, attr)!r} but this accumulator has {getattr(self, attr)!r}")
        return other

    def merge(self, other: "StreamingCovariance") -> "StreamingCovariance":
        """Add another accumulator's tokens (any shift, any device) into this one; returns self."""
        self._check_compatible(other)
        if other._count == 0:
            return self
        if self._count == 0:
            self._shift = other._shift.to(self.device, self.dtype)
            self._sum_xx = other._sum_xx.to(self.device, self.dtype, copy=True)
            self._sum_x = other._sum_x.to(self.device, self.dtype, copy=True)
        else:
            sum_xx, sum_x = other._sums_about(self._shift.to(other.device, other.dtype))
            self._sum_xx += sum_xx.to(self.device, self.dtype)
            self._sum_x += sum_x.to(self.device, self.dtype)
        self._count += other._count
        return self

    def state_dict(self) -> dict[str, Any]:
        """Config and sums (tensors cloned, lower triangle made symmetric)."""
        return {
            "num_layers": self.num_layers,
            "dim": self.dim,
            "normalize": self.normalize,
            "count": self._count,
            "shift": self._shift.clone(),
            "sum_xx": _symmetrize_upper(self._sum_xx),
            "sum_x": self._sum_x.clone(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from state_dict(); config must match this accumulator's."""
        L, d = self.num_layers, self.dim
        _check_state(
            state_dict,
            {"num_layers": L, "dim": d, "normalize": self.normalize},
            {"shift": (L, d), "sum_xx": (L, d, d), "sum_x": (L, d)},
        )
        count = state_dict["count"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"state_dict['count'] must be a non-negative int, got {count!r}")
        self._count = count
        self._shift = state_dict["shift"].to(self.device, self.dtype, copy=True)
        self._sum_xx = state_dict["sum_xx"].to(self.device, self.dtype, copy=True)
        self._sum_x = state_dict["sum_x"].to(self.device, self.dtype, copy=True)

    def all_reduce(self, group: Any = None) -> "StreamingCovariance":
        """Merge the statistics of every rank of `group` so all ranks hold the same totals.

        Collective (torch.distributed must be initialized; the accumulators' device must suit the
        backend: CPU for gloo, CUDA for NCCL). All ranks first agree on a common shift (the
        global mean rounded to fp32), re-express their sums about it, then sum. Returns self.
        """
        import torch.distributed as dist

        count = torch.tensor([self._count], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, group=group)
        total = int(count.item())
        if total == 0:
            return self
        first_moment = self._count * self._shift + self._sum_x
        dist.all_reduce(first_moment, group=group)
        common_shift = (first_moment / total).to(torch.float32).to(self.dtype)
        sum_xx, sum_x = self._sums_about(common_shift)
        sum_xx = _symmetrize_upper(sum_xx)
        dist.all_reduce(sum_xx, group=group)
        dist.all_reduce(sum_x, group=group)
        self._shift, self._sum_xx, self._sum_x, self._count = common_shift, sum_xx, sum_x, total
        return self


class MinibatchHSIC:
    """Streaming unbiased linear HSIC of every layer pair over minibatches (Nguyen et al. 2021).

    Per minibatch of n kept tokens (n >= 4): V [L, n^2] stacks the flattened U-centered Grams of
    the (L2-normalized if normalize="l2") token rows, H = V V^T / (n (n - 3)) gives all unbiased
    HSIC pairs in one GEMM, and t_a = sum_i ||y_i - mean||^2 / (n - 1) the unbiased trace of layer
    a's covariance. hsic() / traces() average over minibatches (each minibatch weighs the same).
    Layers may have different widths. The Gram products are those of cka_matrix (upper-triangle
    tiles, row sums for the centering).

    Precision: float64 on the CPU, float32 on CUDA (Triton kernel), for both the per-minibatch
    products and the accumulators.
    """

    def __init__(self, num_layers: int, normalize: str = "l2", device: str | torch.device | None = None):
        self.num_layers = check_positive_int("num_layers", num_layers)
        self.normalize = check_choice("normalize", normalize, _NORMALIZE_MODES)
        self.device = torch.device("cpu" if device is None else device)
        self.dtype = compute_dtype(self.device)
        self._num_batches = 0
        self._hsic_sum = torch.zeros(num_layers, num_layers, dtype=self.dtype, device=self.device)
        self._trace_sum = torch.zeros(num_layers, dtype=self.dtype, device=self.device)

    @property
    def num_batches(self) -> int:
        """Number of minibatches accumulated (skipped ones not counted)."""
        return self._num_batches

    def update(self, hidden: torch.Tensor | Sequence[torch.Tensor], mask: torch.Tensor | None = None) -> None:
        """Accumulate one minibatch: hidden [L, n, d] or a list of L [n, d_l]; mask [n] bool.

        A minibatch keeping fewer than 4 tokens is skipped with a RuntimeWarning.
        """
        layers, n = check_layer_list("hidden", hidden, num_layers=self.num_layers)
        if layers[0].device != self.device:
            layers = [h.to(self.device) for h in layers]
            hidden = layers
        mask = check_mask("mask", mask, n, self.device)
        kept = n if mask is None else int(mask.sum())
        if kept < 4:
            warnings.warn(
                f"MinibatchHSIC.update skipped a minibatch with {kept} kept tokens (unbiased HSIC needs >= 4)",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        l2 = self.normalize == "l2"
        if use_triton(layers[0]):
            from .kernels.hsic import minibatch_hsic

            batch_hsic, batch_traces = minibatch_hsic(hidden, mask, l2)
        else:
            y = _centered_stack([_kept_rows(h, mask, l2, self.dtype) for h in layers], self.dtype)
            batch_hsic = _centered_gram_inner_products(y, unbiased=True) / (kept * (kept - 3))
            batch_traces = torch.linalg.vector_norm(y, dim=(1, 2)).square() / (kept - 1)
        self._hsic_sum += batch_hsic.to(self.dtype)
        self._trace_sum += batch_traces.to(self.dtype)
        self._num_batches += 1

    def _require_batches(self) -> int:
        if self._num_batches == 0:
            raise ValueError("MinibatchHSIC has no minibatches yet: call update() with >= 4 kept tokens first")
        return self._num_batches

    def hsic(self) -> torch.Tensor:
        """Mean unbiased HSIC over minibatches [L, L] (= ||Cov(x_a, x_b)||_F^2 estimates)."""
        return self._hsic_sum / self._require_batches()

    def traces(self) -> torch.Tensor:
        """Mean unbiased tr(Cov_a) over minibatches [L]."""
        return self._trace_sum / self._require_batches()

    def cka(self) -> torch.Tensor:
        """Minibatch CKA [L, L]: H_ab / sqrt(H_aa H_bb) of the accumulated HSIC sums."""
        self._require_batches()
        return _cka_from_inner_products(self._hsic_sum, [f"layer {i}" for i in range(self.num_layers)])

    def renyi2_entropy(self, layers: Sequence[int]) -> float:
        """Renyi-2 entropy (nats) of the concatenation of `layers` (docs/method.md section 3):
        H2(S) = -log( sum_{a,b in S} H_ab / (sum_{a in S} t_a)^2 )."""
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
            raise TypeError(f"layers must be a sequence of layer indices, got {type(layers).__name__}")
        if len(layers) == 0:
            raise ValueError("layers is empty")
        for i in layers:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
                raise ValueError(f"layers must hold indices in [0, {self.num_layers}), got {i!r}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers has repeated indices: {list(layers)}")
        idx = torch.tensor(list(layers), device=self.device)
        frobenius_sq = float(self.hsic()[idx][:, idx].sum())
        trace = float(self.traces()[idx].sum())
        if frobenius_sq <= 0 or trace <= 0:
            raise ValueError(
                f"layers {list(layers)}: the HSIC estimate ({frobenius_sq:.3g}) or trace ({trace:.3g}) is not "
                "positive (too few tokens or constant features); the entropy is undefined"
            )
        return -math.log(frobenius_sq / trace**2)

    def merge(self, other: "MinibatchHSIC") -> "MinibatchHSIC":
        """Add another accumulator's minibatches into this one; returns self."""
        if not isinstance(other, MinibatchHSIC):
            raise TypeError(f"other must be a MinibatchHSIC, got {type(other).__name__}")
        for attr in ("num_layers", "normalize"):
            if getattr(other, attr) != getattr(self, attr):
                raise ValueError(f"other has {attr}={getattr(other, attr)!r} but this accumulator has {getattr(self, attr)!r}")
        self._hsic_sum += other._hsic_sum.to(self.device, self.dtype)
        self._trace_sum += other._trace_sum.to(self.device, self.dtype)
        self._num_batches += other._num_batches
        return self

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "normalize": self.normalize,
            "num_batches": self._num_batches,
            "hsic_sum": self._hsic_sum.clone(),
            "trace_sum": self._trace_sum.clone(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        L = self.num_layers
        _check_state(
            state_dict,
            {"num_layers": L, "normalize": self.normalize},
            {"hsic_sum": (L, L), "trace_sum": (L,)},
        )
        num_batches = state_dict["num_batches"]
        if isinstance(num_batches, bool) or not isinstance(num_batches, int) or num_batches < 0:
            raise ValueError(f"state_dict['num_batches'] must be a non-negative int, got {num_batches!r}")
        self._num_batches = num_batches
        self._hsic_sum = state_dict["hsic_sum"].to(self.device, self.dtype, copy=True)
        self._trace_sum = state_dict["trace_sum"].to(self.device, self.dtype, copy=True)

    def all_reduce(self, group: Any = None) -> "MinibatchHSIC":
        """Sum the minibatch statistics of every rank of `group` (collective); returns self."""
        import torch.distributed as dist

        count = torch.tensor([self._num_batches], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, group=group)
        dist.all_reduce(self._hsic_sum, group=group)
        dist.all_reduce(self._trace_sum, group=group)
        self._num_batches = int(count.item())
        return self
