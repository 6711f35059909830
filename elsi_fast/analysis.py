"""One streaming pass over calibration prompts -> per-layer entropy, CKA and layer selections.

Per batch of prompts, forward hooks (elsi_fast.capture) hand over each h_l as it is produced; the
hook keeps only the candidate token rows (no padding, no position 0, no special tokens). After the
forward the token-entropy filter picks the kept rows, and they feed
- StreamingCovariance (dataset-mode entropy per layer),
- StreamingCovariance (dataset-mode Shannon and Renyi-2 entropy per layer),
- MinibatchHSIC, one minibatch per prompt (CKA; batching-independent, so resumed and
  data-parallel runs give the same numbers),
- PromptGrams, prompt mode over all kept tokens of each prompt (DESIGN.md section 3): per prompt,
  the layers' exact entropies and the L x L Frobenius products of their Grams in RAM, and the
  factors an exact set entropy needs in a spill file (`gram_dtype`, float32 by default) next to
  the state file. The concatenation of a layer set S has Gram sum_{a in S} K_a: after the pass the
  searches rank candidate sets by a Renyi-2-based surrogate and evaluate the contenders exactly.
The candidate rows are released after each batch; nothing else is kept per token.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import json
import math
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from .capture import capture_hidden_states, decoder_layers
from .interrupt import DeferredInterrupt
from .metrics import linear_token_entropy, normalize_tokens, spectrum_entropy, token_entropy
from .prompts import Prompt, encode_prompt
from .report import LayerReport
from .selection import ScreenedObjective
from .streaming import MinibatchHSIC, StreamingCovariance

# Default token-entropy threshold (nats), from bench/bench_analysis.py --part threshold on
# stories260K, the one real model here (README, "Worked example"). On 96 Spec-Bench prompts at equal
# token counts per prompt (gram_tokens=32), 0.5 nats cut the cross-prompt variance of per-layer
# entropy by 21% keeping 89% of the tokens, the largest reduction measured; 1 and 2 nats raised it
# (by 22% and 98%), and on in-domain TinyStories text every threshold raised it. The paper's
# 35.6-48.4% reduction was measured on 4B-8B models. Every report shows the variance with and
# without the filter, so a model where filtering hurts is visible (then pass 0).
DEFAULT_MIN_TOKEN_ENTROPY = 0.5
_STATE_VERSION = 2
# Elements of the factors read back at once for exact set entropies (16 MiB in float64: below
# glibc's largest mmap threshold, so the buffers are reused instead of faulted in afresh).
_READ_BLOCK_ELEMS = 1 << 21
_EIG_SLICE = 32
# Bytes of per-prompt Gram blocks kept for reuse by the set searches (bounded: independent of P).
_PRODUCT_CACHE_BYTES = 512 << 20
_PAD_TOKENS = 16
# Rows of the stacked Grams built at once by `_gram_inner_products`: bounds its scratch memory.
_GRAM_ROWS_ELEMS = 1 << 24


def _gram_inner_products(z: torch.Tensor) -> torch.Tensor:
    """[L, L] raw Frobenius products <K_a, K_b> of the Grams K_a = Z_a Z_a^T of z [L, n, w].

    Raw, not centered: prompt-mode rows are centered and then L2-normalized, so their Grams are the
    matrices whose spectra DESIGN.md defines. tr(K_S^2) = sum_{a,b in S} <K_a, K_b> gives the
    Renyi-2 entropy of any set. One GEMM over row blocks of the stacked, flattened Grams.
    """
    num_layers, n, _ = z.shape
    rows = max(1, _GRAM_ROWS_ELEMS // (num_layers * n))
    out = torch.zeros(num_layers, num_layers, dtype=z.dtype, device=z.device)
    for start in range(0, n, rows):
        flat = (z[:, start:start + rows] @ z.transpose(1, 2)).reshape(num_layers, -1)
        out.addmm_(flat, flat.T)
    return out


@dataclass
class AnalyzeOptions:
    """Every setting of one analysis (stored in report.json as `options`)."""

    m: tuple[int, ...] = (1, 3)
    batch_size: int = 8
    max_prompts: int | None = None
    max_tokens: int = 512
    min_token_entropy: float = DEFAULT_MIN_TOKEN_ENTROPY
    drop_special_tokens: bool = True
    normalize: str = "l2"
    gram_tokens: int | None = None
    gram_dtype: str = "float32"
    candidates: tuple[int, ...] | None = None
    beta: float = 1.0
    one_per_compartment: bool = False
    novelty_half_width: int = 2
    novelty_threshold: float = 0.1
    max_exhaustive: int = 1000
    screen_z: float = 4.0
    save_every: int = 8

    def validate(self, num_blocks: int) -> None:
        ints = {
            "batch_size": self.batch_size,
            "max_tokens": self.max_tokens,
            "novelty_half_width": self.novelty_half_width,
            "max_exhaustive": self.max_exhaustive,
            "save_every": self.save_every,
        }
        for name, value in ints.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens: must be >= 2 (position 0 is always dropped), got {self.max_tokens}")
        if self.gram_tokens is not None and (
            isinstance(self.gram_tokens, bool) or not isinstance(self.gram_tokens, int) or self.gram_tokens < 2
        ):
            raise ValueError(f"gram_tokens: must be an integer >= 2 or None (all kept tokens), got {self.gram_tokens!r}")
        if self.max_prompts is not None and (not isinstance(self.max_prompts, int) or self.max_prompts < 1):
            raise ValueError(f"max_prompts: must be a positive integer or None, got {self.max_prompts!r}")
        if not math.isfinite(self.min_token_entropy) or self.min_token_entropy < 0:
            raise ValueError(f"min_token_entropy: must be a finite number >= 0 (nats), got {self.min_token_entropy}")
        if self.normalize not in ("l2", "none"):
            raise ValueError(f"normalize: expected 'l2' or 'none', got {self.normalize!r}")
        if self.gram_dtype not in ("float32", "float64"):
            raise ValueError(f"gram_dtype: expected float32 or float64, got {self.gram_dtype!r}")
        if not self.screen_z >= 0:
            raise ValueError(f"screen_z: must be >= 0 (inf: evaluate every set exactly), got {self.screen_z}")
        if self.candidates is None:
            self.candidates = tuple(range(1, num_blocks))
        bad = [c for c in self.candidates if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c <= num_blocks]
        if bad or not self.candidates:
            raise ValueError(f"candidates: need layer indices in 0..{num_blocks} (N={num_blocks} blocks), got {self.candidates!r}")
        self.candidates = tuple(sorted(set(self.candidates)))
        if not self.m:
            raise ValueError("m: give at least one set size")
        for m in self.m:
            if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= len(self.candidates):
                raise ValueError(
                    f"m: each set size must be in 1..{len(self.candidates)}, the number of candidate layers "
                    f"{list(self.candidates)} of this N={num_blocks}-block model, got {m!r}"
                )


# ---------------------------------------------------------------------------------------------
# Prompt-mode Gram store
# ---------------------------------------------------------------------------------------------


class _Rows:
    """A growing float64 array of equally shaped rows, stored contiguously (capacity doubles).

    One block instead of a small array per prompt: interleaving many small long-lived allocations
    with the pass's large temporaries fragments the heap (RSS grew ~7 MB per prompt that way)."""

    def __init__(self, rows: np.ndarray | None = None) -> None:
        self._data = None if rows is None or len(rows) == 0 else np.array(rows, dtype=np.float64)
        self._count = 0 if self._data is None else len(self._data)

    def append(self, row: np.ndarray) -> None:
        if self._data is None:
            self._data = np.empty((16, *row.shape))
        elif self._count == len(self._data):
            grown = np.empty((2 * self._count, *self._data.shape[1:]))
            grown[: self._count] = self._data
            self._data = grown
        self._data[self._count] = row
        self._count += 1

    def __getitem__(self, index):
        return self.array[index]

    @property
    def array(self) -> np.ndarray:
        return np.empty((0,)) if self._data is None else self._data[: self._count]

    @property
    def nbytes(self) -> int:
        return self.array.nbytes


