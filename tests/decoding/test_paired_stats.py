"""Paired statistics of tau (elsi_fast.decoding.paired_stats, experiment_report) against float64
numpy references and known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from elsi_fast.decoding import experiment_report as report
from elsi_fast.decoding.paired_stats import (
    emitted_tokens, mean_t_interval, pooled_bootstrap, prompt_rounds, t_quantile_975,
)


def _t_cdf(q: float, df: int) -> float:
    """P(T <= q) of Student's t by the trapezoid rule on its density (float64)."""
    t = np.linspace(0.0, q, 400_001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_c - (df + 1) / 2 * np.log1p(t * t / df))
    return 0.5 + float(np.sum((density[1:] + density[:-1]) / 2 * np.diff(t)))


@pytest.mark.parametrize("df", [1, 2, 4, 9, 10, 17, 30, 31, 60, 200])
def test_t_quantile_is_the_975_point_of_the_t_distribution(df):
    assert _t_cdf(t_quantile_975(df), df) == pytest.approx(0.975, abs=2e-4)


def test_mean_t_interval_matches_numpy():
    rng = np.random.default_rng(3)
    for n in (2, 3, 5, 12, 40):
        values = rng.normal(1.2, 0.05, n)
        mean, half = mean_t_interval(list(values))
        assert mean == pytest.approx(np.mean(values), rel=1e-14)
        assert half == pytest.approx(t_quantile_975(n - 1) * np.std(values, ddof=1) / np.sqrt(n), rel=1e-12)
    mean, half = mean_t_interval([1.25])
    assert mean == 1.25 and math.isnan(half)
    with pytest.raises(ValueError, match="values"):
        mean_t_interval([])
    with pytest.raises(ValueError, match="df"):
        t_quantile_975(0)


def test_emitted_tokens_count_rounds_up_to_the_first_stop_token():
    answers = [{"id": "a", "response_ids": [5, 6, 7, 2], "stop": "eos"},  # 4 tokens, the prefill's one not a round's
               {"id": "b", "response_ids": [5, 2, 7, 2], "stop": "eos"},  # the first stop token ends it: 2 tokens
               {"id": "c", "response_ids": [5, 6, 7], "stop": "length"},
               {"id": "d", "response_ids": [5], "stop": "length"}]  # no verification round: left out
    assert emitted_tokens(answers, {"a": "x", "b": "y", "c": "x", "d": "x"}) == {"x": [3, 2], "y": [1]}
    with pytest.raises(ValueError, match="category_of"):
        emitted_tokens(answers, {"a": "x"})
    assert prompt_rounds([3, 2], [1.5, 2.0]).tolist() == [2.0, 1.0]


def _bootstrap_reference(tokens, pairs, draws, seed):
    """The pooled bootstrap written draw by draw (float64): the same draws, pooled sums per draw."""
    picks = np.random.default_rng(seed).integers(0, len(tokens), (draws, len(tokens)))
    diffs = []
    for pick in picks:
        per_seed = [tokens[pick].sum() / a[pick].sum() - tokens[pick].sum() / b[pick].sum() for a, b in pairs]
        diffs.append(sum(per_seed) / len(per_seed))
    return np.quantile(np.array(diffs), 0.025), np.quantile(np.array(diffs), 0.975)


def test_pooled_bootstrap_matches_a_draw_by_draw_reference():
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, 128, 60).astype(np.float64)
    pairs = [(tokens / rng.uniform(1.1, 1.5, 60), tokens / rng.uniform(1.0, 1.4, 60)) for _ in range(3)]
    low, high = pooled_bootstrap(tokens, pairs, draws=500, seed=7)
    ref_low, ref_high = _bootstrap_reference(tokens, pairs, 500, 7)
    assert (low, high) == pytest.approx((ref_low, ref_high), rel=1e-12, abs=1e-12)
    point = np.mean([tokens.sum() / a.sum() - tokens.sum() / b.sum() for a, b in pairs])
    assert low < point < high  # the pooled difference of the sample itself lies inside
    assert pooled_bootstrap(tokens, pairs, draws=500, seed=7) == (low, high)  # seeded: the same draws


