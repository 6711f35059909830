"""tau over prompt sets (elsi_fast.evaluation): pooling, and the resumable progress file."""

from __future__ import annotations

import json

import pytest
import torch

from elsi_fast import evaluation
from elsi_fast.evaluation import evaluate_tau
from elsi_fast.speculative import SpecResult, speculative_generate
from elsi_fast.train import train_draft
from tiny_lm import SMALL, TARGET, TEXTS, TOKENIZER


def test_evaluate_tau_pools_rounds_per_category(tmp_path):
    draft = train_draft(TARGET, TOKENIZER, [2, 4], TEXTS, out_dir=tmp_path, steps=3, seed=0, **SMALL)
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
