"""The fused native draft decode step against an independent float64 reference of docs/method.md section 5,
and against Eagle3Draft's own torch path."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from elsi_fast.draft import Eagle3Config, Eagle3Draft, native
from elsi_fast.draft.quant import dequantize_int8, fake_quantize_activation, quantize_int8

from .random_draft import randomize_draft_

requires_native = pytest.mark.skipif(
    not native.available("cpu"),
    reason=f"native extension not built ({native.describe('cpu')}); build with "
           "`ELSI_FAST_SKIP_CUDA=1 python setup.py build_ext --inplace`",
)



# ----------------------------------------------------------------------------- float64 reference
@dataclass
class Shape:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    target_hidden: int
    num_aux: int


def reference_decode(params: dict[str, torch.Tensor], shape: Shape, rope_theta: float, eps: float,
                     steps: list[tuple[torch.Tensor, int, bool]], dtype: torch.dtype = torch.float64,
                     product_input=None):
    """docs/method.md section 5 written out directly, one token at a time with a growing KV cache.

    params: state-dict names (plus "embed"); steps: (input, token, from_target) with input [m*d_t]
    or [d]. Computes in `dtype` (float64: the reference; bfloat16: torch's own bf16 computation).
    product_input: applied to the input vector of every weight product (models the int8 path's
    activation quantization). Returns per step (draft-vocab logits [V_d] float64, hidden_out [d] float64).
    """
    p = {k: v.to(dtype) for k, v in params.items()}

    def mv(name, x):
        return p[name] @ (product_input(x) if product_input is not None else x)

    hd, half = shape.head_dim, shape.head_dim // 2
    group = shape.heads // shape.kv_heads
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)

    def rms(x, w):
        x64 = x.double()
        return (w.double() * x64 / torch.sqrt((x64 * x64).mean() + eps)).to(dtype)

    def rope(x, pos):  # x [heads, hd], rotate-half
        cos, sin = torch.cos(pos * inv_freq).to(dtype), torch.sin(pos * inv_freq).to(dtype)
        x1, x2 = x[:, :half], x[:, half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    keys, values, out = [], [], []
    for pos, (x_in, token, from_target) in enumerate(steps):
        x_in = x_in.to(dtype)
        h = mv("fc.weight", x_in) if from_target else x_in
        x = torch.cat([rms(p["embed"][token], p["midlayer.input_layernorm.weight"]),
                       rms(h, p["midlayer.hidden_norm.weight"])])
        q = mv("midlayer.self_attn.q_proj.weight", x).view(shape.heads, hd)
        k = mv("midlayer.self_attn.k_proj.weight", x).view(shape.kv_heads, hd)
        v = mv("midlayer.self_attn.v_proj.weight", x).view(shape.kv_heads, hd)
        keys.append(rope(k, pos))
        values.append(v)
        q = rope(q, pos)
        K, V = torch.stack(keys), torch.stack(values)  # [T, kv, hd]
        heads = []
        for head in range(shape.heads):
            scores = (K[:, head // group].double() @ q[head].double()) / math.sqrt(hd)
            heads.append((torch.softmax(scores, 0) @ V[:, head // group].double()).to(dtype))
        h1 = h + mv("midlayer.self_attn.o_proj.weight", torch.cat(heads))
        y = rms(h1, p["midlayer.post_attention_layernorm.weight"])
        gate = mv("midlayer.mlp.gate_proj.weight", y)
        act = gate * torch.sigmoid(gate) * mv("midlayer.mlp.up_proj.weight", y)
        h2 = h1 + mv("midlayer.mlp.down_proj.weight", act)
        logits = mv("lm_head.weight", rms(h2, p["norm.weight"]))
        out.append((logits.double(), h2.double()))
    return out


SHAPES = {
    # odd d (not a multiple of 8 or 16), head_dim 8, GQA 3:1
    "odd": Shape(hidden=37, heads=6, kv_heads=2, head_dim=8, intermediate=53, vocab=211, draft_vocab=97,
                 target_hidden=29, num_aux=1),
    # head_dim 64, MHA, three aux layers
    "mha_m3": Shape(hidden=64, heads=2, kv_heads=2, head_dim=64, intermediate=96, vocab=150, draft_vocab=150,
                    target_hidden=40, num_aux=3),
    # GQA 4:1 with d a multiple of 16
    "gqa": Shape(hidden=48, heads=4, kv_heads=1, head_dim=12, intermediate=80, vocab=300, draft_vocab=64,
                 target_hidden=48, num_aux=1),
    # head_dim 6: a KV group's q/k/v rows start inside a packed row group (PACK_ROWS = 4)
    "ragged": Shape(hidden=20, heads=2, kv_heads=2, head_dim=6, intermediate=30, vocab=50, draft_vocab=30,
                    target_hidden=20, num_aux=1),
    # products wider than one activation block of the int8 path (256), with ragged last blocks
    "wide": Shape(hidden=144, heads=4, kv_heads=2, head_dim=40, intermediate=600, vocab=260, draft_vocab=90,
                  target_hidden=200, num_aux=2),
}


def make_draft(shape: Shape, seed: int = 0, rope_theta: float = 500.0, eps: float = 1e-5) -> Eagle3Draft:
    """A random Eagle3Draft with non-trivial norms and an invertible, non-identity d2t."""
    gen = torch.Generator().manual_seed(seed)
    config = Eagle3Config(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, vocab_size=shape.vocab,
        draft_vocab_size=shape.draft_vocab, target_hidden_size=shape.target_hidden, rms_norm_eps=eps,
        rope_theta=rope_theta, aux_layer_ids=tuple(range(1, shape.num_aux + 1)),
    )
    return randomize_draft_(Eagle3Draft(config, torch.randn(shape.vocab, shape.hidden, generator=gen)), gen)


def reference_params(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    params = {name: p.detach().double() for name, p in draft.named_parameters()}
    params["embed"] = draft.embed_tokens.weight.double()
    return params


def make_steps(draft: Eagle3Draft, n: int, seed: int = 1) -> list[tuple[torch.Tensor, int, bool]]:
    """Inputs for n steps: target features every third step, fed-back-sized hiddens otherwise."""
    gen = torch.Generator().manual_seed(seed)
    cfg = draft.config
    steps = []
    for i in range(n):
        from_target = i % 3 == 0
        width = cfg.fc_in_features if from_target else cfg.hidden_size
        steps.append((torch.randn(width, generator=gen), int(torch.randint(cfg.vocab_size, (1,), generator=gen)),
                      from_target))
    return steps


def target_to_draft(draft: Eagle3Draft, target_ids: torch.Tensor) -> torch.Tensor:
    targets = torch.arange(draft.config.draft_vocab_size) + draft.d2t
    return torch.searchsorted(targets, target_ids)


def assert_top_k(draft: Eagle3Draft, target_ids: torch.Tensor, ref_logits: torch.Tensor, tie_tol: float) -> None:
    """Native ids are the reference's top-k, in order; ranks whose logits tie within tie_tol may swap."""
    k = target_ids.numel()
    ref_ids = ref_logits.topk(k).indices
    draft_ids = target_to_draft(draft, target_ids)
    assert torch.equal(draft_ids + draft.d2t[draft_ids], target_ids), "ids are not d2t images of draft ids"
    for rank in range(k):
        if draft_ids[rank] != ref_ids[rank]:
            gap = abs(float(ref_logits[draft_ids[rank]] - ref_logits[ref_ids[rank]]))
            assert gap <= tie_tol, f"rank {rank}: native id {int(draft_ids[rank])} vs reference {int(ref_ids[rank])}"


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.double() - ref).abs().max() / ref.abs().max())


