"""Batched generation on the native forward (docs/native-target.md): the engine `regenerate` and
`self_instruct` use with `--engine native`.

Up to `sequences` prompts decode together: each step is one forward with one row per active
sequence, so the quantized products read the weights once for all of them, and a row's logits
equal those of the same row forwarded alone (`NativeForward`, tests/decoding). A finished answer
frees its sequence for the next prompt, which is prefilled alone (continuous batching). Greedy at
temperature 0; else plain sampling from softmax(logits / temperature) with one seeded generator
per prompt, so an answer depends on its prompt and seed only, not on what it was batched with.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ..targets.native_forward import MAX_ROWS, NativeForward


class NativeBatchGenerator:
    """Answers token-id prompts on `model` (a `NativeForward` with `sequences` > 1 for batching), with
    the interface of `engines.llamacpp_server.LlamaServer.generate`. A token of `end_of_generation`
    outside a call's `stop` ids (an end of turn the file names: `targets.loading.end_of_generation_ids`)
    ends an answer too and is written as stop[0], as llama-server's answers are."""

    ENGINE = "native"  # the name regenerate.json and self_instruct.json record

    def __init__(self, model: NativeForward, end_of_generation: Sequence[int] = ()):
        if model.sequences > MAX_ROWS:
            raise ValueError(f"model: a forward takes {MAX_ROWS} rows, so at most {MAX_ROWS} sequences decode "
                             f"together, got {model.sequences}")
        self.model = model
        self.end_of_generation = tuple(end_of_generation)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float,
                 seeds: Sequence[int], stop: Sequence[int]) -> Iterator[tuple[int, list[int]]]:
        """(prompt index, new tokens) in the order they finish: each answer ends after the first
        `stop` id or an end-of-generation token, or at max_new_tokens."""
        model = self.model
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be positive, got {max_new_tokens}")
        if not stop:
            raise ValueError("stop: at least one end-of-answer id is needed")
        if len(seeds) != len(prompts):
            raise ValueError(f"seeds: one per prompt ({len(prompts)}), got {len(seeds)}")
        for i, prompt in enumerate(prompts):
            if not len(prompt):
                raise ValueError(f"prompts: prompt {i} is empty")
            if len(prompt) + max_new_tokens > model.capacity:
                raise ValueError(f"prompts: prompt {i} ({len(prompt)} tokens) and {max_new_tokens} new tokens "
                                 f"exceed the KV cache capacity of {model.capacity}")
        stops, ends = set(stop), set(self.end_of_generation) - set(stop)
        model.reset()
        waiting = iter(range(len(prompts)))
        # per sequence: [prompt index, answer so far, next token, its generator] or None when free
        slots: list[list | None] = [None] * model.sequences

        def choose(logits: np.ndarray, rng: np.random.Generator | None) -> int:
            if rng is None:
                return int(np.argmax(logits))
            scaled = (logits.astype(np.float64) - logits.max()) / temperature
            p = np.exp(scaled)
            return int(rng.choice(logits.shape[0], p=p / p.sum()))

        def start(seq: int) -> None:
            index = next(waiting, None)
            if index is not None:
                model.rollback(0, seq)
                rng = np.random.default_rng(seeds[index]) if temperature > 0 else None
                slots[seq] = [index, [], choose(model.prefill(prompts[index], seq), rng), rng]

        def finished(slot: list) -> bool:
            answer, token = slot[1], slot[2]
            if token in ends:
                answer.append(stop[0])
                return True
            answer.append(token)
            return token in stops or len(answer) == max_new_tokens

        for seq in range(model.sequences):
            start(seq)
        while True:
            for seq in range(model.sequences):  # take each sequence's chosen token
                while slots[seq] is not None and finished(slots[seq]):
                    done, slots[seq] = slots[seq], None
                    yield done[0], done[1]
                    start(seq)
            active = [seq for seq, slot in enumerate(slots) if slot is not None]
            if not active:
                return
            logits, _ = model.forward([slots[seq][2] for seq in active], sequences=active)
            for row, seq in enumerate(active):
                slots[seq][2] = choose(logits[row], slots[seq][3])
