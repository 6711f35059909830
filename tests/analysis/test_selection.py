"""Compartments, greedy/exhaustive selection, pair gains, ELSI-C and baselines against brute force."""

import itertools

import numpy as np
import pytest

from elsi_fast.analysis import selection as sel


def block_cka(sizes, inside=0.95, outside=0.2):
    labels = np.repeat(np.arange(len(sizes)), sizes)
    return np.where(labels[:, None] == labels[None, :], inside, outside)


def test_novelty_finds_planted_block_boundaries():
    cka = block_cka([3, 4, 2])
    assert sel.novelty_boundaries(cka, half_width=2, threshold=0.1) == [3, 7]
    assert sel.compartments_from_boundaries([3, 7], 9) == [[0, 2], [3, 6], [7, 8]]
    novelty = sel.novelty_curve(cka, half_width=2)
    # boundary b=3 with w=2: 0.95 + 0.95 - 2 * 0.2
    assert novelty[3] == pytest.approx(1.5)
    assert novelty[1] == pytest.approx(0.0)  # inside a block


def test_novelty_threshold_and_uniform_matrix():
    assert sel.novelty_boundaries(np.ones((6, 6)), threshold=0.1) == []
    with pytest.raises(ValueError, match="half_width"):
        sel.novelty_curve(np.eye(3), half_width=0)
    with pytest.raises(ValueError, match="cka"):
        sel.novelty_curve(np.ones((2, 3)))


def _brute_force_segmentation(cka, k):
    size = len(cka)
    best, best_value = None, -np.inf
    for cuts in itertools.combinations(range(1, size), k - 1):
        edges = [0, *cuts, size]
        value = sum(cka[a:b, a:b].sum() / (b - a) for a, b in zip(edges, edges[1:]))
        if value > best_value:
            best, best_value = [[a, b - 1] for a, b in zip(edges, edges[1:])], value
    return best


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_dp_segmentation_equals_brute_force(seed, k):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(9, 4))
    cka = np.abs(np.corrcoef(x))  # a symmetric similarity matrix with unit diagonal
    assert sel.segment_compartments(cka, k) == _brute_force_segmentation(cka, k)


def test_dp_segmentation_recovers_blocks_and_rejects_bad_k():
    assert sel.segment_compartments(block_cka([2, 5, 3]), 3) == [[0, 1], [2, 6], [7, 9]]
    with pytest.raises(ValueError, match="k"):
        sel.segment_compartments(np.eye(4), 5)


def weighted_coverage(weights, covers):
    """A monotone submodular set function (coverage): greedy has known behaviour on it."""

    def f(sets):
        return np.array([sum(weights[e] for e in set().union(*(covers[a] for a in s))) for s in sets])

    return f


def test_greedy_gains_and_exhaustive_optimum_differ_on_a_known_trap():
    # Greedy takes 0 first (covers 4 of 6 elements) and then gains 1; {1, 2} covers all 6.
    covers = {0: {0, 1, 2, 3}, 1: {0, 2, 4}, 2: {1, 3, 5}, 3: set()}
    f = weighted_coverage(np.ones(6), covers)
    greedy = sel.greedy_select(f, range(4), 2)
    assert greedy.layers in ([0, 1], [0, 2])
    assert greedy.gains == [4.0, 1.0] and greedy.value == 5.0
    best = sel.exhaustive_select(f, range(4), 2)
    assert best.layers == [1, 2] and best.value == 6.0 and best.exhaustive
    chosen = sel.select(f, range(4), 2, max_exhaustive=10)
    assert chosen.layers == [1, 2] and chosen.gains == [4.0, 1.0]
    assert sel.select(f, range(4), 2, max_exhaustive=1).layers == greedy.layers  # C(4,2)=6 > 1


def test_exhaustive_matches_brute_force_on_random_function():
    rng = np.random.default_rng(0)
    table = {s: rng.normal() for r in range(1, 4) for s in itertools.combinations(range(7), r)}
    f = lambda sets: np.array([table[tuple(s)] for s in sets])  # noqa: E731
    for m in (1, 2, 3):
        best = max((s for s in table if len(s) == m), key=table.get)
        worst = min((s for s in table if len(s) == m), key=table.get)
        assert sel.exhaustive_select(f, range(7), m, chunk=5).layers == list(best)
        assert sel.exhaustive_select(f, range(7), m, maximize=False).layers == list(worst)


def test_one_per_compartment_constraint():
    covers = {i: {i} for i in range(6)}
    f = weighted_coverage(np.array([5, 4, 3, 2, 1, 0.5]), covers)
    compartments = [[0, 1], [2, 3], [4, 5]]
    assert sel.greedy_select(f, range(6), 3, compartments=compartments).layers == [0, 2, 4]
    assert sel.exhaustive_select(f, range(6), 3, compartments=compartments).layers == [0, 2, 4]
    with pytest.raises(ValueError, match="compartments"):
        sel.greedy_select(f, range(6), 4, compartments=compartments)


