"""The target runtime: its ops against float64 references, the bitwise row independence that makes a
verify forward equal one-token forwards, and tiny transformers models on it (speculative decoding
equals the runtime's own greedy decoding)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from elsi_fast.decoding.speculative import cache_kwarg, greedy_generate, speculative_generate
from elsi_fast.draft import Eagle3Config, Eagle3Draft
from elsi_fast.draft.quant import dequantize_int8, quantize_int8
from elsi_fast.targets import target_runtime as rt

pytestmark = pytest.mark.skipif(not rt.available(), reason="native extension not built")

WEIGHT_DTYPES = ("fp32", "bf16", "int8")
# (out, in): widths that are no multiple of any tile (16 fp32, 32 bf16, 64 int8 columns) or of the
# 4-row groups, one wider than a segment (16 tiles), and one output row.
SHAPES = [(37, 53), (5, 1000), (130, 70), (1, 17)]


def reference_weight(weight: torch.Tensor, weight_dtype: str) -> torch.Tensor:
    """The matrix the op multiplies by, in float64: the weight rounded to the packed precision."""
    if weight_dtype == "int8":
        return dequantize_int8(*quantize_int8(weight), dtype=torch.float64)
    return weight.to(rt.TORCH_WEIGHT_DTYPES[weight_dtype]).double()


# ----------------------------------------------------------------------------- small_linear
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_linear_matches_float64(shape, weight_dtype, cpu_isa):
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(out_features * in_features)
    weight = torch.randn(shape, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    packed, scale = rt.pack_weight(weight, weight_dtype)
    ref_weight = reference_weight(weight, weight_dtype)
    for rows in range(1, rt.MAX_ROWS + 1):
        x = torch.randn(rows, in_features, generator=gen)
        y = rt.small_linear(x, packed, scale, bias, out_features, num_threads=2)
        ref = x.double() @ ref_weight.T + bias.double()
        assert y.dtype == torch.float32 and y.shape == (rows, out_features)
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < 2e-6, rows


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_linear_rows_are_bitwise_independent(weight_dtype, cpu_isa):
    """Row r of a call equals the 1-row call on it, whatever the number of rows, the other rows and
    the thread count."""
    out_features, in_features = 301, 1100  # several chunks and segments
    gen = torch.Generator().manual_seed(7)
    packed, scale = rt.pack_weight(torch.randn(out_features, in_features, generator=gen), weight_dtype)
    row = torch.randn(1, in_features, generator=gen)
    alone = rt.small_linear(row, packed, scale, None, out_features, num_threads=1)
    for rows in range(1, rt.MAX_ROWS + 1):
        for threads in (1, 2):
            others = torch.randn(rows, in_features, generator=gen) * 10
            x = torch.cat([others[: rows // 2], row, others[rows // 2: rows - 1]])
            y = rt.small_linear(x, packed, scale, None, out_features, num_threads=threads)
            assert torch.equal(y[rows // 2], alone[0]), (rows, threads)


def test_linear_bf16_activations():
    weight = torch.randn(40, 90)
    packed, _ = rt.pack_weight(weight, "fp32")
    x = torch.randn(3, 90).bfloat16()
    y = rt.small_linear(x, packed, None, None, 40)
    assert y.dtype == torch.bfloat16  # fp32 products, the result rounded once
    torch.testing.assert_close(y, (x.double() @ weight.double().T).bfloat16())


def test_linear_rejects_bad_input():
    packed, scale = rt.pack_weight(torch.randn(8, 16), "int8")
    with pytest.raises(ValueError, match="rows <= 8"):
        rt.small_linear(torch.randn(9, 16), packed, scale, None, 8)
    with pytest.raises(ValueError, match="per-row scales"):
        rt.small_linear(torch.randn(2, 16), packed, None, None, 8)
    with pytest.raises(ValueError, match="weight \\(packed\\) must have shape"):
        rt.small_linear(torch.randn(2, 16), packed, scale, None, 12)
    with pytest.raises(ValueError, match="weight_dtype"):
        rt.pack_weight(torch.randn(8, 16), "fp16")


def test_ops_pass_opcheck():
    packed, _ = rt.pack_weight(torch.randn(12, 40), "bf16")
    torch.library.opcheck(torch.ops.elsi_fast.small_linear.default, (torch.randn(3, 40), packed, None, None, 12, 40, 1))
    q = torch.randn(1, 4, 3, 8)
    kv = torch.randn(1, 2, 6, 8)
    torch.library.opcheck(torch.ops.elsi_fast.decode_attention.default, (q, kv, kv.clone(), None, 0.3, True, 1))


# ----------------------------------------------------------------------------- decode_attention
def reference_attention(q, k, v, visible, scale):
    """float64 softmax attention; visible [rows, keys] bool. Returns [1, rows, heads, hd]."""
    heads, rows, hd = q.shape[1:]
    group = heads // k.shape[1]
    out = torch.zeros(1, rows, heads, hd, dtype=torch.float64)
    for h in range(heads):
        kh, vh = k[0, h // group].double(), v[0, h // group].double()
        scores = (q[0, h].double() @ kh.T) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[0, :, h] = torch.softmax(scores, dim=-1) @ vh
    return out


@pytest.mark.parametrize("hd, keys", [(40, 37), (64, 300), (256, 70)], ids=["hd40", "hd64-tiles", "hd256-tiles"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
def test_attention_matches_float64_and_rows_are_independent(masked, hd, keys, cpu_isa):
    """Without a mask and with a vector-wide head_dim the pairs of a KV head share key tiles (300 keys
    are three tiles of head_dim 64, csrc/decode_attention_cpu.cpp); every row is still its own
    one-row result, bit for bit, on 1 or 2 threads."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads = 6, 2
    k = torch.randn(1, kv_heads, keys, hd, generator=gen)
    v = torch.randn(1, kv_heads, keys, hd, generator=gen)
    for rows in (1, 3, rt.MAX_ROWS):
        # q as transformers hands it over: a transposed view
        q = torch.randn(1, rows, heads, hd, generator=gen).transpose(1, 2)
        causal = torch.arange(keys)[None, :] <= torch.arange(keys - rows, keys)[:, None]
        mask = causal & (torch.rand(rows, keys, generator=gen) > 0.3) if masked else None
        visible = mask if masked else causal
        out = torch.ops.elsi_fast.decode_attention.default(q, k, v, mask, hd ** -0.5, True, 2)
        ref = reference_attention(q, k, v, visible, hd ** -0.5)
        assert float((out.double() - ref).abs().max()) < 1e-5
        assert torch.equal(out, torch.ops.elsi_fast.decode_attention.default(q, k, v, mask, hd ** -0.5, True, 1))
        for t in range(rows):  # the same row alone, over the keys it sees: bit for bit
            end = keys - rows + t + 1
            alone = torch.ops.elsi_fast.decode_attention.default(
                q[:, :, t:t + 1], k[:, :, :end].contiguous(), v[:, :, :end].contiguous(),
                None if mask is None else mask[t:t + 1, :end].contiguous(), hd ** -0.5, True, 1)
            assert torch.equal(out[:, t], alone[:, 0]), (rows, t)


