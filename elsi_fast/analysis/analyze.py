"""One streaming pass over calibration prompts -> per-layer entropy, CKA and layer selections.

Per batch of prompts, forward hooks (elsi_fast.targets.capture) hand over each h_l as it is produced; the
hook keeps only the candidate token rows (no padding, no position 0, no special tokens). After the
forward the token-entropy filter picks the kept rows, and they feed
- StreamingCovariance (dataset-mode Shannon and Renyi-2 entropy per layer),
- MinibatchHSIC, one minibatch per prompt (CKA; batching-independent, so resumed and
  data-parallel runs give the same numbers),
- PromptModeStore (elsi_fast.analysis.prompt_store), prompt mode over all kept tokens of each prompt
  (docs/method.md section 3).
The candidate rows are released after each batch; nothing else is kept per token. After the pass
the report is assembled: layer statistics, compartments and every method's selection, the set
searches running on the exact set entropies of `set_entropy.SetEntropySolver`. The accumulators
live in `pass_state.PassState` (saved for resume, reduced across ranks).
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch
from torch import nn

from .._infra.interrupt import DeferredInterrupt
from .._infra.state_files import save_state
from ..metrics import linear_token_entropy, normalize_tokens, token_entropy
from ..targets.capture import capture_hidden_states, decoder_layers, plain_lm_head
from .analysis_options import DEFAULTS, AnalyzeOptions
from .pass_state import PassState, pass_fingerprint, rank_and_world, reduce_across_ranks
from .prompts import Prompt, encode_prompt
from .report import LayerReport
from .selection import ScreenedObjective
from .set_entropy import SetEntropySolver


def _special_ids(tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "all_special_ids", None) or []
    return sorted({int(i) for i in ids if i is not None})



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
    m: Sequence[int] | int = DEFAULTS.m,
    batch_size: int = DEFAULTS.batch_size,
    max_prompts: int | None = DEFAULTS.max_prompts,
    max_tokens: int = DEFAULTS.max_tokens,
    min_token_entropy: float = DEFAULTS.min_token_entropy,
    drop_special_tokens: bool = DEFAULTS.drop_special_tokens,
    normalize: str = DEFAULTS.normalize,
    gram_tokens: int | None = DEFAULTS.gram_tokens,
    max_store_bytes: int | None = DEFAULTS.max_store_bytes,
    gram_dtype: str = DEFAULTS.gram_dtype,
    candidates: Sequence[int] | None = DEFAULTS.candidates,
    beta: float = DEFAULTS.beta,
    one_per_compartment: bool = DEFAULTS.one_per_compartment,
    novelty_half_width: int = DEFAULTS.novelty_half_width,
    novelty_threshold: float = DEFAULTS.novelty_threshold,
    max_exhaustive: int = DEFAULTS.max_exhaustive,
    screen_z: float = DEFAULTS.screen_z,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    state_path: str | None = None,
    save_every: int = DEFAULTS.save_every,
    progress: bool = True,
    model_name: str | None = None,
) -> LayerReport:
    """Analyze `model` on `prompts` in one streaming pass and select draft layers.

    prompts: strings or `Prompt`s (see prompts.load_prompts), tokenized with `tokenizer`
    (chat template for instructions) and truncated to `max_tokens`; each needs >= 2 tokens.
    Tokens kept per prompt: not padding, not position 0, not special (if `drop_special_tokens`),
    with next-token entropy >= `min_token_entropy` nats (0 disables the filter).
    m: the set sizes to select for (each at most the number of candidates).
    candidates: layers ELSI / ELSI-C may pick; default `layer_ids.common_candidate_layers(N)`,
    h_1 .. h_{N-1}, the states every engine captures (h_0 is the embedding the draft already sees
    and output-of-layer engines cannot name it; SGLang records aux states at block inputs only,
    so it never captures h_N). `layer_ids.candidate_layers(engine, N)` gives one engine's.
    Every setting's default is `analysis_options.AnalyzeOptions`'s.
    gram_tokens: None (prompt mode as docs/method.md section 3 defines it: all kept tokens) or a
    cap, evenly spaced tokens.
    max_store_bytes: None, or a bound on the prompt-mode spill file (on disk, `gram_dtype`): where
    all kept tokens could exceed it, gram_tokens becomes the largest cap that fits
    (`fitting_gram_tokens`), and the report's options and store line say so.
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
        m=(m,) if isinstance(m, int) else tuple(m),
        batch_size=batch_size,
        max_prompts=max_prompts,
        max_tokens=max_tokens,
        min_token_entropy=float(min_token_entropy),
        drop_special_tokens=drop_special_tokens,
        normalize=normalize,
        gram_tokens=gram_tokens,
        max_store_bytes=max_store_bytes,
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
    dim = model.get_input_embeddings().weight.shape[1]
    if options.max_store_bytes is not None:
        itemsize = torch.empty((), dtype=getattr(torch, options.gram_dtype)).element_size()
        options.gram_tokens = fitting_gram_tokens(token_ids, num_blocks + 1, dim, itemsize, options.max_store_bytes,
                                                  options.gram_tokens)
    special = torch.tensor(_special_ids(tokenizer) if options.drop_special_tokens else [], dtype=torch.long)

    rank, world = rank_and_world()
    # Longest prompts first, so that a batch holds prompts of similar length: padding costs forward
    # FLOPs (Spec-Bench's prompts run from 10 to 512 tokens). Statistics are per prompt, so the order
    # changes nothing but round-off; it is a function of the tokenized prompts, which resume checks.
    shard = sorted(range(rank, len(token_ids), world), key=lambda i: -len(token_ids[i]))
    fingerprint = pass_fingerprint(model, token_ids, options)
    if state_path is not None and world > 1:
        state_path = f"{state_path}.rank{rank}"

    filtered_only = options.min_token_entropy == 0
    factors_path = None if state_path is None else f"{state_path}.factors"
    state = PassState(
        num_blocks + 1, dim, options.normalize, input_device, filtered_only, factors_path, getattr(torch, options.gram_dtype)
    )
    if state_path is not None and os.path.exists(state_path):
        state.load(state_path, fingerprint)

    head = plain_lm_head(model)
    remaining = shard[state.position :]
    bar = _progress_bar(sum(len(token_ids[i]) for i in remaining), progress and rank == 0)
    started, resumed_seconds = time.perf_counter(), state.seconds
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
            state.seconds = resumed_seconds + time.perf_counter() - started
            if state_path is not None and (batches_since_save >= options.save_every or interrupt.requested):
                save_state(state.state_dict(fingerprint), state_path)
                batches_since_save = 0
            interrupt.raise_if_requested()
    bar.close()
    elapsed = state.seconds
    if state_path is not None and batches_since_save:
        save_state(state.state_dict(fingerprint), state_path)

    finished = time.perf_counter()
    if world > 1:
        reduce_across_ranks(state, factors_path)
    report = _build_report(model, model_name, state, options, num_blocks, elapsed, len(token_ids))
    report.timing["selection_seconds"] = time.perf_counter() - finished
    return report



