"""The fused native decode step of the EAGLE3 draft head (`csrc/`, op `torch.ops.elsi_fast.draft_decode_step`).

One call runs a whole draft decode step at batch 1: fc (target features only), both RMSNorms and
the embedding-first concat, q/k/v with RoPE, the KV-cache append, GQA attention over the cache,
o_proj + residual, SwiGLU MLP + residual, the final norm and lm_head with top-k and the d2t remap.
The draft-vocabulary logits never leave the kernel; the outputs are target-vocabulary ids and the
pre-norm hidden state that the next step feeds back.

CPU: a thread team over output rows; AVX-512 (with VNNI and BF16) / AVX2 / scalar chosen at run
time; fp32, bf16 or int8 weights. bf16 weights multiply bf16-rounded inputs, as torch's bf16 matmuls
do; int8 weights (per-output-row scales) multiply inputs quantized to int16 with one scale per 256
columns (`quant.fake_quantize_activation`), ~250x finer than the weight rounding. CUDA (builds with
a CUDA torch): bf16 weights, device-side token and position so a step can be captured in a CUDA graph.

Two entry points:
  * `decode_step(draft, ...)`: what `Eagle3Draft.decode_step` calls; runs on the module's own
    row-major weights and its `DraftKVCache` (no copies), in the module's dtype.
  * `NativeDraftDecoder(draft, weight_dtype, max_len)`: the fast path. Converts the weights once to
    the chosen dtype (bf16 or int8 for memory-bound devices) in the packed layout (`pack_matrix`:
    every product reads one sequential stream: 1.1-1.5x faster steps than row-major on Zen 4) and
    owns an fp32 cache.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .quant import QUANTIZED_LINEARS, quantize_int8

if TYPE_CHECKING:
    from .model import DraftKVCache, Eagle3Draft

try:
    from elsi_fast import _C
except ImportError as exc:  # built with ELSI_FAST_SKIP_NATIVE=1, or not built at all
    _C = None
    _IMPORT_ERROR = str(exc)
else:
    _IMPORT_ERROR = ""

WEIGHT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
# Argument order of the op's `weights` list.
MATRIX_NAMES = tuple(f"{name}.weight" for name in QUANTIZED_LINEARS)
# Rows of the op's `norms` [4, d].
NORM_NAMES = (
    "midlayer.hidden_norm.weight",
    "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight",
    "norm.weight",
)
# Activation dtypes the kernels read and write (inputs, hidden out, embedding, KV cache).
_ACT_DTYPES = (torch.float32, torch.bfloat16)
# Largest top_k of the CUDA kernel (its per-block candidates live in shared memory).
MAX_CUDA_TOP_K = _C.max_cuda_top_k if _C is not None else 0
# Packed weight layout of the CPU kernels (csrc/draft_decode.h, kPackRows / kPackRowBytes).
PACK_ROWS = _C.pack_rows if _C is not None else 4
PACK_ROW_BYTES = _C.pack_row_bytes if _C is not None else 64


def _op():
    return torch.ops.elsi_fast.draft_decode_step.default


if _C is not None:

    @torch.library.register_fake("elsi_fast::draft_decode_step")
    def _draft_decode_step_fake(input, token, position, k_cache, v_cache, embed, weights, scales, norms,
                                inv_freq, d2t, from_target, num_heads, fc_in, intermediate, eps, top_k):
        return input.new_empty((top_k,), dtype=torch.int64), input.new_empty((norms.shape[1],))


def available(device: torch.device | str) -> bool:
    """Whether the fused op can run on `device` (extension built, and with CUDA for a GPU)."""
    device = torch.device(device)
    if _C is None:
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and _C.cuda_built() and torch.cuda.is_available()


def describe(device: torch.device | str) -> str:
    """The decode path used on `device`, e.g. "native cpu (avx512, 2 threads)"."""
    device = torch.device(device)
    if _C is None:
        return f"torch eager (no native extension built: {_IMPORT_ERROR})"
    if device.type == "cpu":
        return f"native cpu ({_C.cpu_isa()}, {torch.get_num_threads()} threads)"
    if available(device):
        major, minor = torch.cuda.get_device_capability(device)
        return f"native cuda (sm_{major}{minor}, bf16 weights)"
    return f"torch eager (native extension built without {device.type} support)"


def _require_native(device: torch.device) -> None:
    if not available(device):
        raise ValueError(f"the native draft decode is not available on {device}: {describe(device)}")


def _as_token(token: int | Tensor, out: Tensor) -> Tensor:
    """Writes one token id into `out` ([1] int64 on `device`) without a host sync."""
    if isinstance(token, Tensor):
        if token.numel() != 1 or token.dtype.is_floating_point or token.dtype == torch.bool:
            raise ValueError(f"token must be one integer id, got {token.dtype} with shape {list(token.shape)}")
        return out.copy_(token.reshape(1))
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"token must be an int or a one-element integer Tensor, got {type(token).__name__}")
    return out.fill_(token)


class _ModuleExtras:
    """Per-draft fp32 norms [4, d] for `decode_step`, rebuilt when a norm weight changes."""

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def norms(self, draft: "Eagle3Draft") -> Tensor:
        params = [draft.get_parameter(name) for name in NORM_NAMES]
        key = tuple((p.data_ptr(), p._version, p.dtype) for p in params)
        hit = self._cache.get(draft)
        if hit is None or hit[0] != key:
            hit = (key, torch.stack([p.detach().float() for p in params]).contiguous())
            self._cache[draft] = hit
        return hit[1]


_EXTRAS = _ModuleExtras()


def _check_embedding(draft: "Eagle3Draft", device: torch.device) -> Tensor:
    if draft.embed_tokens is None:
        raise ValueError("Eagle3Draft has no token embedding: pass the target's embedding as embed_tokens=...")
    embed = draft.embed_tokens.weight
    if embed.device != device:
        raise ValueError(f"embed_tokens is on {embed.device} but the inputs are on {device}")
    return embed


def _kernel_takes(draft: "Eagle3Draft", dtype: torch.dtype, device: torch.device, cache: "DraftKVCache",
                  top_k: int) -> bool:
    """Whether the fused op accepts this module's weights, embedding and cache as they are."""
    if draft.config.native_unsupported_reason() is not None:
        return False
    embed = draft.embed_tokens.weight if draft.embed_tokens is not None else None
    if device.type == "cuda":
        return dtype == torch.bfloat16 and cache.key.dtype == dtype and top_k <= MAX_CUDA_TOP_K and (
            embed is None or embed.dtype in _ACT_DTYPES)
    return dtype in _ACT_DTYPES and cache.key.dtype == dtype and (embed is None or embed.dtype in _ACT_DTYPES)