@pytest.mark.parametrize("hd", [64, 128, 256])
def test_attention_fixed_head_dims_give_the_general_loops_bits(hd, cpu_isa):
    """head_dim 64, 128 and 256 have their own score kernels (the query held in registers); padded
    with 32 zero columns the same attention runs the general loop, whose scores carry the same steps
    plus exact zeros, so the first hd columns agree bit for bit."""
    gen = torch.Generator().manual_seed(5)
    keys, rows = 45, 3
    q = torch.randn(1, 4, rows, hd, generator=gen)
    k, v = (torch.randn(1, 2, keys, hd, generator=gen) for _ in range(2))
    pad = lambda x: torch.nn.functional.pad(x, (0, 32)).contiguous()  # noqa: E731
    for threads in (1, 2):
        out = torch.ops.elsi_fast.decode_attention.default(q, k, v, None, hd ** -0.5, True, threads)
        padded = torch.ops.elsi_fast.decode_attention.default(pad(q), pad(k), pad(v), None, hd ** -0.5, True, threads)
        assert torch.equal(out, padded[..., :hd])


# ----------------------------------------------------------------------------- rms_norm
def test_rms_norm_matches_float64_and_rows_are_independent(cpu_isa):
    gen = torch.Generator().manual_seed(4)
    for d in (1, 7, 64, 577):
        weight = torch.randn(d, generator=gen)
        x = torch.randn(2, 5, d, generator=gen) * 3
        y = torch.ops.elsi_fast.rms_norm.default(x, weight, 1e-5)
        xd = x.double()
        ref = weight.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert float((y.double() - ref).abs().max() / ref.abs().max()) < 1e-6
        assert torch.equal(y[1, 3], torch.ops.elsi_fast.rms_norm.default(x[1, 3:4], weight, 1e-5)[0])