def fitting_gram_tokens(token_ids: Sequence[Sequence[int]], num_layers: int, dim: int, itemsize: int,
                        max_bytes: int, gram_tokens: int | None = None) -> int | None:
    """The prompt-mode token cap that keeps the spill file within `max_bytes`: `gram_tokens` itself
    (None: all kept tokens) when that fits, else the largest smaller cap that does.

    Sized for the worst case, every token but position 0 kept: a prompt of n kept tokens spills
    n x min(n, dim) numbers per layer (prompt_store.PromptModeStore). Raises ValueError when even
    2 tokens a prompt do not fit."""

    def size(cap: int | None) -> int:
        kept = (len(ids) - 1 if cap is None else min(len(ids) - 1, cap) for ids in token_ids)
        return sum(num_layers * n * min(n, dim) * itemsize for n in kept)

    if size(gram_tokens) <= max_bytes:
        return gram_tokens
    if size(2) > max_bytes:
        raise ValueError(f"max_store_bytes: {max_bytes} bytes cannot hold even 2 tokens of each of "
                         f"{len(token_ids)} prompts ({size(2)} bytes needed)")
    low, high = 2, max(len(ids) - 1 for ids in token_ids) if gram_tokens is None else gram_tokens
    while low < high:  # size() grows with the cap: the largest cap that fits
        middle = (low + high + 1) // 2
        low, high = (middle, high) if size(middle) <= max_bytes else (low, middle - 1)
    return low


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
    state: PassState,
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
            state.prompts.add(prompt_index, _prompt_vectors(kept_rows, options.gram_tokens))
        if state.prompts_unfiltered is not None and count >= 2:
            state.prompts_unfiltered.add(prompt_index, _prompt_vectors(prompt_rows, options.gram_tokens))



