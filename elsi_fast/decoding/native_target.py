"""Greedy and speculative decoding with the target on the fused native GGUF forward.

`NativeTargetRunner` is the target side of `speculative.speculative_loop` on a
`targets.native_forward.NativeForward`: one native call per forward of up to 8 tokens (a longer
prompt in forwards of 8), the aux hidden states the draft reads returned by the same call, and the
KV cache rolled back to the verified prefix. `native_greedy_generate` is the same runner without a
draft; `native_speculative_generate` emits exactly its tokens (each verify row equals a one-token
forward bit for bit, docs/native-target.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..targets.native_forward import MAX_ROWS, NativeForward
from .speculative import SpecResult, _check_inputs, _draft_path, draft_positions_needed, speculative_loop, stop_set

if TYPE_CHECKING:
    from ..draft import Eagle3Draft
    from ..draft.native import NativeDraftDecoder


class NativeTargetRunner:
    """The native forward as `speculative_loop`'s target: forward(ids [1, T]) -> (greedy ids [1, T],
    or [1, 1] for the last position when `last_only`; aux [1, T, m * d] fp32 or None)."""

    def __init__(self, native: NativeForward, aux_layer_ids: Sequence[int]):
        self.native = native
        self.layers = list(aux_layer_ids)
        self.seconds = 0.0
        native.reset()

    def forward(self, ids: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        start = time.perf_counter()
        tokens = ids[0].cpu().numpy()
        greedy, aux = [], []
        for s in range(0, len(tokens), MAX_ROWS):
            chunk = tokens[s:s + MAX_ROWS]
            last = s + len(chunk) == len(tokens)
            rows = ([len(chunk) - 1] if last else []) if last_only else list(range(len(chunk)))
            ids, states = self.native.forward_greedy(chunk, rows, self.layers)
            greedy.append(ids)
            aux.append(states.reshape(len(chunk), -1))
        self.seconds += time.perf_counter() - start
        ids_out = torch.from_numpy(np.concatenate(greedy))[None]
        return ids_out, (torch.from_numpy(np.concatenate(aux))[None] if self.layers else None)

    def crop(self, length: int) -> None:
        self.native.rollback(length)

    def describe(self) -> str:
        w = self.native.weights
        return f"native GGUF forward ({w.path.name}, {self.native.num_threads} threads)"


def target_embedding(native: NativeForward) -> torch.Tensor:
    """The target's token embedding [vocab, d] in fp32 (the GGUF rows dequantized), for a draft."""
    import gguf

    e = native.weights.embed
    return torch.from_numpy(gguf.quants.dequantize(e.blocks, gguf.GGMLQuantizationType(e.ggml_type)).astype(np.float32))


def _check_capacity(native: NativeForward, prompt_len: int, max_new_tokens: int, k: int) -> None:
    needed = draft_positions_needed(prompt_len, max_new_tokens, k)
    if needed > native.capacity:
        raise ValueError(f"max_new_tokens: the prompt ({prompt_len}) + {max_new_tokens} new tokens + k + 1 need "
                         f"{needed} KV positions; the native target holds {native.capacity}")


def native_greedy_generate(native: NativeForward, input_ids: torch.Tensor, max_new_tokens: int, *,
                           eos_token_id: int | Sequence[int] | None = None,
                           on_token: Callable[[int], None] | None = None) -> torch.Tensor:
    """Greedy decoding on the native forward: new ids [n_new] (exactly `max_new_tokens`, or up to
    `eos_token_id` included). input_ids: [T] or [1, T]. `on_token(id)` sees each id as it comes."""
    input_ids = _check_inputs(input_ids, max_new_tokens, 1)
    _check_capacity(native, input_ids.shape[1], max_new_tokens, 0)
    runner = NativeTargetRunner(native, [])
    greedy, _ = runner.forward(input_ids, last_only=True)
    emitted = [int(greedy[0, -1])]
    if on_token is not None:
        on_token(emitted[-1])
    stops = stop_set(eos_token_id)
    while len(emitted) < max_new_tokens and emitted[-1] not in stops:
        greedy, _ = runner.forward(torch.tensor([[emitted[-1]]]))
        emitted.append(int(greedy[0, -1]))
        if on_token is not None:
            on_token(emitted[-1])
    return torch.tensor(emitted, dtype=torch.long)