def run_decoder(decoder: native.NativeDraftDecoder, steps, top_k: int):
    return [decoder.step(x, token, from_target, top_k) for x, token, from_target in steps]


# ----------------------------------------------------------------------------- accuracy
@requires_native
@pytest.mark.parametrize("shape_name", sorted(SHAPES))
def test_fp32_matches_float64_reference(shape_name, cpu_isa):
    shape = SHAPES[shape_name]
    draft = make_draft(shape)
    steps = make_steps(draft, 13)
    ref = reference_decode(reference_params(draft), shape, 500.0, 1e-5, steps)
    decoder = native.NativeDraftDecoder(draft, "fp32", max_len=16)
    # Teacher-forced: both sides get the same inputs, so errors cannot compound across steps.
    for (ids, hidden), (logits, ref_hidden) in zip(run_decoder(decoder, steps, top_k=3), ref):
        assert hidden.dtype == torch.float32 and hidden.shape == (shape.hidden,)
        assert rel_err(hidden, ref_hidden) < 1e-5
        assert_top_k(draft, ids, logits, tie_tol=1e-4)
    assert decoder.length == len(steps)


@requires_native
def test_bf16_error_within_twice_torch_bf16(cpu_isa):
    shape = SHAPES["odd"]
    draft = make_draft(shape, seed=3)
    steps = make_steps(draft, 9, seed=4)
    params = reference_params(draft)
    ref = reference_decode(params, shape, 500.0, 1e-5, steps)
    torch_bf16 = reference_decode(params, shape, 500.0, 1e-5, steps, dtype=torch.bfloat16)
    # native: bf16 weights times bf16-rounded product inputs, everything else fp32
    decoder = native.NativeDraftDecoder(draft, "bf16", max_len=9)
    native_out = run_decoder(decoder, steps, top_k=1)
    native_err = max(rel_err(h, r) for (_, h), (_, r) in zip(native_out, ref))
    torch_err = max(rel_err(h, r) for (_, h), (_, r) in zip(torch_bf16, ref))
    assert 0 < native_err <= 2 * torch_err


