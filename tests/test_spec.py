"""speculative_generate: output equals the target's greedy decoding, statistics, rollback."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from elsi_fast.draft import Eagle3Config, Eagle3Draft
from elsi_fast.spec import SpecResult, speculative_generate

VOCAB = 61


def _llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def _qwen3():
    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=12, max_position_embeddings=128)
    return Qwen3ForCausalLM(cfg).eval()


TARGETS = {"llama": _llama(), "qwen3": _qwen3()}


def greedy_reference(model, ids: torch.Tensor, n: int) -> list[int]:
    """Greedy decoding by full recomputation (no KV cache): independent of any cache logic."""
    seq = ids.tolist()
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def random_draft(target, layers, seed: int, draft_vocab_size: int = 40) -> Eagle3Draft:
    torch.manual_seed(seed)
    tc = target.config
    config = Eagle3Config(hidden_size=16, intermediate_size=24, num_attention_heads=2, num_key_value_heads=1,
                          vocab_size=tc.vocab_size, draft_vocab_size=draft_vocab_size,
                          target_hidden_size=tc.hidden_size, aux_layer_ids=tuple(layers))
    embed = torch.randn(tc.vocab_size, 16)
    draft = Eagle3Draft(config, embed).eval()
    # A non-identity vocabulary so the d2t remap is exercised: every other target id.
    draft.set_draft_vocab(torch.arange(draft_vocab_size) * (tc.vocab_size // draft_vocab_size))
    return draft


class _OracleCache:
    def __init__(self):
        self.tokens: list[int] = []  # the pair token x_{t+1} of every cached position t
        self.aux: list[torch.Tensor | None] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        assert 0 <= n <= self.length
        del self.tokens[n:], self.aux[n:]


class OracleDraft:
    """A test double of the draft whose proposals come from the target itself.

    It rebuilds the sequence from the pair tokens in its cache (position t holds x_{t+1}) and
    proposes the target's greedy next token, so with `error_rate=0` every proposal is accepted,
    provided speculative_generate keeps the cache exactly in step (truncation, re-extension).
    With `error_rate > 0` a seeded fraction of proposals is replaced by a wrong token. It also
    records the aux hidden states it is given, per position, for comparison with the target's.
    """

    def __init__(self, target, first_token: int, layers, error_rate: float = 0.0, seed: int = 0):
        self.target = target
        self.first_token = first_token
        self.config = type("Cfg", (), {"aux_layer_ids": tuple(layers)})()
        self.error_rate = error_rate
        self.rng = torch.Generator().manual_seed(seed)
        self.cache = None

    def new_cache(self, max_len, batch_size=1, device=None, dtype=None):
        self.cache = _OracleCache()
        return self.cache

    def _propose(self, cache) -> int:
        with torch.no_grad():
            seq = torch.tensor([[self.first_token, *cache.tokens]])
            best = int(self.target(input_ids=seq).logits[0, -1].argmax())
        if torch.rand((), generator=self.rng) < self.error_rate:
            best = (best + 1) % VOCAB
        return best

    def _one_hot(self, token: int) -> torch.Tensor:
        logits = torch.zeros(1, 1, VOCAB)
        logits[0, 0, token] = 1.0
        return logits

    def extend(self, aux, ids, cache):
        assert aux.shape[:2] == ids.shape
        for t in range(ids.shape[1]):
            cache.tokens.append(int(ids[0, t]))
            cache.aux.append(aux[0, t])
        return self._one_hot(self._propose(cache)), torch.zeros(1, ids.shape[1], 4)

    def decode_step(self, hidden, token, cache, from_target, top_k=1):
        assert not from_target and hidden.shape == (1, 1, 4) and token.shape == (1, 1)
        cache.tokens.append(int(token))
        cache.aux.append(None)
        return torch.tensor([[self._propose(cache)]]), hidden

    def draft_to_target(self, ids):
        return ids


PROMPTS = [[3, 17, 5], [8], [44, 2, 9, 31, 12, 7, 7, 19, 50, 1]]


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["p3", "p1", "p10"])
def test_random_draft_output_equals_greedy(name, k, prompt):
    target = TARGETS[name]
    n_layers = target.config.num_hidden_layers
    draft = random_draft(target, [0, n_layers] if k != 3 else [1], seed=k)
    ids = torch.tensor(prompt)
    result = speculative_generate(target, draft, ids, 15, k)
    assert result.tokens.tolist() == greedy_reference(target, ids, 15)
    assert sum(result.accepted_lengths) + result.rounds == len(result.tokens) - 1
    assert sum(result.histogram) == result.rounds
    assert all(0 <= a <= k for a in result.accepted_lengths)


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_draft_accepts_everything(name, k):
    target = TARGETS[name]
    prompt = torch.tensor(PROMPTS[2])
    n_new = 1 + 4 * (k + 1)  # prefill token, then four full rounds
    draft = OracleDraft(target, first_token=PROMPTS[2][0], layers=[1, 2])
    result = speculative_generate(target, draft, prompt, n_new, k)
    assert result.tokens.tolist() == greedy_reference(target, prompt, n_new)
    assert result.accepted_lengths == [k] * 4
    assert result.tau == k + 1
    assert result.histogram == [0] * k + [4]


@pytest.mark.parametrize("error_rate", [0.3, 0.6])
def test_partial_acceptance_rolls_back_both_caches(error_rate):
    target = TARGETS["llama"]
    prompt = torch.tensor(PROMPTS[0])
    draft = OracleDraft(target, first_token=PROMPTS[0][0], layers=[0, 2], error_rate=error_rate, seed=3)
    n_new = 30
    result = speculative_generate(target, draft, prompt, n_new, 4)
    expected = greedy_reference(target, prompt, n_new)
    assert result.tokens.tolist() == expected
    # Some rounds accept a prefix and are rolled back, some accept all: both paths ran.
    assert any(0 < a < 4 for a in result.accepted_lengths)
    assert sum(result.accepted_lengths) + result.rounds == n_new - 1
    # After the last round the draft cache holds exactly positions 0 .. S-2 of the final
    # sequence, each with the target's real aux states, whatever was rolled back before.
    sequence = PROMPTS[0] + expected
    cache = draft.cache
    assert cache.tokens == sequence[1 : len(cache.tokens) + 1]
    with torch.no_grad():
        out = target(input_ids=torch.tensor([sequence]), output_hidden_states=True)
    reference = torch.cat([out.hidden_states[0], out.hidden_states[2]], dim=-1)[0]
    for t, aux in enumerate(cache.aux):
        assert aux is not None, f"position {t} still holds a draft-fed entry after rollback"
        torch.testing.assert_close(aux, reference[t], rtol=1e-4, atol=1e-5)


def test_eos_stops_generation():
    target = TARGETS["llama"]
    prompt = torch.tensor(PROMPTS[2])
    expected = greedy_reference(target, prompt, 12)
    eos = expected[5]
    stop = expected.index(eos)
    draft = OracleDraft(target, first_token=PROMPTS[2][0], layers=[1])
    result = speculative_generate(target, draft, prompt, 12, 3, eos_token_id=eos)
    assert result.tokens.tolist() == expected[: stop + 1]


def test_tau_and_histogram_from_known_rounds():
    result = SpecResult(tokens=torch.zeros(9, dtype=torch.long), accepted_lengths=[3, 0, 1], k=3,
                        draft_time_s=0.0, target_time_s=0.0, draft_backend="torch eager")
    assert result.rounds == 3
    assert result.tau == pytest.approx(7 / 3)
    assert result.histogram == [1, 1, 0, 1]


def test_bad_inputs():
    target = TARGETS["llama"]
    draft = random_draft(target, [1], seed=0)
    with pytest.raises(ValueError, match="k"):
        speculative_generate(target, draft, torch.tensor([1, 2]), 5, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, draft, torch.tensor([1, 2]), 0, 2)
    with pytest.raises(ValueError, match="batch 1"):
        speculative_generate(target, draft, torch.tensor([[1, 2], [3, 4]]), 5, 2)
    with pytest.raises(TypeError, match="input_ids"):
        speculative_generate(target, draft, torch.tensor([1.0, 2.0]), 5, 2)
    no_layers = Eagle3Draft(Eagle3Config(hidden_size=16, intermediate_size=24, num_attention_heads=2,
                                         num_key_value_heads=1, vocab_size=VOCAB, target_hidden_size=32))
    with pytest.raises(ValueError, match="aux_layer_ids"):
        speculative_generate(target, no_layers, torch.tensor([1, 2]), 5, 2)
    with pytest.raises(ValueError, match="tau"):
        SpecResult(torch.zeros(1, dtype=torch.long), [], 2, 0.0, 0.0, "").tau
