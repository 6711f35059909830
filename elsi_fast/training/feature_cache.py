"""Offline draft training: the target's hidden states on the training samples, dumped once.

Training a draft online runs the target's forward at every step; six layer sets cost six target
forwards over the same tokens. SpecForge's offline mode dumps the states instead. `build` runs the
target once over every sample and stores, per token,
- the hidden states h_l (input-to-layer) of the union of the layers the drafts will read, and
- the final normed state the LM head reads, from which the soft labels come: the target's logits
  restricted to the draft vocabulary are that state times the head's rows (a plain linear head,
  `capture.plain_lm_head`; the head's weights are read from the target, which is loaded but never
  run while training from the cache).
Built with `final=False`, a cache holds the layers only, for drafts trained on the answers' own
tokens (`train_draft(labels="answers")`): the forward then stops at the deepest layer dumped, so a
cache of h_11 of SmolLM2's 30 blocks costs about 11/30 of the target's forward and half the disk,
and a target whose head is not a plain linear map (soft-capped logits) can be cached too.
The folder holds `meta.json` (what was dumped, from which target and data; the samples done so
far) and one flat file per array. The size is known before anything is written and must stay
under `max_bytes`; a dump interrupted by Ctrl-C or a crash continues where its last batch ended.
A cache grows with its data: built again with more samples after the ones it holds (a
`regenerate` run appends its new conversations), it keeps them and dumps only the new ones. Built
with the first samples of the ones it holds, or with some of its layers, a complete cache serves
them as they are (a cell trained on a prefix of the data, or one layer of an m=3 set, needs no
dump of its own); each sample's digest in the meta proves the prefix. Given other caches to
`reuse` (of the same target, dtype and layers or more), a sample already dumped in one of them,
by its digest, is copied from there instead of forwarded: a cell at another training length
shares every conversation short enough to come out the same.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from .._infra.interrupt import DeferredInterrupt
from ..targets.capture import capture_hidden_states, decoder_layers, plain_lm_head
from .training_data import Sample, pad_samples

META_FILE = "meta.json"
_VERSION = 1
_DTYPES = {"float32": (torch.float32, np.float32), "bfloat16": (torch.bfloat16, np.uint16)}
DEFAULT_MAX_BYTES = 32 << 30


def _sample_bytes(sample: Sample) -> bytes:
    """What identifies a sample: its ids (int32) and loss mask."""
    return sample.ids.numpy().astype(np.int32).tobytes() + sample.loss_mask.numpy().tobytes()


def samples_fingerprint(samples: Sequence[Sample]) -> str:
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(_sample_bytes(sample))
    return digest.hexdigest()[:32]


def sample_digests(samples: Sequence[Sample]) -> list[str]:
    """One short hash per sample: what tells a prefix of a cache's samples."""
    return [hashlib.sha256(_sample_bytes(s)).hexdigest()[:16] for s in samples]


def target_fingerprint(target) -> str:
    """The target's config and a hash of its first block's and head's weights (enough to tell two
    targets apart without hashing all of a large model)."""
    digest = hashlib.sha256(target.config.to_json_string().encode())
    head = plain_lm_head(target)
    tensors = [decoder_layers(target)[0].state_dict()[k] for k in sorted(decoder_layers(target)[0].state_dict())]
    tensors += [head.weight] if head is not None else []
    for tensor in tensors:
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes()[: 1 << 22])
    return digest.hexdigest()[:32]