@requires_native
@pytest.mark.parametrize("shape_name", ["gqa", "ragged", "wide"])
def test_int8_matches_dequantized_reference(shape_name, cpu_isa):
    """Int8 weights times int16-quantized product inputs (quant.py), modeled in float64."""
    shape = SHAPES[shape_name]
    draft = make_draft(shape, seed=5)
    steps = make_steps(draft, 10, seed=6)
    params = reference_params(draft)
    for name in native.MATRIX_NAMES:
        params[name] = dequantize_int8(*quantize_int8(params[name].float()), dtype=torch.float64)
    ref = reference_decode(params, shape, 500.0, 1e-5, steps, product_input=fake_quantize_activation)
    decoder = native.NativeDraftDecoder(draft, "int8", max_len=10)
    for (ids, hidden), (logits, ref_hidden) in zip(run_decoder(decoder, steps, top_k=4), ref):
        # fp32 noise can flip an int16 rounding near a half step; one step (2^-15 of its block's
        # largest magnitude) moves the output by ~3e-5, the int8 weight rounding by ~1e-2
        assert rel_err(hidden, ref_hidden) < 1e-4
        assert_top_k(draft, ids, logits, tie_tol=1e-3)


@requires_native
def test_top_k_and_d2t_exact_with_separated_logits():
    """lm_head rows built so logits are far apart: the whole ranking and its d2t images are exact."""
    shape = SHAPES["odd"]
    draft = make_draft(shape, seed=7)
    steps = make_steps(draft, 1, seed=8)
    with torch.no_grad():
        # every row is a multiple of one direction: logit_i = c_i * s with distinct, spread c_i
        direction = torch.randn(shape.hidden)
        coef = torch.randperm(shape.draft_vocab).float() - shape.draft_vocab / 2
        draft.lm_head.weight.copy_(coef[:, None] * direction[None, :] / direction.norm())
    ids, _ = native.NativeDraftDecoder(draft, "fp32", max_len=1).step(*steps[0][:2], True, top_k=shape.draft_vocab)
    logits, _ = reference_decode(reference_params(draft), shape, 500.0, 1e-5, steps)[0]
    expected = logits.argsort(descending=True)
    assert torch.equal(ids, expected + draft.d2t[expected])


