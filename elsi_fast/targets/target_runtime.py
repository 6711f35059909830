"""The target's decode and verify forwards on elsi-fast's own CPU ops.

At batch 1 a decode step reads every weight once, and a verify forward of k+1 tokens should cost
barely more. In eager torch it does not: on a 2-core Zen 3 `aten::mm` with 2 rows cost 1.9x the
1-row call and SmolLM2's 5-token forward 2x its 1-token one (docs/target-runtime.md), which caps what
speculative decoding can gain. `accelerate(model)` routes every `nn.Linear` of a transformers causal
LM (attention and MLP projections, the head) through `torch.ops.elsi_fast.small_linear` whenever
its input holds at most `MAX_ROWS` rows: the weights, packed once in fp32, bf16 (half the bytes;
widened in registers, the activations stay in the model's dtype) or int8 (per-row scales), are read
once for all rows. Larger inputs (the prompt prefill) keep torch's GEMM on the original weights.
The attention function of a model on transformers' "sdpa" becomes `torch.ops.elsi_fast.decode_attention`
for those forwards (registered as the attention implementation "elsi_fast", with sdpa's masks):
SDPA's result for a query row depended on how many rows came with it, and with GQA and a mask it
copied K/V to every head (a 5-token attention cost 3.5x the 1-token one). The RMSNorms of Llama,
Mistral and Qwen models (fp32) become `torch.ops.elsi_fast.rms_norm`, the same formula in one op
instead of six (about 100 us a call in eager torch on a 2-core Zen 3, 61 calls a SmolLM2 forward).
RoPE, the KV cache and everything else stay the model's own torch code.

Each output row of the three ops is computed in the same order whatever the number of rows, so a
verify forward of k+1 tokens computes exactly the logits of k+1 one-token forwards (for widths that
are multiples of 32, as in real models: torch's own elementwise ops send a tensor's last
`numel % 32` elements down a scalar path with AVX-512, `numel % 16` with AVX2) and speculative decoding on the runtime emits exactly the
runtime's own greedy decoding (`speculative.greedy_generate`).

The ops have no autograd formula: with gradients enabled and a weight or input that requires them,
a module runs torch's own forward. The packed weights are a copy (fp32: as large as the model).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from .._infra._extension import _C, IMPORT_ERROR, TORCH_WEIGHT_DTYPES
from .._infra.native_names import NATIVE_WEIGHT_DTYPES as WEIGHT_DTYPES
from ..draft.native import pack_matrix
from ..draft.quant import quantize_int8

# Activation dtypes the op takes (a model in another dtype keeps torch).
_ACT_DTYPES = (torch.float32, torch.bfloat16)
# Most rows of x (tokens) the ops take (csrc/target_runtime.h, kLinearMaxRows); more go to torch.
MAX_ROWS = _C.linear_max_rows if _C is not None else 8

# The attention implementation name a model on the runtime uses (transformers' AttentionInterface).
ATTENTION_NAME = "elsi_fast"

if _C is not None:

    @torch.library.register_fake("elsi_fast::small_linear")
    def _small_linear_fake(x, weight, scale, bias, out_features, in_features, num_threads):
        return x.new_empty((x.shape[0], out_features))

    @torch.library.register_fake("elsi_fast::decode_attention")
    def _decode_attention_fake(q, k, v, mask, scale, causal, num_threads):
        return q.new_empty((1, q.shape[2], q.shape[1], q.shape[3]))

    @torch.library.register_fake("elsi_fast::rms_norm")
    def _rms_norm_fake(x, weight, eps):
        return torch.empty_like(x)


def available() -> bool:
    """Whether the native ops are built."""
    return _C is not None


def _check_weight_dtype(weight_dtype: str) -> None:
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype: expected one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")


def pack_weight(weight: Tensor, weight_dtype: str) -> tuple[Tensor, Tensor | None]:
    """`[out, in]` -> (packed weight, per-row scales for int8 else None) in the op's layout.

    Row groups of PACK_ROWS rows, tile by tile, one PACK_ROW_BYTES line of each row per tile (16
    fp32, 32 bf16 or 64 int8 columns), zero padded: `[ceil(out / R), ceil(in / C), R, C]`. In bf16
    each 16-column block stores its columns in the order 0, 8, 1, 9, ..., 7, 15, so one 32-bit
    lane holds columns i and i + 8 (csrc/target_runtime.h). int8: `quant.quantize_int8`.
    """
    _check_weight_dtype(weight_dtype)
    if not isinstance(weight, Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"weight: expected a floating-point [out, in] Tensor, got {getattr(weight, 'shape', weight)!r}")
    scale = None
    if weight_dtype == "int8":
        w, scale = quantize_int8(weight)
    else:
        w = weight.detach().to(TORCH_WEIGHT_DTYPES[weight_dtype])
    packed = pack_matrix(w)  # the draft kernels' tiling: [groups, tiles, PACK_ROWS, C]
    if weight_dtype == "bf16":
        groups, tiles, rows, cols = packed.shape
        packed = packed.reshape(groups, tiles, rows, cols // 16, 2, 8).transpose(-1, -2).reshape(packed.shape)
    return packed.contiguous(), scale


def small_linear(x: Tensor, packed: Tensor, scale: Tensor | None, bias: Tensor | None, out_features: int,
                 num_threads: int = 0) -> Tensor:
    """`x [rows, in] @ W^T (+ bias)` with W from `pack_weight`, 1 <= rows <= MAX_ROWS, x fp32 or bf16
    (the result has x's dtype). num_threads: 0 for torch's thread count."""
    if _C is None:
        raise RuntimeError(f"the native extension is not built: {IMPORT_ERROR}")
    return torch.ops.elsi_fast.small_linear.default(x, packed, scale, bias, out_features, x.shape[-1], num_threads)


class _PackedLinear:
    """One nn.Linear's packed weights and the forward that replaces its own."""

    def __init__(self, module: nn.Linear, packed: Tensor, scale: Tensor | None, threads: int):
        self.module = module
        self.packed = packed
        self.scale = scale
        self.bias = None if module.bias is None else module.bias.detach().float().contiguous()
        self.threads = threads
        self.torch_forward = module.forward

    def forward(self, x: Tensor) -> Tensor:
        module = self.module
        rows = x.numel() // module.in_features
        if rows > MAX_ROWS or rows == 0 or x.dtype not in _ACT_DTYPES or x.device.type != "cpu" or (
                torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad)):
            return self.torch_forward(x)
        y = torch.ops.elsi_fast.small_linear.default(x.reshape(rows, module.in_features), self.packed, self.scale,
                                                     self.bias, module.out_features, module.in_features, self.threads)
        return y.view(*x.shape[:-1], module.out_features)


