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

The one entry point is `NativeDraftDecoder(draft, weight_dtype, max_len)`: it converts the weights
once to the chosen dtype (bf16 or int8 for memory-bound devices), on the CPU in the packed layout
(`pack_matrix`: every product reads one sequential stream: 1.1-1.5x faster steps than row-major on
Zen 4), and owns an fp32 KV cache. `plan_decoder` answers "can this draft run natively, and how?"
for everyone else (speculative decoding, evaluation, the CLI): the decoder, or the reason why not.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._infra._extension import TORCH_WEIGHT_DTYPES as WEIGHT_DTYPES
from .._infra._extension import _C, IMPORT_ERROR
from .._infra.native_names import NATIVE_WEIGHT_DTYPES
from .quant import QUANTIZED_LINEARS, quantize_int8

if TYPE_CHECKING:
    from .model import Eagle3Draft

# Module dtypes that run natively as they are when no weight dtype is asked for.
_OWN_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16"}
# ELSI_FAST_DISABLE_NATIVE=1 forces the torch path at run time (build switches are in setup.py).
DISABLE_NATIVE_ENV = "ELSI_FAST_DISABLE_NATIVE"
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
        # top_k 0: the cache-only step, no hidden state (csrc/draft_decode.h)
        return input.new_empty((top_k,), dtype=torch.int64), input.new_empty((norms.shape[1] if top_k else 0,))


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
        return f"torch eager (no native extension built: {IMPORT_ERROR})"
    if device.type == "cpu":
        return f"native cpu ({_C.cpu_isa()}, {torch.get_num_threads()} threads)"
    if available(device):
        major, minor = torch.cuda.get_device_capability(device)
        return f"native cuda (sm_{major}{minor}, bf16 weights)"
    return f"torch eager (native extension built without {device.type} support)"


def _draft_device(draft) -> torch.device:
    weight = getattr(getattr(draft, "fc", None), "weight", None)
    return weight.device if isinstance(weight, Tensor) else torch.device("cpu")


def _check_weight_dtype(value: str, argument: str) -> None:
    if value not in WEIGHT_DTYPES:
        raise ValueError(f"{argument}: expected one of {', '.join(NATIVE_WEIGHT_DTYPES)}, got {value!r}")


def unavailable_reason(draft: "Eagle3Draft", weight_dtype: str) -> str | None:
    """Why `draft` cannot run natively with `weight_dtype` weights ("fp32", "bf16", "int8"), or None.

    In order: the draft is an `Eagle3Draft`; ELSI_FAST_DISABLE_NATIVE is not set; the extension is
    built for the draft's device; CUDA takes bf16 weights only; the draft is the plain EAGLE3
    layer (`Eagle3Config.native_unsupported_reason`: an architecture variant runs in torch)."""
    from .model import Eagle3Draft

    _check_weight_dtype(weight_dtype, "weight_dtype")
    if not isinstance(draft, Eagle3Draft):
        return f"the draft is a {type(draft).__name__}, not an Eagle3Draft"
    if os.environ.get(DISABLE_NATIVE_ENV, "") not in ("", "0"):
        return f"{DISABLE_NATIVE_ENV}={os.environ[DISABLE_NATIVE_ENV]} is set"
    device = _draft_device(draft)
    if not available(device):
        return f"no native op for {device}: {describe(device)}"
    if device.type == "cuda" and weight_dtype != "bf16":
        return f"the CUDA kernel takes bf16 weights only, not {weight_dtype}"
    return draft.config.native_unsupported_reason()