def test_pair_gain_matrix_and_cka_penalty():
    covers = {0: {0, 1}, 1: {1, 2}, 2: {3}}
    f = weighted_coverage(np.ones(4), covers)
    gain = sel.pair_gain_matrix(f, [0, 1, 2])
    np.testing.assert_array_equal(gain, [[0, 1, 1], [1, 0, 1], [2, 2, 0]])  # row: first layer, not symmetric
    cka = np.array([[1, 0.8, 0.1], [0.8, 1, 0.3], [0.1, 0.3, 1]])
    penalized = sel.cka_penalized(f, cka, beta=2.0)
    np.testing.assert_allclose(penalized([(0,), (0, 1), (0, 1, 2)]), [2, 3 - 1.6, 4 - 2 * (0.8 + 0.1 + 0.3) / 3])
    with pytest.raises(ValueError, match="beta"):
        sel.cka_penalized(f, cka, beta=-1)


def test_bad_m():
    f = weighted_coverage(np.ones(2), {0: {0}, 1: {1}})
    with pytest.raises(ValueError, match="m: must be an integer in 1..2"):
        sel.greedy_select(f, [0, 1], 3)
    with pytest.raises(ValueError, match="m"):
        sel.exhaustive_select(f, [0, 1], 0)


def test_baselines():
    assert sel.last_layer(36) == [36]
    assert sel.uniform_layers(36, 3) == [9, 18, 27]
    assert sel.uniform_layers(32, 1) == [16]
    assert sel.uniform_layers(2, 2) == [1, 2]  # neighbours that round together are pushed apart
    with pytest.raises(ValueError, match="m"):
        sel.uniform_layers(4, 5)


def _prompt_objective(table, num_prompts, noise, seed, z=4.0):
    """A ScreenedObjective whose per-prompt values scatter around table[S] (prompt effects shared
    by all sets plus set-specific ones), with a surrogate off by a per-set bias of up to `noise`
    and prompt-level noise: what the screen assumes of a good control variate."""
    rng = np.random.default_rng(seed)
    keys = list(table)
    shared = rng.normal(0, 0.3, num_prompts)
    shared -= shared.mean()
    own = {k: rng.normal(0, 0.05, num_prompts) for k in keys}
    own = {k: v - v.mean() for k, v in own.items()}  # so that the mean over prompts is table[k]
    bias = {k: rng.uniform(-noise, noise) for k in keys}
    jitter = {k: rng.normal(0, 0.01, num_prompts) for k in keys}
    per_prompt = {k: table[k] + shared + own[k] for k in keys}
    values = lambda sets, prompts: np.stack([per_prompt[tuple(s)][prompts] for s in sets], 1)  # noqa: E731
    surrogate = lambda sets: np.stack([per_prompt[tuple(s)] - bias[tuple(s)] + jitter[tuple(s)] for s in sets], 1)  # noqa: E731
    return sel.ScreenedObjective(values, surrogate, num_prompts, z=z), lambda sets: np.array([table[tuple(s)] for s in sets])


@pytest.mark.parametrize("seed", range(4))
def test_screened_search_equals_brute_force_and_evaluates_few_sets(seed):
    rng = np.random.default_rng(seed)
    table = {s: rng.normal() for r in range(1, 4) for s in itertools.combinations(range(9), r)}
    objective, plain = _prompt_objective(table, 200, noise=0.05, seed=seed)
    for m in (1, 2, 3):
        for maximize in (True, False):
            assert (sel.exhaustive_select(objective, range(9), m, maximize=maximize).layers
                    == sel.exhaustive_select(plain, range(9), m, maximize=maximize).layers)
            screened = sel.greedy_select(objective, range(9), m, maximize=maximize)
            brute = sel.greedy_select(plain, range(9), m, maximize=maximize)
            assert screened.layers == brute.layers
            np.testing.assert_allclose(screened.gains, brute.gains, rtol=0, atol=1e-12)  # exact values
    assert objective.counts["evaluated"] < objective.counts["screened"] / 4
    assert objective.counts["prompt_evaluations"] < objective.counts["screened"] * 200 / 4


def test_screen_keeps_the_first_of_exact_ties_and_counts_penalized_work():
    table = {(0,): 1.0, (1,): 2.0, (2,): 2.0, (3,): 2.0, (4,): 0.5}
    objective, _ = _prompt_objective(table, 50, noise=0.0, seed=0)
    objective.values = lambda sets, prompts: np.stack([np.full(len(prompts), table[tuple(s)]) for s in sets], 1)
    assert sel.screened_best(objective, [(4,), (3,), (1,), (2,)]) == (1, 2.0)  # (3,) comes first in `sets`
    penalized = sel.cka_penalized(objective, np.eye(5), beta=1.0)
    assert isinstance(penalized, sel.ScreenedObjective)
    before = objective.counts["screened"]
    assert sel.screened_best(penalized, [(0,), (4,)], maximize=False) == (1, 0.5)
    assert objective.counts["screened"] == before + 2


