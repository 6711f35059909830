"""analyze(): statistics equal an independent float64 reference built from output_hidden_states
(plus an independently hooked h_N); planted structure; resume; bad inputs."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from elsi_fast.analysis import analyze
from elsi_fast.prompts import Prompt
from elsi_fast.selection import segment_compartments
from test_capture import TINY_MODELS, VOCAB, _final_norm, tiny_model


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


def reference_statistics(model, prompts, threshold):
    """Per-prompt forwards with output_hidden_states for h_0..h_{N-1}; h_N is the input of the final
    norm (a hook independent of elsi_fast.capture); all math in float64."""
    captured = {}
    handle = _final_norm(model).register_forward_hook(lambda m, a, o: captured.update(h=a[0]))
    per_prompt, dataset_rows, hsic_sum = [], None, None
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
            rows = [s[keep] for s in states]
            if keep.sum() >= 2:  # prompt mode is undefined for one token (it centers to zero)
                z = [r - r.mean(0) for r in rows]
                z = [v / np.linalg.norm(v, axis=1, keepdims=True) for v in z]
                per_prompt.append([_entropy_np(np.linalg.eigvalsh(v @ v.T)) for v in z])
            normed = [r / np.linalg.norm(r, axis=1, keepdims=True) for r in rows]
            dataset_rows = normed if dataset_rows is None else [np.vstack([a, b]) for a, b in zip(dataset_rows, normed)]
            if keep.sum() >= 4:
                h = np.array([[_unbiased_hsic_np(a, b) for b in normed] for a in normed])
                hsic_sum = h if hsic_sum is None else hsic_sum + h
    finally:
        handle.remove()
    per_prompt = np.array(per_prompt)
    dataset = [_entropy_np(np.linalg.eigvalsh(np.cov(r.T, bias=True))) for r in dataset_rows]
    cka = hsic_sum / np.sqrt(np.outer(np.diag(hsic_sum), np.diag(hsic_sum)))
    return per_prompt, np.array(dataset), cka


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
    per_prompt, dataset, cka = reference_statistics(model, prompts, threshold)
    got_mean = [e["entropy_prompt_mean"] for e in report.layers]
    got_std = [e["entropy_prompt_std"] for e in report.layers]
    np.testing.assert_allclose(got_mean, per_prompt.mean(0), rtol=1e-5)
    np.testing.assert_allclose(got_std, per_prompt.std(0), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose([e["entropy_dataset"] for e in report.layers], dataset, rtol=1e-5)
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


class _Interrupt(Exception):
    pass


def test_resume_after_interruption_equals_uninterrupted(tmp_path):
    model = tiny_model("llama", seed=3)
    prompts = make_prompts(7, seed=3)
    options = dict(m=(1, 2), batch_size=2, min_token_entropy=0.5, gram_dtype="float64", progress=False)
    full = analyze(model, SpecialIds(), prompts, **options)

    calls = {"n": 0}

    def fail_on_third_batch(module, args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise _Interrupt

    state = str(tmp_path / "state.pt")
    handle = model.model.layers[0].register_forward_pre_hook(fail_on_third_batch)
    with pytest.raises(_Interrupt):
        analyze(model, SpecialIds(), prompts, state_path=state, save_every=1, **options)
    handle.remove()
    assert torch.load(state, weights_only=False)["position"] == 4  # two batches of 2 were saved
    resumed = analyze(model, SpecialIds(), prompts, state_path=state, save_every=1, **options)
    assert resumed.tokens == full.tokens  # no token counted twice
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
