"""Paired statistics of tau between drafts: intervals over seeds and bootstrap intervals over prompts.

Two drafts compared on the same prompts and trained with the same seeds (data order, initial
weights) differ by less than either varies from seed to seed, so the experiment compares them
paired (docs/experiments.md):
- over seeds: the per-seed differences of pooled tau, their mean and a 95% Student-t half-width
  (`mean_t_interval`);
- over prompts: a bootstrap of the pooled difference (`pooled_bootstrap`). Pooled tau is
  emitted tokens / verification rounds summed over the prompts, so a prompt weighs by its rounds;
  the replay gives every prompt's emitted tokens (the same for every draft: the target's greedy
  continuation, `emitted_tokens`) and its tau, hence its rounds = emitted / tau (`prompt_rounds`).
  Each resample draws prompts with replacement, pools both drafts over the same draw, and averages
  the difference over the seeds: prompt-to-prompt noise, not seed noise.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np

# Two-sided 95% Student-t quantiles t(0.975, df) for df = 1..30 (standard tables, 3 decimals).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)
_Z975 = 1.959964
BOOTSTRAP_DRAWS = 4000


def t_quantile_975(df: int) -> float:
    """t(0.975, df): the table up to df = 30, beyond it the first Cornish-Fisher term around the
    normal quantile (z + (z^3 + z) / (4 df), within 0.002 of the exact value for df > 30)."""
    if isinstance(df, bool) or not isinstance(df, int) or df < 1:
        raise ValueError(f"df: expected a positive integer, got {df!r}")
    if df <= len(_T975):
        return _T975[df - 1]
    return _Z975 + (_Z975**3 + _Z975) / (4 * df)


def mean_t_interval(values: Sequence[float]) -> tuple[float, float]:
    """(mean, 95% Student-t half-width) of `values`; the half-width is nan for one value."""
    n = len(values)
    if n == 0:
        raise ValueError("values: no values to average")
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    return mean, t_quantile_975(n - 1) * sd / math.sqrt(n)


def emitted_tokens(answers: Iterable[Mapping], category_of: Mapping[str, str]) -> dict[str, list[int]]:
    """Tokens each replayed prompt emits through verification rounds (accepted + rounds), per
    category in answer order, as `evaluation.replay_runs_per_k` replays them: the continuation's
    budget (up to its first stop token when it stopped there) less the prefill's token; answers
    with fewer than 2 new tokens (no round) are left out. answers: `regenerate` records or their
    `export_answers` form ({"id", "response_ids", "stop"}); category_of: prompt id -> category."""
    emitted: dict[str, list[int]] = {}
    for answer in answers:
        response = answer["response_ids"]
        if len(response) < 2:
            continue
        budget = response.index(response[-1]) + 1 if answer.get("stop") == "eos" else len(response)
        if answer["id"] not in category_of:
            raise ValueError(f"category_of: no category for the answer to prompt {answer['id']!r}")
        emitted.setdefault(category_of[answer["id"]], []).append(budget - 1)
    return emitted


def prompt_rounds(emitted: Sequence[int], taus: Sequence[float]) -> np.ndarray:
    """Verification rounds of each prompt, emitted / tau (float64), from its emitted tokens and tau."""
    if len(emitted) != len(taus):
        raise ValueError(f"taus: {len(taus)} per-prompt values for {len(emitted)} prompts")
    return np.asarray(emitted) / np.asarray(taus, dtype=np.float64)


def pooled_bootstrap(tokens: np.ndarray, pairs: Sequence[tuple[np.ndarray, np.ndarray]], *,
                     draws: int = BOOTSTRAP_DRAWS, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """`level` bootstrap interval of pooled tau(a) - tau(b) over prompts, averaged over seeds.

    tokens: [P] emitted tokens per prompt; pairs: one (rounds of a [P], rounds of b [P]) per seed
    both drafts have, the prompts in `tokens`' order. Each of `draws` resamples (numpy
    default_rng(seed): the same draws on every call) picks P prompts with replacement; its
    statistic is the mean over seeds of sum(tokens) / sum(rounds a) - sum(tokens) / sum(rounds b)."""
    tokens = np.asarray(tokens, dtype=np.float64)
    if tokens.ndim != 1 or len(tokens) == 0:
        raise ValueError(f"tokens: expected a non-empty vector of emitted tokens, got shape {tokens.shape}")
    if not pairs:
        raise ValueError("pairs: no seed that both drafts have")
    if any(np.shape(a) != tokens.shape or np.shape(b) != tokens.shape for a, b in pairs):
        raise ValueError(f"pairs: every seed's rounds must have one value per prompt ({len(tokens)})")
    if not 0 < level < 1:
        raise ValueError(f"level: expected a probability in (0, 1), got {level!r}")
    picks = np.random.default_rng(seed).integers(0, len(tokens), (draws, len(tokens)))
    resampled = tokens[picks].sum(axis=1)
    diffs = np.mean([resampled / mine[picks].sum(axis=1) - resampled / theirs[picks].sum(axis=1)
                     for mine, theirs in pairs], axis=0)
    tail = round((1 - level) / 2, 12)  # 0.025, not 0.025000000000000022
    return float(np.quantile(diffs, tail)), float(np.quantile(diffs, 1 - tail))
