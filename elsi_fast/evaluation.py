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
2 cores and the draft's own steps only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Mapping, Sequence

import torch

from .speculative import (
    ReplayTarget, SpecResult, _draft_path, draft_positions_needed, native_decoder_for, speculative_generate,
    speculative_loop,
)
from .training_data import Sample


def speculative_runs(
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
) -> dict[str, list[SpecResult]]:
    """`speculative_generate` on every prompt: category -> one `SpecResult` per prompt.

    The draft path is chosen once (`spec.native_decoder_for`; draft_dtype / draft_backend as in
    `speculative_generate`), so int8 weights are quantized once and auto mode warns at most once.
    state_path: a JSON-lines file that gets each prompt's result as soon as it is done; a rerun
    with the same file, target, draft, prompts and settings takes the finished prompts from it
    and runs only the rest (another setting starts the file over).
    """
    from tqdm.auto import tqdm

    if not prompts_by_category:
        raise ValueError("prompts_by_category: no categories given")
    jobs = [(cat, torch.as_tensor(ids, dtype=torch.long)) for cat, prompts in prompts_by_category.items()
            for ids in prompts]
    runs: dict[str, list[SpecResult]] = {cat: [] for cat in prompts_by_category}
    log = _ResultLog(state_path, _runs_fingerprint(target, draft, jobs, k, max_new_tokens, draft_dtype, draft_backend))
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
            result = speculative_generate(target, decoder, ids, max_new_tokens, k)
        else:
            result = speculative_generate(target, draft, ids, max_new_tokens, k, draft_backend="torch")
        if index >= len(done):
            log.append(result)
        runs[category].append(result)
    return runs


def _runs_fingerprint(target, draft, jobs, k, max_new_tokens, draft_dtype, draft_backend) -> str:
    """What decides the results of speculative_runs: settings, prompts, the draft's weights, and the
    target's config and embeddings (hashing all of a large target's weights would take too long)."""
    digest = hashlib.sha256(json.dumps([k, max_new_tokens, draft_dtype, draft_backend,
                                        [(cat, ids.tolist()) for cat, ids in jobs]]).encode())
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
) -> dict[str, list[SpecResult]]:
    """The `SpecResult` of every record's prompt, replayed (see the module docstring): category ->
    results in record order. records: greedy `regenerate` records of the evaluation prompts (each
    continuation ends at the target's stop token or at the length cap); cache: a `FeatureCache` of
    `continuation_samples(records)` holding the draft's layers. Each prompt generates exactly its
    continuation's length, stopping at its stop token, as `speculative_generate` with that budget
    and `eos_token_id` does. batch_size: replay that many prompts side by side in one torch draft
    batch (`_replay_batched`: every draft step reads the weights once for all of them; the torch
    path's numbers), else one prompt at a time on the path draft_dtype / draft_backend choose.
    only: replay just the records at these positions (the cache still covers all of them)."""
    from tqdm.auto import tqdm

    from .feature_cache import samples_fingerprint

    if not records:
        raise ValueError("records: no continuations given")
    samples = continuation_samples(records)
    if cache.meta["samples"] != samples_fingerprint(samples):
        raise ValueError(f"cache: {cache.path} was dumped from other continuations")
    layers = list(draft.config.aux_layer_ids)
    longest = max(len(s.ids) for s in samples)
    runs: dict[str, list[SpecResult]] = {}
    wanted = set(range(len(records))) if only is None else set(only)
    if batch_size is not None:
        if draft_dtype is not None or draft_backend == "native":
            raise ValueError("batch_size: the batched replay runs the torch draft; drop draft_dtype / draft_backend")
        usable = [i for i, r in enumerate(records) if len(r["response_ids"]) >= 2 and (only is None or i in wanted)]
        for start in tqdm(range(0, len(usable), batch_size), desc="replay tau (batched)", disable=not progress):
            chunk = usable[start : start + batch_size]
            for index, result in zip(chunk, _replay_batched(draft, [records[i] for i in chunk], samples, chunk,
                                                             cache, layers, k)):
                runs.setdefault(records[index].get("category") or "text", []).append(result)
        return runs
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
        result = speculative_loop(runner, path, prompt, new, k, eos)
        runs.setdefault(record.get("category") or "text", []).append(result)
    return runs