# ----------------------------------------------------------------------------- against Eagle3Draft
@requires_native
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "row-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_matches_torch_path_over_growing_cache(dtype, packed):
    """NativeDraftDecoder in the module's own precision, packed or row-major (the module's layout,
    and the CUDA kernel's), against Eagle3Draft.decode_step, each feeding back its own hidden."""
    shape = SHAPES["gqa"]
    draft = make_draft(shape, seed=9).to(dtype)
    n_steps = 12
    gen = torch.Generator().manual_seed(10)
    aux = torch.randn(1, 1, draft.config.fc_in_features, generator=gen).to(dtype)
    tokens = torch.randint(shape.vocab, (n_steps, 1, 1), generator=gen)
    cache = draft.new_cache(n_steps)
    decoder = native.NativeDraftDecoder(draft, "fp32" if dtype == torch.float32 else "bf16", n_steps, packed=packed)
    hidden, ref_hidden = aux, aux
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for i in range(n_steps):
        ids, hidden = decoder.step(hidden, tokens[i], from_target=i == 0, top_k=2)
        ref_ids, ref_hidden = draft.decode_step(ref_hidden, tokens[i], cache, from_target=i == 0, top_k=2)
        assert hidden.dtype == dtype and hidden.shape == (shape.hidden,)
        assert rel_err(hidden.float(), ref_hidden.flatten().double()) < tol
        if dtype == torch.float32:
            assert torch.equal(ids, ref_ids[0])
        assert decoder.length == cache.length == i + 1
    assert rel_err(decoder._k_cache.float(), cache.key[0].double()) < tol


@requires_native
@pytest.mark.parametrize("weight_dtype", ["fp32", "int8"])
def test_result_is_independent_of_thread_count(weight_dtype):
    """Every output row is one thread's dot product: 1, 2 or 3 threads (more than this CI's cores,
    so team members get preempted at the barriers) give bitwise equal results."""
    draft = make_draft(SHAPES["wide"], seed=15)
    steps = make_steps(draft, 4, seed=16)
    previous = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results[threads] = run_decoder(native.NativeDraftDecoder(draft, weight_dtype, max_len=4, threads=threads),
                                           steps, top_k=5)
    finally:
        torch.set_num_threads(previous)
    for threads in (2, 3):
        for (ids, hidden), (ref_ids, ref_hidden) in zip(results[threads], results[1]):
            assert torch.equal(ids, ref_ids) and torch.equal(hidden, ref_hidden)


@requires_native
@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("shape_name", ["gqa", "ragged", "mha_m3"])
def test_cached_positions_hold_the_steps_bits(shape_name, weight_dtype, cpu_isa):
    """A run of accepted positions cached with cache_position (key and value only) and then one
    step from its last position leaves the cache and the outputs that a step at every position
    leaves, bit for bit, and the draft-fed steps after it agree too."""
    draft = make_draft(SHAPES[shape_name], seed=7)
    gen = torch.Generator().manual_seed(8)
    run = [(torch.randn(draft.config.fc_in_features, generator=gen), int(torch.randint(50, (1,), generator=gen)))
           for _ in range(4)]
    prefix = make_steps(draft, 4, seed=9)
    stepped, cached = (native.NativeDraftDecoder(draft, weight_dtype, max_len=12) for _ in range(2))
    for decoder in (stepped, cached):
        run_decoder(decoder, prefix, top_k=2)
    for x, token in run:
        want = stepped.step(x, token, from_target=True, top_k=3)
    for x, token in run[:-1]:
        assert cached.cache_position(x, token) is None
    got = cached.step(*run[-1], from_target=True, top_k=3)
    assert cached.length == stepped.length == 8
    assert torch.equal(cached._k_cache, stepped._k_cache) and torch.equal(cached._v_cache, stepped._v_cache)
    for (ids, hidden), (ref_ids, ref_hidden) in [(got, want)] + list(zip(
            run_decoder(cached, [(got[1], int(got[0][0]), False)] * 3, top_k=2),
            run_decoder(stepped, [(want[1], int(want[0][0]), False)] * 3, top_k=2))):
        assert torch.equal(ids, ref_ids) and torch.equal(hidden, ref_hidden)