class FeatureCache:
    """A dumped cache, opened for reading (`open`) or filled by `build`."""

    def __init__(self, path: Path, meta: dict):
        self.path = path
        self.meta = meta
        self.layers: list[int] = meta["layers"]
        self.dim: int = meta["dim"]
        self.dtype = meta["dtype"]
        self._offsets = np.array(meta["offsets"], dtype=np.int64)
        self._lengths = np.array(meta["lengths"], dtype=np.int64)
        self._arrays: dict[str, np.memmap] = {}

    @property
    def complete(self) -> bool:
        return self.meta["done"] == len(self.meta["lengths"])

    @property
    def has_final(self) -> bool:
        return _holds_final(self.meta)

    @property
    def nbytes(self) -> int:
        return int(self.meta["bytes"])

    def _array(self, name: str) -> np.memmap:
        if name not in self._arrays:
            tokens = int(self._lengths.sum())
            width = {"features": len(self.layers) * self.dim, "final": self.dim}[name]
            self._arrays[name] = np.memmap(self.path / f"{name}.bin", dtype=_DTYPES[self.dtype][1], mode="r",
                                           shape=(tokens, width))
        return self._arrays[name]

    def batch(self, samples: Sequence[Sample], indices: Sequence[int], layers: Sequence[int]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The samples at `indices`, right-padded: (ids [B, T], attention [B, T], loss mask [B, T],
        aux [B, T, len(layers) * d] float32 in `layers`' order, final normed state [B, T, d] float32,
        or None for a cache without it)."""
        missing = [l for l in layers if l not in self.layers]
        if missing:
            raise ValueError(f"feature_cache: {self.path} holds layers {self.layers}, not {missing}; dump them too")
        picked = [samples[i] for i in indices]
        ids, attention, loss = pad_samples(picked)
        width = ids.shape[1]
        columns = _columns(self.layers, self.dim, layers)
        aux = torch.zeros(len(picked), width, len(layers) * self.dim)
        final = torch.zeros(len(picked), width, self.dim) if self.has_final else None
        features = self._array("features")
        for b, i in enumerate(indices):
            start, length = int(self._offsets[i]), int(self._lengths[i])
            aux[b, :length] = _to_float(features[start : start + length][:, columns], self.dtype)
            if final is not None:
                final[b, :length] = _to_float(self._array("final")[start : start + length], self.dtype)
        return ids, attention, loss, aux, final


def _columns(held: Sequence[int], dim: int, layers: Sequence[int]) -> np.ndarray:
    """The feature columns of `layers`, in their order, in a cache that holds `held`."""
    return np.concatenate([np.arange(held.index(l) * dim, (held.index(l) + 1) * dim) for l in layers])


def _writable(cache: "FeatureCache") -> dict[str, np.memmap]:
    """The cache's arrays opened for writing: features and, if it holds them, the final states."""
    meta = cache.meta
    widths = {"features": len(cache.layers) * cache.dim, "final": cache.dim}
    return {name: np.memmap(cache.path / f"{name}.bin", dtype=_DTYPES[cache.dtype][1], mode="r+",
                            shape=(meta["tokens"], widths[name])) for name in ("features", "final")[: 1 + cache.has_final]}


def _commit(cache: "FeatureCache", arrays: dict[str, np.memmap], batch: Sequence[int], bar, interrupt) -> None:
    """Make a written batch durable: flush the arrays, then count it done in the meta (a crash
    loses at most the batch under way), then stop there if Ctrl-C came during it."""
    for array in arrays.values():
        array.flush()
    cache.meta["done"] += len(batch)
    _write_meta(cache.path, cache.meta)
    bar.update(sum(cache.meta["lengths"][i] for i in batch))
    interrupt.raise_if_requested()


def _holds_final(meta: dict) -> bool:
    return meta.get("final", True)  # caches dumped before `final=False` all hold it


def _to_float(array: np.ndarray, dtype: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.array(array))  # a copy: the memmap is read-only
    return tensor.view(torch.bfloat16).float() if dtype == "bfloat16" else tensor


def _from_float(tensor: torch.Tensor, dtype: str) -> np.ndarray:
    return tensor.to(_DTYPES[dtype][0]).contiguous().view(torch.uint16 if dtype == "bfloat16" else torch.float32).numpy()


def open_cache(path: str | os.PathLike) -> FeatureCache:
    path = Path(path)
    if not (path / META_FILE).is_file():
        raise ValueError(f"feature_cache: {path} has no {META_FILE}; dump it first (train-draft --cache-dir)")
    return FeatureCache(path, json.loads((path / META_FILE).read_text()))


def build(target, samples: Sequence[Sample], layers: Sequence[int], path: str | os.PathLike, *,
          dtype: str = "float32", max_bytes: int = DEFAULT_MAX_BYTES, batch_size: int = 8,
          final: bool = True, reuse: Sequence[str | os.PathLike] = (), progress: bool = True) -> FeatureCache:
    """Dump (or continue dumping) the cache of `samples` for `layers` into `path`; see the module
    docstring. An existing cache of the same target and dtype that holds `layers` (or more) is
    returned as it is for the same samples, grows for a longer list that starts with its samples
    (the new ones are dumped), and serves a shorter list that its samples start with once it is
    complete; other data, another target or missing layers are refused. final: dump the final
    normed state too (soft labels); a cache that holds it serves `final=False` as it is, one
    without it cannot serve `final=True`. reuse: folders of other caches whose dumped samples are
    copied rather than forwarded; one of another target, dtype or layer set (or without the final
    state this one needs), or no cache at all, is passed over."""
    if dtype not in _DTYPES:
        raise ValueError(f"cache_dtype: expected one of {', '.join(_DTYPES)}, got {dtype!r}")
    if final and plain_lm_head(target) is None:
        raise ValueError("feature_cache: the target's logits are not a plain linear head of its final state "
                         "(soft-capped or scaled): train online, or dump the layers only (final=False) for labels from the answers")
    path = Path(path)
    layers = sorted(set(int(l) for l in layers))
    dim = target.get_input_embeddings().weight.shape[1]
    lengths = [len(s.ids) for s in samples]
    digests = sample_digests(samples)
    element = 4 if dtype == "float32" else 2
    identity = {"version": _VERSION, "target": target_fingerprint(target), "samples": samples_fingerprint(samples),
                "layers": layers, "dim": dim, "dtype": dtype}
    if (path / META_FILE).is_file():
        meta = json.loads((path / META_FILE).read_text())
        source = ("version", "target", "dim", "dtype")
        if any(meta.get(k) != identity[k] for k in source) or not set(layers) <= set(meta.get("layers", [])):
            held = {k: meta.get(k) for k in ("layers", "dtype")}
            raise ValueError(f"feature_cache: {path} was dumped from another target, data or layer set ({held}); "
                             "use another folder")
        if final and not _holds_final(meta):
            raise ValueError(f"feature_cache: {path} holds no final states (dumped for labels from the answers); "
                             "soft labels need a cache with them: use another folder")
        # A cache of more layers, or with the final state, serves these as it is.
        identity["layers"] = layers = meta["layers"]
        final = _holds_final(meta)
        size = sum(lengths) * (len(layers) + final) * dim * element
        held = len(meta["lengths"])
        if meta["samples"] == identity["samples"]:
            if meta.get("digests") is None:  # dumped before the digests were kept
                meta["digests"] = digests
                _write_meta(path, meta)
        elif held < len(samples) and meta["samples"] == samples_fingerprint(samples[:held]):
            meta = _grow(path, meta, identity, lengths, digests, element, size, max_bytes)
        elif held > len(samples) and meta.get("digests") is None:
            raise ValueError(f"feature_cache: {path} was dumped before it kept its samples' digests, so it cannot "
                             "serve a prefix of them; build it once with all its samples")
        elif held > len(samples) and meta["digests"][: len(samples)] == digests:
            if meta["done"] < held:
                raise ValueError(f"feature_cache: {path} holds these {len(samples)} samples among {held} and is "
                                 "still dumping; build it with all its samples first")
            return FeatureCache(path, _prefix_meta(meta, identity, len(samples), size))
        else:
            raise ValueError(f"feature_cache: {path} was dumped from another target, data or layer set "
                             f"({held} other samples); use another folder")
        cache = FeatureCache(path, meta)
        if cache.complete:
            return cache
    else:
        tokens = sum(lengths)
        size = tokens * (len(layers) + final) * dim * element
        if size > max_bytes:
            raise ValueError(f"max_cache_bytes: the cache of {len(samples)} samples ({tokens} tokens) x {len(layers)} "
                             f"layers{' + the final state' if final else ''} in {dtype} needs {size / 2**30:.2f} GiB, over the bound "
                             f"{max_bytes / 2**30:.2f} GiB; dump fewer layers or samples, or use bfloat16")
        path.mkdir(parents=True, exist_ok=True)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist() if samples else []
        # Dumped longest first, so that a batch holds samples of similar length (padding is forward work).
        order = sorted(range(len(samples)), key=lambda i: -lengths[i])
        meta = {**identity, "offsets": [int(o) for o in offsets], "lengths": lengths, "tokens": tokens,
                "bytes": size, "order": order, "done": 0, "digests": digests, "final": final}
        for name, width in (("features", len(layers) * dim), ("final", dim))[: 1 + final]:
            with open(path / f"{name}.bin", "wb") as f:
                f.truncate(tokens * width * element)
        _write_meta(path, meta)
        cache = FeatureCache(path, meta)
    _copy_reused(cache, [Path(r) for r in reuse if Path(r).resolve() != path.resolve()], progress)
    _fill(target, samples, cache, batch_size, progress)
    return cache


def _copy_reused(cache: FeatureCache, sources: Sequence[Path], progress: bool, chunk: int = 256) -> None:
    """Copy the samples still to dump that a source cache has dumped (by digest), chunk by chunk,
    advancing `done` after each (they move to the front of the queue first, so an interrupted copy
    continues like an interrupted dump)."""
    from tqdm.auto import tqdm

    meta = cache.meta
    found: dict[str, tuple[FeatureCache, int]] = {}
    columns: dict[int, np.ndarray] = {}  # id(source) -> its columns of this cache's layers
    for folder in sources:
        if not (folder / META_FILE).is_file():
            continue
        source = open_cache(folder)
        if any(source.meta.get(k) != meta[k] for k in ("version", "target", "dim", "dtype")) or \
                not set(cache.layers) <= set(source.layers) or (cache.has_final and not source.has_final) or \
                source.meta.get("digests") is None:
            continue
        columns[id(source)] = _columns(source.layers, source.dim, cache.layers)
        for j in source.meta["order"][: source.meta["done"]]:
            found.setdefault(source.meta["digests"][j], (source, j))
    done, pending = meta["done"], meta["order"][meta["done"] :]
    copied = [i for i in pending if meta["digests"][i] in found]
    if not copied:
        return
    chosen = set(copied)
    meta["order"] = meta["order"][:done] + copied + [i for i in pending if i not in chosen]
    _write_meta(cache.path, meta)
    arrays = _writable(cache)
    bar = tqdm(total=sum(meta["lengths"][i] for i in copied), unit="tok", unit_scale=True,
               desc="copy features of other caches", disable=not progress)
    try:
        with DeferredInterrupt("the feature cache") as interrupt:
            for at in range(0, len(copied), chunk):
                batch = copied[at : at + chunk]
                for i in batch:
                    source, j = found[meta["digests"][i]]
                    start, begin, length = meta["offsets"][i], source.meta["offsets"][j], meta["lengths"][i]
                    arrays["features"][start : start + length] = \
                        source._array("features")[begin : begin + length][:, columns[id(source)]]
                    if "final" in arrays:
                        arrays["final"][start : start + length] = source._array("final")[begin : begin + length]
                _commit(cache, arrays, batch, bar, interrupt)
    finally:
        bar.close()


def _prefix_meta(meta: dict, identity: dict, count: int, size: int) -> dict:
    """The meta of a complete cache read as its first `count` samples (never written: the folder
    keeps all its samples)."""
    return {**meta, **identity, "offsets": meta["offsets"][:count], "lengths": meta["lengths"][:count],
            "tokens": sum(meta["lengths"][:count]), "bytes": size, "order": [i for i in meta["order"] if i < count],
            "done": count, "digests": meta["digests"][:count]}


def _grow(path: Path, meta: dict, identity: dict, lengths: list[int], digests: list[str], element: int,
          size: int, max_bytes: int) -> dict:
    """Extend a cache to the longer sample list: the dumped samples stay, the new ones are queued
    after them (longest first) and dumped by `_fill`."""
    if size > max_bytes:
        raise ValueError(f"max_cache_bytes: growing {path} to {len(lengths)} samples needs {size / 2**30:.2f} GiB, "
                         f"over the bound {max_bytes / 2**30:.2f} GiB")
    held, tokens = len(meta["lengths"]), sum(lengths)
    width = len(meta["layers"]) * meta["dim"]
    for name, columns in (("features", width), ("final", meta["dim"]))[: 1 + _holds_final(meta)]:
        with open(path / f"{name}.bin", "r+b") as f:
            f.truncate(tokens * columns * element)
    new = sorted(range(held, len(lengths)), key=lambda i: -lengths[i])
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    meta = {**meta, **identity, "offsets": [int(o) for o in offsets], "lengths": lengths, "tokens": tokens,
            "bytes": size, "order": meta["order"] + new, "digests": digests}
    _write_meta(path, meta)
    return meta


def _write_meta(path: Path, meta: dict) -> None:
    tmp = path / f"{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta))
    os.replace(tmp, path / META_FILE)


@torch.inference_mode()
def _fill(target, samples: Sequence[Sample], cache: FeatureCache, batch_size: int, progress: bool) -> None:
    """Forward the samples not yet dumped, in the meta's order, batch by batch (each batch written,
    then the meta's `done` count advanced: a crash loses at most the batch under way)."""
    from tqdm.auto import tqdm

    meta = cache.meta
    layers = cache.layers
    arrays = _writable(cache)
    features, finals = arrays["features"], arrays.get("final")
    device = target.get_input_embeddings().weight.device
    order = meta["order"]
    bar = tqdm(total=meta["tokens"], initial=sum(meta["lengths"][i] for i in order[: meta["done"]]), unit="tok",
               unit_scale=True,
               desc=f"dump features (threads: {torch.get_num_threads()})", disable=not progress)
    was_training = target.training
    target.eval()
    try:
        with DeferredInterrupt("the feature cache") as interrupt:
            while meta["done"] < len(samples):
                batch = order[meta["done"] : meta["done"] + batch_size]
                ids, attention, _ = pad_samples([samples[i] for i in batch])
                # Without the final state the forward stops at the deepest layer dumped.
                with capture_hidden_states(target, layers=layers, stop=finals is None) as cap:
                    out = target.base_model(input_ids=ids.to(device), attention_mask=attention.to(device),
                                            use_cache=False)
                for b, i in enumerate(batch):
                    start, length = meta["offsets"][i], meta["lengths"][i]
                    stacked = torch.cat([cap.states[l][b, :length].float().cpu() for l in layers], dim=-1)
                    features[start : start + length] = _from_float(stacked, cache.dtype)
                    if finals is not None:
                        finals[start : start + length] = _from_float(out.last_hidden_state[b, :length].float().cpu(),
                                                                     cache.dtype)
                _commit(cache, arrays, batch, bar, interrupt)
    finally:
        bar.close()
        target.train(was_training)
