"""Speculative decoding with an EAGLE3 draft head: chain drafting, greedy verification, rollback.

Each round the draft proposes `k` tokens one after another from its own fed-back hidden state;
the target scores the pending token plus the k proposals in one forward pass; the longest prefix
of proposals equal to the target's argmax is accepted and the target's own token follows it. The
output therefore equals the target's greedy decoding token for token, whatever the draft does.

Bookkeeping, for a sequence x_0 .. x_{S-1} whose last token x_{S-1} is still pending:
- the target's KV cache holds positions 0 .. S-2;
- the draft's KV cache holds positions 0 .. S-2, entry t built from the pair
  (target aux hidden state h_t, token x_{t+1}); its last output predicts x_S.
A round adds k-1 speculative draft entries (draft-fed features), verifies, crops the target
cache to the accepted prefix, truncates the draft cache back to S-1 entries and re-extends it
with the target's real features of the accepted positions.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from collections import Counter

import torch

from .capture import capture_hidden_states


@dataclasses.dataclass
class SpecResult:
    """Output and statistics of one `speculative_generate` call.

    `tokens` [n_new] are the generated ids (prompt excluded). The first one comes from the
    prefill forward; every later one from a verification round, so
    ``sum(accepted_lengths) + rounds == len(tokens) - 1``.
    """

    tokens: torch.Tensor
    accepted_lengths: list[int]
    k: int
    draft_time_s: float
    target_time_s: float
    draft_backend: str

    @property
    def rounds(self) -> int:
        """Verification forwards of the target (the prefill is not counted)."""
        return len(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens emitted per verification forward (accepted + 1)."""
        if not self.accepted_lengths:
            raise ValueError("SpecResult.tau: no verification round ran (max_new_tokens <= 1)")
        return (sum(self.accepted_lengths) + self.rounds) / self.rounds

    @property
    def histogram(self) -> list[int]:
        """counts[a] = number of rounds that accepted exactly a draft tokens, a = 0 .. k."""
        counts = Counter(self.accepted_lengths)
        return [counts.get(a, 0) for a in range(self.k + 1)]

    def to_dict(self) -> dict:
        return {
            "new_tokens": int(self.tokens.numel()), "rounds": self.rounds, "tau": self.tau,
            "histogram": self.histogram, "k": self.k, "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s, "draft_backend": self.draft_backend,
        }


def _draft_backend(device: torch.device) -> str:
    """Which decode path `Eagle3Draft.decode_step` takes on `device` (native op or torch)."""
    from .draft import native
    from .draft.model import DISABLE_NATIVE_ENV

    if os.environ.get(DISABLE_NATIVE_ENV, "") not in ("", "0"):
        return f"torch eager ({DISABLE_NATIVE_ENV}=1)"
    return native.describe(device)


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache.

    A negative argument to `crop` means "remove that many" in every transformers version
    (positive absolute lengths were dropped in 5.x).
    """
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class _TargetRunner:
    """Forward passes of the target with its KV cache and the aux hidden states captured."""

    def __init__(self, target, aux_layer_ids: list[int]):
        from transformers import DynamicCache

        self.target = target
        self.layers = list(aux_layer_ids)
        self.cache = DynamicCache(config=target.config)
        # transformers renamed `past_key_values` to `cache` in 5.2x; the cache object is updated
        # in place either way.
        params = inspect.signature(target.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.seconds = 0.0

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [1, T] -> (greedy next ids [1, T], aux hidden [1, T, m*d_target])."""
        start = time.perf_counter()
        with capture_hidden_states(self.target, layers=self.layers) as cap:
            out = self.target(input_ids=ids, use_cache=True, **{self.cache_kwarg: self.cache})
        aux = torch.cat([cap.states[layer] for layer in self.layers], dim=-1)
        greedy = out.logits.argmax(dim=-1)
        self.seconds += time.perf_counter() - start
        return greedy, aux