# RMSNorm classes whose forward is exactly `weight * (x * rsqrt(mean(x^2) + variance_epsilon))` in fp32
# (Gemma's adds 1 to its weight and keeps torch).
_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


class _FusedNorm:
    """One RMSNorm module's forward on the native op (fp32 inputs without gradients)."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.torch_forward = module.forward

    def forward(self, x: Tensor) -> Tensor:
        module = self.module
        if (x.dtype != torch.float32 or module.weight.dtype != torch.float32 or x.device.type != "cpu"
                or (torch.is_grad_enabled() and (x.requires_grad or module.weight.requires_grad))):
            return self.torch_forward(x)
        return torch.ops.elsi_fast.rms_norm.default(x.contiguous(), module.weight, module.variance_epsilon)


# Models currently on the runtime, and the op threads of the configs whose attention it runs.
_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, Runtime]" = weakref.WeakKeyDictionary()
_ATTENTION_THREADS: dict[int, int] = {}  # id(config) -> threads (configs are unhashable)


def _attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
               dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention function: the native op for batch 1 and at most MAX_ROWS queries with
    no mask or a boolean one shared by the heads, else sdpa's own (prefill, softcapping, biases)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rows, keys = query.shape[2], key.shape[2]
    mask_ok = attention_mask is None or (attention_mask.dtype == torch.bool and attention_mask.numel() == rows * keys)
    if (query.shape[0] != 1 or rows > MAX_ROWS or keys < rows or query.device.type != "cpu" or dropout or not mask_ok
            or any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux"))):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    mask = None if attention_mask is None else attention_mask.reshape(rows, keys).contiguous()
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.elsi_fast.decode_attention.default(
        query.float(), key.float().contiguous(), value.float().contiguous(), mask, scale, bool(causal),
        _ATTENTION_THREADS.get(id(getattr(module, "config", None)), 0))
    return out.to(query.dtype), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # the masks sdpa gets


def _sdpa_configs(model: nn.Module) -> list:
    """The distinct configs of `model` (and its submodules) whose attention runs on sdpa."""
    configs = {}
    for m in model.modules():
        config = getattr(m, "config", None)
        if getattr(config, "_attn_implementation", None) == "sdpa":
            configs[id(config)] = config
    return list(configs.values())


class Runtime:
    """A model's linears, norms and attention on the native ops; `restore()` (or leaving a `with`
    block) puts torch back."""

    def __init__(self, model: nn.Module, weight_dtype: str, threads: int, linears: dict[str, _PackedLinear],
                 norms: dict[str, _FusedNorm], attention_configs: list):
        self.model = model
        self.weight_dtype = weight_dtype
        self.threads = threads
        self.linears = linears
        self.norms = norms
        self.attention_configs = attention_configs  # switched from "sdpa" to ATTENTION_NAME

    @property
    def weight_bytes(self) -> int:
        """Bytes of packed weights (padding included) and scales one decode forward reads."""
        seen, total = set(), 0
        for linear in self.linears.values():
            for t in (linear.packed, linear.scale):
                if t is not None and t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    total += t.numel() * t.element_size()
        return total

    def describe(self) -> str:
        """E.g. "elsi-fast runtime (avx2, bf16 weights, 2 threads, 211 linears, 61 norms, native attention)"."""
        threads = self.threads or torch.get_num_threads()
        attention = "native attention" if self.attention_configs else "torch attention"
        return (f"elsi-fast runtime ({_C.cpu_isa()}, {self.weight_dtype} weights, {threads} threads, "
                f"{len(self.linears)} linears, {len(self.norms)} norms, {attention})")

    def restore(self) -> None:
        """Give every linear and norm its torch forward and the model its sdpa attention back; drop
        the packed weights."""
        for patched in [*self.linears.values(), *self.norms.values()]:
            if patched.module.__dict__.get("forward") == patched.forward:
                del patched.module.forward
        for config in self.attention_configs:
            config._attn_implementation = "sdpa"
            _ATTENTION_THREADS.pop(id(config), None)
        self.linears, self.norms, self.attention_configs = {}, {}, []
        if _ACTIVE.get(self.model) is self:
            del _ACTIVE[self.model]

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def runtime_of(model: nn.Module) -> Runtime | None:
    """The runtime `model` is on, or None (plain torch)."""
    return _ACTIVE.get(model)


def describe_target(model: nn.Module) -> str:
    """How `model`'s forwards run: its runtime's description, or "torch eager"."""
    runtime = runtime_of(model)
    return runtime.describe() if runtime is not None else "torch eager"


def accelerate(model: nn.Module, weight_dtype: str = "fp32", *, threads: int | None = None) -> Runtime:
    """Put every nn.Linear of `model` (a CPU causal LM in fp32 or bf16) on the small-batch op, its
    Llama/Mistral/Qwen RMSNorms on the fused norm, and its attention on the decode attention op if
    it runs on sdpa (else the attention stays as is).

    weight_dtype: "fp32", "bf16" or "int8" (per-row scales): the precision of the packed copy the
    decode and verify forwards read. threads: threads of the ops (default: torch's thread count at
    each call). Returns the `Runtime`; use it as a context manager or call `restore()`.
    """
    _check_weight_dtype(weight_dtype)
    if _C is None:
        raise RuntimeError(f"accelerate: the native extension is not built: {IMPORT_ERROR}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads: expected a positive int or None, got {threads!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: expected a torch nn.Module, got {type(model).__name__}")
    if model in _ACTIVE:
        raise ValueError("model: already on the runtime; restore() it first")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and type(head) is not nn.Linear:
        raise ValueError(f"model: its output head is a {type(head).__name__}, not an nn.Linear")
    subclassed = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear) and type(m) is not nn.Linear})
    if subclassed:
        raise ValueError(f"model: linears of types {subclassed} are not plain nn.Linear (their forward differs)")
    modules = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    if not modules:
        raise ValueError(f"model: a {type(model).__name__} has no nn.Linear modules")
    for name, m in modules.items():
        if m.weight.device.type != "cpu":
            raise ValueError(f"model: {name} is on {m.weight.device}; the runtime is CPU only")
        if m.weight.dtype not in _ACT_DTYPES:
            raise ValueError(f"model: {name} is {m.weight.dtype}; the runtime takes fp32 or bf16 models")

    packed_by_weight: dict[int, tuple[Tensor, Tensor | None]] = {}  # tied weights are packed once
    linears = {}
    with torch.no_grad():
        for name, m in modules.items():
            key = m.weight.data_ptr()
            if key not in packed_by_weight:
                packed_by_weight[key] = pack_weight(m.weight, weight_dtype)
            linears[name] = _PackedLinear(m, *packed_by_weight[key], threads or 0)
    norms = {name: _FusedNorm(m) for name, m in model.named_modules()
             if type(m).__name__ in _RMS_NORMS and hasattr(m, "variance_epsilon")}
    for patched in [*linears.values(), *norms.values()]:
        patched.module.forward = patched.forward  # an instance attribute: nn.Module.__call__ finds it first
    configs = _sdpa_configs(model)
    if configs:
        _register_attention()
    for config in configs:
        config._attn_implementation = ATTENTION_NAME
        _ATTENTION_THREADS[id(config)] = threads or 0
    runtime = Runtime(model, weight_dtype, threads or 0, linears, norms, configs)
    _ACTIVE[model] = runtime
    return runtime
