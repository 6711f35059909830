"""Exact entropies of layer sets in prompt mode, from the prompt-mode store's spill file.

The concatenation of a layer set S has Gram K_S = sum_{a in S} K_a (docs/method.md section 3), so
H1(K_S) needs the stored factors of S's layers, prompt by prompt: the nonzero spectrum of K_S is
that of [Z_a]^T [Z_a] (|S| d square) or of K_S (n square), and the smaller one is solved, in
float64. The searches (`selection.screened_best`) ask for many overlapping sets on growing prompt
samples, so the solver
- caches every (set, prompt) value and every per-prompt product block Z_a^T Z_b or Gram K_a it
  built (a bounded LRU, independent of the number of prompts);
- reads only the layers a chunk of prompts is missing, and builds the blocks of one layer against
  a run of consecutive layers as one GEMM;
- solves chunks of prompts on a thread pool with one intra-op thread each.
Renyi-2 entropies and the cheap surrogate come from the store's in-RAM statistics alone.
"""

from __future__ import annotations

import collections
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from ..metrics import spectrum_entropy
from .prompt_store import PromptModeStore

# Elements of the factors read back at once (16 MiB in float64: below glibc's largest mmap
# threshold, so the buffers are reused instead of faulted in afresh).
_READ_BLOCK_ELEMS = 1 << 21
# torch's batched CPU eigvalsh slows down superlinearly with the batch: solves go in slices.
_EIG_SLICE = 32
# Bytes of per-prompt product blocks kept for reuse by the set searches (bounded: independent of P).
_PRODUCT_CACHE_BYTES = 512 << 20


def set_key(layer_set: Sequence[int]) -> tuple[int, ...]:
    """A layer set as the solver keys it: sorted, a repeated layer counted once."""
    return tuple(sorted(set(int(a) for a in layer_set)))


class SetEntropySolver:
    """Set entropies of the prompts in `store` (a `PromptModeStore` with factors, once filled).

    `solves` counts the (set, prompt) eigensolves done. The caches follow the store: adding
    prompts to it clears them.
    """

    def __init__(self, store: PromptModeStore):
        self.store = store
        self.solves = 0
        # per set, H1(K_S) of every prompt in prompt order (NaN: not computed yet)
        self._set_cache: dict[tuple[int, ...], np.ndarray] = {}
        self._products = _ProductCache(_PRODUCT_CACHE_BYTES)
        self._version = store.version

    def _follow_store(self) -> None:
        if self._version != self.store.version:
            self._set_cache.clear()
            self._products.clear()
            self._version = self.store.version

    def _renyi2_terms(self, sets: Sequence[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
        """Per prompt and set: (H2(K_S), sum_a w_a (H1(K_a) - H2(K_a))) with w_a = tr K_a / tr K_S,
        for sets of one size -> two [P, len(sets)] arrays."""
        entropy, trace, frob = self.store.stacked()
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
        keys = [set_key(s) for s in sets]
        out = np.empty((rows, len(keys)))
        for size in sorted({len(k) for k in keys}):
            where = [i for i, k in enumerate(keys) if len(k) == size]
            step = max(1, (1 << 22) // (len(self.store) * size * size))
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
        both = self._by_size(sets, lambda part: np.concatenate(self._renyi2_terms(part)), 2 * len(self.store))
        return both.reshape(2, len(self.store), len(sets))

    def set_entropy(self, sets: Sequence[tuple[int, ...]]) -> np.ndarray:
        """Mean over prompts of H1(sum_{a in S} K_a) for each set S -> [len(sets)] float64, exact.
        A repeated layer counts once."""
        return self.prompt_set_entropy(sets, np.arange(len(self.store))).mean(0)

    def prompt_set_entropy(self, sets: Sequence[tuple[int, ...]], prompts: np.ndarray) -> np.ndarray:
        """H1(sum_{a in S} K_a) of the given prompts (positions in prompt order) -> [len(prompts), len(sets)].

        Values are cached per set and prompt: the searches revisit sets and widen prompt samples.
        """
        self._follow_store()
        keys = [set_key(s) for s in sets]
        prompts = np.asarray(prompts, dtype=np.int64)
        entropy = self.store.stacked()[0]
        for key in keys:
            if key not in self._set_cache:
                self._set_cache[key] = entropy[:, key[0]].copy() if len(key) == 1 else np.full(len(self.store), np.nan)
        todo = sorted({k for k in keys if np.isnan(self._set_cache[k][prompts]).any()})
        if todo:
            if not self.store.factors:
                raise ValueError("set_entropy: this store keeps per-layer statistics only (factors=False)")
            self.store.flush()  # positioned reads see only what reached the OS
            order = self.store.order()
            position = np.empty(len(self.store), dtype=np.int64)
            position[order] = np.arange(len(self.store))
            jobs = []
            for chunk in self._prompt_chunks({int(order[p]) for p in prompts}, todo):
                rows = position[chunk]
                missing = np.stack([np.isnan(self._set_cache[k][rows]) for k in todo])  # [K, c]
                keep, used = missing.any(0), missing.any(1)
                if keep.any():
                    chunk = [i for i, k in zip(chunk, keep) if k]
                    jobs.append((chunk, rows[keep], [k for k, u in zip(todo, used) if u], missing[used][:, keep]))
            # Largest first (by solves x matrix side cubed), so that no thread is left with a big job at the end.
            jobs.sort(key=lambda job: -job[3].sum() * _solve_side(len(job[2][0]), *self.store.solve_shape(job[0][0])) ** 3)
            for done_keys, done_rows, values in _parallel_map(self._chunk_entropies, jobs):
                for key, row, value in zip(done_keys, done_rows, values):
                    self._set_cache[key][row] = value
                self.solves += len(values)
        return np.stack([self._set_cache[k][prompts] for k in keys], axis=1)

    def _chunk_entropies(self, chunk: list[int], rows: np.ndarray, keys: list[tuple[int, ...]], want: np.ndarray):
        """H1(K_S) of the sets `keys` on the prompts `chunk` (insertion indices, one padded shape; at
        positions `rows` in prompt order) where want [len(keys), len(chunk)] -> (set per value,
        position per value, values)."""
        gram, n, w = self.store.solve_shape(chunk[0])
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
            rtol = 10 * matrices.shape[-1] * torch.finfo(self.store.dtype if gram else torch.float64).eps
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
            factors = self.store.read(chunk, layers)  # [c, k, n, w]
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

    def _prompt_chunks(self, records, sets: Sequence[tuple[int, ...]]):
        """`records` (insertion indices) in lists of one storage kind and padded token count, at
        most _READ_BLOCK_ELEMS of the factors of the layers in `sets` each (the searches' memory
        does not grow with P)."""
        shape = lambda i: (self.store.is_gram(i), self.store.padded_tokens(i))  # noqa: E731
        order = sorted(records, key=shape)
        num_layers = len({a for key in sets for a in key})
        chunk: list[int] = []
        for i in order:
            n = self.store.padded_tokens(i)
            width = n if self.store.is_gram(i) else self.store.dim
            if chunk and ((len(chunk) + 1) * num_layers * n * width > _READ_BLOCK_ELEMS or shape(i) != shape(chunk[0])):
                yield chunk
                chunk = []
            chunk.append(i)
        if chunk:
            yield chunk


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
    from the chunk's `products` (see SetEntropySolver._products_of): on the Gram side sum_a K_a (lower
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
    """Least-recently-used cache of per-prompt products (see SetEntropySolver._products_of), at most
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