def decode_step(draft: "Eagle3Draft", hidden: Tensor, token: Tensor, cache: "DraftKVCache", *,
                from_target: bool, top_k: int = 1) -> tuple[Tensor, Tensor]:
    """`Eagle3Draft.decode_step` through the fused op, on the module's weights and cache.

    hidden [B, 1, m * d_t] (from_target) or [B, 1, d]; token [B, 1]; cache: the draft's
    DraftKVCache (its length grows by one). Returns (target ids [B, top_k] int64, hidden_out
    [B, 1, d] in the draft's dtype). Batch rows run one after another (batch-1 kernel). A draft
    whose weights the kernel does not take (fp16 anywhere, or not bf16 on CUDA) runs the torch path.
    """
    weights = [draft.get_parameter(name).detach() for name in MATRIX_NAMES]
    device = hidden.device
    if not _kernel_takes(draft, weights[0].dtype, device, cache, top_k):
        return draft.decode_step(hidden, token, cache, from_target, top_k, use_native=False)
    _require_native(device)
    config = draft.config
    width = config.fc_in_features if from_target else config.hidden_size
    if hidden.dim() != 3 or hidden.shape[1:] != (1, width):
        raise ValueError(f"hidden must have shape [B, 1, {width}], got {list(hidden.shape)}")
    if hidden.dtype != weights[0].dtype:
        raise TypeError(f"hidden has dtype {hidden.dtype} but the draft weights are {weights[0].dtype}")
    if not isinstance(token, Tensor) or token.shape != (hidden.shape[0], 1):
        raise ValueError(f"token must be a Tensor of shape [{hidden.shape[0]}, 1]")
    draft._check_cache(cache, hidden)
    if cache.length >= cache.max_len:
        raise ValueError(f"DraftKVCache overflow: {cache.length} cached + 1 new position exceed "
                         f"max_len={cache.max_len}; allocate the cache with a larger max_len")
    embed = _check_embedding(draft, device)
    norms = _EXTRAS.norms(draft)
    inv_freq = draft.rope_inv_freq(device)
    position = torch.full((1,), cache.length, dtype=torch.int64, device=device)
    tokens = token.to(torch.int64)
    ids, outs = [], []
    for b in range(hidden.shape[0]):
        row_ids, row_hidden = _op()(
            hidden[b, 0].contiguous(), tokens[b], position, cache.key[b], cache.value[b], embed, weights, [],
            norms, inv_freq, draft.d2t, from_target, config.num_attention_heads, config.fc_in_features,
            config.intermediate_size, config.rms_norm_eps, top_k)
        ids.append(row_ids)
        outs.append(row_hidden)
    cache.length += 1
    return torch.stack(ids), torch.stack(outs).unsqueeze(1)