@torch.no_grad()
def _replay_batched(draft, records: list[dict], samples: list[Sample], indices: list[int], cache, layers: list[int],
                    k: int) -> list[SpecResult]:
    """`speculative_loop` for several prompts in lockstep, the draft in torch over a `RaggedKVCache`
    (each prompt at its own position): the same bookkeeping per prompt, one batched draft call per
    step for all of them."""
    from .draft.model import RaggedKVCache

    weight = draft.fc.weight
    rows = len(records)
    _, _, _, aux, _ = cache.batch(samples, indices, layers)
    targets = [ReplayTarget(samples[i].ids, aux[b, : len(samples[i].ids)].to(weight.dtype)) for b, i in enumerate(indices)]
    budget = [len(r["response_ids"]) for r in records]
    eos = [r["response_ids"][-1] if r.get("stop") == "eos" else None for r in records]
    prompt_len = [len(r["prompt_ids"]) for r in records]
    # Room for a finished row's idle writes too: every forward writes every row (at slots past its
    # length, never attended and overwritten later), so that no row's cache needs copying.
    ragged = RaggedKVCache(rows, draft.config.num_key_value_heads, draft.config.head_dim,
                           max(len(samples[i].ids) for i in indices) + 2 * k + 4, device=weight.device,
                           dtype=weight.dtype)

    def run(inputs: torch.Tensor, ids: torch.Tensor, keep: list[int], rows_in: list[int], from_target: bool):
        """One draft forward; inputs [len(rows_in), T, .] and ids [len(rows_in), T] for rows `rows_in`,
        each keeping `keep[i]` positions -> (the target id its last kept position proposes, that
        position's hidden [len(rows_in), 1, d])."""
        index = torch.tensor(rows_in)
        x = draft.project(inputs) if from_target else inputs
        full = x.new_zeros(rows, *x.shape[1:])
        full[index] = x
        full_ids = ids.new_zeros(rows, ids.shape[1])
        full_ids[index] = ids
        last = torch.tensor(keep) - 1
        logits, out = draft.forward(full, full_ids, ragged, logits_at=(index, last))
        ragged.lengths[index] += torch.tensor(keep)
        picked = logits.argmax(-1)
        return draft.draft_to_target(picked).tolist(), out[index, last][:, None]

    # Prefill: the pairs (h_t, x_{t+1}) of every prompt position, the last one's x the first new token.
    emitted, feature_rows, pair_rows = [], [], []
    for b, target in enumerate(targets):
        greedy, features = target.forward(torch.tensor([records[b]["prompt_ids"]]))
        emitted.append([int(greedy[0, -1])])
        feature_rows.append(features[0])
        pair_rows.append(torch.tensor(records[b]["prompt_ids"][1:] + [emitted[b][0]]))
    width = max(prompt_len)
    features = torch.zeros(rows, width, feature_rows[0].shape[-1], dtype=weight.dtype)
    pairs = torch.zeros(rows, width, dtype=torch.long)
    for b in range(rows):
        features[b, : prompt_len[b]], pairs[b, : prompt_len[b]] = feature_rows[b], pair_rows[b]
    proposal, hidden = run(features, pairs, prompt_len, list(range(rows)), True)
    accepted: list[list[int]] = [[] for _ in range(rows)]
    active = [b for b in range(rows) if len(emitted[b]) < budget[b] and emitted[b][-1] != eos[b]]
    while active:
        seq_len = {b: prompt_len[b] + len(emitted[b]) for b in active}
        round_k = {b: min(k, budget[b] - len(emitted[b]) - 1) for b in active}
        proposals = {b: [proposal[b]] if round_k[b] > 0 else [] for b in active}
        for step in range(1, max(round_k.values(), default=0)):
            going = [b for b in active if round_k[b] > step]
            ids = torch.tensor([[proposals[b][-1]] for b in going])
            next_ids, next_hidden = run(hidden[going], ids, [1] * len(going), going, False)
            for b, token, h in zip(going, next_ids, next_hidden):
                proposals[b].append(token)
                hidden[b] = h
        extend = []
        for b in active:
            greedy, verified = targets[b].forward(torch.tensor([[emitted[b][-1], *proposals[b]]]))
            greedy_list = greedy[0].tolist()
            n = 0
            while n < len(proposals[b]) and proposals[b][n] == greedy_list[n]:
                n += 1
            new_tokens = proposals[b][:n] + [greedy_list[n]]
            if eos[b] is not None and eos[b] in new_tokens:
                new_tokens = new_tokens[: new_tokens.index(eos[b]) + 1]
            emitted[b].extend(new_tokens)
            accepted[b].append(len(new_tokens) - 1)
            targets[b].crop(seq_len[b] + n)
            if len(emitted[b]) < budget[b] and emitted[b][-1] != eos[b]:
                ragged.lengths[b] = seq_len[b] - 1
                extend.append((b, new_tokens, verified[0, : len(new_tokens)]))
        if extend:
            width = max(len(tokens) for _, tokens, _ in extend)
            features = torch.zeros(len(extend), width, extend[0][2].shape[-1], dtype=weight.dtype)
            pairs = torch.zeros(len(extend), width, dtype=torch.long)
            for i, (_, tokens, verified) in enumerate(extend):
                features[i, : len(tokens)], pairs[i, : len(tokens)] = verified, torch.tensor(tokens)
            going = [b for b, _, _ in extend]
            next_ids, next_hidden = run(features, pairs, [len(tokens) for _, tokens, _ in extend], going, True)
            for b, token, h in zip(going, next_ids, next_hidden):
                proposal[b] = token
                hidden[b] = h
        active = [b for b, _, _ in extend]
    return [SpecResult(tokens=torch.tensor(emitted[b]), accepted_lengths=accepted[b], k=k, draft_time_s=0.0,
                       target_time_s=0.0, draft_backend="torch batched replay", draft_calls={}) for b in range(rows)]