@requires_native
def test_cache_only_op_writes_a_bf16_cache_as_a_step_does(cpu_isa):
    """The op's cache-only form (top_k 0) on bf16 caches: the slot a whole step writes, and no
    hidden state back."""
    draft = make_draft(SHAPES["gqa"], seed=17)
    decoder = native.NativeDraftDecoder(draft, "int8", max_len=3)
    x = torch.randn(draft.config.fc_in_features)
    decoder._position.fill_(1)
    caches = {}
    for top_k in (1, 0):
        k_cache, v_cache = (torch.zeros_like(decoder._k_cache, dtype=torch.bfloat16) for _ in range(2))
        args = op_args(decoder, x)
        args[3], args[4], args[-1] = k_cache, v_cache, top_k
        ids, hidden = native._op()(*args)
        assert ids.shape == (top_k,) and hidden.shape == ((draft.config.hidden_size,) if top_k else (0,))
        caches[top_k] = (k_cache, v_cache)
    assert caches[1][0][:, 1].abs().sum() > 0
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@requires_native
def test_decoder_matches_module_in_free_running_decode():
    """NativeDraftDecoder fp32 generates the same tokens as the module over many fed-back steps."""
    draft = make_draft(SHAPES["mha_m3"], seed=11)
    gen = torch.Generator().manual_seed(12)
    aux = torch.randn(1, 1, draft.config.fc_in_features, generator=gen)
    cache = draft.new_cache(20)
    decoder = native.NativeDraftDecoder(draft, "fp32", max_len=20)
    ref_ids, ref_hidden = draft.decode_step(aux, torch.tensor([[3]]), cache, from_target=True)
    ids, hidden = decoder.step(aux, 3, from_target=True)
    for _ in range(19):
        assert torch.equal(ids, ref_ids[0])
        assert rel_err(hidden, ref_hidden.flatten().double()) < 1e-5
        ref_ids, ref_hidden = draft.decode_step(ref_hidden, ref_ids, cache, from_target=False)
        ids, hidden = decoder.step(hidden, ids, from_target=False)
    decoder.truncate(5)
    assert decoder.length == 5
    decoder.reset()
    assert decoder.length == 0


# ----------------------------------------------------------------------------- bad inputs
def op_args(decoder: native.NativeDraftDecoder, x: torch.Tensor, from_target: bool = True):
    return [x, decoder._token, decoder._position, decoder._k_cache, decoder._v_cache, decoder._embed,
            list(decoder._weights), list(decoder._scales), decoder._norms, decoder._inv_freq, decoder._d2t,
            from_target, decoder.config.num_attention_heads, decoder.config.fc_in_features,
            decoder.config.intermediate_size, decoder.config.rms_norm_eps, 1]


@pytest.fixture
def small():
    draft = make_draft(SHAPES["odd"], seed=13)
    return draft, native.NativeDraftDecoder(draft, "fp32", max_len=2)


@requires_native
def test_cache_overflow_raises(small):
    draft, decoder = small
    aux = torch.randn(draft.config.fc_in_features)
    decoder.step(aux, 1, True)
    decoder.step(aux, 1, True)
    with pytest.raises(ValueError, match="KV cache overflow"):
        decoder.step(aux, 1, True)
    decoder._position.fill_(2)  # the op itself refuses too
    with pytest.raises(ValueError, match="KV cache overflow"):
        native._op()(*op_args(decoder, aux))
    cache = draft.new_cache(1)
    draft.decode_step(aux.view(1, 1, -1), torch.tensor([[1]]), cache, from_target=True)
    with pytest.raises(ValueError, match="overflow"):
        draft.decode_step(aux.view(1, 1, -1), torch.tensor([[1]]), cache, from_target=True)


@requires_native
def test_fc_width_mismatch_raises(small):
    draft, decoder = small
    with pytest.raises(ValueError, match="m \\* target_hidden_size"):
        decoder.step(torch.randn(draft.config.fc_in_features + 1), 1, True)
    with pytest.raises(ValueError, match="fc input width"):
        native._op()(*op_args(decoder, torch.randn(draft.config.fc_in_features + 1)))
    d, width = draft.config.hidden_size, draft.config.fc_in_features
    args = op_args(decoder, torch.randn(width))
    args[6][0] = native.pack_matrix(torch.randn(d, width + native.PACK_ROW_BYTES))
    with pytest.raises(ValueError, match="fc \\(packed\\) must have shape"):
        native._op()(*args)
    # row-major weights (the module's own) are checked against the same widths
    args[6] = [draft.get_parameter(name).detach() for name in native.MATRIX_NAMES]
    native._op()(*args)
    args[6][0] = torch.randn(d, width + 2)
    with pytest.raises(ValueError, match="fc must have shape"):
        native._op()(*args)
    args[6][0] = native.pack_matrix(draft.fc.weight)
    with pytest.raises(ValueError, match="q_proj must be 4-D"):
        native._op()(*args)


