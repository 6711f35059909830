"""The prompt-mode store: every prompt's layer statistics, exact, in memory independent of its tokens.

Prompt mode (docs/method.md section 3) computes, per prompt and layer, the matrix entropy of the
Gram K_a = Z_a Z_a^T of the prompt's kept token vectors Z_a [n, d] (centered over the prompt,
rows L2-normalized). `PromptModeStore` keeps, per prompt:
- in RAM, O(L^2) numbers in float64: `entropy` H1(K_a) (eigen-solved on the smaller side of Z_a,
  d x d or n x n), `trace` tr K_a and `frob` <K_a, K_b>_F. These give every layer's statistics
  and the Renyi-2 entropy of any set S, -log(sum_{a,b in S} <K_a, K_b> / (sum tr K_a)^2);
- in a spill file (`factors=True`), per layer, Z_a [n, d] when d <= n, else K_a [n, n], in
  `dtype`: what the exact entropy of a set's concatenation needs (`set_entropy.SetEntropySolver`).
The file is read back with positioned reads, a few prompts at a time, so the memory the set
searches use does not grow with the number of prompts.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from typing import Iterator, Sequence

import numpy as np
import torch

from ..metrics import spectrum_entropy

# A prompt's factors are zero-padded to a multiple of this many tokens in the set solves.
PAD_TOKENS = 16
# Rows of the stacked Grams built at once by `gram_inner_products`: bounds its scratch memory.
_GRAM_ROWS_ELEMS = 1 << 24

# One stored prompt as `records()` yields it and `add_record()` takes it:
# (prompt_index, entropy [L], trace [L], frob [L, L] or None, (n, width, factor bytes) or None).
Record = tuple


def gram_inner_products(z: torch.Tensor) -> torch.Tensor:
    """[L, L] raw Frobenius products <K_a, K_b> of the Grams K_a = Z_a Z_a^T of z [L, n, w].

    Raw, not centered: prompt-mode rows are centered and then L2-normalized, so their Grams are the
    matrices whose spectra docs/method.md section 3 defines. tr(K_S^2) = sum_{a,b in S} <K_a, K_b>
    gives the Renyi-2 entropy of any set. One GEMM over row blocks of the stacked, flattened Grams.
    """
    num_layers, n, _ = z.shape
    rows = max(1, _GRAM_ROWS_ELEMS // (num_layers * n))
    out = torch.zeros(num_layers, num_layers, dtype=z.dtype, device=z.device)
    for start in range(0, n, rows):
        flat = (z[:, start:start + rows] @ z.transpose(1, 2)).reshape(num_layers, -1)
        out.addmm_(flat, flat.T)
    return out


class _GrowingRows:
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


class PromptModeStore:
    """Prompt-mode statistics of every prompt added (see the module docstring).

    dim: the model's hidden size d; path: the spill file (None: an anonymous temporary file);
    factors=False keeps the per-layer statistics only (no spill file, no set entropies);
    dtype: precision of the spilled vectors or Grams (every statistic is computed in float64).
    `version` changes whenever prompts are added, so that solvers know their caches are stale.
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
        self._entropy, self._trace, self._frob = _GrowingRows(), _GrowingRows(), _GrowingRows()  # [P, L], [P, L], [P, L, L]
        self._file = None
        self._size = 0
        self._stack: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.version = 0

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
            frob = gram_inner_products(z.double())
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

    def records(self, start: int = 0, stop: int | None = None) -> Iterator[Record]:
        """(prompt_index, entropy, trace, frob, factor bytes or None) per prompt, in insertion order."""
        self.flush()
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
        """Everything but the file's contents (flushed to disk here; the file keeps its path), as
        tensors, numbers and lists only (`state_files.load_state` reads it without unpickling code)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        return {
            "factors": self.factors,
            "prompt_index": list(self.prompt_index),
            "tokens": list(self.tokens),
            "offset": list(self.offset),
            "width": list(self.width),
            "entropy": torch.from_numpy(self._entropy.array.copy()),
            "trace": torch.from_numpy(self._trace.array.copy()),
            "frob": torch.from_numpy(self._frob.array.copy()),
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
        self._entropy, self._trace, self._frob = (_GrowingRows(state[key].numpy()) for key in ("entropy", "trace", "frob"))
        self._changed()

    def _changed(self) -> None:
        self._stack = None
        self.version += 1

    # -- reading ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Make every written factor visible to positioned reads."""
        if self._file is not None:
            self._file.flush()

    def order(self) -> np.ndarray:
        """Insertion indices in prompt order."""
        return np.argsort(self.prompt_index, kind="stable")

    def layer_entropies(self) -> np.ndarray:
        """Shannon entropy H1(K_l) per prompt (in prompt order) and layer -> [P, L] float64."""
        return self._entropy.array[self.order()]

    def stacked(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(entropy [P, L], trace [P, L], frob [P, L, L]) in prompt order."""
        if self._stack is None:
            order = self.order()
            self._stack = (self._entropy.array[order], self._trace.array[order], self._frob.array[order])
        return self._stack

    def prompt_grams(self, i: int) -> torch.Tensor:
        """Grams K_a [L, n, n] float64 of the i-th added prompt, from the stored factors."""
        self.flush()
        factor = self.read([i], range(self._entropy.array.shape[1]))[0, :, : self.tokens[i], : self.width[i]]
        return factor if self.is_gram(i) else factor @ factor.transpose(-2, -1)

    def solve_shape(self, i: int) -> tuple[bool, int, int]:
        """(Grams stored?, padded token count n, columns w of a stored factor) of the i-th added prompt."""
        gram, n = self.is_gram(i), self.padded_tokens(i)
        return gram, n, n if gram else self.dim

    def is_gram(self, i: int) -> bool:
        """Whether the i-th prompt's Grams are stored (Z has more columns than rows) rather than Z."""
        return self.width[i] < self.dim

    def padded_tokens(self, i: int) -> int:
        """The token count a prompt's factors are zero-padded to in the solves: a multiple of
        PAD_TOKENS, a function of the prompt alone, so that its set entropies do not depend on
        which prompts share its batch (exact ties stay exact ties)."""
        return -(-self.tokens[i] // PAD_TOKENS) * PAD_TOKENS

    def read(self, chunk: list[int], layers: Sequence[int]) -> torch.Tensor:
        """The factors of `layers` (sorted) of the prompts in `chunk` (one padded shape) ->
        [len(chunk), len(layers), n, w] float64, zero-padded: zero rows add nothing to Z^T Z, zero
        rows and columns of K add zero eigenvalues only. Stored vectors come back as a view of a
        token-major [len(chunk), n, len(layers), w] tensor, so that the vectors of consecutive layers
        of one token are side by side (one GEMM for the blocks of several layers). Only the layers
        asked for are read, one positioned read per run of consecutive layers."""
        gram = self.is_gram(chunk[0])
        n_pad = self.padded_tokens(chunk[0])
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