def test_screen_with_infinite_z_is_exhaustive():
    # An adversarial surrogate (inverted order) can hide the optimum from a finite screen only.
    table = {(i,): float(i) for i in range(20)}
    objective, _ = _prompt_objective(table, 30, noise=0.0, seed=1, z=np.inf)
    objective.surrogate = lambda sets: -np.stack([np.full(30, table[tuple(s)]) for s in sets], 1)
    assert sel.screened_best(objective, list(table)) == (19, pytest.approx(19.0))
    assert objective.counts["evaluated"] == 20


def test_regression_estimate_known_answers():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 40))
    # y exactly linear in the control variates: the estimate is the population mean, error 0.
    y = 1.5 + 2.0 * x[0] - 3.0 * x[1]
    x_mean = np.array([0.3, -0.2])
    estimate, error = sel._regression_estimate(y, x, x_mean, population=100)
    assert estimate == pytest.approx(1.5 + 2.0 * 0.3 - 3.0 * -0.2, abs=1e-12)
    assert error == pytest.approx(0.0, abs=1e-12)
    # Against the normal equations of y = a + x^T b (intercept + 2 slopes) in float64.
    y = y + rng.normal(0, 0.1, 40)
    design = np.column_stack([np.ones(40), x.T])
    coef = np.linalg.solve(design.T @ design, design.T @ y)
    residual = y - design @ coef
    estimate, error = sel._regression_estimate(y, x, x_mean, population=100)
    assert estimate == pytest.approx(coef[0] + coef[1:] @ x_mean, abs=1e-12)
    assert error == pytest.approx(np.sqrt(residual @ residual / (40 - 3) / 40 * (1 - 40 / 100)), rel=1e-12)
    # No degrees of freedom left: the error is unknown, not zero.
    assert sel._regression_estimate(y[:3], x[:, :3], x_mean, population=100)[1] == np.inf


def test_regression_estimate_covers_the_population_mean():
    # Samples without replacement from one finite population: the z=2 intervals must cover its mean
    # about 95% of the time, and the control variates must shrink them well below the plain mean's.
    rng = np.random.default_rng(1)
    population = 400
    x = rng.normal(size=(2, population))
    y = 0.7 * x[0] + 0.2 * x[1] + rng.standard_t(5, population) * 0.3
    covered, widths, plain = 0, [], []
    for _ in range(2000):
        sample = rng.choice(population, 64, replace=False)
        estimate, error = sel._regression_estimate(y[sample], x[:, sample], x.mean(1), population)
        covered += abs(estimate - y.mean()) <= 2 * error
        widths.append(error)
        plain.append(sel._standard_error(y[sample, None], population)[0])
    assert 0.93 <= covered / 2000 <= 0.97
    assert np.mean(widths) < 0.5 * np.mean(plain)


@pytest.mark.parametrize("seed", range(3))
def test_screen_with_surrogate_terms_equals_brute_force(seed):
    # The surrogate split in two terms, each off in its own way across prompts: the race fits one
    # coefficient per term. Picks and values must still be brute force's.
    rng = np.random.default_rng(seed)
    table = {s: rng.normal(0, 0.2) for r in (1, 2) for s in itertools.combinations(range(10), r)}
    objective, plain = _prompt_objective(table, 300, noise=0.05, seed=seed)
    single = objective.surrogate
    drift = {k: rng.normal(0, 0.05, 300) for k in table}
    scale = {k: rng.uniform(0.5, 1.5) for k in table}

    def terms(sets):
        whole = single(sets)
        second = np.stack([scale[tuple(s)] * drift[tuple(s)] for s in sets], 1)
        return np.stack([whole - second, second])

    objective.surrogate = terms
    for m in (1, 2):
        for maximize in (True, False):
            screened = sel.exhaustive_select(objective, range(10), m, maximize=maximize)
            brute = sel.exhaustive_select(plain, range(10), m, maximize=maximize)
            assert screened.layers == brute.layers
            assert screened.value == pytest.approx(brute.value, abs=1e-12)
    penalized = sel.cka_penalized(objective, np.full((10, 10), 0.5), beta=2.0)
    sets = [(0, 1), (2, 5), (3,)]
    np.testing.assert_allclose(penalized.surrogate(sets).sum(0), terms(sets).sum(0) - np.array([1.0, 1.0, 0.0]), atol=1e-12)


def test_screen_rejects_a_surrogate_of_the_wrong_shape_or_with_nan():
    table = {(i,): float(i) for i in range(4)}
    objective, _ = _prompt_objective(table, 20, noise=0.0, seed=0)
    good = objective.surrogate
    objective.surrogate = lambda sets: good(sets)[:5]  # 5 prompts, not 20
    with pytest.raises(ValueError, match=r"surrogate: expected .*\[20, 4\].*got shape \(1, 5, 4\)"):
        sel.screened_best(objective, list(table))
    objective.surrogate = lambda sets: np.where(np.eye(20, 4, dtype=bool), np.nan, good(sets))
    with pytest.raises(ValueError, match="surrogate: expected finite"):
        sel.screened_best(objective, list(table))