class PromptGrams:
    """Prompt-mode statistics of every prompt, exact, with memory in RAM independent of token counts.

    Per prompt with n kept tokens and layer vectors Z_a [n, d] (centered over the prompt, rows
    L2-normalized; K_a = Z_a Z_a^T):
    - in RAM, O(L^2) per prompt, float64: `entropy` H1(K_a) (eigen-solved on the smaller side of
      Z_a, d x d or n x n), `trace` tr K_a and `frob` <K_a, K_b>_F. These give every layer's
      statistics and the Renyi-2 entropy of any set S, -log(sum_{a,b in S} <K_a, K_b> / (sum tr K_a)^2),
      in O(|S|^2) per prompt;
    - in a spill file (`factors=True`), per prompt and layer, Z_a [n, d] when d <= n, else K_a
      [n, n], in `dtype`: what an exact H1(K_S) of any set needs. The nonzero spectrum of
      K_S = sum_{a in S} K_a is that of [Z_a]^T [Z_a] (|S| d square) or of K_S (n square): the
      smaller one is solved, in float64.
    The file is read back with positioned reads, a few prompts at a time, so the RAM used by the
    searches does not grow with the number of prompts.
    """

    def __init__(self, dim: int, path: str | None = None, *, factors: bool = True, dtype: torch.dtype = torch.float32):
        self.dim = dim
        self.path = path
        self.factors = factors
        self.dtype = dtype
        self.prompt_index: list[int] = []
        self.tokens: list[int] = []  # n per prompt
        self.offset: list[int] = []  # byte offset of the prompt's factors in the file
        self.width: list[int] = []  # columns per layer factor: d (rows of Z) or n (Gram)
        self._entropy, self._trace, self._frob = _Rows(), _Rows(), _Rows()  # [P, L], [P, L], [P, L, L]
        self._file = None
        self._size = 0
        # per set, H1(K_S) of every prompt in prompt order (NaN: not computed yet)
        self._set_cache: dict[tuple[int, ...], np.ndarray] = {}
        self._stack: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.solves = 0  # (set, prompt) eigensolves done by the set entropies
        self._products = _ProductCache(_PRODUCT_CACHE_BYTES)

    # -- building ---------------------------------------------------------------------------

    def _open(self, truncate_to: int) -> None:
        """Open the spill file (a fresh store opens it on the first write), keeping its first
        `truncate_to` bytes: what a saved state had written."""
        if self._file is not None:
            self._file.close()
        if self.path is None:
            self._file = tempfile.TemporaryFile(prefix="elsi-prompt-factors-")
        else:
            self._file = open(self.path, "r+b" if os.path.exists(self.path) else "w+b")
        self._file.truncate(truncate_to)
        self._size = truncate_to

    def _append(self, data: bytes) -> None:
        if self._file is None:
            self._open(truncate_to=0)
        self._file.seek(self._size)
        self._file.write(data)
        self.offset.append(self._size)
        self._size += len(data)

    def add(self, prompt_index: int, z: torch.Tensor) -> None:
        """Add one prompt: z [L, n, d] (n >= 2), its layers' prompt-mode vectors (centered and
        L2-normalized rows), in float64 on the CPU or float32 or better on an accelerator."""
        num_layers, n, d = z.shape
        if d <= n:
            small = z.transpose(-2, -1) @ z  # [L, d, d]: the covariance side
        else:
            small = z @ z.transpose(-2, -1)  # [L, n, n]: the Gram side
        eigvals = torch.linalg.eigvalsh(small.double())
        self._entropy.append(spectrum_entropy(eigvals).cpu().numpy())
        self._trace.append(small.diagonal(dim1=-2, dim2=-1).sum(-1).double().cpu().numpy())
        if self.factors:
            frob = _gram_inner_products(z.double())
            self._frob.append(frob.cpu().numpy())
            stored = z if d <= n else small
            self._append(stored.to(device="cpu", dtype=self.dtype).contiguous().numpy().tobytes())
            self.width.append(min(n, d))
        self.prompt_index.append(int(prompt_index))
        self.tokens.append(n)
        self._changed()

    def __len__(self) -> int:
        return len(self.prompt_index)

    @property
    def nbytes(self) -> int:
        """Bytes of the spill file."""
        return self._size

    @property
    def ram_bytes(self) -> int:
        """Bytes of the per-prompt statistics held in RAM."""
        return self._entropy.nbytes + self._trace.nbytes + self._frob.nbytes

    def records(self, start: int = 0, stop: int | None = None):
        """(prompt_index, entropy, trace, frob, factor bytes or None) per prompt, in insertion order."""
        if self._file is not None:
            self._file.flush()
        for i in range(start, len(self) if stop is None else stop):
            factor = None
            if self.factors:
                end = self.offset[i + 1] if i + 1 < len(self) else self._size
                factor = (self.tokens[i], self.width[i], os.pread(self._file.fileno(), end - self.offset[i], self.offset[i]))
            frob = self._frob[i].copy() if self.factors else None
            yield self.prompt_index[i], self._entropy[i].copy(), self._trace[i].copy(), frob, factor

    def add_record(self, prompt_index: int, entropy: np.ndarray, trace: np.ndarray, frob, factor) -> None:
        """Append a record from `records()` (another rank's, or a saved state's)."""
        self.prompt_index.append(int(prompt_index))
        self._entropy.append(entropy)
        self._trace.append(trace)
        if self.factors:
            n, width, data = factor
            self._frob.append(frob)
            self._append(data)
            self.width.append(width)
            self.tokens.append(n)
        else:
            self.tokens.append(0)
        self._changed()

    def state_dict(self) -> dict:
        """Everything but the file's contents (flushed to disk here; the file keeps its path)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        return {
            "factors": self.factors,
            "prompt_index": list(self.prompt_index),
            "tokens": list(self.tokens),
            "offset": list(self.offset),
            "width": list(self.width),
            "entropy": self._entropy.array.copy(),
            "trace": self._trace.array.copy(),
            "frob": self._frob.array.copy(),
            "size": self._size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from state_dict(): the file is truncated to what that state had written."""
        if self.factors:
            if self.path is None or not os.path.exists(self.path) or os.path.getsize(self.path) < state["size"]:
                raise ValueError(
                    f"state_path: the prompt-mode factor file {self.path} is missing or shorter than the saved state"
                )
            self._open(truncate_to=state["size"])
        for key in ("prompt_index", "tokens", "offset", "width"):
            setattr(self, key, list(state[key]))
        self._entropy, self._trace, self._frob = _Rows(state["entropy"]), _Rows(state["trace"]), _Rows(state["frob"])
        self._changed()

    def _changed(self) -> None:
        self._set_cache.clear()
        self._products.clear()
        self._stack = None

    # -- statistics -------------------------------------------------------------------------

    def _order(self) -> np.ndarray:
        return np.argsort(self.prompt_index, kind="stable")

    def layer_entropies(self) -> np.ndarray:
        """Shannon entropy H1(K_l) per prompt (in prompt order) and layer -> [P, L] float64."""
        return self._entropy.array[self._order()]

    def _stacked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._stack is None:
            order = self._order()
            self._stack = (self._entropy.array[order], self._trace.array[order], self._frob.array[order])
        return self._stack

    def _renyi2_terms(self, sets: Sequence[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
        """Per prompt and set: (H2(K_S), sum_a w_a (H1(K_a) - H2(K_a))) with w_a = tr K_a / tr K_S,
        for sets of one size -> two [P, len(sets)] arrays."""
        entropy, trace, frob = self._stacked()
        index = np.array(sets, dtype=np.int64)  # [N, m]
        total = trace[:, index].sum(-1)  # [P, N]
        cross = frob[:, index[:, :, None], index[:, None, :]].sum((-2, -1))
        single_h2 = -np.log(np.diagonal(frob, axis1=1, axis2=2) / trace**2)  # [P, L]
        weights = trace[:, index] / total[..., None]
        gap = (weights * (entropy - single_h2)[:, index]).sum(-1)
        return -np.log(cross / total**2), gap

    def _by_size(self, sets: Sequence[tuple[int, ...]], fn, rows: int) -> np.ndarray:
        """fn(sets of one size) -> [rows, len(part)] applied per set size, in chunks that bound the
        [P, chunk, m, m] gathers to about 2^22 elements -> [rows, len(sets)]."""
        keys = [_set_key(s) for s in sets]
        out = np.empty((rows, len(keys)))
        for size in sorted({len(k) for k in keys}):
            where = [i for i, k in enumerate(keys) if len(k) == size]
            step = max(1, (1 << 22) // (len(self) * size * size))
            for start in range(0, len(where), step):
                part = where[start : start + step]
                out[:, part] = fn([keys[i] for i in part])
        return out

    def renyi2_entropy(self, sets: Sequence[tuple[int, ...]]) -> np.ndarray:
        """Mean over prompts of the Renyi-2 entropy H2(sum_{a in S} K_a) per set -> [len(sets)], exact."""
        return self._by_size(sets, lambda part: self._renyi2_terms(part)[0].mean(0, keepdims=True), 1)[0]

    def surrogate(self, sets: Sequence[tuple[int, ...]]) -> np.ndarray:
        """Cheap per-prompt estimates of H1(K_S): H2(K_S) + sum_a w_a (H1(K_a) - H2(K_a)), as its two
        terms -> [2, P, len(sets)] (the screened searches use each as a control variate).

        Exact for one layer, for layers with identical Grams and for layers with orthogonal Grams of
        equal trace and purity (H1(K_S) = log |S| + mean H1(K_a)); in between its error varies
        smoothly across prompts, which makes it a good control variate for the screened searches.
        """
        both = self._by_size(sets, lambda part: np.concatenate(self._renyi2_terms(part)), 2 * len(self))
        return both.reshape(2, len(self), len(sets))

    def set_entropy(self, sets: Sequence[tuple[int, ...]]) -> np.ndarray:
        """Mean over prompts of H1(sum_{a in S} K_a) for each set S -> [len(sets)] float64, exact.
        A repeated layer counts once."""
        return self.prompt_set_entropy(sets, np.arange(len(self))).mean(0)

    def prompt_set_entropy(self, sets: Sequence[tuple[int, ...]], prompts: np.ndarray) -> np.ndarray:
        """H1(sum_{a in S} K_a) of the given prompts (positions in prompt order) -> [len(prompts), len(sets)].

        Values are cached per set and prompt: the searches revisit sets and widen prompt samples.
        """
        keys = [_set_key(s) for s in sets]
        prompts = np.asarray(prompts, dtype=np.int64)
        entropy = self._stacked()[0]
        for key in keys:
            if key not in self._set_cache:
                self._set_cache[key] = entropy[:, key[0]].copy() if len(key) == 1 else np.full(len(self), np.nan)
        todo = sorted({k for k in keys if np.isnan(self._set_cache[k][prompts]).any()})
        if todo:
            if not self.factors:
                raise ValueError("set_entropy: this store keeps per-layer statistics only (factors=False)")
            self._file.flush()  # positioned reads see only what reached the OS
            order = self._order()
            position = np.empty(len(self), dtype=np.int64)
            position[order] = np.arange(len(self))
            jobs = []
            for chunk in self._prompt_chunks({int(order[p]) for p in prompts}, todo):
                rows = position[chunk]
                missing = np.stack([np.isnan(self._set_cache[k][rows]) for k in todo])  # [K, c]
                keep, used = missing.any(0), missing.any(1)
                if keep.any():
                    chunk = [i for i, k in zip(chunk, keep) if k]
                    jobs.append((chunk, rows[keep], [k for k, u in zip(todo, used) if u], missing[used][:, keep]))
            # Largest first (by solves x matrix side cubed), so that no thread is left with a big job at the end.
            jobs.sort(key=lambda job: -job[3].sum() * _solve_side(len(job[2][0]), *self._solve_shape(job[0][0])) ** 3)
            for done_keys, done_rows, values in _parallel_map(self._chunk_entropies, jobs):
                for key, row, value in zip(done_keys, done_rows, values):
                    self._set_cache[key][row] = value
                self.solves += len(values)
        return np.stack([self._set_cache[k][prompts] for k in keys], axis=1)

    def _chunk_entropies(self, chunk: list[int], rows: np.ndarray, keys: list[tuple[int, ...]], want: np.ndarray):
        """H1(K_S) of the sets `keys` on the prompts `chunk` (insertion indices, one padded shape; at
        positions `rows` in prompt order) where want [len(keys), len(chunk)] -> (set per value,
        position per value, values)."""
        gram, n, w = self._solve_shape(chunk[0])
        groups = list(_key_groups(keys, len(chunk) * w * w))
        needed = set()
        for group in groups:
            if _gram_side(len(group[0]), gram, n, w):
                needed |= {(a, -1) for key in group for a in key}
            else:
                needed |= {(b, a) for key in group for i, a in enumerate(key) for b in key[: i + 1]}
        products = self._products_of(chunk, needed, gram)
        row_of = {key: i for i, key in enumerate(keys)}
        done_keys, done_rows, done_values = [], [], []
        for group in groups:
            group_want = want[[row_of[k] for k in group]]
            matrices = _set_matrices(products, group, group_want, n, w, gram)
            uplo = "L" if _gram_side(len(group[0]), gram, n, w) else "U"
            # torch's batched CPU eigvalsh slows down superlinearly with the batch: slices.
            eigvals = torch.cat([torch.linalg.eigvalsh(part, UPLO=uplo) for part in matrices.split(_EIG_SLICE)])
            # Vectors stored in `dtype` give an exactly PSD sum; Grams rounded to `dtype` entry by
            # entry move eigenvalues by up to about n eps(dtype) max|K| (clipped as round-off).
            rtol = 10 * matrices.shape[-1] * torch.finfo(self.dtype if gram else torch.float64).eps
            which_key, which_row = np.nonzero(group_want)
            done_keys += [group[k] for k in which_key]
            done_rows.append(rows[which_row])
            done_values.append(spectrum_entropy(eigvals, rtol=rtol).numpy())
        return done_keys, np.concatenate(done_rows), np.concatenate(done_values)

    def _products_of(self, chunk: list[int], needed: set[tuple[int, int]], gram: bool) -> dict[tuple[int, int], torch.Tensor]:
        """The products `needed` of the prompts `chunk` -> {(a, b): [len(chunk), x, x] float64}:
        (a, b), a <= b, the block Z_a^T Z_b of stored vectors; (a, -1) the Gram K_a (stored, or
        Z_a Z_a^T). Taken from the product cache where there, else computed from the factors
        (read only for the layers missing) and cached: the searches' sets share most layers and
        pairs, within a search and across searches. The blocks of one layer a are one GEMM,
        Z_a^T [Z_b ...], over the layers read side by side: small GEMMs run at half the speed."""
        found = {p: self._products.get_many([(i, *p) for i in chunk]) for p in needed}
        missing = {p: [j for j, e in enumerate(entries) if e is None] for p, entries in found.items()}
        missing = {p: rows for p, rows in missing.items() if rows}
        if missing:
            computed = []
            layers = sorted({a for p in missing for a in p if a >= 0})
            factors = self._read(chunk, layers)  # [c, k, n, w]
            at = {a: i for i, a in enumerate(layers)}
            by_row: dict[tuple[int, bool], list[tuple[int, int]]] = collections.defaultdict(list)
            for p in missing:
                by_row[p[0], p[1] < 0].append(p)
            for (a, _), pairs in by_row.items():
                rows = sorted({j for p in pairs for j in missing[p]})
                pick = slice(None) if len(rows) == len(chunk) else torch.tensor(rows)
                z = factors[pick, at[a]]
                if pairs[0][1] < 0:  # (a, -1): one Gram per layer
                    value = {pairs[0]: z if gram else z @ z.transpose(-2, -1)}
                else:
                    value, w = {}, factors.shape[-1]
                    # Stored vectors are read token-major: a run of consecutive layers side by side is one view.
                    partners = sorted(at[b] for _, b in pairs)
                    for _, run in itertools.groupby(enumerate(partners), key=lambda x: x[1] - x[0]):
                        first, last = (run := list(run))[0][1], run[-1][1]
                        side_by_side = factors[pick, first : last + 1].transpose(1, 2).flatten(-2)
                        block = z.transpose(-2, -1) @ side_by_side  # [c, w, (last - first + 1) w]
                        value.update({(a, layers[b]): block[..., (b - first) * w : (b - first + 1) * w] for _, b in run})
                for p, v in value.items():
                    for j, entry in zip(rows, v):
                        if found[p][j] is None:
                            found[p][j] = entry.clone()  # not a view: the cache counts what it holds
                            computed.append(((chunk[j], *p), found[p][j]))
                    if len(missing[p]) == len(chunk):  # all computed here: no need to stack the clones
                        found[p] = v
            self._products.put_many(computed)
        return {p: entries if isinstance(entries, torch.Tensor) else torch.stack(entries) for p, entries in found.items()}

    def prompt_grams(self, i: int) -> torch.Tensor:
        """Grams K_a [L, n, n] float64 of the i-th added prompt, from the stored factors."""
        self._file.flush()
        factor = self._read([i], range(self._entropy.array.shape[1]))[0, :, : self.tokens[i], : self.width[i]]
        return factor if self._is_gram(i) else factor @ factor.transpose(-2, -1)

    def _solve_shape(self, i: int) -> tuple[bool, int, int]:
        """(Grams stored?, padded token count n, columns w of a stored factor) of the i-th added prompt."""
        gram, n = self._is_gram(i), self._padded_tokens(i)
        return gram, n, n if gram else self.dim

    def _is_gram(self, i: int) -> bool:
        return self.width[i] < self.dim  # Z has more columns than rows: K is stored

    def _padded_tokens(self, i: int) -> int:
        """The token count a prompt's factors are zero-padded to in the solves: a multiple of
        _PAD_TOKENS, a function of the prompt alone, so that its set entropies do not depend on
        which prompts share its batch (exact ties stay exact ties)."""
        return -(-self.tokens[i] // _PAD_TOKENS) * _PAD_TOKENS

    def _prompt_chunks(self, records, sets: Sequence[tuple[int, ...]]):
        """`records` (insertion indices) in lists of one storage kind and padded token count, at
        most _READ_BLOCK_ELEMS of the factors of the layers in `sets` each (the searches' memory
        does not grow with P)."""
        shape = lambda i: (self._is_gram(i), self._padded_tokens(i))  # noqa: E731
        order = sorted(records, key=shape)
        num_layers = len({a for key in sets for a in key})
        chunk: list[int] = []
        for i in order:
            n = self._padded_tokens(i)
            width = n if self._is_gram(i) else self.dim
            if chunk and ((len(chunk) + 1) * num_layers * n * width > _READ_BLOCK_ELEMS or shape(i) != shape(chunk[0])):
                yield chunk
                chunk = []
            chunk.append(i)
        if chunk:
            yield chunk

    def _read(self, chunk: list[int], layers: Sequence[int]) -> torch.Tensor:
        """The factors of `layers` (sorted) of the prompts in `chunk` (one padded shape) ->
        [len(chunk), len(layers), n, w] float64, zero-padded: zero rows add nothing to Z^T Z, zero
        rows and columns of K add zero eigenvalues only. Stored vectors come back as a view of a
        token-major [len(chunk), n, len(layers), w] tensor, so that the vectors of consecutive layers
        of one token are side by side (one GEMM for the blocks of several layers). Only the layers
        asked for are read, one positioned read per run of consecutive layers."""
        gram = self._is_gram(chunk[0])
        n_pad = self._padded_tokens(chunk[0])
        w_pad = n_pad if gram else self.dim
        if gram:
            out = torch.empty(len(chunk), len(layers), n_pad, w_pad, dtype=torch.float64)
        else:
            out = torch.empty(len(chunk), n_pad, len(layers), w_pad, dtype=torch.float64).transpose(1, 2)
        runs = [(run[0][0], run[0][1], len(run)) for _, g in itertools.groupby(enumerate(layers), key=lambda x: x[1] - x[0])
                for run in [list(g)]]  # (position in `layers`, first layer, length)
        staging = torch.empty(len(layers) * n_pad * w_pad, dtype=self.dtype)  # one buffer for every prompt
        flat = staging.numpy().view(np.uint8)
        for row, i in enumerate(chunk):
            n, w = self.tokens[i], self.width[i]
            layer_bytes = n * w * staging.element_size()
            for start, first, length in runs:
                part = flat[start * layer_bytes : (start + length) * layer_bytes]
                if os.preadv(self._file.fileno(), [part], self.offset[i] + first * layer_bytes) != part.nbytes:
                    raise OSError(f"{self.path or 'the prompt-mode factor file'}: shorter than its index (truncated?)")
            out[row, :, :n, :w] = staging[: len(layers) * n * w].view(len(layers), n, w)
            if n < n_pad:
                out[row, :, n:].zero_()
            if w < w_pad:
                out[row, :, :n, w:].zero_()
        return out


@functools.lru_cache(maxsize=1)
def _solver_pool(workers: int) -> ThreadPoolExecutor:
    # Kept for the process: a fresh thread pays LAPACK's per-thread set-up on its first solve.
    return ThreadPoolExecutor(workers, thread_name_prefix="elsi-set-entropy")


def _parallel_map(fn, jobs: list[tuple]) -> list:
    """[fn(*job) for job in jobs], on a pool of one thread per intra-op thread, each running torch
    with one intra-op thread: the jobs are many small GEMMs and eigensolves, which LAPACK's and
    torch's own threads only slow down (the solves ran up to 10x slower with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if threads > 1 and len(jobs) > 1:
            return list(_solver_pool(threads).map(lambda job: fn(*job), jobs))
        return [fn(*job) for job in jobs]
    finally:
        torch.set_num_threads(threads)


def _key_groups(keys: list[tuple[int, ...]], elements_per_key: int):
    """`keys` in groups of one set size, each bounded so its set matrices hold at most about
    _READ_BLOCK_ELEMS elements."""
    for size in sorted({len(k) for k in keys}):
        same = [k for k in keys if len(k) == size]
        step = max(1, _READ_BLOCK_ELEMS // (elements_per_key * size * size))
        for start in range(0, len(same), step):
            yield same[start : start + step]


def _gram_side(m: int, gram: bool, n: int, w: int) -> bool:
    """Whether the spectrum of a set of m layers is solved on the n x n Gram side (stored Grams,
    or m w > n), else on the m w x m w side of the concatenated vectors."""
    return gram or m * w > n


def _solve_side(m: int, gram: bool, n: int, w: int) -> int:
    """Side of the matrix solved for a set of m layers (see _gram_side)."""
    return n if _gram_side(m, gram, n, w) else m * w


def _set_matrices(
    products: dict[tuple[int, int], torch.Tensor], keys: list[tuple[int, ...]], want: np.ndarray, n: int, w: int, gram: bool
) -> torch.Tensor:
    """Per set S of `keys` (sorted layers, all of one size m) and prompt r with want[S, r], in that
    order, a matrix whose nonzero spectrum is that of K_S = sum_{a in S} K_a -> [want.sum(), k, k],
    from the chunk's `products` (see PromptGrams._products_of): on the Gram side sum_a K_a (lower
    triangle read: stored Grams are symmetric only up to rounding); else [Z_a]^T [Z_a], its upper
    triangle only, assembled from the blocks Z_a^T Z_b, a <= b, as they are stored (no transposes).
    """
    m = len(keys[0])
    gram_side = _gram_side(m, gram, n, w)
    side = _solve_side(m, gram, n, w)
    counts = want.sum(1)
    out = torch.empty(int(counts.sum()), side, side, dtype=torch.float64)
    start = 0
    for key, wanted, count in zip(keys, want, counts):
        rows = slice(None) if count == len(wanted) else torch.from_numpy(np.flatnonzero(wanted))
        target = out[start : start + count]
        start += count
        if gram_side:
            target.copy_(products[key[0], -1][rows])
            for a in key[1:]:
                target += products[a, -1][rows]
            continue
        for i, a in enumerate(key):
            for j, b in enumerate(key[i:], i):  # block (i, j), i <= j: Z_a^T Z_b
                target[:, i * w : (i + 1) * w, j * w : (j + 1) * w] = products[a, b][rows]
    return out


class _ProductCache:
    """Least-recently-used cache of per-prompt products (see PromptGrams._products_of), at most
    `limit` bytes, shared by the solver threads."""

    def __init__(self, limit: int):
        self.limit = limit
        self.bytes = 0
        self._entries: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
        self._lock = threading.Lock()

    def get_many(self, keys: list[tuple]) -> list[torch.Tensor | None]:
        """The cached value of each key (None where absent); the ones found become most recent."""
        with self._lock:
            values = [self._entries.get(key) for key in keys]
            for key, value in zip(keys, values):
                if value is not None:
                    self._entries.move_to_end(key)
            return values

    def put_many(self, items: list[tuple[tuple, torch.Tensor]]) -> None:
        """Add (key, value) pairs, dropping the least recently used entries beyond the limit."""
        with self._lock:
            for key, value in items:
                size = value.numel() * value.element_size()
                if key in self._entries or size > self.limit:
                    continue
                self._entries[key] = value
                self.bytes += size
            while self.bytes > self.limit:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0


# ---------------------------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------------------------


def _entropy_head(model: nn.Module) -> nn.Linear | None:
    """The LM head as a plain Linear when logits = head(final normed hidden) exactly, else None
    (soft-capped or scaled logits need the model's own logits)."""
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attr, None) not in (None, 1.0):
            return None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, nn.Linear) else None


def _set_key(layer_set: Sequence[int]) -> tuple[int, ...]:
    return tuple(sorted(set(int(a) for a in layer_set)))


def _special_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "all_special_ids", None) or []
    return sorted({int(i) for i in ids if i is not None})


class _PassState:
    """Everything accumulated so far on this rank; saved and restored for resume.

    factors_path: the prompt-mode factor file (None: an anonymous temporary file)."""

    def __init__(
        self, num_layers: int, dim: int, normalize: str, device: torch.device, filtered_only: bool,
        factors_path: str | None, factors_dtype: torch.dtype,
    ):
        self.covariance = StreamingCovariance(num_layers, dim, normalize=normalize, device=device)
        self.hsic = MinibatchHSIC(num_layers, normalize=normalize, device=device)
        self.grams = PromptGrams(dim, factors_path, dtype=factors_dtype)
        # Unfiltered prompts serve only the variance comparison: per-layer statistics, no factors.
        self.grams_unfiltered = None if filtered_only else PromptGrams(dim, factors=False)
        self.position = 0  # prompts of this rank's shard already consumed
        self.tokens = {"total": 0, "candidates": 0, "kept": 0}
        self.prompts_without_hsic = 0

    def state_dict(self, fingerprint: str) -> dict:
        return {
            "version": _STATE_VERSION,
            "fingerprint": fingerprint,
            "position": self.position,
            "tokens": dict(self.tokens),
            "prompts_without_hsic": self.prompts_without_hsic,
            "covariance": self.covariance.state_dict(),
            "hsic": self.hsic.state_dict(),
            "grams": self.grams.state_dict(),
            "grams_unfiltered": None if self.grams_unfiltered is None else self.grams_unfiltered.state_dict(),
        }

    def load(self, state: dict, fingerprint: str, path: str) -> None:
        if state.get("version") != _STATE_VERSION or state.get("fingerprint") != fingerprint:
            raise ValueError(
                f"state_path: {path} was written by a run with other prompts, model or options; "
                "delete it or pass another state_path"
            )
        self.position = state["position"]
        self.tokens = dict(state["tokens"])
        self.prompts_without_hsic = state["prompts_without_hsic"]
        self.covariance.load_state_dict(state["covariance"])
        self.hsic.load_state_dict(state["hsic"])
        self.grams.load_state_dict(state["grams"])
        if self.grams_unfiltered is not None:
            self.grams_unfiltered.load_state_dict(state["grams_unfiltered"])


def _save_atomically(obj: Any, path: str) -> None:
    # torch.save to a temporary file, then os.replace: a crash mid-save leaves the old state intact.
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _prompt_vectors(rows: list[torch.Tensor], gram_tokens: int | None) -> torch.Tensor:
    """[L, n, d] float64 prompt-mode vectors of one prompt's rows (n >= 2): centered over the prompt,
    rows L2-normalized; with `gram_tokens`, at most that many evenly spaced tokens."""
    n = rows[0].shape[0]
    if gram_tokens is not None and n > gram_tokens:
        pick = torch.linspace(0, n - 1, gram_tokens, device=rows[0].device).round().long()
        rows = [r[pick] for r in rows]
    return normalize_tokens(torch.stack(rows).to(torch.float64), "center_l2")


def analyze(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt | str],
    *,
    m: Sequence[int] = (1, 3),
    batch_size: int = 8,
    max_prompts: int | None = None,
    max_tokens: int = 512,
    min_token_entropy: float = DEFAULT_MIN_TOKEN_ENTROPY,
    drop_special_tokens: bool = True,
    normalize: str = "l2",
    gram_tokens: int | None = None,
    gram_dtype: str = "float32",
    candidates: Sequence[int] | None = None,
    beta: float = 1.0,
    one_per_compartment: bool = False,
    novelty_half_width: int = 2,
    novelty_threshold: float = 0.1,
    max_exhaustive: int = 1000,
    screen_z: float = 4.0,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    state_path: str | None = None,
    save_every: int = 8,
    progress: bool = True,
    model_name: str | None = None,
) -> LayerReport:
    """Analyze `model` on `prompts` in one streaming pass and select draft layers.

    prompts: strings or `Prompt`s (see prompts.load_prompts), tokenized with `tokenizer`
    (chat template for instructions) and truncated to `max_tokens`; each needs >= 2 tokens.
    Tokens kept per prompt: not padding, not position 0, not special (if `drop_special_tokens`),
    with next-token entropy >= `min_token_entropy` nats (0 disables the filter).
    m: the set sizes to select for (each at most the number of candidates).
    candidates: layers ELSI / ELSI-C may pick; default 1..N-1, the states every engine captures
    (h_0 is the embedding the draft already sees and SGLang/TRT-LLM cannot name it; vLLM and
    SGLang record aux states at block inputs only, so they never capture h_N).
    gram_tokens: None (DESIGN's prompt mode: all kept tokens) or a cap, evenly spaced tokens.
    gram_dtype: precision of the spilled prompt-mode vectors ("float32" or "float64"); every
    statistic is computed in float64.
    screen_z: width of the set searches' screen in standard errors (inf: every candidate set is
    evaluated on every prompt; the picks of the default are tested against that).
    state_path: accumulator state saved there atomically every `save_every` batches and on
    Ctrl-C (once the batch under way ends, then KeyboardInterrupt is raised); a rerun with the
    same path, prompts and options continues after the last saved batch. The prompt-mode
    vectors go to `state_path + ".factors"` (without state_path: an anonymous temporary file).
    Under torch.distributed, prompts are sharded by rank and the statistics reduced, so every rank
    returns the single-process result (the state file gets a `.rank{r}` suffix).
    Returns a LayerReport with indices in the input-to-layer convention (h_0 .. h_N).
    """
    blocks = decoder_layers(model)
    num_blocks = len(blocks)
    options = AnalyzeOptions(
        m=tuple(sorted(set(m))) if not isinstance(m, int) else (m,),
        batch_size=batch_size,
        max_prompts=max_prompts,
        max_tokens=max_tokens,
        min_token_entropy=float(min_token_entropy),
        drop_special_tokens=drop_special_tokens,
        normalize=normalize,
        gram_tokens=gram_tokens,
        gram_dtype=gram_dtype,
        candidates=None if candidates is None else tuple(int(c) for c in candidates),
        beta=float(beta),
        one_per_compartment=one_per_compartment,
        novelty_half_width=novelty_half_width,
        novelty_threshold=float(novelty_threshold),
        max_exhaustive=max_exhaustive,
        screen_z=float(screen_z),
        save_every=save_every,
    )
    options.validate(num_blocks)
    if device is not None or dtype is not None:
        if getattr(model, "hf_device_map", None) and device is not None:
            raise ValueError("device: the model is dispatched with device_map; do not pass device as well")
        model.to(device=device, dtype=dtype)
    model.eval()
    input_device = model.get_input_embeddings().weight.device

    token_ids = _tokenize(prompts, tokenizer, options)
    special = torch.tensor(_special_ids(tokenizer) if options.drop_special_tokens else [], dtype=torch.long)

    rank, world = _distributed_rank_world()
    shard = list(range(rank, len(token_ids), world))
    fingerprint = _fingerprint(model, token_ids, options)
    if state_path is not None and world > 1:
        state_path = f"{state_path}.rank{rank}"

    dim = model.get_input_embeddings().weight.shape[1]
    filtered_only = options.min_token_entropy == 0
    factors_path = None if state_path is None else f"{state_path}.factors"
    state = _PassState(
        num_blocks + 1, dim, options.normalize, input_device, filtered_only, factors_path, getattr(torch, options.gram_dtype)
    )
    if state_path is not None and os.path.exists(state_path):
        state.load(torch.load(state_path, weights_only=False), fingerprint, state_path)

    head = _entropy_head(model)
    remaining = shard[state.position :]
    bar = _progress_bar(sum(len(token_ids[i]) for i in remaining), progress and rank == 0)
    started = time.perf_counter()
    batches_since_save = 0
    # Ctrl-C mid-batch would leave the accumulators half-updated: it waits for the batch's end,
    # where the state is saved.
    with torch.inference_mode(), DeferredInterrupt("the pass", enabled=state_path is not None) as interrupt:
        for start in range(0, len(remaining), options.batch_size):
            batch = remaining[start : start + options.batch_size]
            _process_batch(
                model, head, [token_ids[i] for i in batch], batch, special, state, options, input_device, num_blocks,
            )
            state.position += len(batch)
            bar.update(sum(len(token_ids[i]) for i in batch))
            batches_since_save += 1
            if state_path is not None and (batches_since_save >= options.save_every or interrupt.requested):
                _save_atomically(state.state_dict(fingerprint), state_path)
                batches_since_save = 0
            interrupt.raise_if_requested()
    bar.close()
    elapsed = time.perf_counter() - started
    if state_path is not None and batches_since_save:
        _save_atomically(state.state_dict(fingerprint), state_path)

    finished = time.perf_counter()
    if world > 1:
        _reduce_across_ranks(state, factors_path)
    report = _build_report(model, model_name, state, options, num_blocks, elapsed, len(token_ids))
    report.timing["selection_seconds"] = time.perf_counter() - finished
    return report


