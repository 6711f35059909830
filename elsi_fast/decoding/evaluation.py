"""Mean acceptance length tau of a draft on a prompt set: run live, or replayed exactly.

`speculative_runs` runs `speculative.speculative_generate` on every prompt (greedy chain drafting,
docs/method.md section 6) and keeps each finished prompt's `SpecResult` in a JSON-lines file, so
an evaluation interrupted by Ctrl-C continues with the prompts not yet done. `pooled_tau` pools
the rounds of a category: tau = (accepted + rounds) / rounds over all its prompts.

`replay_runs` gives the same `SpecResult`s without a target forward: greedy speculative decoding
against a fixed target emits the target's greedy continuation whatever the draft proposes, so the
continuation of each prompt (`regenerate` with greedy decoding) and the target's states along it
(a `feature_cache.FeatureCache` of prompt + continuation) are computed once, and every draft's
rounds are replayed on them (`speculative.ReplayTarget`): the same accepted lengths, round by round.
On 480 Spec-Bench prompts that is the difference between an hour of target forwards per draft on
2 cores and the draft's own steps only. `replay_runs_per_k` goes further: one whole-sequence
training-time-test forward of the draft gives its chain from every position, and with it the
rounds at every k.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

import torch

from .prompt_lookup import lookup_matches
from .speculative import (
    ReplayTarget, SpecResult, _draft_path, draft_positions_needed, native_decoder_for, speculative_generate,
    check_lookup, speculative_loop, stop_set,
)
from ..training.training_data import Sample


def speculative_runs(
    target,
    draft,
    prompts_by_category: Mapping[str, Sequence[Sequence[int] | torch.Tensor]],
    *,
    k: int = 4,
    max_new_tokens: int = 48,
    draft_dtype: str | None = None,
    draft_backend: str = "auto",
    eos_token_id: int | Sequence[int] | None = None,
    progress: bool = False,
    state_path: str | os.PathLike | None = None,
    prompt_lookup: int | None = None,
    lookup_k: int | None = None,
) -> dict[str, list[SpecResult]]:
    """`speculative_generate` on every prompt: category -> one `SpecResult` per prompt.

    eos_token_id: the ids an answer ends with (`targets.loading.stop_token_ids`): each prompt
    stops after the first, as a served answer does; None generates all `max_new_tokens` (past the
    end of the answer, text no chat ever shows, which a draft trained on answers predicts poorly).

    The draft path is chosen once (`spec.native_decoder_for`; draft_dtype / draft_backend as in
    `speculative_generate`), so int8 weights are quantized once and auto mode warns at most once.
    state_path: a JSON-lines file that gets each prompt's result as soon as it is done; a rerun
    with the same file, target, draft, prompts and settings takes the finished prompts from it
    and runs only the rest (another setting starts the file over). prompt_lookup, lookup_k: as in
    `speculative_generate` (the n-gram lookup proposes up to lookup_k tokens where it finds any).
    """
    from tqdm.auto import tqdm

    if not prompts_by_category:
        raise ValueError("prompts_by_category: no categories given")
    jobs = [(cat, torch.as_tensor(ids, dtype=torch.long)) for cat, prompts in prompts_by_category.items()
            for ids in prompts]
    runs: dict[str, list[SpecResult]] = {cat: [] for cat in prompts_by_category}
    stops = sorted(stop_set(eos_token_id))
    log = _ResultLog(state_path, _runs_fingerprint(target, draft, jobs, k, max_new_tokens, draft_dtype, draft_backend,
                                                   stops, prompt_lookup, lookup_k))
    done = log.load()
    longest = max((ids.numel() for _, ids in jobs), default=1)
    decoder = None
    if len(done) < len(jobs):
        decoder = native_decoder_for(draft, draft_positions_needed(longest, max_new_tokens, k),
                                     draft_dtype=draft_dtype, draft_backend=draft_backend)
    bar = tqdm(jobs, desc=f"eval tau (threads: {torch.get_num_threads()})", disable=not progress)
    for index, (category, ids) in enumerate(bar):
        if index < len(done):
            result = done[index]
        elif decoder is not None:
            result = speculative_generate(target, decoder, ids, max_new_tokens, k, eos_token_id=stops,
                                          prompt_lookup=prompt_lookup, lookup_k=lookup_k)
        else:
            result = speculative_generate(target, draft, ids, max_new_tokens, k, eos_token_id=stops,
                                          draft_backend="torch", prompt_lookup=prompt_lookup, lookup_k=lookup_k)
        if index >= len(done):
            log.append(result)
        runs[category].append(result)
    return runs


def _runs_fingerprint(target, draft, jobs, k, max_new_tokens, draft_dtype, draft_backend, stops,
                      prompt_lookup=None, lookup_k=None) -> str:
    """What decides the results of speculative_runs: settings, prompts, the draft's weights, and the
    target's config and embeddings (hashing all of a large target's weights would take too long)."""
    digest = hashlib.sha256(json.dumps([k, max_new_tokens, draft_dtype, draft_backend,
                                        [(cat, ids.tolist()) for cat, ids in jobs]] + ([stops] if stops else [])
                                       + ([{"prompt_lookup": prompt_lookup}] if prompt_lookup else [])
                                       + ([{"lookup_k": lookup_k}] if lookup_k else [])).encode())
    digest.update(target.config.to_json_string().encode())
    tensors = [*draft.state_dict().values(), target.get_input_embeddings().weight]
    head = target.get_output_embeddings() if hasattr(target, "get_output_embeddings") else None
    if head is not None:
        tensors.append(head.weight)
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class _ResultLog:
    """Finished SpecResults of speculative_runs in a JSON-lines file: a header line with the runs'
    fingerprint, then one line per prompt in order. No file (path None): nothing is kept."""

    def __init__(self, path: str | os.PathLike | None, fingerprint: str):
        self.path = None if path is None else Path(path)
        self.fingerprint = fingerprint

    def load(self) -> list[SpecResult]:
        if self.path is None:
            return []
        results: list[SpecResult] = []
        if self.path.is_file():
            lines = self.path.read_text().splitlines()
            if lines and self._header(lines[0]) == self.fingerprint:
                for line in lines[1:]:
                    try:
                        fields = json.loads(line)
                    except json.JSONDecodeError:  # a line cut by a crash: that prompt runs again
                        break
                    results.append(SpecResult(tokens=torch.tensor(fields.pop("tokens"), dtype=torch.long), **fields))
        with open(self.path, "w") as f:  # rewritten whole: drops a cut line or another run's results
            f.write(json.dumps({"fingerprint": self.fingerprint}) + "\n")
            for result in results:
                f.write(self._line(result))
        return results

    def append(self, result: SpecResult) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(self._line(result))

    @staticmethod
    def _header(line: str) -> str | None:
        """The fingerprint a header line names (None for a line cut by a crash: start over)."""
        try:
            header = json.loads(line)
        except json.JSONDecodeError:
            return None
        return header.get("fingerprint") if isinstance(header, dict) else None

    @staticmethod
    def _line(result: SpecResult) -> str:
        fields = dataclasses.asdict(result)
        fields["tokens"] = result.tokens.tolist()
        return json.dumps(fields) + "\n"


def pooled_tau(runs: Mapping[str, Sequence[SpecResult]]) -> dict[str, float]:
    """tau per category = (accepted + rounds) / rounds summed over its prompts; "all" pools every one."""
    totals: dict[str, list[int]] = {}
    for category, results in runs.items():
        for result in results:
            for key in (category, "all"):
                emitted, rounds = totals.setdefault(key, [0, 0])
                totals[key] = [emitted + sum(result.accepted_lengths) + result.rounds, rounds + result.rounds]
    empty = [cat for cat, (_, rounds) in totals.items() if rounds == 0]
    if empty:
        raise ValueError(f"max_new_tokens: no verification round ran for {empty}; use max_new_tokens >= 2")
    pooled = totals.pop("all")
    return {**{cat: emitted / rounds for cat, (emitted, rounds) in totals.items()}, "all": pooled[0] / pooled[1]}


def evaluate_tau(
    target,
    draft,
    prompts_by_category: Mapping[str, Sequence[Sequence[int] | torch.Tensor]],
    *,
    k: int = 4,
    max_new_tokens: int = 48,
    draft_dtype: str | None = None,
    draft_backend: str = "auto",
    progress: bool = False,
    state_path: str | os.PathLike | None = None,
) -> dict[str, float]:
    """Mean acceptance length tau per category, pooled over its prompts.

    prompts_by_category: category -> list of prompt token ids. tau = (accepted + rounds) /
    rounds summed over every prompt of the category; the key ``"all"`` pools every category.
    draft_dtype / draft_backend: the draft's decode path, as in `speculative_generate`;
    state_path: as in `speculative_runs`.
    """
    return pooled_tau(speculative_runs(target, draft, prompts_by_category, k=k, max_new_tokens=max_new_tokens,
                                       draft_dtype=draft_dtype, draft_backend=draft_backend, progress=progress,
                                       state_path=state_path))


def continuation_samples(records: Sequence[dict]) -> list[Sample]:
    """prompt + greedy continuation of each `regenerate` record, the continuation in the loss mask:
    the samples a replay `FeatureCache` is dumped from."""
    samples = []
    for record in records:
        ids = torch.tensor(list(record["prompt_ids"]) + list(record["response_ids"]), dtype=torch.long)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(record["prompt_ids"]):] = True
        samples.append(Sample(ids, mask))
    return samples


def _checked_samples(records: Sequence[dict], cache) -> list[Sample]:
    """`continuation_samples(records)`, checked to be what `cache` was dumped from."""
    from ..training.feature_cache import samples_fingerprint

    if not records:
        raise ValueError("records: no continuations given")
    samples = continuation_samples(records)
    if cache.meta["samples"] != samples_fingerprint(samples):
        raise ValueError(f"cache: {cache.path} was dumped from other continuations")
    return samples


def replay_runs(
    draft,
    records: Sequence[dict],
    cache,
    *,
    k: int = 4,
    draft_dtype: str | None = None,
    draft_backend: str = "auto",
    batch_size: int | None = None,
    only: Sequence[int] | None = None,
    progress: bool = False,
    prompt_lookup: int | None = None,
    lookup_k: int | None = None,
) -> dict[str, list[SpecResult]]:
    """The `SpecResult` of every record's prompt, replayed (see the module docstring): category ->
    results in record order. records: greedy `regenerate` records of the evaluation prompts (each
    continuation ends at the target's stop token or at the length cap); cache: a `FeatureCache` of
    `continuation_samples(records)` holding the draft's layers. Each prompt generates exactly its
    continuation's length, stopping at its stop token, as `speculative_generate` with that budget
    and `eos_token_id` does. batch_size: replay that many prompts per torch forward, all rounds at
    once (`replay_runs_per_k`; the torch path's numbers), else one prompt at a time on the path
    draft_dtype / draft_backend choose.
    only: replay just the records at these positions (the cache still covers all of them).
    prompt_lookup, lookup_k: the n-gram lookup that proposes up to lookup_k tokens where it finds any
    (`speculative_loop`)."""
    from tqdm.auto import tqdm

    if batch_size is not None:
        if draft_dtype is not None or draft_backend == "native":
            raise ValueError("batch_size: the batched replay runs the torch draft; drop draft_dtype / draft_backend")
        return replay_runs_per_k(draft, records, cache, (k,), batch_size=batch_size, only=only, progress=progress,
                                 prompt_lookup=prompt_lookup, lookup_k=lookup_k)[k]
    samples = _checked_samples(records, cache)
    layers = list(draft.config.aux_layer_ids)
    longest = max(len(s.ids) for s in samples)
    runs: dict[str, list[SpecResult]] = {}
    wanted = set(range(len(records))) if only is None else set(only)
    decoder = native_decoder_for(draft, longest + k + 1, draft_dtype=draft_dtype, draft_backend=draft_backend)
    for index, record in enumerate(tqdm(records, desc="replay tau", disable=not progress)):
        if index not in wanted:
            continue
        prompt = torch.tensor([record["prompt_ids"]], dtype=torch.long)
        new = len(record["response_ids"])
        if new < 2:
            continue  # no verification round: no tau
        _, _, _, aux, _ = cache.batch(samples, [index], layers)
        runner = ReplayTarget(samples[index].ids, aux[0, : len(samples[index].ids)])
        eos = record["response_ids"][-1] if record.get("stop") == "eos" else None
        path = _draft_path(decoder if decoder is not None else draft, prompt, new, k, None,
                           "auto" if decoder is not None else "torch")
        result = speculative_loop(runner, path, prompt, new, k, eos, prompt_lookup=prompt_lookup, lookup_k=lookup_k)
        runs.setdefault(record.get("category") or "text", []).append(result)
    return runs


def replay_runs_per_k(
    draft,
    records: Sequence[dict],
    cache,
    ks: Sequence[int] = (1, 2, 3, 4, 5),
    *,
    batch_size: int = 16,
    only: Sequence[int] | None = None,
    progress: bool = False,
    prompt_lookup: int | None = None,
    lookup_k: int | None = None,
) -> dict[int, dict[str, list[SpecResult]]]:
    """`replay_runs` at every k of `ks` from one pass of the torch draft: k -> category -> results.

    With the continuation fixed, round after round the draft restarts from a pair t whose context
    is all target states, and its chain from t (k greedy steps) is the same whatever k is: a
    k-chain is the first k steps of a longer one. The training-time-test forward
    (`Eagle3Draft.ttt_forward`) computes the chain from every t at once, step i at position t
    predicting token t + 2 + i with the same attention and RoPE positions as decoding, fed the
    continuation's tokens, which are the drafted ones for as long as the chain matches. So the
    match length L(t) of every t comes from max(ks) whole-sequence steps, and each k's rounds are
    bookkeeping: from t, n = min(L(t), k) accepted and t moves n + 1 on (`_rounds`). batch_size:
    sequences per forward (length-sorted). A sliding-window draft attends a window that moves
    with each step, which the whole-sequence forward does not: it replays with batch_size=None in
    `replay_runs` when its sequences outgrow the window. prompt_lookup: n; at the chain starts where
    the n-gram lookup proposes (`prompt_lookup.lookup_matches`) its match length replaces the
    draft's, as `speculative_loop(prompt_lookup=n)` proposes its tokens there, lookup_k of them
    (None: k) at every k."""
    from tqdm.auto import tqdm

    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise ValueError(f"ks: expected positive integers, got {ks!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size: expected a positive integer, got {batch_size!r}")
    check_lookup(prompt_lookup, lookup_k)
    samples = _checked_samples(records, cache)
    window = draft.config.sliding_window
    if window is not None and max(len(s.ids) for s in samples) + max(ks) > window:
        raise ValueError(f"draft: its sliding window ({window}) is shorter than the replayed sequences; "
                         "replay it with replay_runs(..., batch_size=None)")
    wanted = range(len(records)) if only is None else sorted(set(only))
    usable = sorted((i for i in wanted if len(records[i]["response_ids"]) >= 2), key=lambda i: len(samples[i].ids))
    layers = list(draft.config.aux_layer_ids)
    rounds: dict[int, dict[int, list[int]]] = {k: {} for k in ks}
    for start in tqdm(range(0, len(usable), batch_size), desc="replay tau (all k)", disable=not progress):
        chunk = usable[start : start + batch_size]
        for i, matches in zip(chunk, chain_matches(draft, [records[i] for i in chunk], samples, chunk, cache, layers,
                                                    max(ks))):
            found = None
            if prompt_lookup is not None:
                looked, found = lookup_matches(samples[i].ids.tolist(), len(records[i]["prompt_ids"]) - 1,
                                               prompt_lookup, max(*ks, lookup_k or 0))
                matches = [looked[t] if found[t] else m for t, m in enumerate(matches)]
            for k in ks:
                caps = None if found is None else [lookup_k or k if f else k for f in found]
                rounds[k][i] = chain_rounds(matches, records[i], k, caps)
    runs: dict[int, dict[str, list[SpecResult]]] = {}
    for k in ks:
        runs[k] = {}
        for i in sorted(rounds[k]):  # record order within each category
            runs[k].setdefault(records[i].get("category") or "text", []).append(SpecResult(
                tokens=torch.tensor(records[i]["response_ids"]), accepted_lengths=rounds[k][i], k=k, draft_time_s=0.0,
                target_time_s=0.0, draft_backend="torch chain replay", draft_calls={}))
    return runs


@torch.no_grad()
def chain_matches(draft, records: list[dict], samples: list[Sample], indices: list[int], cache, layers: list[int],
                   depth: int) -> list[list[int]]:
    """For each record, L(t) for every pair t = prompt_len - 1 ... len - 3: how many of the draft's
    first `depth` greedy chain tokens from t equal the continuation's (see `replay_runs_per_k`)."""
    weight = draft.fc.weight
    ids, _, _, aux, _ = cache.batch(samples, indices, layers)
    lengths = [len(samples[i].ids) for i in indices]
    starts = [len(r["prompt_ids"]) - 1 for r in records]
    width = ids.shape[1] - 1  # pairs (h_t, x_{t+1}) for t < len - 1
    next_ids = ids[:, 1:]
    chain_rows = torch.zeros(len(indices), width, dtype=torch.bool)
    for b, (first, length) in enumerate(zip(starts, lengths)):
        chain_rows[b, first : length - 2] = True  # chain starts whose first token t + 2 exists
    step_logits = draft.ttt_forward(aux[:, :width].to(weight.dtype), next_ids, depth, label_rows=chain_rows)
    rows_b, rows_s = chain_rows.nonzero(as_tuple=True)
    matched = torch.zeros(len(indices), width, depth, dtype=torch.bool)  # [b, chain start t, step i]
    for step, logits in enumerate(step_logits):
        keep = rows_s >= step
        b, t = rows_b[keep], rows_s[keep] - step  # step i's logits sit at (b, s - i) for label rows s >= i
        target = t + 2 + step
        inside = target < torch.tensor(lengths)[b]
        proposed = draft.draft_to_target(logits.argmax(-1))
        matched[b[inside], t[inside], step] = proposed[inside] == ids[b[inside], target[inside]]
    counts = matched.to(torch.int32).cumprod(dim=-1).sum(dim=-1)  # leading matches
    return [counts[b, : lengths[b]].tolist() for b in range(len(indices))]


def chain_rounds(matches: list[int], record: dict, k: int, caps: Sequence[int] | None = None) -> list[int]:
    """Accepted lengths of greedy chain decoding at k along a continuation with match lengths
    `matches` (index t: the chain from pair t), as `speculative.speculative_loop` runs it: a round
    proposes min(k, budget - emitted - 1) tokens (caps[t] instead of k where given: a prompt-lookup
    round's lookup_k) and ends at the stop token."""
    response = record["response_ids"]
    budget = len(response)
    if record.get("stop") == "eos":
        budget = response.index(response[-1]) + 1  # the first stop token ends it
    emitted, t, accepted = 1, len(record["prompt_ids"]) - 1, []
    while emitted < budget:
        n = min(matches[t], k if caps is None else caps[t], budget - emitted - 1)
        accepted.append(n)
        emitted += n + 1
        t += n + 1
    return accepted
