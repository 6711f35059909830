"""Speculative decoding with an EAGLE3 draft head: chain drafting, greedy verification, rollback.

Each round the draft proposes `k` tokens one after another from its own fed-back hidden state;
the target scores the pending token plus the k proposals in one forward pass; the longest prefix
of proposals equal to the target's argmax is accepted and the target's own token follows it. The
output therefore equals the target's greedy decoding token for token, whatever the draft does
(and whatever precision it runs in).

Bookkeeping, for a sequence x_0 .. x_{S-1} whose last token x_{S-1} is still pending:
- the target's KV cache holds positions 0 .. S-2;
- the draft's KV cache holds positions 0 .. S-2, entry t built from the pair
  (target aux hidden state h_t, token x_{t+1}); its last output predicts x_S.
A round adds k-1 speculative draft entries (draft-fed features), verifies, crops the target
cache to the accepted prefix, truncates the draft cache back to S-1 entries and re-extends it
with the target's real features of the accepted positions.

Prompt lookup (`prompt_lookup=n`, `prompt_lookup.PromptLookup`): a round whose last n tokens
occurred earlier in prompt + output proposes the tokens that followed them there instead of the
draft's chain (the draft's k - 1 steps do not run; its cache is re-extended as in any round), and
`SpecResult.draft_calls["lookup_rounds"]` counts those rounds. Greedy targets copy from their prompt
and repeat themselves, where the lookup is right more often than a draft (docs/real-models.md,
"Copying"). A lookup round may propose `lookup_k` tokens, more than the draft's k: they cost no
draft steps, a copied passage is often accepted whole, and the verify forward of a small target
on a CPU costs little more for 9 positions than for 5 (docs/native-target.md, "Prompt lookup").

Draft paths. Native (`draft.native.NativeDraftDecoder`, weights in fp32, bf16 or int8): every
proposal and the re-extension over the 1 .. k+1 accepted positions are fused decode steps (for the
latter, key-and-value-only steps, `NativeDraftDecoder.cache_position`, then one `from_target=True`
step from the last position); a prompt longer than `NATIVE_EXTEND_MAX` tokens is
prefilled by one torch extend of the draft module whose keys and values go into the decoder's
cache (`NativeDraftDecoder.prefill`). Whether a draft runs natively is `draft.native.plan_decoder`'s
answer. Torch: `Eagle3Draft.extend` over each run of target positions and the torch `decode_step`
for every draft-fed proposal. `SpecResult.draft_calls` counts what ran.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Sequence, Union

import torch

from .._infra.native_names import DRAFT_BACKENDS
from .prompt_lookup import PromptLookup
from ..targets.capture import capture_hidden_states
from ..targets.target_runtime import describe_target

if TYPE_CHECKING:
    from ..draft import Eagle3Draft
    from ..draft.native import NativeDraftDecoder

# Longest span of target positions the native path extends by single fused steps; longer spans (the
# prompt prefill) run as one torch extend. Measured at d=1024 (2026-11-30): a loop of native steps
# wins up to 2 positions in fp32 and 5 in int8, the torch GEMM from 5-8 on; at SmolLM2's d=576
# (bench/bench_spec_e2e.py --part parts, 2026-12-02, 2 threads) native bf16 / int8 take 6.8 / 4.3 ms
# for 4 positions against torch's 12.9, and 27.2 / 18.9 ms for 16 against 16.0. k+1 accepted
# positions (k <= 7) therefore stay native and prompts of more than 8 tokens do not.
NATIVE_EXTEND_MAX = 8


@dataclasses.dataclass
class SpecResult:
    """Output and statistics of one `speculative_generate` call.

    `tokens` [n_new] are the generated ids (prompt excluded). The first one comes from the
    prefill forward; every later one from a verification round, so
    ``sum(accepted_lengths) + rounds == len(tokens) - 1``. `draft_calls` counts the draft calls
    that ran: ``native_steps`` (fused steps, one per draft position), ``torch_extends`` (torch
    multi-position extends), ``torch_steps`` (torch decode steps) and, with prompt lookup,
    ``lookup_rounds`` (rounds the lookup proposed); `draft_backend` says the same
    in words, e.g. "native cpu (avx512, 2 threads) int8: 123 steps"; `target_backend` how the
    target's forwards ran ("torch eager" or its `target_runtime` description).
    """

    tokens: torch.Tensor
    accepted_lengths: list[int]
    k: int
    draft_time_s: float
    target_time_s: float
    draft_backend: str
    draft_calls: dict[str, int] = dataclasses.field(default_factory=dict)
    target_backend: str = "torch eager"

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
        """counts[a] = number of rounds that accepted exactly a draft tokens, a = 0 .. k (or up to the
        longest accepted prompt-lookup proposal, which may pass k)."""
        counts = Counter(self.accepted_lengths)
        return [counts.get(a, 0) for a in range(max([self.k, *self.accepted_lengths]) + 1)]

    def to_dict(self) -> dict:
        return {
            "new_tokens": int(self.tokens.numel()), "rounds": self.rounds, "tau": self.tau,
            "histogram": self.histogram, "k": self.k, "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s, "draft_backend": self.draft_backend,
            "draft_calls": dict(self.draft_calls), "target_backend": self.target_backend,
        }


def _crop(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers cache.

    A negative argument to `crop` means "remove that many" in every transformers version
    (positive absolute lengths were dropped in 5.x).
    """
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def cache_kwarg(model) -> str:
    """The keyword `model.forward` takes its KV cache by: transformers renamed `past_key_values` to
    `cache` in 5.2x (the cache object is updated in place either way)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class _TargetRunner:
    """Forward passes of the target with its KV cache and the aux hidden states captured (none
    when `aux_layer_ids` is empty: greedy decoding)."""

    def __init__(self, target, aux_layer_ids: list[int]):
        from transformers import DynamicCache

        self.target = target
        self.layers = list(aux_layer_ids)
        self.cache = DynamicCache(config=target.config)
        self.cache_kwarg = cache_kwarg(target)
        # The prompt's prefill needs the logits of its last position only: the lm head over every
        # prompt position is a large share of a long prefill (SmolLM2: 49152 x 576 per position).
        self.keeps_logits = "logits_to_keep" in inspect.signature(target.forward).parameters
        self.seconds = 0.0
        from .._infra.threads import FreeCores

        # The verify forwards' thread team follows the cores free right now, as the native draft's does.
        self.team = FreeCores(limit=torch.get_num_threads())

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids [1, T] -> (greedy next ids [1, T], or [1, 1] for the last position when
        `last_only`; aux hidden [1, T, m*d_target] or None)."""
        start = time.perf_counter()
        team, previous = self.team(), torch.get_num_threads()
        torch.set_num_threads(team)
        kwargs = {self.cache_kwarg: self.cache, **({"logits_to_keep": 1} if last_only and self.keeps_logits else {})}
        try:
            if self.layers:
                with capture_hidden_states(self.target, layers=self.layers) as cap:
                    out = self.target(input_ids=ids, use_cache=True, **kwargs)
                aux = torch.cat([cap.states[layer] for layer in self.layers], dim=-1)
            else:
                out = self.target(input_ids=ids, use_cache=True, **kwargs)
                aux = None
        finally:
            torch.set_num_threads(previous)
        greedy = out.logits[:, -1:].argmax(dim=-1) if last_only else out.logits.argmax(dim=-1)
        self.seconds += time.perf_counter() - start
        return greedy, aux

    def crop(self, length: int) -> None:
        """Keep the first `length` positions of the KV cache (the verified ones)."""
        _crop(self.cache, length)

    def describe(self) -> str:
        return describe_target(self.target)