@requires_native
@pytest.mark.parametrize("weight_dtype", ["fp32", "int8"])
def test_step_read_bytes_counts_weights_scales_and_cache(weight_dtype):
    draft = make_draft(SHAPES["wide"], seed=17)
    cfg = draft.config
    decoder = native.NativeDraftDecoder(draft, weight_dtype, max_len=8)
    itemsize = {"fp32": 4, "int8": 1}[weight_dtype]
    padded = sum(math.ceil(w.shape[0] / native.PACK_ROWS) * native.PACK_ROWS
                 * math.ceil(w.shape[1] * itemsize / native.PACK_ROW_BYTES) * native.PACK_ROW_BYTES
                 for w in (draft.get_parameter(name) for name in native.MATRIX_NAMES))
    scales = sum(draft.get_parameter(name).shape[0] * 4 for name in native.MATRIX_NAMES) if itemsize == 1 else 0
    assert decoder.weight_bytes == padded + scales
    per_position = 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert decoder.step_read_bytes(True, 5) - decoder.step_read_bytes(True, 4) == per_position
    fc = decoder._weights[0].numel() * itemsize + (cfg.hidden_size * 4 if itemsize == 1 else 0)
    wider_input = (cfg.fc_in_features - cfg.hidden_size) * 4
    assert decoder.step_read_bytes(True, 3) - decoder.step_read_bytes(False, 3) == fc + wider_input
    assert decoder.step_read_bytes(True, 3) > decoder.weight_bytes + 4 * per_position


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pack_matrix_layout(dtype):
    """Element [g, t, j, c] of the packed matrix is w[g * R + j, t * C + c] with C columns filling one
    PACK_ROW_BYTES line; padding is zero."""
    cols_per_tile = native.PACK_ROW_BYTES // torch.empty(0, dtype=dtype).element_size()
    rows, cols = 2 * native.PACK_ROWS + 1, cols_per_tile + 5
    w = (torch.arange(rows * cols).view(rows, cols) % 101 + 1).to(dtype)
    packed = native.pack_matrix(w)
    assert packed.shape == (3, 2, native.PACK_ROWS, cols_per_tile) and packed.dtype == dtype
    assert packed.is_contiguous()
    g, t, j, c = torch.meshgrid(*[torch.arange(n) for n in packed.shape], indexing="ij")
    r, k = g * native.PACK_ROWS + j, t * cols_per_tile + c
    inside = (r < rows) & (k < cols)
    assert torch.equal(packed[inside], w[r[inside], k[inside]])
    assert not packed[~inside].any()
    with pytest.raises(ValueError, match="2-D"):
        native.pack_matrix(w[0])


@requires_native
def test_dtype_and_device_mismatches_raise(small):
    draft, decoder = small
    aux = torch.randn(draft.config.fc_in_features)
    with pytest.raises(TypeError, match="input must be"):
        native._op()(*op_args(decoder, aux.double()))
    args = op_args(decoder, aux)
    args[6][2] = args[6][2].bfloat16()
    with pytest.raises(TypeError, match="k_proj must be"):
        native._op()(*args)
    args = op_args(decoder, aux)
    args[6] = [native.pack_matrix(draft.get_parameter(name).detach().to(torch.int8)) for name in native.MATRIX_NAMES]
    with pytest.raises(ValueError, match="int8 weights need"):
        native._op()(*args)
    args[6] = [draft.get_parameter(name).detach().to(torch.int8) for name in native.MATRIX_NAMES]
    with pytest.raises(TypeError, match="int8 weights must be packed"):
        native._op()(*args)
    args = op_args(decoder, aux)
    args[3] = args[3].bfloat16()
    with pytest.raises(TypeError, match="v_cache must be"):
        native._op()(*args)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        decoder.step(aux.half(), 1, True)
    with pytest.raises(ValueError, match="is on meta"):
        decoder.step(aux.to("meta"), 1, True)
    with pytest.raises(ValueError, match="outside the embedding"):
        decoder.step(aux, draft.config.vocab_size, True)
    with pytest.raises(ValueError, match="weight_dtype"):
        native.NativeDraftDecoder(draft, "fp8")
    with pytest.raises(ValueError, match="int8 weights are always packed"):
        native.NativeDraftDecoder(draft, "int8", packed=False)