def plan_decoder(draft: "Eagle3Draft", max_len: int, weight_dtype: str | None = None, *,
                 threads: int | None = None) -> tuple["NativeDraftDecoder | None", str | None]:
    """Can `draft` run natively, and how: (decoder, None), or (None, the reason it cannot).

    weight_dtype: "fp32", "bf16", "int8", or None for the draft's own precision (fp32 or bf16;
    other module dtypes are converted only when asked). max_len: positions of the decoder's KV
    cache. threads: the decoder's CPU team (`NativeDraftDecoder`). The one place that decides;
    callers choose what a refusal means (speculative decoding raises when a native path was asked
    for, else warns and runs torch)."""
    if weight_dtype is not None:
        _check_weight_dtype(weight_dtype, "draft_dtype")
    dtype = weight_dtype
    if dtype is None:
        weight = getattr(getattr(draft, "fc", None), "weight", None)
        dtype = _OWN_DTYPE.get(weight.dtype) if isinstance(weight, Tensor) else "fp32"
        if dtype is None:
            return None, (f"the draft's weights are {weight.dtype}, which the native kernels do not take as they are "
                          f"(pass draft_dtype='fp32', 'bf16' or 'int8' to convert them)")
    reason = unavailable_reason(draft, dtype)
    if reason is not None:
        return None, reason
    try:
        return NativeDraftDecoder(draft, weight_dtype=dtype, max_len=max_len, threads=threads), None
    except ValueError as exc:
        return None, str(exc)


def _as_token(token: int | Tensor, out: Tensor) -> Tensor:
    """Writes one token id into `out` ([1] int64 on `device`) without a host sync."""
    if isinstance(token, Tensor):
        if token.numel() != 1 or token.dtype.is_floating_point or token.dtype == torch.bool:
            raise ValueError(f"token must be one integer id, got {token.dtype} with shape {list(token.shape)}")
        return out.copy_(token.reshape(1))
    if isinstance(token, bool) or not isinstance(token, int):
        raise TypeError(f"token must be an int or a one-element integer Tensor, got {type(token).__name__}")
    return out.fill_(token)


