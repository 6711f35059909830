"""analyze(): statistics equal an independent float64 reference built from output_hidden_states
(plus an independently hooked h_N); planted structure; resume; bad inputs."""

import itertools
import math
import os
import signal

import numpy as np
import pytest
import torch
from torch import nn

from elsi_fast.analysis.analyze import analyze
from elsi_fast.analysis.prompts import Prompt
from elsi_fast.analysis.selection import segment_compartments
from tiny_models import TINY_MODELS, VOCAB, _final_norm, tiny_model


class SpecialIds:
    """The tokenizer surface analyze() uses when prompts carry their own input_ids."""

    all_special_ids = [0, 1]
    chat_template = None


def make_prompts(num, seed=0, min_len=12, max_len=22):
    rng = np.random.default_rng(seed)
    prompts = []
    for i in range(num):
        ids = [1] + rng.integers(2, VOCAB, rng.integers(min_len, max_len + 1)).tolist()
        ids[len(ids) // 2] = 0  # a special token inside the prompt: must be dropped
        prompts.append(Prompt(text=f"p{i}", input_ids=ids))
    return prompts


def _entropy_np(eigvals):
    lam = np.clip(eigvals, 0, None)
    p = lam / lam.sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def _unbiased_hsic_np(x, y):
    """Song et al. unbiased HSIC of linear kernels, float64."""
    n = x.shape[0]
    k, l = x @ x.T, y @ y.T
    np.fill_diagonal(k, 0)
    np.fill_diagonal(l, 0)
    one = np.ones(n)
    return (np.trace(k @ l) + (one @ k @ one) * (one @ l @ one) / ((n - 1) * (n - 2))
            - 2 / (n - 2) * one @ k @ l @ one) / (n * (n - 3))


def reference_kept_rows(model, prompts, threshold):
    """Per prompt, the kept token rows [n, d] of every layer h_0..h_N in float64, from per-prompt
    forwards with output_hidden_states (h_N: the input of the final norm, a hook independent of
    elsi_fast.targets.capture)."""
    captured = {}
    handle = _final_norm(model).register_forward_hook(lambda m, a, o: captured.update(h=a[0]))
    per_prompt = []
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt.input_ids])
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
            states = [h[0].double().numpy() for h in out.hidden_states[:-1]] + [captured["h"][0].double().numpy()]
            logits = out.logits[0].double().numpy()
            logp = logits - logits.max(1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(1, keepdims=True))
            entropy = -(np.exp(logp) * logp).sum(1)
            positions = np.arange(len(prompt.input_ids))
            keep = (positions >= 1) & ~np.isin(prompt.input_ids, [0, 1]) & (entropy >= threshold)
            per_prompt.append([s[keep] for s in states])
    finally:
        handle.remove()
    return per_prompt


def reference_prompt_vectors(model, prompts, threshold):
    """Per prompt with >= 2 kept tokens (prompt mode is undefined for one token: it centers to
    zero), the prompt-mode vectors of every layer: centered over the prompt, rows L2-normalized."""
    out = []
    for rows in reference_kept_rows(model, prompts, threshold):
        if rows[0].shape[0] >= 2:
            z = [r - r.mean(0) for r in rows]
            out.append([v / np.linalg.norm(v, axis=1, keepdims=True) for v in z])
    return out


def reference_statistics(model, prompts, threshold):
    """Per-prompt prompt-mode entropies [P, L], dataset-mode Shannon and Renyi-2 entropies [L] and
    the minibatch CKA [L, L], all in float64 numpy."""
    per_prompt = [[_entropy_np(np.linalg.eigvalsh(v @ v.T)) for v in z]
                  for z in reference_prompt_vectors(model, prompts, threshold)]
    dataset_rows, hsic_sum = None, None
    for rows in reference_kept_rows(model, prompts, threshold):
        normed = [r / np.linalg.norm(r, axis=1, keepdims=True) for r in rows]
        dataset_rows = normed if dataset_rows is None else [np.vstack([a, b]) for a, b in zip(dataset_rows, normed)]
        if rows[0].shape[0] >= 4:
            h = np.array([[_unbiased_hsic_np(a, b) for b in normed] for a in normed])
            hsic_sum = h if hsic_sum is None else hsic_sum + h
    spectra = [np.clip(np.linalg.eigvalsh(np.cov(r.T, bias=True)), 0, None) for r in dataset_rows]
    dataset = [_entropy_np(lam) for lam in spectra]
    renyi2 = [-np.log((lam**2).sum() / lam.sum() ** 2) for lam in spectra]
    cka = hsic_sum / np.sqrt(np.outer(np.diag(hsic_sum), np.diag(hsic_sum)))
    return np.array(per_prompt), np.array(dataset), np.array(renyi2), cka


