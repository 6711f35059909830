"""elsi_fast.streaming: exactness under chunking / merging / all_reduce, against float64 numpy."""

from __future__ import annotations

import io
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from elsi_fast import MinibatchHSIC, StreamingCovariance, matrix_entropy, streaming
from numpy_references import np_hsic_song

HYPOTHESIS = settings(max_examples=15, deadline=None)


def np_rows(x: torch.Tensor, normalize: str, mask: torch.Tensor | None = None) -> np.ndarray:
    y = x.double().numpy()
    if mask is not None:
        y = y[mask.numpy()]
    if normalize == "l2":
        y = y / np.linalg.norm(y, axis=1, keepdims=True)
    return y


def np_population_cov(y: np.ndarray) -> np.ndarray:
    return np.cov(y.T, bias=True).reshape(y.shape[1], y.shape[1])


def hidden_states(num_layers: int, n: int, d: int, seed: int, offset: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    """[L, n, d] correlated, anisotropic token features with a per-dim offset."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.2, 2.0, d, dtype=torch.float64)
    layers = [base]
    for _ in range(num_layers - 1):
        layers.append(layers[-1] + 0.7 * torch.randn(n, d, generator=g, dtype=torch.float64))
    return (torch.stack(layers) + offset * torch.linspace(-1, 1, d, dtype=torch.float64)).to(dtype)


# ------------------------------------------------------------------ StreamingCovariance


@pytest.mark.parametrize("normalize", ["l2", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("tile_cols", [64, 4])  # one tile; two uneven ones (upper-triangle update)
def test_covariance_matches_numpy(monkeypatch, normalize, dtype, as_list, tile_cols):
    monkeypatch.setattr(streaming, "_COV_TILE_COLS", tile_cols)
    x = hidden_states(3, 41, 6, seed=1, offset=2.0, dtype=dtype)
    mask = torch.rand(41, generator=torch.Generator().manual_seed(2)) > 0.3
    acc = StreamingCovariance(3, 6, normalize=normalize)
    acc.update(list(x) if as_list else x, mask=mask)
    assert acc.count == int(mask.sum())
    for a in range(3):
        y = np_rows(x[a], normalize, mask)
        np.testing.assert_allclose(acc.covariance()[a].numpy(), np_population_cov(y), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(acc.mean()[a].numpy(), y.mean(0), rtol=1e-10, atol=1e-12)


def test_covariance_stays_exact_with_1e4_offsets():
    """Shifted sums: ~1e-15 relative error. Raw sums would lose ~1e-8 (E[x^2] ~ 1e8 vs Var ~ 1)."""
    x = hidden_states(2, 300, 5, seed=3, offset=1e4, dtype=torch.float32)
    acc = StreamingCovariance(2, 5, normalize="none")
    for chunk in x.split(37, dim=1):
        acc.update(chunk)
    for a in range(2):
        np.testing.assert_allclose(acc.covariance()[a].numpy(), np_population_cov(np_rows(x[a], "none")),
                                   rtol=1e-11, atol=1e-11)


@HYPOTHESIS
@given(cuts=st.lists(st.integers(1, 59), max_size=6), normalize=st.sampled_from(["l2", "none"]),
       seed=st.integers(0, 2**16), masked=st.booleans())
def test_covariance_invariant_to_chunking(cuts, normalize, seed, masked):
    x = hidden_states(2, 60, 4, seed=seed, offset=50.0)
    mask = torch.arange(60) % 3 != 0 if masked else None
    one_shot = StreamingCovariance(2, 4, normalize=normalize)
    one_shot.update(x, mask=mask)
    chunked = StreamingCovariance(2, 4, normalize=normalize)
    bounds = [0, *sorted(set(cuts)), 60]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if mask is None or mask[lo:hi].any():
            chunked.update(x[:, lo:hi], mask=None if mask is None else mask[lo:hi])
    assert chunked.count == one_shot.count
    torch.testing.assert_close(chunked.covariance(), one_shot.covariance(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(chunked.mean(), one_shot.mean(), rtol=1e-10, atol=1e-12)


def test_merge_equals_concatenation_in_any_order():
    """Parts with offsets +1e4 and -1e4 get very different shifts; merging must reconcile them."""
    parts = [hidden_states(2, 30, 4, seed=s, offset=off) for s, off in ((4, 1e4), (5, -1e4), (6, 0.0))]
    full = torch.cat(parts, dim=1)
    expected = [np_population_cov(np_rows(full[a], "none")) for a in range(2)]
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        accs = []
        for i in order:
            acc = StreamingCovariance(2, 4, normalize="none")
            acc.update(parts[i])
            accs.append(acc)
        merged = StreamingCovariance(2, 4, normalize="none")  # empty: takes the first one's shift
        for acc in accs:
            assert merged.merge(acc) is merged
        merged.merge(StreamingCovariance(2, 4, normalize="none"))  # empty: no-op
        assert merged.count == 90
        for a in range(2):
            np.testing.assert_allclose(merged.covariance()[a].numpy(), expected[a], rtol=1e-9, atol=1e-9)


def test_state_dict_round_trip_then_continue():
    x = hidden_states(3, 50, 5, seed=7, offset=3.0)
    acc = StreamingCovariance(3, 5)
    acc.update(x[:, :20])
    buffer = io.BytesIO()
    torch.save(acc.state_dict(), buffer)
    restored = StreamingCovariance(3, 5)
    restored.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    for a in (acc, restored):
        a.update(x[:, 20:])
    assert restored.count == acc.count == 50
    torch.testing.assert_close(restored.covariance(), acc.covariance(), rtol=0, atol=0)
    torch.testing.assert_close(restored.entropy(), acc.entropy(), rtol=0, atol=0)


@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_entropy_equals_matrix_entropy_of_normalized_rows(alpha):
    x = hidden_states(2, 40, 7, seed=8, offset=1.0)
    acc = StreamingCovariance(2, 7, normalize="l2")
    acc.update(x)
    rows = torch.nn.functional.normalize(x.double(), dim=-1)
    expected = matrix_entropy(rows, alpha=alpha, normalize="center")
    torch.testing.assert_close(acc.entropy(alpha), expected, rtol=1e-10, atol=1e-12)


def test_triton_dispatch_matches_torch_path(monkeypatch):
    """ELSI_FAST_FORCE_TRITON routes CPU tensors through the kernel (interpreter) into fp64 sums."""
    x = hidden_states(2, 24, 8, seed=9, offset=5.0)
    mask = torch.arange(24) % 4 != 1
    reference = StreamingCovariance(2, 8)
    reference.update(x, mask=mask)
    monkeypatch.setenv("ELSI_FAST_FORCE_TRITON", "1")
    kernel = StreamingCovariance(2, 8)
    kernel.update(x, mask=mask)
    assert kernel.count == reference.count
    torch.testing.assert_close(kernel.covariance(), reference.covariance(), rtol=1e-5, atol=1e-6)


def _all_reduce_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    cov = StreamingCovariance(2, 4, normalize="none")
    hs = MinibatchHSIC(2)
    for part in _rank_parts(rank):
        cov.update(part)
        hs.update(part)
    cov.all_reduce()
    hs.all_reduce()
    torch.save({"cov": cov.state_dict(), "hsic": hs.state_dict()}, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def _rank_parts(rank: int) -> list[torch.Tensor]:
    """Rank 0: two batches near +1e4; rank 1: one batch near -1e4; rank 2: nothing."""
    return {0: [hidden_states(2, 25, 4, seed=10, offset=1e4), hidden_states(2, 9, 4, seed=11, offset=1e4)],
            1: [hidden_states(2, 30, 4, seed=12, offset=-1e4)], 2: []}[rank]


def test_all_reduce_over_gloo_equals_one_process(tmp_path):
    world_size = 3
    mp.spawn(_all_reduce_worker, args=(world_size, str(tmp_path / "init"), str(tmp_path)), nprocs=world_size)
    states = [torch.load(tmp_path / f"{r}.pt") for r in range(world_size)]
    cov = StreamingCovariance(2, 4, normalize="none")
    hs = MinibatchHSIC(2)
    for r in range(world_size):
        for part in _rank_parts(r):
            cov.update(part)
            hs.update(part)
    for state in states:
        for key, value in state["cov"].items():
            same = torch.equal(value, states[0]["cov"][key]) if torch.is_tensor(value) else value == states[0]["cov"][key]
            assert same, f"ranks disagree on {key}"
        reduced = StreamingCovariance(2, 4, normalize="none")
        reduced.load_state_dict(state["cov"])
        assert reduced.count == cov.count == 64
        torch.testing.assert_close(reduced.covariance(), cov.covariance(), rtol=1e-9, atol=1e-9)
        reduced_hsic = MinibatchHSIC(2)
        reduced_hsic.load_state_dict(state["hsic"])
        assert reduced_hsic.num_batches == 3
        torch.testing.assert_close(reduced_hsic.hsic(), hs.hsic(), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ MinibatchHSIC


def test_minibatch_hsic_single_batch_matches_song():
    x = [hidden_states(1, 12, d, seed=d, offset=1.0)[0] for d in (3, 5, 8)]  # different widths
    x[1] = x[1] + x[0] @ torch.ones(3, 5)
    mask = torch.arange(12) != 4
    acc = MinibatchHSIC(3, normalize="l2")
    acc.update(x, mask=mask)
    rows = [np_rows(h, "l2", mask) for h in x]
    grams = [r @ r.T for r in rows]
    expected = [[np_hsic_song(K, L) for L in grams] for K in grams]
    np.testing.assert_allclose(acc.hsic().numpy(), expected, rtol=1e-9, atol=1e-13)
    traces = [np.trace(np.cov(r.T, ddof=1)) for r in rows]
    np.testing.assert_allclose(acc.traces().numpy(), traces, rtol=1e-12)
    # Renyi-2 of a set = -log(HSIC(K_S, K_S) / tr^2) with K_S = sum of the set's Grams (bilinearity).
    k_set = grams[0] + grams[2]
    expected_h2 = -math.log(np_hsic_song(k_set, k_set) / (traces[0] + traces[2]) ** 2)
    assert acc.renyi2_entropy([0, 2]) == pytest.approx(expected_h2, rel=1e-10)


def test_minibatch_hsic_averages_batches_and_merges():
    batches = [hidden_states(3, n, 4, seed=n) for n in (8, 13, 20)]
    singles = []
    for b in batches:
        acc = MinibatchHSIC(3, normalize="none")
        acc.update(b)
        singles.append(acc)
    merged = MinibatchHSIC(3, normalize="none")
    for acc in reversed(singles):
        merged.merge(acc)
    sequential = MinibatchHSIC(3, normalize="none")
    for b in batches:
        sequential.update(b)
    assert merged.num_batches == sequential.num_batches == 3
    mean_hsic = sum(a.hsic() for a in singles) / 3
    torch.testing.assert_close(sequential.hsic(), mean_hsic, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(merged.hsic(), sequential.hsic(), rtol=1e-12, atol=1e-14)
    h = mean_hsic
    torch.testing.assert_close(sequential.cka(), h / torch.sqrt(h.diagonal()[:, None] * h.diagonal()[None, :]))
    restored = MinibatchHSIC(3, normalize="none")
    restored.load_state_dict(sequential.state_dict())
    torch.testing.assert_close(restored.cka(), sequential.cka(), rtol=0, atol=0)
    # The order of a set does not matter; the sums run in a different order, so equal to round-off
    # (one ulp apart on AMD Zen 4, bit-equal on Intel), never bit-for-bit.
    assert restored.renyi2_entropy([2, 0]) == pytest.approx(sequential.renyi2_entropy([0, 2]), rel=1e-12, abs=1e-14)


def test_renyi2_from_hsic_agrees_with_streaming_covariance():
    """Both estimate -log(tr C^2 / (tr C)^2) of the L2-normalized rows; 3200 tokens."""
    cov = StreamingCovariance(2, 6)
    hs = MinibatchHSIC(2)
    for seed in range(50):
        batch = hidden_states(2, 64, 6, seed=100 + seed, offset=1.5)
        cov.update(batch)
        hs.update(batch)
    h2_cov = cov.entropy(alpha=2.0)
    for a in range(2):
        assert hs.renyi2_entropy([a]) == pytest.approx(h2_cov[a].item(), abs=0.01)


def test_minibatch_with_fewer_than_4_tokens_is_skipped_with_warning():
    acc = MinibatchHSIC(2)
    acc.update(hidden_states(2, 10, 3, seed=1))
    before = acc.state_dict()
    with pytest.warns(RuntimeWarning, match="3 kept tokens"):
        acc.update(hidden_states(2, 10, 3, seed=2), mask=torch.arange(10) < 3)
    assert acc.num_batches == 1
    torch.testing.assert_close(acc.hsic(), before["hsic_sum"], rtol=0, atol=0)


def test_minibatch_hsic_triton_dispatch_matches_torch_path(monkeypatch):
    x = [hidden_states(1, 14, d, seed=d, offset=2.0)[0] for d in (4, 9)]
    mask = torch.arange(14) != 0
    reference = MinibatchHSIC(2)
    reference.update(x, mask=mask)
    monkeypatch.setenv("ELSI_FAST_FORCE_TRITON", "1")
    kernel = MinibatchHSIC(2)
    kernel.update(x, mask=mask)
    torch.testing.assert_close(kernel.hsic(), reference.hsic(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(kernel.traces(), reference.traces(), rtol=1e-5, atol=1e-6)


def test_cka_of_constant_layer_raises():
    x = hidden_states(2, 10, 3, seed=1)
    x[1] = 1.0
    acc = MinibatchHSIC(2)
    acc.update(x)
    with pytest.raises(ValueError, match="layer 1 has no variance"):
        acc.cka()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_cuda_accumulators_match_cpu_float64(dtype, rtol):
    """fp32 accumulators (Triton updates) on CUDA: 1e4 offsets, chunks, merge and read-back."""
    x = hidden_states(3, 3000, 96, seed=20, offset=1e4 if dtype == torch.float32 else 3.0, dtype=dtype)
    mask = torch.arange(3000) % 7 != 3
    cpu = StreamingCovariance(3, 96, normalize="none")
    cpu.update(x, mask=mask)
    halves = [StreamingCovariance(3, 96, normalize="none", device="cuda") for _ in range(2)]
    for acc, lo, hi in ((halves[0], 0, 1000), (halves[1], 1000, 3000)):
        for start in range(lo, hi, 250):
            acc.update(x[:, start : start + 250].cuda(), mask=mask[start : start + 250].cuda())
    gpu = halves[0].merge(halves[1])
    assert gpu.count == cpu.count and gpu.dtype == torch.float32
    ref = cpu.covariance()
    assert float((gpu.covariance().double().cpu() - ref).abs().max()) <= rtol * float(ref.abs().max())
    torch.testing.assert_close(gpu.entropy().cpu(), cpu.entropy(), rtol=rtol, atol=rtol)
    hs_cpu, hs_gpu = MinibatchHSIC(3), MinibatchHSIC(3, device="cuda")
    for start in range(0, 3000, 500):
        hs_cpu.update(x[:, start : start + 500])
        hs_gpu.update(x[:, start : start + 500].cuda())
    torch.testing.assert_close(hs_gpu.cka().double().cpu(), hs_cpu.cka(), rtol=rtol, atol=rtol)


# ------------------------------------------------------------------ bad input

_x = hidden_states(2, 10, 3, seed=0)
_nan = _x.clone()
_nan[1, 2, 0] = float("nan")


def _cov(**kw) -> StreamingCovariance:
    return StreamingCovariance(2, 3, **kw)


def _fed_cov() -> StreamingCovariance:
    acc = _cov()
    acc.update(_x)
    return acc


BAD_INPUTS = [
    (lambda: _cov().update(_x[0]), ValueError, "hidden must be 3-D"),
    (lambda: _cov().update(_x[:1]), ValueError, "hidden has 1 layers, expected num_layers=2"),
    (lambda: _cov().update(torch.zeros(2, 10, 4)), ValueError, r"hidden\[0\] has feature dim 4, expected dim=3"),
    (lambda: _cov().update([_x[0], _x[1, :9]]), ValueError, r"hidden\[1\] has 9 tokens"),
    (lambda: _cov().update(_x.int()), TypeError, "hidden must have dtype"),
    (lambda: _cov().update([_x[0], _x[1].double()]), ValueError, r"hidden\[1\] has dtype torch.float64"),
    (lambda: _cov().update(_nan), ValueError, "hidden contains NaN or Inf"),
    (lambda: _cov().update(_x, mask=torch.zeros(10, dtype=torch.bool)), ValueError, "mask is all False"),
    (lambda: _cov().update(_x, mask=torch.ones(10)), TypeError, "mask must have dtype torch.bool"),
    (lambda: _cov().update(_x, mask=torch.ones(9, dtype=torch.bool)), ValueError, r"mask must have shape \(10,\)"),
    (lambda: _cov().update("hidden"), TypeError, "hidden must be a"),
    (lambda: _cov().covariance(), ValueError, "no tokens yet"),
    (lambda: _cov(normalize="center").update(_x), ValueError, "normalize must be one of"),
    (lambda: StreamingCovariance(0, 3), ValueError, "num_layers must be >= 1"),
    (lambda: _fed_cov().merge(StreamingCovariance(3, 3)), ValueError, "other has num_layers=3"),
    (lambda: _fed_cov().merge(StreamingCovariance(2, 4)), ValueError, "other has dim=4"),
    (lambda: _fed_cov().merge(_cov(normalize="none")), ValueError, "other has normalize='none'"),
    (lambda: _fed_cov().merge(MinibatchHSIC(2)), TypeError, "other must be a StreamingCovariance"),
    (lambda: _cov().load_state_dict(StreamingCovariance(2, 4).state_dict()), ValueError, r"state_dict\['dim'\] is 4"),
    (lambda: _cov().load_state_dict({"num_layers": 2}), ValueError, "state_dict is missing keys"),
    (lambda: _fed_cov().entropy(alpha=-1), ValueError, "alpha must be > 0"),
    (lambda: MinibatchHSIC(2).update(_x, mask=torch.zeros(10, dtype=torch.bool)), ValueError, "mask is all False"),
    (lambda: MinibatchHSIC(2).update(_nan), ValueError, "hidden contains NaN"),
    (lambda: MinibatchHSIC(3).update(_x), ValueError, "hidden has 2 layers, expected num_layers=3"),
    (lambda: MinibatchHSIC(2).cka(), ValueError, "no minibatches yet"),
    (lambda: MinibatchHSIC(2).merge(MinibatchHSIC(3)), ValueError, "other has num_layers=3"),
    (lambda: MinibatchHSIC(2).merge(MinibatchHSIC(2, normalize="none")), ValueError, "other has normalize='none'"),
    (lambda: MinibatchHSIC(2).load_state_dict(MinibatchHSIC(3).state_dict()), ValueError, r"state_dict\['num_layers'\] is 3"),
    (lambda: MinibatchHSIC(2).renyi2_entropy([0, 2]), ValueError, r"layers must hold indices in \[0, 2\)"),
    (lambda: MinibatchHSIC(2).renyi2_entropy([1, 1]), ValueError, "layers has repeated indices"),
    (lambda: MinibatchHSIC(2).renyi2_entropy([]), ValueError, "layers is empty"),
]


@pytest.mark.parametrize("call,error,message", BAD_INPUTS, ids=[m for _, _, m in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(call, error, message):
    with pytest.raises(error, match=message):
        call()