def _check_embedding(draft: "Eagle3Draft", device: torch.device) -> Tensor:
    if draft.embed_tokens is None:
        raise ValueError("Eagle3Draft has no token embedding: pass the target's embedding as embed_tokens=...")
    embed = draft.embed_tokens.weight
    if embed.device != device:
        raise ValueError(f"embed_tokens is on {embed.device} but the inputs are on {device}")
    return embed


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
    packed layout (`pack_matrix`; `packed=False` keeps fp32 / bf16 row-major, the layout of the
    module itself and of the CUDA kernel, to measure what packing buys), on CUDA row-major (shared
    with `draft` when already bf16); the norms are copied. Treat `draft` as frozen while a decoder
    uses it. threads: the CPU thread team of a step; None (default) picks it at every step from the
    cores other processes leave free right now (`threads.FreeCores`), at most torch's thread count
    when the decoder was made, so that a busy neighbour does not stall a team waiting on a
    descheduled thread.
    `step` writes cache slot `length` and advances it; `truncate(n)` rolls back rejected draft steps.
    """

    def __init__(self, draft: "Eagle3Draft", weight_dtype: str = "bf16", max_len: int = 2048, *,
                 packed: bool = True, threads: int | None = None) -> None:
        _check_weight_dtype(weight_dtype, "weight_dtype")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        params = dict(draft.named_parameters())
        missing = [name for name in MATRIX_NAMES + NORM_NAMES if name not in params]
        if missing:
            raise ValueError(f"draft lacks the parameters {missing}; expected an Eagle3Draft")
        reason = unavailable_reason(draft, weight_dtype)
        if reason is not None:
            raise ValueError(f"NativeDraftDecoder cannot run this draft: {reason}")
        device = params[MATRIX_NAMES[0]].device
        if not packed and weight_dtype == "int8":
            raise ValueError("packed=False: int8 weights are always packed (their scales follow the row groups)")
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
            pack = packed and device.type == "cpu"
            self._weights = [pack_matrix(m) if pack else m.contiguous() for m in matrices]
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
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads must be a positive int or None, got {threads!r}")
        from .._infra.threads import FreeCores

        self._team = (lambda: threads) if threads is not None else FreeCores(limit=torch.get_num_threads())
        self.threads = threads

    def describe(self) -> str:
        """The path a step takes, e.g. "native cpu (avx2, free cores up to 2 threads) int8"."""
        if self.device.type != "cpu":
            return f"{describe(self.device)} {self.weight_dtype}"
        team = f"{self.threads} threads" if self.threads is not None else f"free cores up to {self._team.limit} threads"
        isa = _C.cpu_isa() if _C is not None else "none"
        return f"native cpu ({isa}, {team}) {self.weight_dtype}"

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
        passes once T is more than a few tokens (64 positions at d=1024 were 3-7x faster on
        2026-11-30; 16 at SmolLM2's d=576 1.2-1.7x: bench/bench_spec_e2e.py --part parts). The
        keys/values come from the module's own weights (fp32 or bf16, not this decoder's int8/bf16
        copies) and are stored in the decoder's fp32 cache.

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

    def cache_position(self, aux: Tensor, token: int | Tensor) -> None:
        """Caches position `length` from target features [m * d_t] and their paired token without
        drafting from it: only its key and value, what later positions read. A run of accepted
        positions needs its last one's draft only (`step`), so the fused kernel skips the rest of the
        layer and the draft vocabulary's products for the others (csrc/draft_decode.h, top_k 0); the
        cache holds the bits `step` would have written. The CUDA kernel has no such step and runs a
        whole one."""
        if self.device.type == "cuda":
            self.step(aux, token, from_target=True)
            return
        self._check_step_input(aux, True)
        self._advance(aux, token, True, 0)

    def step(self, hidden_or_aux: Tensor, token: int | Tensor, from_target: bool,
             top_k: int = 1) -> tuple[Tensor, Tensor]:
        """One draft token at position `length`.

        hidden_or_aux: target features [m * d_t] when `from_target`, else the previous step's
        hidden_out [d] (leading singleton dims allowed), fp32 or bf16; token: the id paired with it.
        Returns (target ids [top_k] int64 best first, hidden_out [d] in the input's dtype).
        """
        self._check_step_input(hidden_or_aux, from_target)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= self.config.draft_vocab_size:
            raise ValueError(f"top_k must be an int in [1, {self.config.draft_vocab_size}], got {top_k!r}")
        if self.device.type == "cuda" and top_k > MAX_CUDA_TOP_K:
            raise ValueError(f"the CUDA kernel supports top_k <= {MAX_CUDA_TOP_K}, got {top_k}")
        return self._advance(hidden_or_aux, token, from_target, top_k)

    def _check_step_input(self, hidden_or_aux: Tensor, from_target: bool) -> None:
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
        if self.length >= self.max_len:
            raise ValueError(f"KV cache overflow: {self.length} positions cached and max_len={self.max_len}; "
                             f"create the decoder with a larger max_len or truncate()")

    def _advance(self, hidden_or_aux: Tensor, token: int | Tensor, from_target: bool,
                 top_k: int) -> tuple[Tensor, Tensor]:
        """Runs the fused step at position `length` (inputs checked) and moves past it."""
        _as_token(token, self._token)
        self._position.fill_(self.length)
        team, previous = self._team() if self.device.type == "cpu" else None, torch.get_num_threads()
        if team is not None and team != previous:
            torch.set_num_threads(team)  # the op reads torch's count; restored below
        try:
            ids, hidden_out = self._run(hidden_or_aux, from_target, top_k)
        finally:
            if team is not None and team != previous:
                torch.set_num_threads(previous)
        self.length += 1
        return ids, hidden_out

    def _run(self, hidden_or_aux: Tensor, from_target: bool, top_k: int) -> tuple[Tensor, Tensor]:
        return _op()(
            hidden_or_aux.reshape(-1).contiguous(), self._token, self._position, self._k_cache, self._v_cache,
            self._embed, self._weights, self._scales, self._norms, self._inv_freq, self._d2t, bool(from_target),
            self.config.num_attention_heads, self.config.fc_in_features, self.config.intermediate_size,
            self.config.rms_norm_eps, top_k)
