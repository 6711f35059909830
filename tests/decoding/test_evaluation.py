"""tau over prompt sets (elsi_fast.decoding.evaluation): pooling, and the resumable progress file."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from elsi_fast.decoding import evaluation
from elsi_fast.decoding.evaluation import evaluate_tau
from elsi_fast.decoding.speculative import SpecResult, speculative_generate
from elsi_fast.training.train import train_draft
from tiny_lm import SMALL, TARGET, TEXTS, TOKENIZER


def test_evaluate_tau_pools_rounds_per_category(tmp_path):
    draft, _ = train_draft(TARGET, TOKENIZER, [2, 4], TEXTS, out_dir=tmp_path, steps=3, seed=0, **SMALL)
    prompts = {"a": [TOKENIZER(TEXTS[0][:30])["input_ids"], TOKENIZER(TEXTS[1][:20])["input_ids"]],
               "b": [TOKENIZER(TEXTS[2][:40])["input_ids"]]}
    taus = evaluate_tau(TARGET, draft, prompts, k=3, max_new_tokens=10)
    totals = {}
    for cat, plist in prompts.items():
        for ids in plist:
            r = speculative_generate(TARGET, draft, torch.tensor(ids), 10, 3)
            for key in (cat, "all"):
                e, n = totals.get(key, (0, 0))
                totals[key] = (e + len(r.tokens) - 1, n + r.rounds)
    assert taus == pytest.approx({key: e / n for key, (e, n) in totals.items()})
    assert all(1.0 <= tau <= 4.0 for tau in taus.values())
    with pytest.raises(ValueError, match="max_new_tokens"):
        evaluate_tau(TARGET, draft, prompts, k=3, max_new_tokens=1)


def test_eval_progress_file_cut_by_a_crash_starts_over_or_keeps_whole_lines(tmp_path):
    log_path = tmp_path / "progress.jsonl"
    log_path.write_text('{"finger')  # the header itself was cut
    assert evaluation._ResultLog(log_path, "abc").load() == []
    assert json.loads(log_path.read_text().splitlines()[0]) == {"fingerprint": "abc"}
    result = SpecResult(tokens=torch.tensor([5, 6, 7]), accepted_lengths=[1], k=2, draft_time_s=0.1,
                        target_time_s=0.2, draft_backend="torch", draft_calls={"torch_steps": 2})
    log = evaluation._ResultLog(log_path, "abc")
    log.append(result)
    with open(log_path, "a") as f:
        f.write('{"tokens": [1')  # a result line cut by a crash
    (loaded,) = evaluation._ResultLog(log_path, "abc").load()
    assert torch.equal(loaded.tokens, result.tokens) and loaded.accepted_lengths == [1]
    assert loaded.draft_calls == {"torch_steps": 2}
    assert evaluation._ResultLog(log_path, "other").load() == []  # other settings: start over


@pytest.mark.parametrize("prompt_lookup, lookup_k", [(None, None), (1, None), (3, None), (1, 8)])
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_replayed_rounds_equal_live_speculative_decoding(replay_setup, backend, prompt_lookup, lookup_k):
    """tau replayed from the target's greedy continuation (no target forward) gives the accepted
    lengths of speculative_generate, round by round, prompt by prompt, with prompt lookup too."""
    from elsi_fast.draft import native

    if backend == "native" and not native.available("cpu"):
        pytest.skip("native extension not built")
    draft, records, cache = replay_setup
    looked = 0
    for k in (1, 3, 5):
        replayed = evaluation.replay_runs(draft, records, cache, k=k, draft_backend=backend,
                                          prompt_lookup=prompt_lookup, lookup_k=lookup_k)
        rounds = 0
        for category, results in replayed.items():
            live_records = [r for r in records if r["category"] == category]
            for record, result in zip(live_records, results):
                eos = record["response_ids"][-1] if record["stop"] == "eos" else None
                live = speculative_generate(TARGET, draft, torch.tensor(record["prompt_ids"]),
                                            len(record["response_ids"]), k, eos_token_id=eos, draft_backend=backend,
                                            prompt_lookup=prompt_lookup, lookup_k=lookup_k)
                assert result.accepted_lengths == live.accepted_lengths, (k, record["id"])
                assert result.tokens.tolist() == live.tokens.tolist() == record["response_ids"]
                assert ("lookup_rounds" in live.draft_calls) == (prompt_lookup is not None)
                looked += live.draft_calls.get("lookup_rounds", 0)
                rounds += result.rounds
        assert rounds > 0 and evaluation.pooled_tau(replayed)["all"] > 1.0
    if prompt_lookup == 1:
        assert looked > 0  # the lookup did propose (a 1-gram recurs in every continuation)
    with pytest.raises(ValueError, match="cache: .* other continuations"):
        evaluation.replay_runs(draft, records[:-1], cache)


def test_chain_replay_with_prompt_lookup_equals_the_one_prompt_replay(replay_setup):
    """With prompt lookup, the whole-sequence replay takes the lookup's matches where it proposes:
    the accepted lengths of the one-prompt replay (itself equal to live decoding, above)."""
    draft, records, cache = replay_setup
    ks = (1, 3, 5)
    for n, lookup_k in ((1, None), (2, None), (1, 8)):
        every_k = evaluation.replay_runs_per_k(draft, records, cache, ks, batch_size=4, prompt_lookup=n,
                                               lookup_k=lookup_k)
        for k in ks:
            one = evaluation.replay_runs(draft, records, cache, k=k, draft_backend="torch", prompt_lookup=n,
                                         lookup_k=lookup_k)
            assert {c: [r.accepted_lengths for r in rs] for c, rs in every_k[k].items()} == \
                {c: [r.accepted_lengths for r in rs] for c, rs in one.items()}, (n, lookup_k, k)
        plain = evaluation.replay_runs_per_k(draft, records, cache, ks, batch_size=4)
        assert any(a.accepted_lengths != b.accepted_lengths for c in plain[5] for a, b in zip(plain[5][c], every_k[5][c]))


def test_chain_replay_at_every_k_equals_the_one_prompt_replay(replay_setup):
    """One whole-sequence training-time-test pass gives every k's rounds: the same accepted lengths
    as the one-prompt replay (itself equal to live decoding, above), prompt by prompt."""
    draft, records, cache = replay_setup
    ks = (1, 2, 4, 5)
    one = {k: evaluation.replay_runs(draft, records, cache, k=k, draft_backend="torch") for k in ks}
    assert any(max(r.accepted_lengths, default=0) >= 2 for rs in one[4].values() for r in rs)  # chains do match
    for batch_size in (1, 4):
        every_k = evaluation.replay_runs_per_k(draft, records, cache, ks, batch_size=batch_size)
        for k in ks:
            assert {c: [r.accepted_lengths for r in rs] for c, rs in every_k[k].items()} == \
                {c: [r.accepted_lengths for r in rs] for c, rs in one[k].items()}, (k, batch_size)
            assert evaluation.pooled_tau(every_k[k]) == evaluation.pooled_tau(one[k])
            for category, results in every_k[k].items():
                expected = [r["response_ids"] for r in records if r["category"] == category]
                assert [r.tokens.tolist() for r in results] == expected
    some = evaluation.replay_runs(draft, records, cache, k=2, batch_size=3, only=[0, 3, 5])
    assert sum(len(rs) for rs in some.values()) == 3
    with pytest.raises(ValueError, match="ks"):
        evaluation.replay_runs_per_k(draft, records, cache, ())
    windowed = copy.deepcopy(draft)
    windowed.config.sliding_window = 8  # its window moves with each chain step: no whole-sequence replay
    with pytest.raises(ValueError, match="draft: its sliding window"):
        evaluation.replay_runs_per_k(windowed, records, cache)
    with pytest.raises(ValueError, match="cache: .* other continuations"):
        evaluation.replay_runs_per_k(draft, records[:-1], cache)