def _tokenize(prompts: Sequence[Prompt | str], tokenizer: Any, options: AnalyzeOptions) -> list[list[int]]:
    if isinstance(prompts, (str, Prompt)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts: expected a sequence of strings or Prompt objects, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts: no prompts given")
    if options.max_prompts is not None:
        prompts = prompts[: options.max_prompts]
    token_ids = []
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (str, Prompt)):
            raise TypeError(f"prompts[{i}]: expected a string or Prompt, got {type(prompt).__name__}")
        ids = encode_prompt(prompt, tokenizer)[: options.max_tokens]
        if len(ids) < 2:
            raise ValueError(
                f"prompts[{i}]: has {len(ids)} token(s); at least 2 are needed (position 0 is always dropped)"
            )
        token_ids.append(ids)
    return token_ids


def _process_batch(
    model: nn.Module,
    head: nn.Linear | None,
    batch_ids: list[list[int]],
    batch_index: list[int],
    special: torch.Tensor,
    state: _PassState,
    options: AnalyzeOptions,
    device: torch.device,
    num_blocks: int,
) -> None:
    lengths = torch.tensor([len(ids) for ids in batch_ids])
    width = int(lengths.max())
    input_ids = torch.zeros(len(batch_ids), width, dtype=torch.long)
    for b, ids in enumerate(batch_ids):
        input_ids[b, : len(ids)] = torch.tensor(ids)
    positions = torch.arange(width)
    attention_mask = positions[None, :] < lengths[:, None]
    candidates = attention_mask & (positions[None, :] >= 1) & ~torch.isin(input_ids, special)
    per_prompt_candidates = candidates.sum(1).tolist()
    candidates_on = {}

    rows: list[torch.Tensor | None] = [None] * (num_blocks + 1)

    def keep_candidate_rows(layer: int, hidden: torch.Tensor) -> None:
        mask = candidates_on.setdefault(hidden.device, candidates.to(hidden.device))
        rows[layer] = hidden[mask].to(device)

    model_inputs = {
        "input_ids": input_ids.to(device),
        "attention_mask": attention_mask.to(device=device, dtype=torch.long),
        "use_cache": False,
    }
    num_candidates = int(candidates.sum())
    with capture_hidden_states(model, callback=keep_candidate_rows):
        if options.min_token_entropy == 0:  # filter off: hidden states only, no logits or entropies
            model.base_model(**model_inputs)
            keep = torch.ones(num_candidates, dtype=torch.bool, device=device)
        elif head is not None:  # entropy from the final normed states, never building the logits
            final = model.base_model(**model_inputs).last_hidden_state
            final_rows = final[candidates.to(final.device)].to(head.weight.device)
            keep = (linear_token_entropy(final_rows, head.weight, head.bias) >= options.min_token_entropy).to(device)
        else:
            logits = model(**model_inputs).logits
            keep = (token_entropy(logits[candidates.to(logits.device)]) >= options.min_token_entropy).to(device)

    state.tokens["total"] += int(lengths.sum())
    state.tokens["candidates"] += num_candidates
    state.tokens["kept"] += int(keep.sum())
    if bool(keep.any()):
        state.covariance.update(rows, mask=keep)
    offset = 0
    for prompt_index, count in zip(batch_index, per_prompt_candidates):
        prompt_rows = [r[offset : offset + count] for r in rows]
        prompt_keep = keep[offset : offset + count]
        offset += count
        kept = int(prompt_keep.sum())
        if kept >= 4:
            state.hsic.update(prompt_rows, mask=prompt_keep)
        else:
            state.prompts_without_hsic += 1
        if kept >= 2:
            kept_rows = [r[prompt_keep] for r in prompt_rows]
            state.grams.add(prompt_index, _prompt_vectors(kept_rows, options.gram_tokens))
        if state.grams_unfiltered is not None and count >= 2:
            state.grams_unfiltered.add(prompt_index, _prompt_vectors(prompt_rows, options.gram_tokens))


