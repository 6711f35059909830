"""The EAGLE3 draft head in torch (docs/method.md section 5), with its own KV cache.

One step over pairs (h_t, token_{t+1}) at positions p:

    x   = cat([input_layernorm(embed(token)), hidden_norm(h)], -1)      # embedding first, 2d wide
    h'  = h + o_proj(attention(rope(q(x)), rope(k(x)), v(x)))            # GQA, attends the cache
    h'' = h' + down(silu(gate(post_ln(h'))) * up(post_ln(h')))
    logits = lm_head(norm(h'')),   and h'' (pre-norm) is the next draft step's `h`

where the first `h` of a sequence position is `fc(concat of the m target hidden states)`.
The variants of `Eagle3Config` change this as follows: norm_before_residual: h' = hidden_norm(h)
+ o_proj(...); norm_before_fc: fc(input_norm(concat)); fc_norm: fc(concat(fc_norm_i(state_i)));
norm_feedback: the next step's `h` is norm(h''); final_norm=False: logits = lm_head(h'');
qk_norm: q and k pass a per-head RMSNorm before RoPE; sliding_window=w: position p attends
positions > p - w only (training-time-test steps j >= 1 attend their own position as before).
This torch path is the reference the native fused decode (`elsi_fast.draft.native`) must match;
drafts with a variant run only here (`Eagle3Config.native_unsupported_reason`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import Eagle3Config


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half types, the dtype itself for fp32 / fp64 (so a float64 draft is float64 exact)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """RMSNorm computed in (at least) fp32 and cast back before the weight multiply, as upstream EAGLE3 does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xa = x.to(_accumulate_dtype(x.dtype))
        xa = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xa.to(x.dtype)


class FrozenEmbedding(nn.Module):
    """The target's token embedding, held as a non-persistent buffer: never trained, never saved in
    draft checkpoints, and `.to()` on the draft makes a new tensor rather than converting the
    target's own parameter in place."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach(), persistent=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        return F.embedding(input_ids, self.weight)


class Eagle3Attention(nn.Module):
    """q/k/v read the 2d-wide concat; o_proj maps heads back to d."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(2 * d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(2 * d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(2 * d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.hidden_norm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Eagle3Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = Eagle3MLP(config)


class DraftKVCache:
    """Preallocated keys and values `[batch, num_kv_heads, max_len, head_dim]` (RoPE applied).

    All batch rows share one `length`: a batch is decoded in lockstep, so row b's new entry always
    sits at position `length` (ragged batches need one cache per sequence). `truncate(n)` rolls
    back to the first n positions (speculative decoding discards rejected draft steps).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, max_len: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        for name, value in (("batch_size", batch_size), ("max_len", max_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DraftKVCache {name} must be a positive int, got {value!r}")
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.key = torch.zeros(shape, device=device, dtype=dtype)
        self.value = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.key.shape[2]

    @property
    def batch_size(self) -> int:
        return self.key.shape[0]

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self.length:
            raise ValueError(f"DraftKVCache.truncate: length must be an int in [0, {self.length}], got {length!r}")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Write `[B, n_kv, T, hd]` keys/values at positions length..length+T-1; return views of all
        cached keys and values `[B, n_kv, length, hd]` including the new ones."""
        new = key.shape[2]
        if self.length + new > self.max_len:
            raise ValueError(
                f"DraftKVCache overflow: {self.length} cached + {new} new positions exceed max_len={self.max_len}; "
                f"allocate the cache with a larger max_len"
            )
        end = self.length + new
        self.key[:, :, self.length:end] = key
        self.value[:, :, self.length:end] = value
        self.length = end
        return self.key[:, :, :end], self.value[:, :, :end]