def _check_draft(native: NativeForward, draft: "Eagle3Draft | NativeDraftDecoder") -> None:
    cfg, w = draft.config, native.weights
    if cfg.aux_layer_ids is None:
        raise ValueError("draft: its config has no aux_layer_ids, so the target layers it reads are unknown")
    if cfg.vocab_size != w.vocab or cfg.target_hidden_size != w.hidden or max(cfg.aux_layer_ids) > w.layers:
        raise ValueError(f"draft: it reads a target with vocabulary {cfg.vocab_size}, hidden size "
                         f"{cfg.target_hidden_size} and layers {list(cfg.aux_layer_ids)}; {w.path.name} has "
                         f"{w.vocab}, {w.hidden} and {w.layers} blocks: a draft for another target")


def native_draft_decoder(native: NativeForward, draft: "Eagle3Draft", draft_dtype: str | None = None
                         ) -> "NativeDraftDecoder":
    """The native decoder of `draft` beside `native`, to build once and pass to
    `native_speculative_generate` for every prompt: its weights packed in `draft_dtype` ("fp32",
    "bf16", "int8"; None: the draft's own), a KV cache of the target's capacity, and the target's
    thread team. Building one per prompt repacks the weights and, without a fixed team, measures
    the free cores for 0.15 s (`_infra.threads.FreeCores`): about 11% of a 128-token answer
    (docs/native-target.md, Speed). ValueError naming `draft` or `draft_dtype` when it cannot run
    natively."""
    from ..draft.native import plan_decoder

    _check_draft(native, draft)
    decoder, reason = plan_decoder(draft, native.capacity, draft_dtype, threads=native.num_threads)
    if decoder is None:
        raise ValueError(f"draft_dtype={draft_dtype!r}: the draft cannot run natively: {reason}")
    return decoder


def native_speculative_generate(native: NativeForward, draft: "Eagle3Draft | NativeDraftDecoder",
                                input_ids: torch.Tensor, max_new_tokens: int, k: int, *,
                                eos_token_id: int | Sequence[int] | None = None,
                                draft_dtype: str | None = None, draft_backend: str = "auto",
                                on_token: Callable[[int], None] | None = None,
                                prompt_lookup: int | None = None, lookup_k: int | None = None) -> SpecResult:
    """Greedy speculative decoding with the target on the native forward; the tokens equal
    `native_greedy_generate`'s. The draft must have been trained for this target (its vocabulary,
    hidden size and layer ids are checked) and carry its embedding (`target_embedding`); pass a
    `native_draft_decoder` to decode several prompts (an `Eagle3Draft` is packed anew per call, its
    steps on the target's thread count). `on_token(id)` sees each id as soon as the round that
    verified it ends. prompt_lookup, lookup_k: the n-gram lookup that proposes up to lookup_k tokens
    (None: k) in the rounds where it finds any (`speculative.speculative_loop`)."""
    input_ids = _check_inputs(input_ids, max_new_tokens, k)
    _check_draft(native, draft)
    _check_capacity(native, input_ids.shape[1], max_new_tokens, k)
    path = _draft_path(draft, input_ids, max_new_tokens, k, draft_dtype, draft_backend, threads=native.num_threads)
    return speculative_loop(NativeTargetRunner(native, draft.config.aux_layer_ids), path, input_ids, max_new_tokens,
                            k, eos_token_id, on_token, prompt_lookup=prompt_lookup, lookup_k=lookup_k)