def pack_matrix(weight: Tensor) -> Tensor:
    """`[out, in]` -> the CPU kernels' packed layout `[ceil(out / R), ceil(in / C), R, C]`, zero
    padded, same dtype, with R = PACK_ROWS and C = PACK_ROW_BYTES / element size (one cache line:
    16 fp32, 32 bf16, 64 int8 columns). Each group of R rows is one contiguous run of R x C tiles,
    so a matrix-vector product reads the matrix as one sequential stream (csrc/draft_decode.h)."""
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D [out, in] Tensor, got {getattr(weight, 'shape', type(weight))}")
    if PACK_ROW_BYTES % weight.element_size():
        raise ValueError(f"weight dtype {weight.dtype} does not tile a {PACK_ROW_BYTES}-byte row")
    rows, cols = weight.shape
    tile_cols = PACK_ROW_BYTES // weight.element_size()
    padded = torch.nn.functional.pad(weight.detach(), (0, -cols % tile_cols, 0, -rows % PACK_ROWS))
    groups, tiles = padded.shape[0] // PACK_ROWS, padded.shape[1] // tile_cols
    return padded.reshape(groups, PACK_ROWS, tiles, tile_cols).permute(0, 2, 1, 3).contiguous()


class NativeDraftDecoder:
    """Batch-1 draft decoding with weights packed once in `weight_dtype` and an fp32 KV cache.

    weight_dtype: "fp32" (CPU), "bf16" (CPU and CUDA) or "int8" (CPU; per-output-row scales,
    see `quant.quantize_int8`). The decoder holds its own copy of the matrices: on the CPU in the
    packed layout (`pack_matrix`), on CUDA row-major (shared with `draft` when already bf16); the
    norms are copied. Treat `draft` as frozen while a decoder uses it.
    `step` writes cache slot `length` and advances it; `truncate(n)` rolls back rejected draft steps.
    """

    def __init__(self, draft: "Eagle3Draft", weight_dtype: str = "bf16", max_len: int = 2048) -> None:
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be one of {sorted(WEIGHT_DTYPES)}, got {weight_dtype!r}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        params = dict(draft.named_parameters())
        missing = [name for name in MATRIX_NAMES + NORM_NAMES if name not in params]
        if missing:
            raise ValueError(f"draft lacks the parameters {missing}; expected an Eagle3Draft")
        reason = draft.config.native_unsupported_reason()
        if reason is not None:
            raise ValueError(f"NativeDraftDecoder cannot run this draft: {reason}")
        device = params[MATRIX_NAMES[0]].device
        _require_native(device)
        if device.type == "cuda" and weight_dtype != "bf16":
            raise ValueError(f"the CUDA kernel takes bf16 weights, got weight_dtype={weight_dtype!r}")
        config = draft.config
        embed = _check_embedding(draft, device)
        self.draft = draft  # kept for `prefill`, which runs the module's torch extend
        self.config = config
        self.device = device
        self.weight_dtype = weight_dtype
        self._embed = embed if embed.dtype in _ACT_DTYPES else embed.float()
        with torch.no_grad():
            if weight_dtype == "int8":
                quantized = [quantize_int8(params[name]) for name in MATRIX_NAMES]
                matrices = [q for q, _ in quantized]
                self._scales = [s for _, s in quantized]
            else:
                matrices = [params[name].detach().to(WEIGHT_DTYPES[weight_dtype]) for name in MATRIX_NAMES]
                self._scales = []
            # The CPU kernels read packed row groups as one stream; the CUDA kernel reads row-major.
            self._weights = [pack_matrix(m) if device.type == "cpu" else m.contiguous() for m in matrices]
            self._norms = torch.stack([params[name].detach().float() for name in NORM_NAMES]).contiguous()
        self._inv_freq = draft.rope_inv_freq(device).contiguous()
        self._d2t = draft.d2t.to(device=device, dtype=torch.int64).contiguous()
        cache_shape = (config.num_key_value_heads, max_len, config.head_dim)
        self._k_cache = torch.zeros(cache_shape, dtype=torch.float32, device=device)
        self._v_cache = torch.zeros(cache_shape, dtype=torch.float32, device=device)
        self._token = torch.zeros(1, dtype=torch.int64, device=device)
        self._position = torch.zeros(1, dtype=torch.int64, device=device)
        self.max_len = max_len
        self.length = 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of the packed weight matrices (padding included) and scales that one step reads."""
        return sum(t.numel() * t.element_size() for t in self._weights + self._scales)

    def step_read_bytes(self, from_target: bool = True, length: int | None = None) -> int:
        """Bytes one step at cache length `length` (default: the current one) reads from memory:
        weights (fc only when `from_target`), scales, both KV caches over the attended positions,
        the norms, the embedding row and the input vector. The numerator of a memory floor."""
        length = self.length if length is None else length
        fc = 0 if from_target else self._weights[0].numel() * self._weights[0].element_size() + (
            self._scales[0].numel() * 4 if self._scales else 0)
        cfg = self.config
        cache = 2 * cfg.num_key_value_heads * (length + 1) * cfg.head_dim * self._k_cache.element_size()
        width = cfg.fc_in_features if from_target else cfg.hidden_size
        small = (self._norms.numel() + self._inv_freq.numel() + width) * 4 + cfg.hidden_size * self._embed.element_size()
        return self.weight_bytes - fc + cache + small

    def reset(self) -> None:
        """Empty the KV cache."""
        self.length = 0

    @torch.no_grad()
    def prefill(self, aux: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Cache positions length .. length+T-1 from target features with one torch extend of the
        source module, instead of T fused steps: a GEMM over T positions beats T matrix-vector
        passes once T is more than a few tokens (bench/bench_spec_e2e.py: 64 positions at d=1024
        are 3-7x faster). The keys/values come from the module's own weights (fp32 or bf16, not
        this decoder's int8/bf16 copies) and are stored in the decoder's fp32 cache.

        aux [1, T, m * d_t] target features, ids [1, T] their paired tokens. Returns (target ids
        [1] of the last position's best draft token, its hidden_out [d] in the module's dtype).
        """
        if aux.ndim != 3 or aux.shape[0] != 1 or ids.shape != aux.shape[:2]:
            raise ValueError(f"aux must be [1, T, m * d_t] and ids [1, T], got {list(aux.shape)} and {list(ids.shape)}")
        count = aux.shape[1]
        if self.length + count > self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} + {count} positions and max_len={self.max_len}; "
                             f"create the decoder with a larger max_len or truncate()")
        from .model import DraftKVCache

        weight = self.draft.fc.weight
        staging = DraftKVCache(1, self.config.num_key_value_heads, self.config.head_dim, self.length + count,
                               device=self.device, dtype=weight.dtype)
        staging.key[0, :, : self.length] = self._k_cache[:, : self.length]
        staging.value[0, :, : self.length] = self._v_cache[:, : self.length]
        staging.length = self.length
        logits, hidden = self.draft.extend(aux.to(weight.dtype), ids, staging)
        end = self.length + count
        self._k_cache[:, self.length:end] = staging.key[0, :, self.length:end]
        self._v_cache[:, self.length:end] = staging.value[0, :, self.length:end]
        self.length = end
        return self.draft.draft_to_target(logits[0, -1].argmax()).reshape(1), hidden[0, -1]

    def truncate(self, length: int) -> None:
        """Keep the first `length` cached positions."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"length must be an int in [0, {self.length}], got {length!r}")
        self.length = length

    def step(self, hidden_or_aux: Tensor, token: int | Tensor, from_target: bool,
             top_k: int = 1) -> tuple[Tensor, Tensor]:
        """One draft token at position `length`.

        hidden_or_aux: target features [m * d_t] when `from_target`, else the previous step's
        hidden_out [d] (leading singleton dims allowed), fp32 or bf16; token: the id paired with it.
        Returns (target ids [top_k] int64 best first, hidden_out [d] in the input's dtype).
        """
        if not isinstance(hidden_or_aux, Tensor):
            raise TypeError(f"hidden_or_aux must be a Tensor, got {type(hidden_or_aux).__name__}")
        width = self.config.fc_in_features if from_target else self.config.hidden_size
        if hidden_or_aux.numel() != width or any(s != 1 for s in hidden_or_aux.shape[:-1]):
            what = "m * target_hidden_size" if from_target else "hidden_size"
            raise ValueError(f"hidden_or_aux must hold [{width}] ({what}), got shape {list(hidden_or_aux.shape)}")
        if hidden_or_aux.dtype not in _ACT_DTYPES:
            raise TypeError(f"hidden_or_aux must be float32 or bfloat16, got {hidden_or_aux.dtype}")
        if hidden_or_aux.device != self.device:
            raise ValueError(f"hidden_or_aux is on {hidden_or_aux.device} but the decoder is on {self.device}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= self.config.draft_vocab_size:
            raise ValueError(f"top_k must be an int in [1, {self.config.draft_vocab_size}], got {top_k!r}")
        if self.device.type == "cuda" and top_k > MAX_CUDA_TOP_K:
            raise ValueError(f"the CUDA kernel supports top_k <= {MAX_CUDA_TOP_K}, got {top_k}")
        if self.length >= self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} positions cached and max_len={self.max_len}; "
                             f"create the decoder with a larger max_len or truncate()")
        _as_token(token, self._token)
        self._position.fill_(self.length)
        ids, hidden_out = _op()(
            hidden_or_aux.reshape(-1).contiguous(), self._token, self._position, self._k_cache, self._v_cache,
            self._embed, self._weights, self._scales, self._norms, self._inv_freq, self._d2t, bool(from_target),
            self.config.num_attention_heads, self.config.fc_in_features, self.config.intermediate_size,
            self.config.rms_norm_eps, top_k)
        self.length += 1
        return ids, hidden_out