def rope_inv_freq(config: Eagle3Config) -> Tensor:
    """Inverse RoPE frequencies `[head_dim // 2]` in float64 (with Llama-3.1 scaling if configured)."""
    hd = config.head_dim
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_ctx / low, inv_freq / factor, blended)
    return torch.where(wavelen < old_ctx / high, inv_freq, out)


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE on `[B, heads, T, hd]` with cos/sin `[B or 1, 1, T, hd]` (accumulate dtype)."""
    xa = x.to(cos.dtype)
    half = xa.shape[-1] // 2
    rotated = torch.cat([-xa[..., half:], xa[..., :half]], dim=-1)
    return (xa * cos + rotated * sin).to(x.dtype)


def _attend(q: Tensor, keys: Tensor, values: Tensor, allowed: Tensor) -> Tensor:
    """Softmax attention, GQA without repeating the KV heads.

    q [B, H, T, hd]; keys, values [B, KV, S, hd]; allowed [T, S] or [B, 1, 1, T, S] bool (True = may
    attend).
    Scores and softmax in (at least) fp32. Returns [B, T, H * hd].
    """
    b, h, t, hd = q.shape
    kv = keys.shape[1]
    qg = q.reshape(b, kv, h // kv, t, hd)
    acc = _accumulate_dtype(q.dtype)
    scores = torch.matmul(qg, keys.unsqueeze(2).transpose(-1, -2)).to(acc) / math.sqrt(hd)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs, values.unsqueeze(2))  # [B, KV, g, T, hd]
    return out.reshape(b, h, t, hd).transpose(1, 2).reshape(b, t, h * hd)


def _allowed_mask(num_new: int, past: int, window: int | None, device: torch.device) -> Tensor:
    """[num_new, past + num_new] bool: new position i (absolute past + i) may attend position j
    when j <= past + i and, with a sliding window w, j > past + i - w."""
    allowed = torch.ones(num_new, past + num_new, dtype=torch.bool, device=device).tril(diagonal=past)
    if window is not None:
        allowed &= ~torch.ones_like(allowed).tril(diagonal=past - window)
    return allowed


def _ttt_attend(q: Tensor, keys: list[Tensor], values: list[Tensor], window: int | None = None,
                start: int = 0) -> Tensor:
    """Training-time-test attention for step i = len(keys) - 1.

    Query (step i, position t) attends step-0 keys at positions <= t (and > t - window with a
    sliding window) and step-j keys (1 <= j <= i) at position t only. q [B, H, T - start, hd] at
    positions start..T-1; keys[0], values[0] [B, KV, T, hd]; keys[j], values[j] (j >= 1) [B, KV,
    T - start, hd] at q's positions. Returns [B, T - start, H * hd].
    """
    b, h, t, hd = q.shape
    kv = keys[0].shape[1]
    qg = q.reshape(b, kv, h // kv, t, hd)
    acc = _accumulate_dtype(q.dtype)
    causal = _allowed_mask(t, start, window, q.device)
    dense = torch.matmul(qg, keys[0].unsqueeze(2).transpose(-1, -2)).to(acc).masked_fill(~causal, float("-inf"))
    diagonal = [(qg * k.unsqueeze(2)).sum(-1, keepdim=True).to(acc) for k in keys[1:]]
    probs = torch.softmax(torch.cat([dense, *diagonal], dim=-1) / math.sqrt(hd), dim=-1).to(values[0].dtype)
    width = start + t
    out = torch.matmul(probs[..., :width], values[0].unsqueeze(2))
    for j, v in enumerate(values[1:]):
        out = out + probs[..., width + j : width + j + 1] * v.unsqueeze(2)
    return out.reshape(b, h, t, hd).transpose(1, 2).reshape(b, t, h * hd)


class Eagle3Draft(nn.Module):
    """EAGLE3 draft head for any number m >= 1 of target hidden states (`config.num_aux_layers`).

    `embed_tokens` is the target's token embedding `[vocab_size, hidden_size]` (a tensor or an
    `nn.Embedding`); it is frozen, not a parameter, and not saved. It may be None for inspection or
    parameter counting; every forward then raises. Buffers: `d2t` [draft_vocab] int64 offsets
    (draft id i -> target id i + d2t[i]) and `t2d` [vocab] bool (target ids in the draft vocab);
    both start as the identity onto the first `draft_vocab_size` target ids.
    """

    def __init__(self, config: Eagle3Config, embed_tokens: Tensor | nn.Embedding | None = None) -> None:
        super().__init__()
        if not isinstance(config, Eagle3Config):
            raise TypeError(f"config must be an Eagle3Config, got {type(config).__name__}")
        self.config = config
        d = config.hidden_size
        if config.norm_before_fc:
            self.input_norm = RMSNorm(config.fc_in_features, config.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(config.target_hidden_size, config.rms_norm_eps)
                                         for _ in range(config.num_aux_layers))
        self.fc = nn.Linear(config.fc_in_features, d, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)
        self.embed_tokens: FrozenEmbedding | None = None
        self._inv_freq: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        if embed_tokens is not None:
            self.attach_embedding(embed_tokens)

    # ----------------------------------------------------------------------------- setup
    def attach_embedding(self, embed_tokens: Tensor | nn.Embedding) -> None:
        """Use the target's token embedding `[vocab_size, hidden_size]` (kept in its own dtype)."""
        weight = embed_tokens.weight if isinstance(embed_tokens, nn.Embedding) else embed_tokens
        if not isinstance(weight, Tensor):
            raise TypeError(f"embed_tokens must be a Tensor or nn.Embedding, got {type(embed_tokens).__name__}")
        expected = (self.config.vocab_size, self.config.hidden_size)
        if tuple(weight.shape) != expected:
            raise ValueError(f"embed_tokens has shape {tuple(weight.shape)}, expected [vocab_size, hidden_size] = "
                             f"{list(expected)}: the draft was trained for a target of that vocabulary and width")
        if not weight.is_floating_point():
            raise TypeError(f"embed_tokens must be floating point, got {weight.dtype}")
        self.embed_tokens = FrozenEmbedding(weight)

    def set_draft_vocab(self, target_ids: Tensor) -> None:
        """Set `d2t` / `t2d` from the target ids of the draft vocabulary, `[draft_vocab_size]`,
        strictly increasing (so that `target_logits[..., t2d]` lists them in draft order)."""
        ids = torch.as_tensor(target_ids)
        n, vocab = self.config.draft_vocab_size, self.config.vocab_size
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or tuple(ids.shape) != (n,):
            raise ValueError(f"target_ids must be an integer tensor of shape [{n}], got {ids.dtype} {tuple(ids.shape)}")
        ids = ids.to(device="cpu", dtype=torch.int64)
        if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise ValueError(f"target_ids must be strictly increasing ids in [0, {vocab})")
        self.d2t.copy_(ids - torch.arange(n))
        self.t2d.zero_()
        self.t2d[ids.to(self.t2d.device)] = True

    def new_cache(self, max_len: int, batch_size: int = 1, device: torch.device | str | None = None,
                  dtype: torch.dtype | None = None) -> DraftKVCache:
        """An empty KV cache for up to `max_len` positions, on the draft's device and dtype by default."""
        weight = self.fc.weight
        return DraftKVCache(batch_size, self.config.num_key_value_heads, self.config.head_dim, max_len,
                            device=weight.device if device is None else device,
                            dtype=weight.dtype if dtype is None else dtype)

    def rope_inv_freq(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> Tensor:
        """Inverse RoPE frequencies `[head_dim // 2]` on `device` (cached; not a buffer so that
        `.to(bf16)` cannot round them). The forward uses fp32, or fp64 for a float64 draft."""
        key = (torch.device(device), dtype)
        if key not in self._inv_freq:
            self._inv_freq[key] = rope_inv_freq(self.config).to(device=key[0], dtype=dtype)
        return self._inv_freq[key]

    # ----------------------------------------------------------------------------- forward paths
    def project(self, aux_hidden: Tensor) -> Tensor:
        """fc: `[B, T, m * target_hidden_size]` concatenated target states -> `[B, T, hidden_size]`."""
        config = self.config
        self._check_float(aux_hidden, "aux_hidden", config.fc_in_features,
                          f"m * target_hidden_size = {config.num_aux_layers} * {config.target_hidden_size}")
        if config.norm_before_fc:
            aux_hidden = self.input_norm(aux_hidden)
        if config.fc_norm:
            states = aux_hidden.split(config.target_hidden_size, dim=-1)
            aux_hidden = torch.cat([norm(x) for norm, x in zip(self.fc_norm, states)], dim=-1)
        return self.fc(aux_hidden)

    def forward(self, hidden: Tensor, input_ids: Tensor, cache: DraftKVCache | None = None,
                position_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """One draft layer over T new pairs.

        hidden [B, T, d]: fc output or a previous step's `hidden_out`; input_ids [B, T]: the token
        paired with each (token_{t+1}). Attends causally within the T positions and to everything in
        `cache`, then appends to it. Positions default to `cache.length + arange(T)` (0.. without a
        cache); `position_ids` [T] or [B, T] overrides the RoPE positions only (the mask is always
        causal by cache index). Returns (logits [B, T, draft_vocab], hidden_out [B, T, d]: the next
        step's `h`, pre-norm unless `config.norm_feedback`).
        """
        self._check_float(hidden, "hidden", self.config.hidden_size, "hidden_size")
        self._check_ids(input_ids, hidden, "input_ids")
        t = hidden.shape[1]
        past = 0 if cache is None else cache.length
        if cache is not None:
            self._check_cache(cache, hidden)
        if position_ids is None:
            position_ids = torch.arange(past, past + t, device=hidden.device)
        elif position_ids.shape not in ((t,), (hidden.shape[0], t)):
            raise ValueError(f"position_ids must have shape [T] or [B, T] = [{t}] or {list(hidden.shape[:2])}, "
                             f"got {list(position_ids.shape)}")

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            if cache is not None:
                k, v = cache.append(k, v)
            return _attend(q, k, v, _allowed_mask(t, past, self.config.sliding_window, q.device))

        return self._head(self._layer(hidden, input_ids, position_ids, attend))

    def extend(self, aux_hidden: Tensor, input_ids: Tensor,
               cache: DraftKVCache | None = None) -> tuple[Tensor, Tensor]:
        """`forward(project(aux_hidden), input_ids, cache)`: the draft consumes target features."""
        return self.forward(self.project(aux_hidden), input_ids, cache)

    @torch.no_grad()
    def decode_step(self, hidden: Tensor, token: Tensor, cache: DraftKVCache, from_target: bool,
                    top_k: int = 1) -> tuple[Tensor, Tensor]:
        """One draft token, in torch (the reference of the native `NativeDraftDecoder.step`).

        hidden: `[B, 1, m * target_hidden_size]` target features when `from_target`, else the
        previous step's `hidden_out` `[B, 1, d]`; token [B, 1]. Returns (target_token_ids [B, top_k]
        int64, best first, mapped through d2t; hidden_out [B, 1, d]).
        """
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= self.config.draft_vocab_size:
            raise ValueError(f"top_k must be an int in [1, {self.config.draft_vocab_size}], got {top_k!r}")
        if not isinstance(hidden, Tensor):
            raise TypeError(f"decode_step: hidden must be a Tensor, got {type(hidden).__name__}")
        if hidden.dim() != 3 or hidden.shape[1] != 1:
            raise ValueError(f"decode_step: hidden must have shape [B, 1, features], got {list(hidden.shape)}")
        x = self.project(hidden) if from_target else hidden
        logits, hidden_out = self.forward(x, token, cache)
        draft_ids = logits[:, -1].topk(top_k, dim=-1).indices
        return self.draft_to_target(draft_ids), hidden_out

    def ttt_forward(self, aux_hidden: Tensor, next_ids: Tensor, num_steps: int,
                    label_rows: Tensor | None = None, head: bool = True) -> list[Tensor]:
        """EAGLE3 training-time test over a whole sequence, no cache.

        aux_hidden [B, T, m * d_t]; next_ids [B, T] (token_{t+1} for each position t). Step 0 is
        `forward(fc(aux_hidden), next_ids)`; step i > 0 feeds step i-1's hidden_out at the same
        position with next_ids shifted left by i (tail padded with 0: the caller masks those
        positions), at RoPE positions t + i as in EAGLE3 / SpecForge (the draft's i-th own token
        sits i places after its target-fed pair). Query (step i, position t) attends step-0 keys at
        positions <= t and step-j keys (1 <= j <= i) at position t only. Step i at position t
        predicts token t + 2 + i. Returns num_steps logits tensors [B, T, draft_vocab].

        label_rows [B, T] bool (training: the rows whose label is in the loss): the head then runs
        only where a loss needs it, and step i returns [n_i, draft_vocab] logits at positions
        (b, s - i) for the (b, s) of ``label_rows.nonzero()`` with s >= i, in that order (the head
        is about half a step's work, and prompt and padding rows are most of a batch). Steps i >= 1
        then also skip the positions before the first label row less num_steps - 1, which no loss
        reads (a conversation's prompt): only step 0's keys are attended there.

        head=False: each step returns the head's inputs [..., d] at those positions instead of its
        logits, for a loss that applies the head itself (training.head_loss).
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
        hidden = self.project(aux_hidden)
        self._check_ids(next_ids, hidden, "next_ids")
        t = hidden.shape[1]
        positions = torch.arange(t, device=hidden.device)
        keys: list[Tensor] = []
        values: list[Tensor] = []

        start = 0  # the first position steps >= 1 compute

        def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            keys.append(k)
            values.append(v)
            return _ttt_attend(q, keys, values, self.config.sliding_window, start)

        if label_rows is not None and label_rows.shape != next_ids.shape:
            raise ValueError(f"label_rows: expected shape {list(next_ids.shape)}, got {list(label_rows.shape)}")
        label_b, label_t = label_rows.nonzero(as_tuple=True) if label_rows is not None else (None, None)
        logits = []
        ids = next_ids
        for step in range(num_steps):
            if step:
                ids = F.pad(next_ids[:, start + step :], (0, step), value=0)
            out = self._layer(hidden, ids, positions[start:] + step, attend)
            if label_rows is None:
                step_logits, hidden = self._head(out, apply=head)
            else:
                keep = label_t >= step
                step_logits, hidden = self._head(out, (label_b[keep], label_t[keep] - step - start), head)
            logits.append(step_logits)
            if step == 0 and label_rows is not None and num_steps > 1 and label_t.numel():
                # Step i reads step i-1's output at its own position only: the later steps need
                # positions from the first label row's (the last step's logits) on.
                start = max(0, int(label_t.min()) - (num_steps - 1))
                hidden = hidden[:, start:]
        return logits

    def draft_to_target(self, ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target-vocab ids (`ids + d2t[ids]`)."""
        return ids + self.d2t[ids]

    # ----------------------------------------------------------------------------- internals
    def _head(self, hidden: Tensor, rows: tuple[Tensor, Tensor] | None = None,
              apply: bool = True) -> tuple[Tensor, Tensor]:
        """(logits, the next step's `h`) from the layer output h'' (logits only at `rows`, an
        index pair into [B, T], when given; the head's inputs instead of its logits without `apply`)."""
        config = self.config
        normed = self.norm(hidden) if config.final_norm or config.norm_feedback else hidden
        source = normed if config.final_norm else hidden
        source = source if rows is None else source[rows]
        return self.lm_head(source) if apply else source, normed if config.norm_feedback else hidden

    def _layer(self, hidden: Tensor, input_ids: Tensor, position_ids: Tensor,
               attend: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Tensor:
        """The decoder layer; `attend(q, k, v)` (RoPE applied, [B, heads, T, hd]) -> [B, T, H * hd]."""
        if self.embed_tokens is None:
            raise ValueError("Eagle3Draft has no token embedding: pass the target's embedding as "
                             "embed_tokens=... (or call attach_embedding)")
        emb_weight = self.embed_tokens.weight
        if emb_weight.device != hidden.device:
            raise ValueError(f"embed_tokens is on {emb_weight.device} but the inputs are on {hidden.device}")
        layer = self.midlayer
        attn = layer.self_attn
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)
        residual = normed if self.config.norm_before_residual else hidden
        b, t, _ = x.shape
        q = attn.q_proj(x).view(b, t, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim)
        if self.config.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = attn.v_proj(x).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
        acc = _accumulate_dtype(hidden.dtype)
        angles = position_ids.to(acc).unsqueeze(-1) * self.rope_inv_freq(hidden.device, acc)
        angles = torch.cat([angles, angles], dim=-1)
        if angles.dim() == 2:
            angles = angles.unsqueeze(0)
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        h = residual + attn.o_proj(attend(_apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def _check_float(self, x: Tensor, name: str, width: int, what: str) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != width:
            raise ValueError(f"{name} must have shape [B, T, {width}] ({what}), got {list(x.shape)}")
        weight = self.fc.weight
        if x.dtype != weight.dtype:
            raise TypeError(f"{name} has dtype {x.dtype} but the draft weights are {weight.dtype}")
        if x.device != weight.device:
            raise ValueError(f"{name} is on {x.device} but the draft weights are on {weight.device}")

    @staticmethod
    def _check_ids(ids: Tensor, hidden: Tensor, name: str) -> None:
        if not isinstance(ids, Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer Tensor, got "
                            f"{ids.dtype if isinstance(ids, Tensor) else type(ids).__name__}")
        if tuple(ids.shape) != tuple(hidden.shape[:2]):
            raise ValueError(f"{name} must have shape [B, T] = {list(hidden.shape[:2])}, got {list(ids.shape)}")
        if ids.device != hidden.device:
            raise ValueError(f"{name} is on {ids.device} but hidden is on {hidden.device}")

    def _check_cache(self, cache: DraftKVCache, hidden: Tensor) -> None:
        if not isinstance(cache, DraftKVCache):
            raise TypeError(f"cache must be a DraftKVCache, got {type(cache).__name__}")
        expected = (hidden.shape[0], self.config.num_key_value_heads, self.config.head_dim)
        got = (cache.batch_size, cache.key.shape[1], cache.key.shape[3])
        if got != expected:
            raise ValueError(f"cache has [batch, kv_heads, head_dim] = {list(got)}, expected {list(expected)}")
        if cache.key.dtype != hidden.dtype or cache.key.device != hidden.device:
            raise ValueError(f"cache is {cache.key.dtype} on {cache.key.device} but hidden is {hidden.dtype} "
                             f"on {hidden.device}")
