"""Layer selection from entropy and CKA: compartments, ELSI, ELSI-C and the baselines.

Everything here is plain numpy on small L x L matrices and on a *set function* `f`, a callable
that maps a list of layer sets (tuples of input-to-layer indices) to their objective values in one
batched call, so the caller decides how a set's entropy is computed (prompt-mode Shannon entropy
of the concatenation, dataset-mode Renyi-2, ...).

An objective that is a mean over prompts and costs one eigensolve per prompt and set can come
with a cheap per-prompt surrogate (`ScreenedObjective`): the searches then estimate every
candidate set from its surrogate corrected on a small sample of prompts, and evaluate on every
prompt only the sets that the estimates cannot rule out (`screened_best`). The winners and every
reported value are exact values.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

SetFunction = Callable[[Sequence[tuple[int, ...]]], np.ndarray]

# Values this close (relative) are ties, won by the first set in enumeration order: exact ties
# (identical layers) then do not depend on round-off, which differs between implementations.
TIE_RTOL = 1e-12
# Sets per round of a screened search's first stage, and its first prompt sample.
_SCREEN_ROUND = 8
_FIRST_SAMPLE = 8
# One prompt order for every search: the searches revisit sets (greedy steps, then the exhaustive
# search over the same pairs), and exact values already computed on the shared samples are cached.
_SAMPLE_SEED = 0
# Sample size from which each surrogate term is a control variate of its own in the race: fitting
# k coefficients on fewer prompts would understate the standard errors.
_MULTI_TERM_SAMPLE = 32


@dataclass
class ScreenedObjective:
    """A set objective that is a mean over prompts, with a cheap per-prompt surrogate of it.

    values(sets, prompts) -> [len(prompts), len(sets)]: the exact per-prompt values of the given
    prompt positions (0..num_prompts-1); surrogate(sets) -> [num_prompts, len(sets)]: cheap
    approximations whose errors vary little across prompts, or [k, num_prompts, len(sets)]: k terms
    whose sum is that approximation, each a control variate of its own in the race (see
    screened_best). Calling the object gives the exact means. z: width, in standard errors, of the
    screen's confidence intervals (inf: exhaustive).
    """

    values: Callable[[Sequence[tuple[int, ...]], np.ndarray], np.ndarray]
    surrogate: Callable[[Sequence[tuple[int, ...]]], np.ndarray]
    num_prompts: int
    z: float = 4.0
    # {"screened": sets ranked, "evaluated": sets evaluated on every prompt, "prompt_evaluations":
    # exact per-prompt values computed}; shared with objectives derived from this one (cka_penalized).
    counts: dict[str, int] = field(default_factory=lambda: {"screened": 0, "evaluated": 0, "prompt_evaluations": 0})

    def __call__(self, sets: Sequence[tuple[int, ...]]) -> np.ndarray:
        return np.asarray(self.values(sets, np.arange(self.num_prompts)), dtype=np.float64).mean(0)


def screened_best(objective: ScreenedObjective, sets: Sequence[tuple[int, ...]], maximize: bool = True) -> tuple[int, float]:
    """(index into `sets`, exact value) of the best set, the first in `sets` among exact ties.

    The mean over prompts of the surrogate is exact and cheap for every set; its error is estimated
    from exact values on a random sample of prompts (a control variate): est(S) = mean surrogate(S)
    + sample mean of (exact - surrogate)(S), with standard error se(S) (finite-population corrected).
    1. Sets are taken in order of their mean surrogate, _SCREEN_ROUND at a time, and estimated on
       the first sample; taking stops when the chance that any set not yet taken reaches the
       leader's lower bound est - z se is below the normal tail at z, with the corrections of the
       sets not taken modelled as normal around the largest correction seen (see
       _chance_any_reaches).
    2. Racing on paired differences: each set is compared with the leader on the same prompts.
       The difference of their exact values is estimated by regression on the differences of the
       surrogate's terms (control variates, coefficients fitted on the sample by least squares;
       from _MULTI_TERM_SAMPLE prompts on, each term has its own coefficient, before that their
       sum has one), and the set is dropped when that estimate + z se < 0. Sets that share layers
       have errors that move together across prompts, so their difference is known far better
       than either value. The sample doubles until it holds every prompt; the survivors' values
       are then exact.
    This is a screen, not a bound: tests compare its picks with brute force, including planted ties.
    """
    sign = 1.0 if maximize else -1.0
    num_prompts = objective.num_prompts
    terms = sign * np.asarray(objective.surrogate(sets), dtype=np.float64)
    terms = terms[None] if terms.ndim == 2 else terms  # [k, P, N]
    if terms.ndim != 3 or terms.shape[1:] != (num_prompts, len(sets)) or not np.all(np.isfinite(terms)):
        raise ValueError(
            f"surrogate: expected finite values of shape [{num_prompts}, {len(sets)}] or [k, {num_prompts}, "
            f"{len(sets)}] (prompts, sets), got shape {terms.shape}"
        )
    per_prompt = terms.sum(0)  # [P, N]
    approx = per_prompt.mean(0)
    order = np.argsort(-approx, kind="stable")
    permutation = np.random.default_rng(_SAMPLE_SEED).permutation(num_prompts)
    estimate, error = np.full(len(sets), np.nan), np.zeros(len(sets))
    residuals: dict[int, np.ndarray] = {}  # per set, exact - surrogate on permutation[:size]

    def run(indices: list[int], size: int) -> None:
        sample = permutation[:size]
        exact = sign * np.asarray(objective.values([sets[i] for i in indices], sample), dtype=np.float64)
        objective.counts["prompt_evaluations"] += exact.size
        if size == num_prompts:  # exact means, so that exact ties stay ties
            estimate[indices], error[indices] = exact[np.argsort(sample)].mean(0), 0.0
            return
        residual = exact - per_prompt[sample][:, indices]
        estimate[indices] = approx[indices] + residual.mean(0)
        error[indices] = _standard_error(residual, num_prompts)
        residuals.update(zip(indices, residual.T))

    def beaten(i: int, leader: int) -> bool:
        size = len(residuals[i])
        sample = permutation[:size]
        exact = residuals[i] - residuals[leader] + per_prompt[sample, i] - per_prompt[sample, leader]
        used = terms if size >= _MULTI_TERM_SAMPLE else per_prompt[None]
        cheap = used[:, sample, i] - used[:, sample, leader]  # [k, s]
        population = used[:, :, i].mean(1) - used[:, :, leader].mean(1)  # [k]
        gap, error = _regression_estimate(exact, cheap, population, num_prompts)
        return gap + objective.z * error < 0

    size = num_prompts if math.isinf(objective.z) else min(num_prompts, _FIRST_SAMPLE)
    alive: list[int] = []
    for start in range(0, len(order), _SCREEN_ROUND):
        batch = [int(i) for i in order[start : start + _SCREEN_ROUND]]
        run(batch, size)
        alive += batch
        unseen = order[start + _SCREEN_ROUND :]
        if math.isinf(objective.z) or len(unseen) == 0:
            continue
        lower = np.max(estimate[alive] - objective.z * error[alive])
        if _chance_any_reaches(lower - approx[unseen], estimate[alive] - approx[alive], error[alive]) < _tail(objective.z):
            break
    while size < num_prompts:
        leader = alive[int(np.argmax(estimate[alive]))]
        alive = [i for i in alive if i == leader or not beaten(i, leader)]
        size = min(num_prompts, 2 * size)
        run(alive, size)
    objective.counts["screened"] += len(sets)
    objective.counts["evaluated"] += len(alive)
    alive.sort()  # ties go to the first in `sets`
    pick = alive[_first_best(estimate[alive])]
    return pick, float(sign * estimate[pick])


def _regression_estimate(y: np.ndarray, x: np.ndarray, x_mean: np.ndarray, population: int) -> tuple[float, float]:
    """(estimate, standard error) of the population mean of y from a sample y [s] drawn without
    replacement, with control variates x [k, s] whose population means x_mean [k] are known:
    mean(y) - beta (mean(x) - x_mean), beta fitted by least squares on the sample; the standard
    error counts the k + 1 fitted parameters and is finite-population corrected."""
    size, k = len(y), x.shape[0]
    centered_x = (x - x.mean(1, keepdims=True)).T  # [s, k]
    centered_y = y - y.mean()
    beta = np.linalg.lstsq(centered_x, centered_y, rcond=None)[0]
    estimate = float(y.mean() - beta @ (x.mean(1) - x_mean))
    if size <= k + 1:
        return estimate, math.inf
    residual = centered_y - centered_x @ beta
    variance = float(residual @ residual) / (size - k - 1)
    return estimate, math.sqrt(variance / size * (1 - size / population))


def _tail(z: float) -> float:
    """P(X > z) for a standard normal X."""
    return 0.5 * math.erfc(z / math.sqrt(2))


def _chance_any_reaches(needed: np.ndarray, corrections: np.ndarray, errors: np.ndarray) -> float:
    """Union bound on the chance that some set not yet evaluated has a correction (exact -
    surrogate) of at least `needed` (one entry per set), with corrections modelled as normal around
    the largest one seen, with the spread of those seen plus their largest standard error.
    Centred on the largest, not the mean: sets ranked lower by the surrogate tend to have larger
    corrections than the top ones evaluated first (the surrogate's errors regress to the mean)."""
    spread = math.sqrt((corrections.var(ddof=1) if len(corrections) > 1 else 0.0) + float(errors.max()) ** 2)
    gap = needed - corrections.max()
    if spread == 0:
        return float(np.any(gap <= 0))
    return float(sum(_tail(g) for g in gap / spread))


def _standard_error(samples: np.ndarray, population: int) -> np.ndarray:
    """Standard error of the column means of `samples` [s, N], drawn without replacement from
    `population` values (finite-population corrected; 0 for one sample)."""
    size = samples.shape[0]
    if size < 2:
        return np.zeros(samples.shape[1])
    return samples.std(0, ddof=1) / math.sqrt(size) * math.sqrt(1 - size / population)


def _check_square(matrix: np.ndarray, name: str) -> np.ndarray:
    matrix = np.asarray(matrix, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] < 1:
        raise ValueError(f"{name}: expected a non-empty square matrix, got shape {matrix.shape}")
    if not np.all(np.isfinite(matrix)):
        raise ValueError(f"{name}: contains NaN or inf")
    return matrix


# ---------------------------------------------------------------------------------------------
# Compartments
# ---------------------------------------------------------------------------------------------


def novelty_curve(cka: np.ndarray, half_width: int = 2) -> np.ndarray:
    """Foote checkerboard novelty along the diagonal of the [L, L] CKA matrix.

    Entry b (1 <= b < L) scores a boundary between layers b-1 and b:
    mean(A[b-w:b, b-w:b]) + mean(A[b:b+w, b:b+w]) - 2 mean(A[b-w:b, b:b+w]), with the half-width
    w shrunk near the ends so the two windows stay equal and inside the matrix. Entry 0 is 0.
    """
    cka = _check_square(cka, "cka")
    if half_width < 1:
        raise ValueError(f"half_width: must be >= 1, got {half_width}")
    size = cka.shape[0]
    novelty = np.zeros(size)
    for b in range(1, size):
        w = min(half_width, b, size - b)
        before, after = slice(b - w, b), slice(b, b + w)
        novelty[b] = cka[before, before].mean() + cka[after, after].mean() - 2 * cka[before, after].mean()
    return novelty


def novelty_boundaries(cka: np.ndarray, half_width: int = 2, threshold: float = 0.1) -> list[int]:
    """Boundaries b (a compartment starts at layer b): local maxima of the novelty curve above
    `threshold` (a plateau counts once, at its first index)."""
    novelty = novelty_curve(cka, half_width)
    size = len(novelty)
    boundaries = []
    for b in range(1, size):
        left = novelty[b - 1] if b > 1 else -np.inf
        right = novelty[b + 1] if b + 1 < size else -np.inf
        if novelty[b] > threshold and novelty[b] > left and novelty[b] >= right:
            boundaries.append(b)
    return boundaries


def compartments_from_boundaries(boundaries: Sequence[int], num_layers: int) -> list[list[int]]:
    """Runs between boundaries as inclusive [first, last] pairs covering 0..num_layers-1."""
    starts = [0, *sorted(b for b in boundaries if 0 < b < num_layers)]
    ends = [s - 1 for s in starts[1:]] + [num_layers - 1]
    return [[s, e] for s, e in zip(starts, ends)]


def segment_compartments(cka: np.ndarray, k: int) -> list[list[int]]:
    """Exact split of layers 0..L-1 into k contiguous compartments by dynamic programming.

    Maximizes sum over segments of (sum of the segment's CKA block) / (segment size): with CKA as
    a kernel this is contiguous kernel k-means (within-segment scatter is minimized), which does
    not favour one huge segment the way a raw sum of within-segment entries would.
    """
    cka = _check_square(cka, "cka")
    size = cka.shape[0]
    if not 1 <= k <= size:
        raise ValueError(f"k: must be in 1..{size} (number of layers), got {k}")
    prefix = np.zeros((size + 1, size + 1))
    prefix[1:, 1:] = cka.cumsum(0).cumsum(1)

    def score(i: int, j: int) -> float:  # segment [i, j) inclusive-exclusive
        block = prefix[j, j] - prefix[i, j] - prefix[j, i] + prefix[i, i]
        return block / (j - i)

    best = np.full((k + 1, size + 1), -np.inf)
    back = np.zeros((k + 1, size + 1), dtype=int)
    best[0, 0] = 0.0
    for parts in range(1, k + 1):
        for end in range(parts, size + 1):
            for start in range(parts - 1, end):
                value = best[parts - 1, start] + score(start, end)
                if value > best[parts, end]:
                    best[parts, end], back[parts, end] = value, start
    segments, end = [], size
    for parts in range(k, 0, -1):
        start = back[parts, end]
        segments.append([int(start), end - 1])
        end = start
    return segments[::-1]


# ---------------------------------------------------------------------------------------------
# Set selection
# ---------------------------------------------------------------------------------------------


@dataclass
class Selection:
    """A chosen layer set. `gains[i]` is the objective gain of the i-th greedy step (f(empty) = 0);
    `exhaustive` is True when `layers` is the exact optimum over all C(L, m) sets."""

    layers: list[int]
    value: float
    gains: list[float] = field(default_factory=list)
    exhaustive: bool = False


def _allowed(candidate: int, chosen: Sequence[int], compartment_of: dict[int, int] | None) -> bool:
    if candidate in chosen:
        return False
    if compartment_of is None:
        return True
    return compartment_of[candidate] not in {compartment_of[c] for c in chosen}


def greedy_select(
    f: SetFunction,
    candidates: Sequence[int],
    m: int,
    *,
    maximize: bool = True,
    compartments: Sequence[Sequence[int]] | None = None,
) -> Selection:
    """Add the best layer m times (argmax, or argmin with maximize=False) of f(S + {l}).

    With `compartments`, at most one layer per compartment is taken.
    """
    candidates = sorted(set(int(c) for c in candidates))
    compartment_of = _compartment_index(compartments, candidates)
    _check_m(m, candidates, compartment_of)
    chosen: list[int] = []
    gains: list[float] = []
    current = 0.0
    for _ in range(m):
        options = [c for c in candidates if _allowed(c, chosen, compartment_of)]
        pick, value = _best(f, [tuple(sorted([*chosen, c])) for c in options], maximize)
        chosen.append(options[pick])
        gains.append(value - current)
        current = value
    return Selection(layers=sorted(chosen), value=current, gains=gains)


def exhaustive_select(
    f: SetFunction,
    candidates: Sequence[int],
    m: int,
    *,
    maximize: bool = True,
    compartments: Sequence[Sequence[int]] | None = None,
    chunk: int = 4096,
) -> Selection:
    """The exact optimum of f over all m-subsets of `candidates` (respecting `compartments`)."""
    candidates = sorted(set(int(c) for c in candidates))
    compartment_of = _compartment_index(compartments, candidates)
    _check_m(m, candidates, compartment_of)
    best_set, best_value = None, None
    subsets = (
        s
        for s in itertools.combinations(candidates, m)
        if compartment_of is None or len({compartment_of[c] for c in s}) == m
    )
    while batch := list(itertools.islice(subsets, chunk)):
        pick, value = _best(f, batch, maximize)
        tie = TIE_RTOL * max(1.0, abs(value))
        if best_value is None or (value > best_value + tie if maximize else value < best_value - tie):
            best_set, best_value = batch[pick], value
    return Selection(layers=list(best_set), value=best_value, exhaustive=True)


def _best(f: SetFunction, sets: Sequence[tuple[int, ...]], maximize: bool) -> tuple[int, float]:
    """(index, value) of the best of `sets` (the first among ties)."""
    if isinstance(f, ScreenedObjective):
        return screened_best(f, sets, maximize)
    values = np.asarray(f(sets), dtype=np.float64)
    pick = _first_best(values if maximize else -values)
    return pick, float(values[pick])


def _first_best(values: np.ndarray) -> int:
    """Index of the first value within TIE_RTOL of the maximum."""
    best = values.max()
    return int(np.flatnonzero(values >= best - TIE_RTOL * max(1.0, abs(best)))[0])


def select(
    f: SetFunction,
    candidates: Sequence[int],
    m: int,
    *,
    maximize: bool = True,
    compartments: Sequence[Sequence[int]] | None = None,
    max_exhaustive: int = 1000,
) -> Selection:
    """Greedy selection, replaced by the exact optimum when C(len(candidates), m) <= max_exhaustive.
    The greedy steps' gains are kept either way."""
    greedy = greedy_select(f, candidates, m, maximize=maximize, compartments=compartments)
    if math.comb(len(set(candidates)), m) > max_exhaustive:
        return greedy
    best = exhaustive_select(f, candidates, m, maximize=maximize, compartments=compartments)
    best.gains = greedy.gains
    return best


def pair_gain_matrix(f: SetFunction, candidates: Sequence[int]) -> np.ndarray:
    """G[i, j] = f({a_i, a_j}) - f({a_i}) over `candidates` a (diagonal 0): the gain of adding
    layer a_j to layer a_i. Its non-uniformity shows that selection must be joint."""
    candidates = list(candidates)
    singles = np.asarray(f([(a,) for a in candidates]), dtype=np.float64)
    pairs = list(itertools.combinations(range(len(candidates)), 2))
    pair_values = np.asarray(f([(candidates[i], candidates[j]) for i, j in pairs]), dtype=np.float64)
    gain = np.zeros((len(candidates), len(candidates)))
    for (i, j), value in zip(pairs, pair_values):
        gain[i, j] = value - singles[i]
        gain[j, i] = value - singles[j]
    return gain


def cka_penalized(f: SetFunction, cka: np.ndarray, beta: float) -> SetFunction:
    """ELSI-C objective: f(S) - beta * mean over pairs a < b in S of CKA[a, b] (0 for one layer).

    A ScreenedObjective stays one, with the penalty on both its exact values and its surrogate
    (the penalty is exact, so the surrogate's errors are unchanged)."""
    cka = _check_square(cka, "cka")
    if not np.isfinite(beta) or beta < 0:
        raise ValueError(f"beta: must be a finite number >= 0, got {beta}")

    def penalty(sets: Sequence[tuple[int, ...]]) -> np.ndarray:
        return np.array(
            [beta * np.mean([cka[a, b] for a, b in itertools.combinations(s, 2)]) if len(s) > 1 else 0.0 for s in sets]
        )

    if isinstance(f, ScreenedObjective):

        def surrogate(sets: Sequence[tuple[int, ...]]) -> np.ndarray:
            terms = np.array(f.surrogate(sets), dtype=np.float64)
            (terms[0] if terms.ndim == 3 else terms)[...] -= penalty(sets)  # once, on the first term
            return terms

        return ScreenedObjective(
            lambda sets, prompts: np.asarray(f.values(sets, prompts), dtype=np.float64) - penalty(sets),
            surrogate, f.num_prompts, f.z, f.counts,
        )
    return lambda sets: np.asarray(f(sets), dtype=np.float64) - penalty(sets)


def _compartment_index(
    compartments: Sequence[Sequence[int]] | None, candidates: Sequence[int]
) -> dict[int, int] | None:
    if compartments is None:
        return None
    index = {}
    for number, (first, last) in enumerate(compartments):
        for layer in range(first, last + 1):
            index[layer] = number
    missing = [c for c in candidates if c not in index]
    if missing:
        raise ValueError(f"compartments: layers {missing} are in no compartment")
    return index


def _check_m(m: int, candidates: Sequence[int], compartment_of: dict[int, int] | None) -> None:
    limit = len(candidates) if compartment_of is None else len({compartment_of[c] for c in candidates})
    what = "candidate layers" if compartment_of is None else "compartments (one layer per compartment)"
    if not isinstance(m, (int, np.integer)) or not 1 <= m <= limit:
        raise ValueError(f"m: must be an integer in 1..{limit} (number of {what}), got {m}")


# ---------------------------------------------------------------------------------------------
# Baselines (input-to-layer indices of an N-block model)
# ---------------------------------------------------------------------------------------------
# The eagle3 baseline, [2, N//2, N-3], is the engines' default: engines.layer_ids.eagle3_default_layers.


def last_layer(num_blocks: int) -> list[int]:
    """The EAGLE1/EAGLE2 feature: h_N, the last block's output before the final norm."""
    return [num_blocks]


def uniform_layers(num_blocks: int, m: int) -> list[int]:
    """m layers evenly spaced inside 1..N: round(N (i+1) / (m+1)), i = 0..m-1 (half rounds up)."""
    if not 1 <= m <= num_blocks:
        raise ValueError(f"m: must be in 1..{num_blocks} for uniform spacing, got {m}")
    layers: list[int] = []
    for i in range(m):
        position = int(math.floor(num_blocks * (i + 1) / (m + 1) + 0.5))
        # When m is close to N, neighbours can round to the same layer: push them apart.
        layers.append(max(position, layers[-1] + 1) if layers else max(position, 1))
    return layers
