"""One streaming pass over calibration prompts -> per-layer entropy, CKA and layer selections.

Per batch of prompts, forward hooks (elsi_fast.capture) hand over each h_l as it is produced; the
hook keeps only the candidate token rows (no padding, no position 0, no special tokens). After the
forward the token-entropy filter picks the kept rows, and they feed
- StreamingCovariance (dataset-mode entropy per layer),
- MinibatchHSIC, one minibatch per prompt (CKA, Renyi-2 of any set; batching-independent, so
  resumed and data-parallel runs give the same numbers),
- the prompt-mode Gram store: per prompt and layer K_l = Z_l Z_l^T of the centered, L2-normalized
  kept rows (at most `gram_tokens` of them, evenly spaced), stored on the CPU in `gram_dtype`.
  The concatenation of a layer set S has Gram sum_{a in S} K_a, so its Shannon entropy (ELSI's
  objective) is evaluated after the pass for any S. Its size is reported (`memory`).
The candidate rows are released after each batch; nothing else is kept per token.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from .capture import capture_hidden_states, decoder_layers
from .metrics import normalize_tokens, linear_token_entropy, spectrum_entropy, token_entropy
from .prompts import Prompt, encode_prompt
from .report import LayerReport
from .streaming import MinibatchHSIC, StreamingCovariance

# Default token-entropy threshold (nats), from bench/bench_analysis.py --part threshold on
# stories260K, the one real model here (README, "Worked example"). On 96 Spec-Bench prompts at equal
# token counts per prompt (gram_tokens=32), 0.5 nats cut the cross-prompt variance of per-layer
# entropy by 21% keeping 89% of the tokens, the largest reduction measured; 1 and 2 nats raised it
# (by 22% and 98%), and on in-domain TinyStories text every threshold raised it. The paper's
# 35.6-48.4% reduction was measured on 4B-8B models. Every report shows the variance with and
# without the filter, so a model where filtering hurts is visible (then pass 0).
DEFAULT_MIN_TOKEN_ENTROPY = 0.5
_STATE_VERSION = 1
# Elements of one batched eigen-solve over stored Grams (32 MiB in float32).
_EIG_BLOCK_ELEMS = 1 << 23
_EIG_SLICE = 32


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
    gram_tokens: int = 128
    gram_dtype: str = "float16"
    candidates: tuple[int, ...] | None = None
    beta: float = 1.0
    one_per_compartment: bool = False
    novelty_half_width: int = 2
    novelty_threshold: float = 0.1
    max_exhaustive: int = 1000
    save_every: int = 8

    def validate(self, num_blocks: int) -> None:
        ints = {
            "batch_size": self.batch_size,
            "max_tokens": self.max_tokens,
            "gram_tokens": self.gram_tokens,
            "novelty_half_width": self.novelty_half_width,
            "max_exhaustive": self.max_exhaustive,
            "save_every": self.save_every,
        }
        for name, value in ints.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens: must be >= 2 (position 0 is always dropped), got {self.max_tokens}")
        if self.gram_tokens < 2:
            raise ValueError(f"gram_tokens: must be >= 2, got {self.gram_tokens}")
        if self.max_prompts is not None and (not isinstance(self.max_prompts, int) or self.max_prompts < 1):
            raise ValueError(f"max_prompts: must be a positive integer or None, got {self.max_prompts!r}")
        if not math.isfinite(self.min_token_entropy) or self.min_token_entropy < 0:
            raise ValueError(f"min_token_entropy: must be a finite number >= 0 (nats), got {self.min_token_entropy}")
        if self.normalize not in ("l2", "none"):
            raise ValueError(f"normalize: expected 'l2' or 'none', got {self.normalize!r}")
        if self.gram_dtype not in ("float16", "float32", "float64"):
            raise ValueError(f"gram_dtype: expected float16, float32 or float64, got {self.gram_dtype!r}")
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


class PromptGrams:
    """Per-prompt, per-layer Grams of prompt-mode token vectors, for set entropies after the pass.

    `grams[i]` is [L, n_i, n_i] (n_i <= gram_tokens) on the CPU. Zero-padding a Gram to a common
    size adds zero eigenvalues only, so prompts of different lengths are solved in one batch.
    """

    def __init__(self) -> None:
        self.prompt_index: list[int] = []
        self.grams: list[torch.Tensor] = []
        self._set_cache: dict[tuple[int, ...], float] = {}

    def add(self, prompt_index: int, gram: torch.Tensor) -> None:
        self.prompt_index.append(prompt_index)
        self.grams.append(gram)
        self._set_cache.clear()

    def __len__(self) -> int:
        return len(self.grams)

    @property
    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grams)

    def sorted_by_prompt(self) -> "PromptGrams":
        out = PromptGrams()
        for i in np.argsort(self.prompt_index, kind="stable"):
            out.add(self.prompt_index[i], self.grams[i])
        return out

    def _padded(self, start: int, stop: int) -> torch.Tensor:
        size = max(g.shape[-1] for g in self.grams[start:stop])
        out = torch.zeros(stop - start, self.grams[0].shape[0], size, size, dtype=torch.float32)
        for i, g in enumerate(self.grams[start:stop]):
            out[i, :, : g.shape[-1], : g.shape[-1]] = g
        return out

    def _prompt_chunks(self):
        """Prompt ranges whose padded [L, g, g] Grams fit in _EIG_BLOCK_ELEMS: bounds the memory of
        the solves after the pass, whatever the number of prompts."""
        size = max(g.shape[-1] for g in self.grams)
        step = max(1, _EIG_BLOCK_ELEMS // (self.grams[0].shape[0] * size * size))
        for start in range(0, len(self.grams), step):
            yield start, min(len(self.grams), start + step)

    def _entropy(self, grams: torch.Tensor) -> torch.Tensor:
        """H1 of PSD matrices [..., g, g] whose entries were stored in reduced precision.

        fp32 solves suffice: the entries carry at most fp32 accuracy. Rounding perturbs
        eigenvalues by up to about g * eps(dtype) * max|K|, so negative eigenvalues within that
        bound are round-off and are clipped to 0 (spectrum_entropy's tolerance assumes exact entries).
        """
        flat = grams.reshape(-1, *grams.shape[-2:])
        # torch's batched CPU eigvalsh slows down superlinearly with the batch: solve in slices.
        eigvals = torch.cat([torch.linalg.eigvalsh(part) for part in flat.split(_EIG_SLICE)]).view(grams.shape[:-1])
        eps = max(torch.finfo(self.grams[0].dtype).eps, torch.finfo(torch.float32).eps)
        scale = grams.diagonal(dim1=-2, dim2=-1).amax(-1, keepdim=True)
        tolerance = grams.shape[-1] * eps * scale
        return spectrum_entropy(torch.where(eigvals.abs() <= tolerance, eigvals.clamp_min(0), eigvals))

    def layer_entropies(self) -> np.ndarray:
        """Shannon entropy H1(K_l) per prompt and layer -> [P, L] float64."""
        rows = []
        for start, stop in self._prompt_chunks():
            rows.append(self._entropy(self._padded(start, stop)))
        return torch.cat(rows).numpy()

    def set_entropy(self, sets: Sequence[tuple[int, ...]]) -> np.ndarray:
        """Mean over prompts of H1(sum_{a in S} K_a) for each set S -> [len(sets)] float64.

        Values are cached: greedy, exhaustive and pair-gain searches revisit the same sets.
        """
        keys = [tuple(sorted(set(int(a) for a in s))) for s in sets]
        todo = sorted({k for k in keys if k not in self._set_cache})
        if todo:
            totals = np.zeros(len(todo))
            for start, stop in self._prompt_chunks():
                grams = self._padded(start, stop)
                for k, layer_set in enumerate(todo):
                    totals[k] += float(self._entropy(grams[:, list(layer_set)].sum(1)).sum())
            self._set_cache.update(zip(todo, (totals / len(self.grams)).tolist()))
        return np.array([self._set_cache[k] for k in keys])


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


def _special_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "all_special_ids", None) or []
    return sorted({int(i) for i in ids if i is not None})


class _PassState:
    """Everything accumulated so far on this rank; saved and restored for resume."""

    def __init__(self, num_layers: int, dim: int, normalize: str, device: torch.device, filtered_only: bool):
        self.covariance = StreamingCovariance(num_layers, dim, normalize=normalize, device=device)
        self.hsic = MinibatchHSIC(num_layers, normalize=normalize, device=device)
        self.grams = PromptGrams()
        self.grams_unfiltered = None if filtered_only else PromptGrams()
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
            "grams": (self.grams.prompt_index, self.grams.grams),
            "grams_unfiltered": None
            if self.grams_unfiltered is None
            else (self.grams_unfiltered.prompt_index, self.grams_unfiltered.grams),
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
        for store, saved in ((self.grams, state["grams"]), (self.grams_unfiltered, state["grams_unfiltered"])):
            if store is not None:
                for index, gram in zip(*saved):
                    store.add(index, gram)


def _save_atomically(obj: Any, path: str) -> None:
    # torch.save to a temporary file, then os.replace: a crash mid-save leaves the old state intact.
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _prompt_grams(rows: list[torch.Tensor], gram_tokens: int, compute_dtype: torch.dtype, store_dtype: torch.dtype) -> torch.Tensor:
    """[L, g, g] Gram of the centered, L2-normalized rows (n >= 2) of one prompt, g = min(n, gram_tokens)."""
    n = rows[0].shape[0]
    if n > gram_tokens:
        # Evenly spaced tokens keep the whole prompt represented at a bounded size.
        pick = torch.linspace(0, n - 1, gram_tokens, device=rows[0].device).round().long()
        rows = [r[pick] for r in rows]
    z = normalize_tokens(torch.stack(rows).to(compute_dtype), "center_l2")
    return (z @ z.transpose(-2, -1)).to(device="cpu", dtype=store_dtype)


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
    gram_tokens: int = 128,
    gram_dtype: str = "float16",
    candidates: Sequence[int] | None = None,
    beta: float = 1.0,
    one_per_compartment: bool = False,
    novelty_half_width: int = 2,
    novelty_threshold: float = 0.1,
    max_exhaustive: int = 1000,
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
    state_path: accumulator state saved there atomically every `save_every` batches; a rerun
    with the same path, prompts and options continues after the last saved batch.
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
    state = _PassState(num_blocks + 1, dim, options.normalize, input_device, filtered_only)
    if state_path is not None and os.path.exists(state_path):
        state.load(torch.load(state_path, weights_only=False), fingerprint, state_path)

    head = _entropy_head(model)
    store_dtype = getattr(torch, options.gram_dtype)
    # Grams are computed in the precision they are stored in (at least fp32).
    compute_dtype = torch.float64 if store_dtype == torch.float64 else torch.float32
    remaining = shard[state.position :]
    bar = _progress_bar(sum(len(token_ids[i]) for i in remaining), progress and rank == 0)
    started = time.perf_counter()
    batches_since_save = 0
    with torch.inference_mode():
        for start in range(0, len(remaining), options.batch_size):
            batch = remaining[start : start + options.batch_size]
            _process_batch(
                model, head, [token_ids[i] for i in batch], batch, special, state, options,
                input_device, compute_dtype, store_dtype, num_blocks,
            )
            state.position += len(batch)
            bar.update(sum(len(token_ids[i]) for i in batch))
            batches_since_save += 1
            if state_path is not None and batches_since_save >= options.save_every:
                _save_atomically(state.state_dict(fingerprint), state_path)
                batches_since_save = 0
    bar.close()
    elapsed = time.perf_counter() - started
    if state_path is not None and batches_since_save:
        _save_atomically(state.state_dict(fingerprint), state_path)

    if world > 1:
        _reduce_across_ranks(state)
    return _build_report(model, model_name, state, options, num_blocks, elapsed, len(token_ids))


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
    compute_dtype: torch.dtype,
    store_dtype: torch.dtype,
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
            state.grams.add(prompt_index, _prompt_grams(kept_rows, options.gram_tokens, compute_dtype, store_dtype))
        if state.grams_unfiltered is not None and count >= 2:
            state.grams_unfiltered.add(
                prompt_index, _prompt_grams(prompt_rows, options.gram_tokens, compute_dtype, store_dtype)
            )


def _distributed_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _reduce_across_ranks(state: _PassState) -> None:
    """Sum accumulators over ranks and gather every rank's Grams, so all ranks hold the totals."""
    import torch.distributed as dist

    state.covariance.all_reduce()
    state.hsic.all_reduce()
    local = {
        "tokens": state.tokens,
        "prompts_without_hsic": state.prompts_without_hsic,
        "grams": (state.grams.prompt_index, state.grams.grams),
        "grams_unfiltered": None
        if state.grams_unfiltered is None
        else (state.grams_unfiltered.prompt_index, state.grams_unfiltered.grams),
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    state.tokens = {key: sum(g["tokens"][key] for g in gathered) for key in state.tokens}
    state.prompts_without_hsic = sum(g["prompts_without_hsic"] for g in gathered)
    state.grams = PromptGrams()
    state.grams_unfiltered = None if state.grams_unfiltered is None else PromptGrams()
    for g in gathered:
        for store, key in ((state.grams, "grams"), (state.grams_unfiltered, "grams_unfiltered")):
            if store is not None:
                for index, gram in zip(*g[key]):
                    store.add(index, gram)


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
    grams = state.grams.sorted_by_prompt()
    entropy_per_prompt = grams.layer_entropies()
    variance = {"filtered": float(entropy_per_prompt.var(0).mean())}
    if state.grams_unfiltered is not None:
        unfiltered = state.grams_unfiltered.sorted_by_prompt()
        unfiltered_entropy = unfiltered.layer_entropies()
        variance["unfiltered"] = float(unfiltered_entropy.var(0).mean())
        variance["reduction"] = 1.0 - variance["filtered"] / variance["unfiltered"] if variance["unfiltered"] > 0 else 0.0
        variance["unfiltered_prompts"] = len(unfiltered)
    else:
        unfiltered_entropy = None
    variance["filtered_prompts"] = len(grams)

    hsic = state.hsic
    layers = []
    dataset_entropy = state.covariance.entropy().cpu().numpy()
    for index in range(num_blocks + 1):
        entry = {
            "index": index,
            "entropy_prompt_mean": float(entropy_per_prompt[:, index].mean()),
            "entropy_prompt_std": float(entropy_per_prompt[:, index].std()),
            "entropy_dataset": float(dataset_entropy[index]),
            "renyi2_dataset": hsic.renyi2_entropy([index]),
        }
        if unfiltered_entropy is not None:
            entry["entropy_prompt_mean_unfiltered"] = float(unfiltered_entropy[:, index].mean())
            entry["entropy_prompt_std_unfiltered"] = float(unfiltered_entropy[:, index].std())
        layers.append(entry)
    memory = {
        "gram_store_bytes": grams.nbytes + (state.grams_unfiltered.nbytes if state.grams_unfiltered else 0),
        "accumulator_bytes": sum(
            t.numel() * t.element_size()
            for sd in (state.covariance.state_dict(), hsic.state_dict())
            for t in sd.values()
            if isinstance(t, torch.Tensor)
        ),
    }
    tokens = dict(state.tokens)
    tokens["kept_fraction"] = tokens["kept"] / tokens["candidates"] if tokens["candidates"] else 0.0
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
        set_entropy=grams.set_entropy,
    )
    report.compute_selections()
    return report