def _check_inputs(input_ids: torch.Tensor, max_new_tokens: int, k: int) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("input_ids: expected an integer tensor of token ids")
    if input_ids.ndim == 1:
        input_ids = input_ids[None]
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids: expected shape [T] or [1, T] (batch 1), got {tuple(input_ids.shape)}")
    if input_ids.shape[1] < 1:
        raise ValueError("input_ids: the prompt is empty")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k: expected an int >= 1 (draft tokens per round), got {k!r}")
    return input_ids.long()


@torch.no_grad()
def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    k: int,
    *,
    eos_token_id: int | None = None,
) -> SpecResult:
    """Greedy speculative decoding of `target` with an EAGLE3 `draft`, batch 1.

    target: a transformers causal LM; draft: an `Eagle3Draft` (its ``config.aux_layer_ids`` name
    the target layers it reads, input-to-layer convention). input_ids: [T] or [1, T].
    Generates exactly `max_new_tokens` tokens, or stops after `eos_token_id` when given.
    Returns a `SpecResult` whose tokens equal the target's own greedy decoding.
    """
    input_ids = _check_inputs(input_ids, max_new_tokens, k)
    if draft.config.aux_layer_ids is None:
        raise ValueError("draft: its config has no aux_layer_ids, so the target layers it reads are unknown")
    device = input_ids.device
    runner = _TargetRunner(target, draft.config.aux_layer_ids)
    prompt_len = input_ids.shape[1]
    cache = draft.new_cache(prompt_len + max_new_tokens + k + 1, batch_size=1, device=device)
    draft_seconds = 0.0

    greedy, aux = runner.forward(input_ids)
    emitted = [int(greedy[0, -1])]
    # Draft pairs (h_t, x_{t+1}) for every prompt position; the last output predicts x_{S}.
    pair_ids = torch.cat([input_ids[:, 1:], greedy[:, -1:]], dim=1)
    start = time.perf_counter()
    logits, hidden = draft.extend(aux, pair_ids, cache)
    draft_seconds += time.perf_counter() - start

    accepted_lengths: list[int] = []
    while len(emitted) < max_new_tokens and emitted[-1] != eos_token_id:
        seq_len = prompt_len + len(emitted)  # S; x_{S-1} = emitted[-1] is pending
        round_k = min(k, max_new_tokens - len(emitted) - 1)

        start = time.perf_counter()
        proposals: list[int] = []
        if round_k > 0:
            token = draft.draft_to_target(logits[:, -1].argmax(dim=-1, keepdim=True))  # [1, 1]
            proposals.append(int(token))
            hidden = hidden[:, -1:]
            for _ in range(round_k - 1):
                token, hidden = draft.decode_step(hidden, token, cache, from_target=False)
                token = token[:, :1]
                proposals.append(int(token))
        draft_seconds += time.perf_counter() - start

        verify = torch.tensor([[emitted[-1], *proposals]], dtype=torch.long, device=device)
        greedy, aux = runner.forward(verify)
        greedy_list = greedy[0].tolist()
        n = 0
        while n < len(proposals) and proposals[n] == greedy_list[n]:
            n += 1
        new_tokens = proposals[:n] + [greedy_list[n]]
        if eos_token_id is not None and eos_token_id in new_tokens:
            new_tokens = new_tokens[: new_tokens.index(eos_token_id) + 1]
        emitted.extend(new_tokens)
        accepted_lengths.append(len(new_tokens) - 1)

        # Verified positions S-1 .. S-1+n stay in the target cache; the rest is rolled back.
        _crop(runner.cache, seq_len + n)
        if len(emitted) >= max_new_tokens or emitted[-1] == eos_token_id:
            break
        start = time.perf_counter()
        cache.truncate(seq_len - 1)
        pair_ids = torch.tensor([new_tokens], dtype=torch.long, device=device)
        logits, hidden = draft.extend(aux[:, : len(new_tokens)], pair_ids, cache)
        draft_seconds += time.perf_counter() - start

    return SpecResult(
        tokens=torch.tensor(emitted, dtype=torch.long), accepted_lengths=accepted_lengths, k=k,
        draft_time_s=draft_seconds, target_time_s=runner.seconds,
        draft_backend=_draft_backend(device),
    )