def _distributed_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _reduce_across_ranks(state: _PassState, factors_path: str | None) -> None:
    """Sum accumulators over ranks and gather every rank's prompt-mode records, so that all ranks
    hold the totals. Records travel by broadcast from each rank in turn, _GATHER_PROMPTS at a time
    (memory bounded); each rank writes the union to its own factor file."""
    import torch.distributed as dist

    state.covariance.all_reduce()
    state.hsic.all_reduce()
    local = {"tokens": state.tokens, "prompts_without_hsic": state.prompts_without_hsic,
             "counts": (len(state.grams), 0 if state.grams_unfiltered is None else len(state.grams_unfiltered))}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    state.tokens = {key: sum(g["tokens"][key] for g in gathered) for key in state.tokens}
    state.prompts_without_hsic = sum(g["prompts_without_hsic"] for g in gathered)
    stores = [(state.grams, PromptGrams(state.grams.dim, None if factors_path is None else f"{factors_path}.all",
                                        dtype=state.grams.dtype))]
    if state.grams_unfiltered is not None:
        stores.append((state.grams_unfiltered, PromptGrams(state.grams.dim, factors=False)))
    rank = dist.get_rank()
    for which, (local_store, merged) in enumerate(stores):
        for source, g in enumerate(gathered):
            count = g["counts"][which]
            for start in range(0, count, _GATHER_PROMPTS):
                payload = [list(local_store.records(start, min(count, start + _GATHER_PROMPTS)))] if source == rank else [None]
                dist.broadcast_object_list(payload, src=source)
                for record in payload[0]:
                    merged.add_record(*record)
    state.grams = stores[0][1]
    if state.grams_unfiltered is not None:
        state.grams_unfiltered = stores[1][1]