# ----------------------------------------------------------------------------- dispatch, tracing, build
@requires_native
def test_describe_and_isa_switch():
    from elsi_fast import _C

    assert native.describe("cpu") == f"native cpu ({_C.cpu_isa()}, {torch.get_num_threads()} threads)"
    assert not _C.set_cpu_isa("sse9")
    assert _C.set_cpu_isa("scalar") and _C.cpu_isa() == "scalar"
    assert _C.set_cpu_isa("avx512") or _C.set_cpu_isa("avx2") or _C.cpu_isa() == "scalar"


@requires_native
def test_op_traces_with_fake_tensors_and_compile(small):
    draft, decoder = small
    aux = torch.randn(draft.config.fc_in_features)
    args = op_args(decoder, aux)
    args[-1] = 3
    torch.library.opcheck(torch.ops.elsi_fast.draft_decode_step.default, args,
                          test_utils=("test_schema", "test_faketensor"))

    def step(x):
        ids, hidden = native._op()(*op_args(decoder, x))
        return ids, hidden * 2

    decoder._position.fill_(0)
    eager_ids, eager_hidden = step(aux)
    decoder._position.fill_(0)
    compiled_ids, compiled_hidden = torch.compile(step, backend="eager", fullgraph=True)(aux)
    assert torch.equal(compiled_ids, eager_ids) and torch.equal(compiled_hidden, eager_hidden)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_source_compiles_with_nvcc(tmp_path):
    """Syntax check of the CUDA kernels for sm_90, with the flags torch's CUDAExtension adds."""
    import os

    csrc = os.path.join(os.path.dirname(__file__), "..", "..", "csrc")
    cmd = ["nvcc", "-c", "-arch=sm_90", "-std=c++17", "-O1", f"-I{csrc}", "-DELSI_FAST_WITH_CUDA",
           "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
           os.path.join(csrc, "draft_decode_cuda.cu"), "-o", str(tmp_path / "draft_decode_cuda.o")]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.skip("nvcc took over 60 s")
    assert result.returncode == 0, result.stderr[-3000:]


@requires_native
@pytest.mark.gpu
def test_cuda_matches_torch_bf16_path():
    if not native.available("cuda"):
        pytest.skip(f"no CUDA build: {native.describe('cuda')}")
    shape = SHAPES["gqa"]
    draft = make_draft(shape, seed=14)
    steps = make_steps(draft, 10, seed=15)
    ref = reference_decode(reference_params(draft), shape, 500.0, 1e-5, steps)
    torch_bf16 = reference_decode(reference_params(draft), shape, 500.0, 1e-5, steps, dtype=torch.bfloat16)
    decoder = native.NativeDraftDecoder(draft.cuda(), "bf16", max_len=10)
    out = [decoder.step(x.cuda(), t, f, 2) for x, t, f in steps]
    native_err = max(rel_err(h.cpu(), r) for (_, h), (_, r) in zip(out, ref))
    torch_err = max(rel_err(h, r) for (_, h), (_, r) in zip(torch_bf16, ref))
    assert native_err <= 2 * torch_err
    for (ids, _), (logits, _) in zip(out, ref):
        assert_top_k(draft.cpu(), ids.cpu(), logits, tie_tol=0.1)