def _progress_bar(total_tokens: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total_tokens, unit="tok", unit_scale=True, desc=f"analyze (threads: {torch.get_num_threads()})", disable=not enabled)



def _build_report(
    model: nn.Module,
    model_name: str | None,
    state: PassState,
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
    if len(state.prompts) == 0 or state.hsic.num_batches == 0:
        raise ValueError(
            "prompts: no prompt kept enough tokens for the statistics (prompt mode needs >= 2 kept tokens, "
            "CKA >= 4 per prompt); give longer prompts or lower min_token_entropy"
        )
    store = state.prompts
    entropy_per_prompt = store.layer_entropies()
    variance = {"filtered": float(entropy_per_prompt.var(0).mean())}
    if state.prompts_unfiltered is not None:
        unfiltered_entropy = state.prompts_unfiltered.layer_entropies()
        variance["unfiltered"] = float(unfiltered_entropy.var(0).mean())
        variance["reduction"] = 1.0 - variance["filtered"] / variance["unfiltered"] if variance["unfiltered"] > 0 else 0.0
        variance["unfiltered_prompts"] = len(state.prompts_unfiltered)
    else:
        unfiltered_entropy = None
    variance["filtered_prompts"] = len(store)

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
        "gram_store_bytes": store.nbytes,
        "gram_store_path": store.path,
        "prompt_statistics_bytes": store.ram_bytes + (state.prompts_unfiltered.ram_bytes if state.prompts_unfiltered else 0),
        "accumulator_bytes": sum(
            t.numel() * t.element_size()
            for sd in (state.covariance.state_dict(), hsic.state_dict())
            for t in sd.values()
            if isinstance(t, torch.Tensor)
        ),
    }
    tokens = dict(state.tokens)
    tokens["kept_fraction"] = tokens["kept"] / tokens["candidates"] if tokens["candidates"] else 0.0
    solver = SetEntropySolver(store)
    objective = ScreenedObjective(solver.prompt_set_entropy, solver.surrogate, len(store), options.screen_z)
    report = LayerReport(
        model=model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__,
        num_hidden_layers=num_blocks,
        layers=layers,
        cka=hsic.cka().cpu().numpy().tolist(),
        tokens=tokens,
        options=options.to_dict(),
        prompts={
            "count": num_prompts,
            "in_prompt_mode": len(store),
            "without_cka_minibatch": state.prompts_without_hsic,
        },
        entropy_variance=variance,
        memory=memory,
        timing={"pass_seconds": elapsed},
        set_entropy=objective,
        set_renyi2=solver.renyi2_entropy,
        prompt_store=store,
    )
    report.compute_selections()
    report.timing["sets_screened"] = objective.counts["screened"]
    report.timing["sets_evaluated_exactly"] = objective.counts["evaluated"]
    report.timing["prompt_set_eigensolves"] = solver.solves
    return report