def test_prefill_linears_stay_torch():
    model = MODELS["llama"]()
    x = torch.randn(1, rt.MAX_ROWS + 1, 64)
    with rt.accelerate(model, "bf16"), torch.no_grad():
        assert torch.equal(model.lm_head(x), nn.functional.linear(x, model.lm_head.weight))
        native = model.lm_head(x[:, :2])  # bf16 weights: not torch's fp32 product
        assert not torch.equal(native, nn.functional.linear(x[:, :2], model.lm_head.weight))


@pytest.mark.parametrize("cols", [1, 7, 16, 100, 65536 * 2 + 37])
def test_argmax_rows_is_numpys(cols, cpu_isa):
    """The first of equal maxima (a tie planted across vector lanes and slices), the first NaN of a
    row that has one, rows of -inf: numpy.argmax's answers, on 1 and 2 threads."""
    from elsi_fast import _C

    rng = np.random.default_rng(cols)
    x = rng.standard_normal((6, cols)).astype(np.float32)
    x[1] = -np.inf
    x[2, cols // 2:] = x[2].max() + 1.0  # a run of equal maxima: the first one counts
    x[3, cols - 1] = np.nan
    x[3, cols // 3] = np.nan
    x[4, -1] = x[4].max() + 2.0  # the largest in the scalar tail
    x[5, 0] = x[5].max() + 2.0
    want = np.argmax(x, axis=1)
    for threads in (1, 2):
        np.testing.assert_array_equal(_C.argmax_rows(x, threads), want)


def test_attention_rejects_bad_input():
    q, kv = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 12, 8)
    with pytest.raises(ValueError, match="rows <= 8"):
        torch.ops.elsi_fast.decode_attention.default(q, kv, kv, None, 1.0, True, 1)
    with pytest.raises(ValueError, match="kv_heads dividing"):
        torch.ops.elsi_fast.decode_attention.default(q[:, :, :2], torch.randn(1, 3, 12, 8), kv, None, 1.0, True, 1)


# ----------------------------------------------------------------------------- models
VOCAB = 97


# Widths are multiples of 32, as in real models: torch's vectorized elementwise loops step over
# 2 vectors (32 floats with AVX-512, 16 with AVX2) and send a tensor's last numel % 32 (or 16)
# elements down a scalar path, so with other widths which elements of a row
# take it depends on the number of rows, and the model's own torch code (norms, SiLU) would break
# the bitwise equality of verify and one-token forwards that the runtime's ops keep.
def _llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        tie_word_embeddings=True)).eval()


def _qwen2():  # q/k/v biases
    torch.manual_seed(1)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=3, num_key_value_heads=1,
                                        max_position_embeddings=128)).eval()


def _qwen3():  # q/k norms, head_dim != hidden / heads
    torch.manual_seed(2)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                        max_position_embeddings=128)).eval()


MODELS = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3}
PROMPT = [5, 17, 3, 60, 2, 9, 41, 33, 12, 7, 88]  # 11 tokens: the prefill stays on torch


def _forward(model, ids, cache=None):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config) if cache is None else cache
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=True, **{cache_kwarg(model): cache}).logits[0], cache