def test_pooled_bootstrap_known_answers():
    tokens = np.arange(1, 41, dtype=np.float64)
    # every prompt at tau 1.5 against 1.2: every resample pools to exactly those, the interval is the constant
    low, high = pooled_bootstrap(tokens, [(tokens / 1.5, tokens / 1.2)])
    assert low == pytest.approx(0.3, abs=1e-12) and high == pytest.approx(0.3, abs=1e-12)
    # the same draft against itself: 0
    rounds = tokens / np.linspace(1.0, 2.0, 40)
    assert pooled_bootstrap(tokens, [(rounds, rounds)]) == (0.0, 0.0)
    # a known shift: a draft that emits 0.1 more per round on every prompt is 0.1 ahead, whatever the resample
    rounds = np.full(40, 8.0)
    tau = np.linspace(1.1, 1.6, 40)
    shifted = pooled_bootstrap(tokens=tau * rounds, pairs=[(tau * rounds / (tau + 0.1), rounds)])
    assert shifted == pytest.approx((0.1, 0.1), abs=0.02)
    with pytest.raises(ValueError, match="pairs"):
        pooled_bootstrap(tokens, [])
    with pytest.raises(ValueError, match="one value per prompt"):
        pooled_bootstrap(tokens, [(tokens[:-1], tokens)])


def _cell(name, seed, per_prompt, emitted, tag="claims"):
    """A cell file's dict from per-prompt tau at every k (the same at each k)."""
    pooled = {c: sum(emitted[c]) / sum(e / t for e, t in zip(emitted[c], taus)) for c, taus in per_prompt.items()}
    tokens = sum(sum(v) for v in emitted.values())
    pooled["all"] = tokens / sum(e / t for c in emitted for e, t in zip(emitted[c], per_prompt[c]))
    tau = {str(k): {"pooled": pooled, "per_prompt": per_prompt} for k in (1, 2, 3, 4, 5)}
    return {"name": name, "layers": [1], "seed": seed, "tag": tag, "recipe": {}, "train_tokens": 1, "final_loss": 0.0,
            "tau": tau}


def test_claims_tables_paired_columns_match_the_references():
    rng = np.random.default_rng(1)
    emitted = {"qa": list(rng.integers(5, 60, 12)), "rag": list(rng.integers(5, 60, 9))}
    cells = []
    for seed in range(3):
        for name, base in (("eagle3-m3", 1.2), ("elsi-m1", 1.3)):
            cells.append(_cell(name, seed, {c: list(base + rng.uniform(-0.1, 0.1, len(e))) for c, e in emitted.items()},
                               emitted))
    sets = {"elsi-m1": [1], "eagle3-m3": [0, 1, 2]}
    main, per_k, delta_k, delta_category = report.claims_tables(cells, sets, emitted)
    assert [row[0] for row in main.rows] == ["elsi-m1", "eagle3-m3"] and main.rows[1][-1] == "0"
    diffs = np.array([c["tau"]["4"]["pooled"]["all"] for c in cells if c["name"] == "elsi-m1"]) - \
        np.array([c["tau"]["4"]["pooled"]["all"] for c in cells if c["name"] == "eagle3-m3"])
    half = t_quantile_975(2) * np.std(diffs, ddof=1) / np.sqrt(3)
    tokens = np.array(emitted["qa"] + emitted["rag"], dtype=np.float64)

    def rounds(cell):
        return np.concatenate([np.array(emitted[c]) / np.array(cell["tau"]["4"]["per_prompt"][c]) for c in ("qa", "rag")])

    pairs = [(rounds(cells[2 * s + 1]), rounds(cells[2 * s])) for s in range(3)]
    low, high = _bootstrap_reference(tokens, pairs, 4000, 0)
    assert main.rows[0][-1] == f"{diffs.mean():+.3f} ± {half:.3f} (n=3 seeds); prompts [{low:+.3f}, {high:+.3f}]"
    assert main.header == ["set", "layers", "seeds", "all", "qa", "rag", "Δ all vs EAGLE3 (paired)"]
    assert delta_k.rows[0][4] == main.rows[0][-1].replace(" (n=3 seeds); prompts", "")  # k=4 is the main column
    assert [row[0] for row in per_k.rows] == ["eagle3-m3", "elsi-m1"] and len(delta_category.rows[0]) == 3
    lines = main.markdown()
    assert lines[3].startswith("| set |") and lines[4] == "|---" * 7 + "|" and len(lines) == 7
    with pytest.raises(ValueError, match="do not match"):  # other continuations than the cells were replayed on
        report.claims_tables(cells, sets, {"qa": [e + 1 for e in emitted["qa"]], "rag": emitted["rag"]})