class ReplayTarget:
    """The target's side of speculative decoding replayed from its greedy continuation.

    Greedy chain speculative decoding against a fixed target is deterministic: whatever the draft
    proposes, the emitted tokens are the target's greedy continuation, and the features the draft
    gets are the target's states at the accepted positions. So with `ids` [T] (prompt, then the
    greedy continuation) and `features` [T, m * d_t] (the aux states at every position, one forward
    over `ids`), a verify forward is a lookup: the target's next token after a true prefix, and a
    token no draft proposes (-1) after a wrong one, which ends the accepted run exactly where a real
    verify would. `evaluation.replay_runs` drives it."""

    def __init__(self, ids: torch.Tensor, features: torch.Tensor):
        self.ids, self.features = ids.long(), features
        self.position = 0  # positions the (virtual) target cache holds
        self.seconds = 0.0

    def forward(self, ids: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        length = ids.shape[1]
        start, end = self.position, self.position + length
        true = self.ids[start:end]
        if end > len(self.ids) or int(ids[0, 0]) != int(true[0]):
            raise ValueError("ReplayTarget: asked to verify past the recorded continuation or off its path")
        matches = (ids[0] == true).long().cumprod(0).bool()  # inputs 0..j all on the true path
        following = torch.full((length,), -1, dtype=torch.long)
        known = min(length, len(self.ids) - start - 1)
        following[:known] = self.ids[start + 1 : start + 1 + known]
        greedy = torch.where(matches, following, torch.full_like(following, -1))
        self.position = end
        return greedy[None], self.features[start:end][None]

    def crop(self, length: int) -> None:
        self.position = min(self.position, length)

    def describe(self) -> str:
        return "replayed greedy continuation"


# ------------------------------------------------------------------------------------ draft paths
class _TorchDraftPath:
    """The draft module in torch: one `extend` per run of target positions, torch decode steps."""

    def __init__(self, draft, max_len: int, device: torch.device):
        self.draft = draft
        self.cache = draft.new_cache(max_len, batch_size=1, device=device)
        self.extends = 0
        self.steps = 0

    def extend(self, aux: torch.Tensor, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        """aux [1, T, m*d_t], ids [1, T] -> (target id the last position predicts, its hidden [1, 1, d])."""
        weight = getattr(getattr(self.draft, "fc", None), "weight", None)
        if isinstance(weight, torch.Tensor):
            aux = aux.to(weight.dtype)  # a half-precision draft on an fp32 target
        logits, hidden = self.draft.extend(aux, ids, self.cache)
        self.extends += 1
        return int(self.draft.draft_to_target(logits[0, -1].argmax())), hidden[:, -1:]

    def step(self, hidden: torch.Tensor, token: int) -> tuple[int, torch.Tensor]:
        """One draft-fed position: (hidden [1, 1, d], its pair token) -> (next target id, hidden)."""
        ids = torch.tensor([[token]], dtype=torch.long, device=hidden.device)
        ids, hidden = self.draft.decode_step(hidden, ids, self.cache, from_target=False)
        self.steps += 1
        return int(ids[0, 0]), hidden

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def calls(self) -> dict[str, int]:
        return {"native_steps": 0, "torch_extends": self.extends, "torch_steps": self.steps}

    def describe(self) -> str:
        weight = getattr(getattr(self.draft, "fc", None), "weight", None)
        dtype = f" {str(weight.dtype).removeprefix('torch.')}" if isinstance(weight, torch.Tensor) else ""
        return f"torch eager{dtype}: {self.extends} extends, {self.steps} steps"


class _NativeDraftPath:
    """A `NativeDraftDecoder`: one fused step per draft position, target-fed or draft-fed.

    Re-extension over the 1 .. k+1 accepted positions caches all but the last (`cache_position`: the
    key and value only) and drafts from the last with a `from_target=True` step; a
    span of more than `NATIVE_EXTEND_MAX` positions (the prompt prefill) is one torch extend whose
    keys/values go into the decoder's cache (`NativeDraftDecoder.prefill`): bench/bench_spec_e2e.py
    times both against the torch extend.
    """

    def __init__(self, decoder: "NativeDraftDecoder"):
        self.decoder = decoder
        self.steps = 0
        self.prefills = 0
        decoder.reset()

    def extend(self, aux: torch.Tensor, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        if ids.shape[1] > NATIVE_EXTEND_MAX:
            top, hidden = self.decoder.prefill(aux, ids)
            self.prefills += 1
            return int(top[0]), hidden
        if aux.dtype not in (torch.float32, torch.bfloat16):
            aux = aux.float()  # e.g. an fp16 target: the kernels read fp32 or bf16 features
        *run, last = zip(aux[0], ids[0].tolist())
        for feature, token in run:  # the accepted positions before the last are only cached
            self.decoder.cache_position(feature, token)
        top, hidden = self.decoder.step(*last, from_target=True)
        self.steps += ids.shape[1]
        return int(top[0]), hidden

    def step(self, hidden: torch.Tensor, token: int) -> tuple[int, torch.Tensor]:
        if hidden.dtype not in (torch.float32, torch.bfloat16):
            hidden = hidden.float()  # a prefill's hidden state in an fp16 module's dtype
        top, hidden = self.decoder.step(hidden, token, from_target=False)
        self.steps += 1
        return int(top[0]), hidden

    def truncate(self, length: int) -> None:
        self.decoder.truncate(length)

    def calls(self) -> dict[str, int]:
        return {"native_steps": self.steps, "torch_extends": self.prefills, "torch_steps": 0}

    def describe(self) -> str:
        prefill = f"; torch prefill: {self.prefills} extends" if self.prefills else ""
        return f"{self.decoder.describe()}: {self.steps} steps{prefill}"


def native_decoder_for(
    draft: "Eagle3Draft",
    max_len: int,
    *,
    draft_dtype: str | None = None,
    draft_backend: str = "auto",
    threads: int | None = None,
) -> "NativeDraftDecoder | None":
    """The native decoder speculative decoding runs `draft` with, or None for the torch path.

    draft_backend "torch": None (draft_dtype must be None). "native", or any explicit
    `draft_dtype`: a `NativeDraftDecoder` in `draft_dtype` (default: the draft's own fp32 / bf16),
    or ValueError naming draft_dtype and why it cannot run. "auto" without draft_dtype: native in
    the draft's own precision when possible, else a warning with the reason and None.
    `max_len`: draft positions the decoder's KV cache holds; `threads`: its CPU team (None: the
    cores free at each step, `NativeDraftDecoder`).
    """
    if draft_backend not in DRAFT_BACKENDS:
        raise ValueError(f"draft_backend: expected one of {DRAFT_BACKENDS}, got {draft_backend!r}")
    if draft_backend == "torch":
        if draft_dtype is not None:
            raise ValueError(f"draft_dtype={draft_dtype!r} selects native weights, but draft_backend='torch' "
                             "runs the draft module in its own dtype; drop one of them")
        return None
    from ..draft.native import plan_decoder

    decoder, reason = plan_decoder(draft, max_len, draft_dtype, threads=threads)
    if decoder is not None:
        return decoder
    if draft_dtype is not None or draft_backend == "native":
        raise ValueError(f"draft_dtype={draft_dtype!r} (draft_backend={draft_backend!r}): the native draft "
                         f"decode cannot run: {reason}")
    warnings.warn(f"speculative decoding runs the draft in torch, not natively: {reason}", stacklevel=3)
    return None


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


def draft_positions_needed(prompt_len: int, max_new_tokens: int, k: int) -> int:
    """KV-cache positions a draft needs for one `speculative_generate` call (upper bound)."""
    return prompt_len + max_new_tokens + k + 1


def _draft_path(draft, input_ids: torch.Tensor, max_new_tokens: int, k: int, draft_dtype: str | None,
                draft_backend: str, threads: int | None = None):
    from ..draft.native import NativeDraftDecoder

    max_len = draft_positions_needed(input_ids.shape[1], max_new_tokens, k)
    if isinstance(draft, NativeDraftDecoder):
        if draft_backend == "torch" or draft_dtype not in (None, draft.weight_dtype):
            raise ValueError(f"draft is a NativeDraftDecoder with {draft.weight_dtype} weights; it cannot run "
                             f"with draft_backend={draft_backend!r}, draft_dtype={draft_dtype!r}")
        if draft.max_len < max_len:
            raise ValueError(f"draft: the NativeDraftDecoder holds max_len={draft.max_len} positions; this call "
                             f"needs {max_len} (prompt + max_new_tokens + k + 1)")
        return _NativeDraftPath(draft)
    decoder = native_decoder_for(draft, max_len, draft_dtype=draft_dtype, draft_backend=draft_backend,
                                 threads=threads)
    if decoder is not None:
        return _NativeDraftPath(decoder)
    return _TorchDraftPath(draft, max_len, input_ids.device)


DraftLike = Union["Eagle3Draft", "NativeDraftDecoder"]


@torch.no_grad()
def speculative_generate(
    target,
    draft: DraftLike,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    k: int,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    draft_dtype: str | None = None,
    draft_backend: str = "auto",
    prompt_lookup: int | None = None,
    lookup_k: int | None = None,
) -> SpecResult:
    """Greedy speculative decoding of `target` with an EAGLE3 `draft`, batch 1.

    target: a transformers causal LM; draft: an `Eagle3Draft` (its ``config.aux_layer_ids`` name
    the target layers it reads, input-to-layer convention) or a `NativeDraftDecoder` built from one
    (reused across calls; it is reset here). input_ids: [T] or [1, T].
    draft_dtype: None, "fp32", "bf16" or "int8": the native weight precision; an explicit value
    must run natively (ValueError with the reason otherwise). draft_backend: "auto" (native in the
    draft's own precision when possible, else torch with a warning saying why), "native" or
    "torch". Generates exactly `max_new_tokens` tokens, or stops after `eos_token_id` (one id or
    several, e.g. `targets.loading.stop_token_ids`) when given. prompt_lookup: n, to propose the
    n-gram lookup's tokens in the rounds where it finds any (module docstring); None: the draft's only.
    lookup_k: the most tokens a lookup round proposes (None: k). Returns a `SpecResult` whose tokens equal the target's own greedy decoding.
    """
    input_ids = _check_inputs(input_ids, max_new_tokens, k)
    if draft.config.aux_layer_ids is None:
        raise ValueError("draft: its config has no aux_layer_ids, so the target layers it reads are unknown")
    path = _draft_path(draft, input_ids, max_new_tokens, k, draft_dtype, draft_backend)
    return speculative_loop(_TargetRunner(target, draft.config.aux_layer_ids), path, input_ids, max_new_tokens, k,
                            eos_token_id, prompt_lookup=prompt_lookup, lookup_k=lookup_k)


def check_lookup(prompt_lookup: int | None, lookup_k: int | None) -> None:
    """One line naming the argument when the prompt-lookup settings are not n >= 1 and k >= 1."""
    for name, value in (("prompt_lookup", prompt_lookup), ("lookup_k", lookup_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}: expected an int >= 1 or None, got {value!r}")
    if lookup_k is not None and prompt_lookup is None:
        raise ValueError("lookup_k: sets the length of prompt-lookup proposals; give prompt_lookup too")


def stop_set(eos_token_id: int | Sequence[int] | None) -> frozenset[int]:
    """The ids decoding stops after: none, one, or several (a chat model's end of turn and EOS)."""
    if eos_token_id is None:
        return frozenset()
    return frozenset([int(eos_token_id)] if isinstance(eos_token_id, int) else map(int, eos_token_id))


def speculative_loop(runner, path, input_ids: torch.Tensor, max_new_tokens: int, k: int,
                     eos_token_id: int | Sequence[int] | None,
                     on_token: Callable[[int], None] | None = None, *,
                     prompt_lookup: int | None = None, lookup_k: int | None = None) -> SpecResult:
    """The rounds of greedy chain speculative decoding (see the module docstring): `runner` is the
    target (`_TargetRunner`, or a `ReplayTarget`), `path` the draft (`_TorchDraftPath` or
    `_NativeDraftPath`). `on_token(id)` sees each emitted id as soon as its round has verified it.
    prompt_lookup: n of the n-gram lookup whose proposals replace the draft's where it has any;
    lookup_k: the most tokens such a proposal holds (None: k)."""
    check_lookup(prompt_lookup, lookup_k)
    lookup_k = k if lookup_k is None else lookup_k
    stops = stop_set(eos_token_id)
    device = input_ids.device
    prompt_len = input_ids.shape[1]
    draft_seconds = 0.0

    greedy, aux = runner.forward(input_ids, last_only=True)
    emitted = [int(greedy[0, -1])]
    if on_token is not None:
        on_token(emitted[0])
    lookup = None if prompt_lookup is None else PromptLookup(prompt_lookup, input_ids[0].tolist() + emitted)
    lookup_rounds = 0
    # Draft pairs (h_t, x_{t+1}) for every prompt position; the last output predicts x_{S}.
    pair_ids = torch.cat([input_ids[:, 1:], greedy[:, -1:]], dim=1)
    start = time.perf_counter()
    proposal, hidden = path.extend(aux, pair_ids)
    draft_seconds += time.perf_counter() - start

    accepted_lengths: list[int] = []
    while len(emitted) < max_new_tokens and emitted[-1] not in stops:
        seq_len = prompt_len + len(emitted)  # S; x_{S-1} = emitted[-1] is pending
        round_k = min(k, max_new_tokens - len(emitted) - 1)

        start = time.perf_counter()
        proposals = lookup.propose(min(lookup_k, max_new_tokens - len(emitted) - 1)) \
            if lookup is not None and round_k > 0 else []
        lookup_rounds += bool(proposals)
        if round_k > 0 and not proposals:
            proposals.append(proposal)
            for _ in range(round_k - 1):
                proposal, hidden = path.step(hidden, proposal)
                proposals.append(proposal)
        draft_seconds += time.perf_counter() - start

        verify = torch.tensor([[emitted[-1], *proposals]], dtype=torch.long, device=device)
        greedy, aux = runner.forward(verify)
        greedy_list = greedy[0].tolist()
        n = 0
        while n < len(proposals) and proposals[n] == greedy_list[n]:
            n += 1
        new_tokens = proposals[:n] + [greedy_list[n]]
        ends = [i for i, token in enumerate(new_tokens) if token in stops]
        if ends:
            new_tokens = new_tokens[: ends[0] + 1]
        emitted.extend(new_tokens)
        if lookup is not None:
            lookup.extend(new_tokens)
        accepted_lengths.append(len(new_tokens) - 1)
        if on_token is not None:
            for token in new_tokens:
                on_token(token)

        # Verified positions S-1 .. S-1+n stay in the target cache; the rest is rolled back.
        runner.crop(seq_len + n)
        if len(emitted) >= max_new_tokens or emitted[-1] in stops:
            break
        start = time.perf_counter()
        path.truncate(seq_len - 1)
        pair_ids = torch.tensor([new_tokens], dtype=torch.long, device=device)
        proposal, hidden = path.extend(aux[:, : len(new_tokens)], pair_ids)
        draft_seconds += time.perf_counter() - start

    return SpecResult(
        tokens=torch.tensor(emitted, dtype=torch.long), accepted_lengths=accepted_lengths, k=k,
        draft_time_s=draft_seconds, target_time_s=runner.seconds, draft_backend=path.describe(),
        draft_calls={**path.calls(), **({"lookup_rounds": lookup_rounds} if lookup is not None else {})},
        target_backend=runner.describe(),
    )


@torch.no_grad()
def greedy_generate(target, input_ids: torch.Tensor, max_new_tokens: int, *,
                    eos_token_id: int | Sequence[int] | None = None) -> torch.Tensor:
    """The target's greedy decoding, batch 1, on the forward path `speculative_generate` verifies
    with (the same KV cache and forwards; on the target runtime when the target is on it): one
    prefill of the prompt, then one 1-token forward per new token. input_ids: [T] or [1, T].
    Returns the new ids [n_new] (exactly `max_new_tokens`, or up to `eos_token_id` included), which
    `speculative_generate` on the same target reproduces."""
    input_ids = _check_inputs(input_ids, max_new_tokens, 1)
    runner = _TargetRunner(target, [])
    greedy, _ = runner.forward(input_ids, last_only=True)
    emitted = [int(greedy[0, -1])]
    stops = stop_set(eos_token_id)
    while len(emitted) < max_new_tokens and emitted[-1] not in stops:
        greedy, _ = runner.forward(torch.tensor([[emitted[-1]]], dtype=torch.long, device=input_ids.device))
        emitted.append(int(greedy[0, -1]))
    return torch.tensor(emitted, dtype=torch.long)