@requires_native
@pytest.mark.gpu
def test_cuda_decoder_on_bf16_module_and_graph_replay():
    """NativeDraftDecoder on a bf16 CUDA module against the module's torch decode_step, and one
    step captured in a CUDA graph replaying exactly what the launched op computes."""
    if not native.available("cuda"):
        pytest.skip(f"no CUDA build: {native.describe('cuda')}")
    draft = make_draft(SHAPES["mha_m3"], seed=16).to("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(17)
    aux = torch.randn(1, 1, draft.config.fc_in_features, generator=gen).to("cuda", torch.bfloat16)
    tokens = torch.randint(draft.config.vocab_size, (6, 1, 1), generator=gen).cuda()
    cache = draft.new_cache(6)
    decoder = native.NativeDraftDecoder(draft, "bf16", max_len=6)
    hidden, ref_hidden = aux, aux
    for i in range(6):
        _, hidden = decoder.step(hidden, tokens[i], from_target=i == 0)
        _, ref_hidden = draft.decode_step(ref_hidden, tokens[i], cache, from_target=i == 0)
        assert rel_err(hidden.float().cpu(), ref_hidden.flatten().double().cpu()) < 3e-2

    decoder = native.NativeDraftDecoder(draft, "bf16", max_len=4)
    x = torch.randn(draft.config.fc_in_features, device="cuda")
    eager_ids, eager_hidden = decoder.step(x, 5, from_target=True, top_k=3)
    decoder.reset()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture, as CUDA graphs require
        decoder.step(x, 5, from_target=True, top_k=3)
    torch.cuda.current_stream().wait_stream(stream)
    decoder.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_ids, graph_hidden = decoder.step(x, 5, from_target=True, top_k=3)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_ids, eager_ids) and torch.equal(graph_hidden, eager_hidden)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@requires_native
@pytest.mark.parametrize("weight_dtype", ["fp32", "int8"])
def test_prefill_caches_what_single_steps_cache(weight_dtype):
    """NativeDraftDecoder.prefill (one torch extend of the source module) leaves the decoder in the
    state T target-fed fused steps leave it in: same last output, and the next fed-back steps
    match. The keys/values come from the module's fp32 weights, so an int8 decoder's prefill
    differs from its own steps by the weight rounding only."""
    draft = make_draft(SHAPES["gqa"], seed=21)
    gen = torch.Generator().manual_seed(22)
    count = 11
    aux = torch.randn(1, count, draft.config.fc_in_features, generator=gen)
    ids = torch.randint(draft.config.vocab_size, (1, count), generator=gen)
    looped = native.NativeDraftDecoder(draft, weight_dtype, max_len=count + 4)
    for t in range(count):
        loop_ids, loop_hidden = looped.step(aux[0, t], int(ids[0, t]), from_target=True)
    prefilled = native.NativeDraftDecoder(draft, weight_dtype, max_len=count + 4)
    top, hidden = prefilled.prefill(aux, ids)
    assert prefilled.length == looped.length == count
    tol = 1e-5 if weight_dtype == "fp32" else 5e-2
    assert rel_err(hidden, loop_hidden.double()) < tol
    assert rel_err(prefilled._k_cache[:, :count], looped._k_cache[:, :count].double()) < tol
    assert rel_err(prefilled._v_cache[:, :count], looped._v_cache[:, :count].double()) < tol
    # the module's own torch extend, the independent reference for the prefill's output
    with torch.no_grad():
        logits, ref_hidden = draft.extend(aux, ids, draft.new_cache(count))
    assert rel_err(hidden, ref_hidden[0, -1].double()) < 1e-6
    assert int(top[0]) == int(draft.draft_to_target(logits[0, -1].argmax()))
    for _ in range(3):
        token = int(top[0])
        top, hidden = prefilled.step(hidden, token, from_target=False)
        loop_ids, loop_hidden = looped.step(loop_hidden, token, from_target=False)
        assert rel_err(hidden, loop_hidden.double()) < tol


@requires_native
def test_prefill_bad_inputs():
    draft = make_draft(SHAPES["gqa"], seed=23)
    decoder = native.NativeDraftDecoder(draft, "fp32", max_len=4)
    aux = torch.zeros(1, 5, draft.config.fc_in_features)
    with pytest.raises(ValueError, match="max_len=4"):
        decoder.prefill(aux, torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"aux must be \[1, T, m \* d_t\]"):
        decoder.prefill(aux[0], torch.zeros(1, 5, dtype=torch.long))
    assert decoder.length == 0
