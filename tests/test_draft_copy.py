"""bench.draft_copy's replayed figures against decoding.evaluation's own replay of the same draft."""

from __future__ import annotations

import pytest

from bench.draft_copy import pooled, set_rows
from elsi_fast.decoding import evaluation


def test_pooled_is_pooled_tau():
    rounds = {"a": [[0, 2, 1], [3]], "b": [[1, 1]]}
    expected = {"a": (6 + 4) / 4, "b": (2 + 2) / 2, "all": (8 + 6) / 6}
    assert pooled(rounds) == pytest.approx(expected)


@pytest.mark.parametrize("n", [1, 2])
def test_draft_and_combined_tau_equal_the_replay(replay_setup, n):
    draft, records, cache = replay_setup
    k = 3
    rows = set_rows(draft, records, cache, list(draft.config.aux_layer_ids), n, k, lookup_k=7)
    alone = evaluation.pooled_tau(evaluation.replay_runs_per_k(draft, records, cache, (k,))[k])
    combined = evaluation.pooled_tau(evaluation.replay_runs_per_k(draft, records, cache, (k,), prompt_lookup=n)[k])
    assert rows[f"tau_k{k}/draft"] == pytest.approx(alone)
    assert rows[f"tau_k{k}/lookup_then_draft"] == pytest.approx(combined)
    longer = evaluation.replay_runs_per_k(draft, records, cache, (k,), prompt_lookup=n, lookup_k=7)[k]
    assert rows[f"tau_k{k}/lookup_then_draft_up_to_7"] == pytest.approx(evaluation.pooled_tau(longer))
    for category, either in rows[f"tau_k{k}/either"].items():
        assert either >= max(rows[f"tau_k{k}/draft"][category], rows[f"tau_k{k}/prompt_lookup"][category]) - 1e-12
    for name in ("draft", "prompt_lookup", "draft_where_lookup_right"):
        assert all(0.0 <= v <= 1.0 for v in rows[f"first_token_acc/{name}"].values())
    assert rows["first_token_acc/prompt_lookup"]["all"] > 0  # the lookup did propose right tokens