# Prompts per broadcast when ranks exchange prompt-mode records.
_GATHER_PROMPTS = 16


def _fingerprint(model: nn.Module, token_ids: list[list[int]], options: AnalyzeOptions) -> str:
    digest = hashlib.sha256()
    digest.update(type(model).__name__.encode())
    digest.update(json.dumps(getattr(model.config, "to_dict", dict)(), sort_keys=True, default=str).encode())
    digest.update(json.dumps(token_ids).encode())
    # Selection settings are applied after the pass and may change between resumed runs.
    pass_options = {k: v for k, v in asdict(options).items() if k in _PASS_OPTIONS}
    digest.update(json.dumps(pass_options, sort_keys=True).encode())
    return digest.hexdigest()


# Statistics are per prompt, so the batch size may change between an interrupted run and its resume.
_PASS_OPTIONS = (
    "max_prompts", "max_tokens", "min_token_entropy", "drop_special_tokens",
    "normalize", "gram_tokens", "gram_dtype",
)


def _progress_bar(total_tokens: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total_tokens, unit="tok", unit_scale=True, desc=f"analyze (threads: {torch.get_num_threads()})", disable=not enabled)


def _build_report(
    model: nn.Module,
    model_name: str | None,
    state: _PassState,
    options: AnalyzeOptions,
    num_blocks: int,
    elapsed: float,
    num_prompts: int,
) -> LayerReport:
    if state.tokens["kept"] == 0:
        raise ValueError(
            f"min_token_entropy: every token was filtered out ({state.tokens['candidates']} candidate tokens, "
            f"none with next-token entropy >= {options.min_token_entropy} nats); lower the threshold (0 disables it)"
        )
    if len(state.grams) == 0 or state.hsic.num_batches == 0:
        raise ValueError(
            "prompts: no prompt kept enough tokens for the statistics (prompt mode needs >= 2 kept tokens, "
            "CKA >= 4 per prompt); give longer prompts or lower min_token_entropy"
        )
    grams = state.grams
    entropy_per_prompt = grams.layer_entropies()
    variance = {"filtered": float(entropy_per_prompt.var(0).mean())}
    if state.grams_unfiltered is not None:
        unfiltered_entropy = state.grams_unfiltered.layer_entropies()
        variance["unfiltered"] = float(unfiltered_entropy.var(0).mean())
        variance["reduction"] = 1.0 - variance["filtered"] / variance["unfiltered"] if variance["unfiltered"] > 0 else 0.0
        variance["unfiltered_prompts"] = len(state.grams_unfiltered)
    else:
        unfiltered_entropy = None
    variance["filtered_prompts"] = len(grams)

    hsic = state.hsic
    layers = []
    dataset_entropy = state.covariance.entropy().cpu().numpy()
    dataset_renyi2 = state.covariance.entropy(alpha=2).cpu().numpy()
    for index in range(num_blocks + 1):
        entry = {
            "index": index,
            "entropy_prompt_mean": float(entropy_per_prompt[:, index].mean()),
            "entropy_prompt_std": float(entropy_per_prompt[:, index].std()),
            "entropy_dataset": float(dataset_entropy[index]),
            "renyi2_dataset": float(dataset_renyi2[index]),
        }
        if unfiltered_entropy is not None:
            entry["entropy_prompt_mean_unfiltered"] = float(unfiltered_entropy[:, index].mean())
            entry["entropy_prompt_std_unfiltered"] = float(unfiltered_entropy[:, index].std())
        layers.append(entry)
    memory = {
        "gram_store_bytes": grams.nbytes,
        "gram_store_path": grams.path,
        "prompt_statistics_bytes": grams.ram_bytes + (state.grams_unfiltered.ram_bytes if state.grams_unfiltered else 0),
        "accumulator_bytes": sum(
            t.numel() * t.element_size()
            for sd in (state.covariance.state_dict(), hsic.state_dict())
            for t in sd.values()
            if isinstance(t, torch.Tensor)
        ),
    }
    tokens = dict(state.tokens)
    tokens["kept_fraction"] = tokens["kept"] / tokens["candidates"] if tokens["candidates"] else 0.0
    objective = ScreenedObjective(grams.prompt_set_entropy, grams.surrogate, len(grams), options.screen_z)
    report = LayerReport(
        model=model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        num_hidden_layers=num_blocks,
        layers=layers,
        cka=hsic.cka().cpu().numpy().tolist(),
        tokens=tokens,
        options=asdict(options),
        prompts={
            "count": num_prompts,
            "in_prompt_mode": len(grams),
            "without_cka_minibatch": state.prompts_without_hsic,
        },
        entropy_variance=variance,
        memory=memory,
        timing={"pass_seconds": elapsed},
        set_entropy=objective,
        set_renyi2=grams.renyi2_entropy,
    )
    report.compute_selections()
    report.timing["sets_screened"] = objective.counts["screened"]
    report.timing["sets_evaluated_exactly"] = objective.counts["evaluated"]
    report.timing["prompt_set_eigensolves"] = grams.solves
    return report