def _midpoint_threshold(model, prompts):
    """A threshold between two well-separated token entropies near the median (robust to round-off)."""
    values = []
    for prompt in prompts:
        with torch.no_grad():
            logits = model(torch.tensor([prompt.input_ids])).logits[0, 1:].double()
        values += (-(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)).tolist()
    values = np.sort(values)
    gaps = np.diff(values)
    middle = len(values) // 2
    window = range(middle - len(values) // 4, middle + len(values) // 4)
    best = max(window, key=lambda i: gaps[i])
    assert gaps[best] > 1e-4
    return float((values[best] + values[best + 1]) / 2)


@pytest.mark.parametrize("arch", sorted(TINY_MODELS))
def test_statistics_equal_independent_reference(arch):
    model = tiny_model(arch)
    prompts = make_prompts(6)
    threshold = _midpoint_threshold(model, prompts)
    report = analyze(model, SpecialIds(), prompts, m=(1, 2), batch_size=4, min_token_entropy=threshold,
                     gram_dtype="float64", progress=False)
    per_prompt, dataset, renyi2, cka = reference_statistics(model, prompts, threshold)
    got_mean = [e["entropy_prompt_mean"] for e in report.layers]
    got_std = [e["entropy_prompt_std"] for e in report.layers]
    np.testing.assert_allclose(got_mean, per_prompt.mean(0), rtol=1e-5)
    np.testing.assert_allclose(got_std, per_prompt.std(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose([e["entropy_dataset"] for e in report.layers], dataset, rtol=1e-5)
    # the "H2 dataset" column is the Renyi-2 entropy of the dataset covariance, between-prompt variance included
    np.testing.assert_allclose([e["renyi2_dataset"] for e in report.layers], renyi2, rtol=1e-5)
    np.testing.assert_allclose(np.array(report.cka), cka, rtol=1e-4, atol=1e-6)
    assert [e["index"] for e in report.layers] == list(range(5))
    assert 0 < report.tokens["kept"] < report.tokens["candidates"]
    # ELSI m=1 is the candidate with the largest prompt-mode entropy
    candidates = list(range(1, 4))
    assert report.select("elsi", 1) == [max(candidates, key=lambda l: per_prompt.mean(0)[l])]


def planted_model():
    """N=8 Llama whose blocks 2-4 and 6-7 are exact identities (o_proj and down_proj zeroed):
    h_2 = h_3 = h_4 = h_5 and h_6 = h_7 = h_8; the other blocks are strongly non-linear."""
    model = tiny_model("llama", num_hidden_layers=8, initializer_range=0.5)
    with torch.no_grad():
        for i in (2, 3, 4, 6, 7):
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    return model


def test_planted_identity_blocks_give_known_compartments_and_picks():
    model = planted_model()
    report = analyze(model, SpecialIds(), make_prompts(8, seed=2), m=(2, 3), min_token_entropy=0,
                     gram_dtype="float32", progress=False)
    cka = np.array(report.cka)
    for group in ([2, 3, 4, 5], [6, 7, 8]):
        np.testing.assert_allclose(cka[np.ix_(group, group)], 1.0, atol=1e-6)
    assert segment_compartments(cka, 4) == [[0, 0], [1, 1], [2, 5], [6, 8]]
    boundaries = set(report.boundaries)
    assert {1, 6} <= boundaries and not boundaries & {3, 4, 5, 7, 8}  # never inside an identical run
    gain = np.array(report.pair_gain)
    for run in ([2, 3, 4, 5], [6, 7, 8]):
        np.testing.assert_allclose(gain[np.ix_(run, run)], 0.0, atol=1e-5)  # a copy adds nothing
    assert gain[1, 6] > 0.05
    runs = {1: "a", 2: "b", 3: "b", 4: "b", 5: "b", 6: "c", 7: "c"}
    assert len({runs[l] for l in report.select("elsi", 2)}) == 2
    # ELSI's concatenation may weight a run twice (K_1 + 2 K_6); the CKA penalty of a copy (CKA = 1)
    # makes ELSI-C take one layer per run.
    assert sorted(runs[l] for l in report.select("elsi-c", 3)) == ["a", "b", "c"]


def brute_force_set_entropy(grams):
    """The definition, reference for the screened searches: f(S) = mean over prompts of
    H1(sum_{a in S} K_a), one n x n eigensolve per prompt and set, float64 numpy.
    grams: per prompt, the layers' Grams K_a [n, n]."""
    cache = {}

    def f(layer_set):
        key = tuple(sorted(set(layer_set)))
        if key not in cache:
            cache[key] = float(np.mean([_entropy_np(np.linalg.eigvalsh(sum(k[a] for a in key))) for k in grams]))
        return cache[key]

    return f


def first_best(values):
    """The first index among values equal to the maximum up to round-off (TIE_RTOL)."""
    values = np.asarray(values)
    return int(np.flatnonzero(values >= values.max() - 1e-12 * max(1.0, abs(values.max())))[0])


def brute_force_select(f, candidates, m, maximize=True, penalty=lambda s: 0.0, max_exhaustive=1000):
    """(layers, greedy gains) by the definitions of docs/method.md section 4, evaluating every set."""
    sign = 1 if maximize else -1
    g = lambda s: f(s) - penalty(s)  # noqa: E731
    chosen, gains, current = [], [], 0.0
    for _ in range(m):
        options = [c for c in candidates if c not in chosen]
        values = [sign * g(tuple(sorted([*chosen, c]))) for c in options]
        pick = first_best(values)
        chosen.append(options[pick])
        gains.append(sign * values[pick] - current)
        current = sign * values[pick]
    if math.comb(len(candidates), m) <= max_exhaustive:
        subsets = list(itertools.combinations(candidates, m))
        return list(subsets[first_best([sign * g(s) for s in subsets])]), gains
    return sorted(chosen), gains


def check_selections_equal_brute_force(model, prompts, threshold, **options):
    """Brute force runs on the analysis' own float64 prompt vectors (an independent forward differs
    by fp32 round-off, ~1e-8 nats), checked against the independent reference first."""
    report = analyze(model, SpecialIds(), prompts, min_token_entropy=threshold, gram_dtype="float64",
                     progress=False, **options)
    store = report.set_entropy.values.__self__.store
    grams = [store.prompt_grams(i).numpy() for i in np.argsort(store.prompt_index)]
    reference = reference_prompt_vectors(model, prompts, threshold)
    for k, z in zip(grams, reference):
        np.testing.assert_allclose(k, [v @ v.T for v in z], atol=1e-5)
    f = brute_force_set_entropy(grams)
    cka = np.array(report.cka)
    beta = report.options["beta"]
    penalty = lambda s: beta * np.mean([cka[a, b] for a, b in itertools.combinations(s, 2)]) if len(s) > 1 else 0.0  # noqa: E731
    candidates = list(range(1, report.num_hidden_layers))
    for m in report.options["m"]:
        for method, kwargs in (("elsi", {}), ("elsi-c", {"penalty": penalty}),
                               ("low-entropy", {"maximize": False})):
            pool = [0, *candidates] if method == "low-entropy" else candidates
            layers, gains = brute_force_select(f, pool, m, max_exhaustive=report.options["max_exhaustive"], **kwargs)
            assert report.selections[method][str(m)] == layers, (method, m)
            assert report.set_values[method][str(m)] == pytest.approx(f(tuple(layers)), abs=1e-9)
            np.testing.assert_allclose(report.greedy_gains[method][str(m)], gains, rtol=0, atol=1e-9)
        uniform = report.selections["uniform"][str(m)]
        assert report.set_values["uniform"][str(m)] == pytest.approx(f(tuple(uniform)), abs=1e-9)
    # pair gains: the prompt-mode Renyi-2 entropy of the concatenation, -log(tr K^2 / (tr K)^2)
    def h2(layer_set):
        return np.mean([-np.log(np.trace(k @ k) / np.trace(k) ** 2) for k in (sum(g[a] for a in layer_set) for g in grams)])
    gain = np.array(report.pair_gain)
    for a, b in ((1, 2), (0, report.num_hidden_layers), (2, 1)):
        assert gain[a, b] == pytest.approx(h2((a, b)) - h2((a,)), abs=1e-9)
    assert report.timing["sets_evaluated_exactly"] <= report.timing["sets_screened"]
    return report


def test_set_entropies_do_not_depend_on_threads_cache_or_batching():
    """Set entropies are solved by a thread pool over prompt chunks, from Gram blocks kept in a
    bounded cache: two threads, a cache that holds almost nothing, and sets asked one at a time or
    all at once give the same values (to 1e-12: BLAS may round by alignment), equal to the
    brute-force definition."""
    from elsi_fast.analysis import set_entropy

    model = tiny_model("llama", num_hidden_layers=5, seed=21)
    prompts = make_prompts(12, seed=21, min_len=12, max_len=60)  # Grams and vectors stored
    report = analyze(model, SpecialIds(), prompts, m=(1,), min_token_entropy=0, gram_dtype="float64", progress=False)
    store = report.set_entropy.values.__self__.store
    sets = [(1, 2), (1, 3), (2, 4), (1, 2, 3), (0, 2, 5), (3, 4, 5)]
    everything = np.arange(len(store))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = set_entropy.SetEntropySolver(store).prompt_set_entropy(sets, everything)
        torch.set_num_threads(2)
        solver = set_entropy.SetEntropySolver(store)
        solver._products = set_entropy._ProductCache(limit=40_000)  # about one block: every product is recomputed
        two = np.stack([solver.prompt_set_entropy([s], everything)[:, 0] for s in sets], axis=1)
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_allclose(one, two, rtol=0, atol=1e-12)
    assert solver._products.bytes <= 40_000
    f = brute_force_set_entropy([store.prompt_grams(i).numpy() for i in np.argsort(store.prompt_index)])
    np.testing.assert_allclose(one.mean(0), [f(s) for s in sets], rtol=0, atol=1e-9)


@pytest.mark.parametrize("lengths", [(12, 22), (40, 60), (20, 50)], ids=["grams", "rows", "mixed"])
def test_screened_selections_equal_brute_force(lengths):
    """Short prompts store Grams (n < d = 32), long ones the vectors themselves (n >= d); set
    entropies are solved on the smaller side. Picks, set values and greedy gains equal the
    brute-force definitions to 1e-9; m = 2 is exhaustive, m = 3 greedy (C(6, 3) > max_exhaustive)."""
    model = tiny_model("llama", num_hidden_layers=7, seed=12)
    prompts = make_prompts(40, seed=12, min_len=lengths[0], max_len=lengths[1])  # > 16: the screen samples prompts
    check_selections_equal_brute_force(model, prompts, _midpoint_threshold(model, prompts), m=(1, 2, 3),
                                       max_exhaustive=16)


def test_screened_selections_equal_brute_force_on_planted_ties():
    """Identity blocks make whole runs of layers exactly equal (exact ties in every search): the
    screen must still return brute force's first-in-order winner."""
    model = planted_model()
    report = check_selections_equal_brute_force(model, make_prompts(24, seed=6, min_len=30, max_len=40), 0.0,
                                                 m=(2, 3, 4), max_exhaustive=40)
    assert report.timing["sets_evaluated_exactly"] < report.timing["sets_screened"] / 2


def test_prompt_statistics_use_all_kept_tokens_and_spill_to_the_run_folder(tmp_path):
    """More kept tokens than the former 128-token cap: the per-layer entropies equal the
    all-token reference, and the factors live in a file next to the state, sized as documented."""
    model = tiny_model("llama", seed=8, max_position_embeddings=256)
    prompts = make_prompts(3, seed=8, min_len=150, max_len=170)
    state = str(tmp_path / "state.pt")
    report = analyze(model, SpecialIds(), prompts, m=(1,), min_token_entropy=0, state_path=state, progress=False)
    per_prompt, *_ = reference_statistics(model, prompts, 0.0)
    np.testing.assert_allclose([e["entropy_prompt_mean"] for e in report.layers], per_prompt.mean(0), rtol=1e-9)
    vectors = reference_prompt_vectors(model, prompts, 0.0)
    expected = sum(len(z) * z[0].shape[0] * min(z[0].shape) * 4 for z in vectors)  # float32, n x min(n, d) per layer
    assert report.memory["gram_store_bytes"] == expected == os.path.getsize(state + ".factors")
    assert report.memory["prompt_statistics_bytes"] < expected
    assert report.timing["selection_seconds"] > 0 and report.timing["pass_seconds"] > 0


class _Crash(Exception):
    pass


@pytest.mark.parametrize("stop", ["crash", "ctrl_c"])
def test_resume_after_interruption_equals_uninterrupted(tmp_path, stop):
    """A crash in the third batch loses it (the state has the last periodic save, every batch
    here); Ctrl-C in the third batch lets it finish and saves it although no save was due."""
    model = tiny_model("llama", seed=3)
    prompts = make_prompts(7, seed=3)
    options = dict(m=(1, 2), batch_size=2, min_token_entropy=0.5, gram_dtype="float64", progress=False)
    full = analyze(model, SpecialIds(), prompts, **options)

    calls = {"n": 0}

    def stop_in_third_batch(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            if stop == "crash":
                raise _Crash
            os.kill(os.getpid(), signal.SIGINT)

    state = str(tmp_path / "state.pt")
    handle = model.model.layers[0].register_forward_pre_hook(stop_in_third_batch)
    with pytest.raises(_Crash if stop == "crash" else KeyboardInterrupt):
        analyze(model, SpecialIds(), prompts, state_path=state, save_every=1 if stop == "crash" else 100, **options)
    handle.remove()
    assert calls["n"] == 3  # no batch started after the stop
    saved = torch.load(state, weights_only=True)
    assert saved["position"] == (4 if stop == "crash" else 6)  # batches of 2
    resumed = analyze(model, SpecialIds(), prompts, state_path=state, save_every=1, **options)
    assert resumed.tokens == full.tokens  # no token counted twice
    assert resumed.timing["pass_seconds"] > saved["seconds"] > 0  # the time of both runs
    for a, b in zip(resumed.layers, full.layers):
        for key in ("entropy_prompt_mean", "entropy_prompt_std", "entropy_dataset"):
            assert a[key] == pytest.approx(b[key], rel=1e-9)
    np.testing.assert_allclose(resumed.cka, full.cka, rtol=1e-9)
    assert resumed.selections == full.selections
    with pytest.raises(ValueError, match="state_path"):
        analyze(model, SpecialIds(), prompts[:5], state_path=state, **options)


def test_batch_size_does_not_change_results():
    model = tiny_model("gpt2", seed=4)
    prompts = make_prompts(5, seed=4)
    a = analyze(model, SpecialIds(), prompts, m=(1,), batch_size=1, min_token_entropy=0, gram_dtype="float64", progress=False)
    b = analyze(model, SpecialIds(), prompts, m=(1,), batch_size=5, min_token_entropy=0, gram_dtype="float64", progress=False)
    np.testing.assert_allclose([e["entropy_dataset"] for e in a.layers], [e["entropy_dataset"] for e in b.layers], rtol=1e-6)
    np.testing.assert_allclose(a.cka, b.cka, rtol=1e-6)


def test_filter_reports_variance_with_and_without():
    model = tiny_model("llama", seed=5)
    report = analyze(model, SpecialIds(), make_prompts(6, seed=5), m=(1,), min_token_entropy=_midpoint_threshold(
        model, make_prompts(6, seed=5)), gram_dtype="float64", progress=False)
    variance = report.entropy_variance
    per_layer_unfiltered = np.array([e["entropy_prompt_std_unfiltered"] for e in report.layers]) ** 2
    assert variance["unfiltered"] == pytest.approx(per_layer_unfiltered.mean(), rel=1e-9)
    assert variance["reduction"] == pytest.approx(1 - variance["filtered"] / variance["unfiltered"])
    assert report.memory["gram_store_bytes"] > 0
    # The table says which way the variance moved, never "-11% reduction" for a rise.
    line = next(l for l in report.table().splitlines() if l.startswith("cross-prompt variance"))
    verb = "cut it by" if variance["filtered"] < variance["unfiltered"] else "raised it by"
    assert f"the filter {verb} {100 * abs(variance['reduction']):.1f}%" in line and "-" not in line.split(":")[-1]


def test_bad_inputs():
    model = tiny_model("llama")
    tok = SpecialIds()
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        analyze(model, tok, [Prompt("a", input_ids=[1, 5, 6]), Prompt("b", input_ids=[1])], progress=False)
    with pytest.raises(ValueError, match="every token was filtered out"):
        analyze(model, tok, make_prompts(3), min_token_entropy=100.0, progress=False)
    with pytest.raises(ValueError, match="m: each set size"):
        analyze(model, tok, make_prompts(3), m=(4,), progress=False)  # candidates are 1..3
    with pytest.raises(ValueError, match="prompts: no prompts"):
        analyze(model, tok, [], progress=False)
    with pytest.raises(TypeError, match="Sequential"):
        analyze(nn.Sequential(nn.Linear(2, 2)), tok, make_prompts(2), progress=False)
    with pytest.raises(ValueError, match="min_token_entropy"):
        analyze(model, tok, make_prompts(2), min_token_entropy=-1, progress=False)