def rounded_copy(model, weight_dtype: str):
    """`model` with every linear weight replaced by the matrix the runtime multiplies by (fp32)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if type(m) is nn.Linear:
                m.weight = nn.Parameter(reference_weight(m.weight, weight_dtype).float())
    return ref


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_verify_forward_matches_torch_and_single_forwards(name, weight_dtype):
    model = MODELS[name]()
    verify = [44, 8, 70, 1, 19]
    # Reference: torch's prefill with the model's own weights (the prompt, 11 rows, stays on torch's
    # GEMM and attention), then torch's verify forward with the weights the runtime multiplies by.
    torch_prefill, ref_cache = _forward(model, PROMPT)
    ref_logits, _ = _forward(rounded_copy(model, weight_dtype), verify, ref_cache)
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
    with rt.accelerate(model, weight_dtype) as runtime:
        assert runtime.describe().endswith(f"{norms} norms, native attention)")
        prefill, cache = _forward(model, PROMPT)  # torch's GEMM and attention, the native norms
        torch.testing.assert_close(prefill, torch_prefill, rtol=1e-5, atol=1e-5)
        logits, _ = _forward(model, verify, cache)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        _, cache = _forward(model, PROMPT)
        singles = torch.cat([_forward(model, [token], cache)[0] for token in verify])
        assert torch.equal(logits, singles)


class SequenceDraft:
    """A draft test double that proposes the next token of a known sequence, wrong every
    `wrong_every`-th time, so rounds accept anything from 0 to k tokens."""

    def __init__(self, sequence: list[int], layers, wrong_every: int = 3):
        self.sequence = sequence
        self.wrong_every = wrong_every
        self.calls = 0
        self.config = type("Cfg", (), {"aux_layer_ids": tuple(layers)})()

    def new_cache(self, max_len, batch_size=1, device=None, dtype=None):
        return _Count()

    def _propose(self, cache) -> torch.Tensor:
        self.calls += 1
        position = cache.length + 1  # cache entry t holds the pair token x_{t+1}
        token = self.sequence[position] if position < len(self.sequence) else 0
        if self.calls % self.wrong_every == 0:
            token = (token + 1) % VOCAB
        return torch.tensor(token)

    def extend(self, aux, ids, cache):
        cache.length += ids.shape[1]
        logits = torch.zeros(1, 1, VOCAB)
        logits[0, 0, self._propose(cache)] = 1.0
        return logits, torch.zeros(1, ids.shape[1], 4)

    def decode_step(self, hidden, token, cache, from_target, top_k=1):
        cache.length += 1
        return self._propose(cache).reshape(1, 1), hidden

    def draft_to_target(self, ids):
        return ids


class _Count:
    def __init__(self):
        self.length = 0

    def truncate(self, n):
        self.length = n


def random_draft(target, layers) -> Eagle3Draft:
    torch.manual_seed(5)
    tc = target.config
    config = Eagle3Config(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
                          vocab_size=tc.vocab_size, draft_vocab_size=VOCAB, target_hidden_size=tc.hidden_size,
                          aux_layer_ids=tuple(layers))
    return Eagle3Draft(config, torch.randn(tc.vocab_size, 16)).eval()


@pytest.mark.parametrize("weight_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("k", [1, 4, 7])
def test_speculative_equals_runtime_greedy(name, weight_dtype, k):
    model = MODELS[name]()
    n_new = 24
    with rt.accelerate(model, weight_dtype, threads=2) as runtime:
        greedy = greedy_generate(model, torch.tensor(PROMPT), n_new).tolist()
        drafts = [SequenceDraft(PROMPT + greedy, layers=[1]), random_draft(model, [0, 2])]
        for draft in drafts:
            result = speculative_generate(model, draft, torch.tensor(PROMPT), n_new, k, draft_backend="torch")
            assert result.tokens.tolist() == greedy
            assert result.target_backend == runtime.describe()


def test_sequence_draft_partial_acceptance_on_runtime():
    model = MODELS["llama"]()
    with rt.accelerate(model, "fp32"):
        greedy = greedy_generate(model, torch.tensor(PROMPT), 30).tolist()
        result = speculative_generate(model, SequenceDraft(PROMPT + greedy, layers=[1]), torch.tensor(PROMPT), 30, 4,
                                      draft_backend="torch")
    assert result.tokens.tolist() == greedy
    assert len(set(result.accepted_lengths)) > 1 and max(result.accepted_lengths) >= 2  # partial rounds rolled back


def test_restore_and_errors():
    model = MODELS["llama"]()
    ids = PROMPT[:4]
    before, _ = _forward(model, ids)
    runtime = rt.accelerate(model, "bf16")
    assert rt.runtime_of(model) is runtime and rt.describe_target(model) == runtime.describe()
    assert model.config._attn_implementation == rt.ATTENTION_NAME
    with pytest.raises(ValueError, match="already on the runtime"):
        rt.accelerate(model)
    with torch.enable_grad():  # gradients wanted: torch's own forward, exactly
        grad_logits = model(input_ids=torch.tensor([ids])).logits[0]
    assert grad_logits.requires_grad
    runtime.restore()
    assert rt.runtime_of(model) is None and rt.describe_target(model) == "torch eager"
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in m.__dict__ for m in model.modules())
    after, _ = _forward(model, ids)
    assert torch.equal(before, after)
    with pytest.raises(ValueError, match="weight_dtype"):
        rt.accelerate(model, "fp16")
    with pytest.raises(ValueError, match="threads"):
        rt.accelerate(model, threads=0)


class _Conv1D(nn.Linear):
    """A linear whose forward is not nn.Linear's (as quantized or LoRA linears are)."""


def test_rejects_non_plain_linears():
    model = MODELS["llama"]()
    model.model.layers[0].mlp.up_proj = _Conv1D(64, 96, bias=False)
    with pytest.raises(ValueError, match="not plain nn.Linear"):
        rt.accelerate(model)
    with pytest.raises(ValueError, match="no nn.Linear"):
        rt.accelerate(nn.Sequential(nn.ReLU()))
    half = MODELS["qwen3"]().half()
    with pytest.raises(ValueError, match="fp32 or bf16 models"):
        rt.accelerate(half)
