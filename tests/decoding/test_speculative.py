"""speculative_generate: output equals the target's greedy decoding, statistics, rollback."""

from __future__ import annotations

import json
from collections import Counter
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from test_prompt_lookup import reference_proposal  # tests/decoding is on sys.path (no __init__.py)

from elsi_fast.decoding.speculative import NATIVE_EXTEND_MAX, SpecResult, greedy_generate, speculative_generate
from elsi_fast.draft import Eagle3Config, Eagle3Draft, native, read_draft, write_draft
from elsi_fast.draft.native import DISABLE_NATIVE_ENV

requires_native = pytest.mark.skipif(not native.available("cpu"),
                                     reason=f"native extension not built: {native.describe('cpu')}")

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


_GREEDY: dict[tuple, list[int]] = {}


def greedy_reference(model, ids: torch.Tensor, n: int) -> list[int]:
    """Greedy decoding by full recomputation (no KV cache): independent of any cache logic.
    Memoized per (model, prompt, n): every draft path is checked against the same reference."""
    key = (id(model), tuple(ids.tolist()), n)
    if key not in _GREEDY:
        seq = ids.tolist()
        with torch.no_grad():
            for _ in range(n):
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        _GREEDY[key] = seq[len(ids):]
    return list(_GREEDY[key])


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
# (draft_dtype, draft_backend) of every draft path a user can pick.
PATHS = [(None, "torch"), ("fp32", "native"), ("bf16", "native"), ("int8", "native")]


def draft_work(prompt_len: int, result: SpecResult, max_new_tokens: int) -> tuple[int, int, int]:
    """(prefill positions, fed-back steps, re-extended positions) speculative decoding must run,
    from the round bookkeeping alone: the prompt, k_r - 1 fed-back proposals in round r, and the
    accepted a_r + 1 positions re-extended after every round but the last."""
    fed_back, reextended, emitted = 0, 0, 1
    for i, accepted in enumerate(result.accepted_lengths):
        fed_back += max(min(result.k, max_new_tokens - emitted - 1) - 1, 0)
        emitted += accepted + 1
        if i < result.rounds - 1:
            reextended += accepted + 1
    return prompt_len, fed_back, reextended



def native_calls(prompt_len: int, result: SpecResult, max_new_tokens: int) -> dict[str, int]:
    """The native path's expected call counts: every fed-back proposal and re-extended position is
    one fused step; the prefill too, unless the prompt is longer than NATIVE_EXTEND_MAX, when it is
    one torch extend (NativeDraftDecoder.prefill)."""
    prefill, fed_back, reextended = draft_work(prompt_len, result, max_new_tokens)
    torch_prefill = prefill > NATIVE_EXTEND_MAX
    return {"native_steps": (0 if torch_prefill else prefill) + fed_back + reextended,
            "torch_extends": int(torch_prefill), "torch_steps": 0}

def _path_params():
    return [pytest.param(dtype, backend, id=dtype or backend,
                         marks=requires_native if backend == "native" else ()) for dtype, backend in PATHS]


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["p3", "p1", "p10"])
@pytest.mark.parametrize("draft_dtype, draft_backend", _path_params())
def test_random_draft_output_equals_greedy(name, k, prompt, draft_dtype, draft_backend):
    target = TARGETS[name]
    n_layers = target.config.num_hidden_layers
    draft = random_draft(target, [0, n_layers] if k != 3 else [1], seed=k)
    ids = torch.tensor(prompt)
    result = speculative_generate(target, draft, ids, 15, k, draft_dtype=draft_dtype, draft_backend=draft_backend)
    # Verification is exact, so even int8 draft weights leave the output equal to greedy decoding.
    assert result.tokens.tolist() == greedy_reference(target, ids, 15)
    assert sum(result.accepted_lengths) + result.rounds == len(result.tokens) - 1
    assert sum(result.histogram) == result.rounds
    assert all(0 <= a <= k for a in result.accepted_lengths)
    prefill, fed_back, reextended = draft_work(len(prompt), result, 15)
    if draft_backend == "native":
        # Every proposal and re-extension ran as a fused step; the prefill too unless the prompt is long.
        calls = native_calls(len(prompt), result, 15)
        assert result.draft_calls == calls
        prefill_note = "; torch prefill: 1 extends" if calls["torch_extends"] else ""
        assert result.draft_backend.startswith("native cpu") and result.draft_backend.endswith(
            f"{draft_dtype}: {calls['native_steps']} steps{prefill_note}")
    else:
        # One extend for the prompt and one per re-extension; torch decode steps for fed-back proposals.
        assert result.draft_calls == {"native_steps": 0, "torch_extends": result.rounds, "torch_steps": fed_back}
        assert result.draft_backend == f"torch eager float32: {result.rounds} extends, {fed_back} steps"


@pytest.mark.parametrize("n, lookup_k", [(1, None), (2, None), (2, 9)])
@pytest.mark.parametrize("draft_backend", ["torch", pytest.param("native", marks=requires_native)])
def test_prompt_lookup_proposes_in_the_rounds_whose_ngram_recurs(n, lookup_k, draft_backend):
    """The output is still greedy; a round is the lookup's exactly when its context's last n tokens
    occurred before, and then it accepts as many tokens as the brute-force proposal (the lookup_k or
    k tokens that followed their latest earlier occurrence) shares with the output, round by round."""
    target = TARGETS[sorted(TARGETS)[0]]
    draft = random_draft(target, [1], seed=7)
    prompt = [3, 9, 4, 3, 9, 4, 3, 9, 1, 2, 3, 9]  # repeats, so the lookup has something to find
    k, new = 4, 40
    result = speculative_generate(target, draft, torch.tensor(prompt), new, k, prompt_lookup=n, lookup_k=lookup_k,
                                  draft_backend=draft_backend)
    tokens = result.tokens.tolist()
    assert tokens == greedy_reference(target, torch.tensor(prompt), new)
    expected, emitted = 0, 1
    for accepted in result.accepted_lengths:
        context = prompt + tokens[:emitted]
        if min(k, new - emitted - 1) > 0:  # a last round with one token left proposes nothing
            proposal = reference_proposal(context, n, min(lookup_k or k, new - emitted - 1))
            if proposal:
                expected += 1
                matched = next((i for i, (a, b) in enumerate(zip(proposal, tokens[emitted:])) if a != b),
                               min(len(proposal), len(tokens) - emitted))
                assert accepted == matched
        emitted += accepted + 1
    assert result.draft_calls["lookup_rounds"] == expected > 0
    assert max(result.accepted_lengths) <= (lookup_k or k) and sum(result.histogram) == result.rounds
    if lookup_k is not None:
        assert max(result.accepted_lengths) > k  # a copied run longer than the draft's chain, accepted in one round
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="^prompt_lookup: expected an int >= 1 or None"):
            speculative_generate(target, draft, torch.tensor(prompt), 4, 2, prompt_lookup=bad)
        with pytest.raises(ValueError, match="^lookup_k: expected an int >= 1 or None"):
            speculative_generate(target, draft, torch.tensor(prompt), 4, 2, prompt_lookup=2, lookup_k=bad)
    with pytest.raises(ValueError, match="^lookup_k: sets the length of prompt-lookup proposals; give prompt_lookup"):
        speculative_generate(target, draft, torch.tensor(prompt), 4, 2, lookup_k=8)


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_draft_accepts_everything(name, k):
    target = TARGETS[name]
    prompt = torch.tensor(PROMPTS[2])
    n_new = 1 + 4 * (k + 1)  # prefill token, then four full rounds
    draft = OracleDraft(target, first_token=PROMPTS[2][0], layers=[1, 2])
    result = speculative_generate(target, draft, prompt, n_new, k, draft_backend="torch")
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
    result = speculative_generate(target, draft, prompt, n_new, 4, draft_backend="torch")
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
    result = speculative_generate(target, draft, prompt, 12, 3, eos_token_id=eos, draft_backend="torch")
    assert result.tokens.tolist() == expected[: stop + 1]


def test_several_stop_ids_stop_at_the_first_of_them():
    """A chat model ends a turn with its end-of-turn token or EOS: decoding stops after whichever
    comes first, inside a verified round too (the draft proposes the whole greedy chain)."""
    target = TARGETS["llama"]
    prompt = torch.tensor(PROMPTS[2])
    expected = greedy_reference(target, prompt, 12)
    late, early = expected[7], expected[4]
    stop = min(expected.index(late), expected.index(early))
    never = next(i for i in range(target.config.vocab_size) if i not in expected)
    draft = OracleDraft(target, first_token=PROMPTS[2][0], layers=[1])
    result = speculative_generate(target, draft, prompt, 12, 3, eos_token_id=[never, late, early], draft_backend="torch")
    assert result.tokens.tolist() == expected[: stop + 1]
    assert greedy_generate(target, prompt, 12, eos_token_id=(late, early)).tolist() == expected[: stop + 1]
    assert speculative_generate(target, draft, prompt, 12, 3, eos_token_id=[never],
                                draft_backend="torch").tokens.tolist() == expected


def test_prompts_are_cut_to_their_last_tokens_as_regenerate_cuts_them():
    """eval-draft's --max-prompt-tokens keeps a prompt's end: a chat prompt's generation prompt
    (the assistant marker) is what the answer continues."""
    from elsi_fast.analysis.prompts import Prompt, encode_prompt, prompts_by_category

    class Chars:
        chat_template = None

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    prompts = [Prompt(text="abcdefgh", category="x"), Prompt(text="xyz", category="x")]
    grouped = prompts_by_category(prompts, Chars(), None, 4)
    assert grouped == {"x": [[ord(c) for c in "efgh"], [ord(c) for c in "xyz"]]}
    assert prompts_by_category(prompts, Chars())["x"][0] == encode_prompt(prompts[0], Chars())


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


# ----------------------------------------------------------------------------- choosing the draft path
@requires_native
def test_auto_mode_runs_every_draft_step_natively():
    target = TARGETS["qwen3"]
    draft = random_draft(target, [1], seed=4)
    ids = torch.tensor(PROMPTS[2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto mode must not fall back here
        result = speculative_generate(target, draft, ids, 20, 4)
    assert result.tokens.tolist() == greedy_reference(target, ids, 20)
    assert len(PROMPTS[2]) > NATIVE_EXTEND_MAX  # its prefill is the one torch extend
    assert result.draft_calls == native_calls(len(PROMPTS[2]), result, 20) == {
        "native_steps": sum(draft_work(len(PROMPTS[2]), result, 20)[1:]), "torch_extends": 1, "torch_steps": 0}
    assert "fp32" in result.draft_backend


@requires_native
def test_fp16_draft_falls_back_with_a_warning_in_auto_mode_and_converts_when_asked():
    target = TARGETS["llama"]
    draft = random_draft(target, [1, 3], seed=5).to(torch.float16)
    ids = torch.tensor(PROMPTS[0])
    expected = greedy_reference(target, ids, 12)
    with pytest.warns(UserWarning, match="float16"):
        result = speculative_generate(target, draft, ids, 12, 3)
    assert result.tokens.tolist() == expected
    assert result.draft_calls["native_steps"] == 0 and result.draft_calls["torch_extends"] == result.rounds
    assert result.draft_backend.startswith("torch eager float16")
    # An explicit precision converts the fp16 weights once and runs natively.
    result = speculative_generate(target, draft, ids, 12, 3, draft_dtype="bf16")
    assert result.tokens.tolist() == expected
    assert result.draft_calls == native_calls(len(PROMPTS[0]), result, 12)


def test_requested_native_path_that_cannot_run_raises_and_auto_warns(monkeypatch):
    target = TARGETS["llama"]
    draft = random_draft(target, [1], seed=6)
    ids = torch.tensor(PROMPTS[0])
    monkeypatch.setenv(DISABLE_NATIVE_ENV, "1")
    for dtype in ("fp32", "bf16", "int8"):
        with pytest.raises(ValueError, match=f"draft_dtype='{dtype}'.*{DISABLE_NATIVE_ENV}"):
            speculative_generate(target, draft, ids, 8, 3, draft_dtype=dtype)
    with pytest.raises(ValueError, match=f"draft_dtype=None.*'native'.*{DISABLE_NATIVE_ENV}"):
        speculative_generate(target, draft, ids, 8, 3, draft_backend="native")
    with pytest.warns(UserWarning, match=DISABLE_NATIVE_ENV):
        result = speculative_generate(target, draft, ids, 8, 3)
    assert result.draft_calls["native_steps"] == 0
    assert result.tokens.tolist() == greedy_reference(target, ids, 8)


@requires_native
def test_draft_variant_the_op_lacks_raises_with_the_config_reason():
    target = TARGETS["llama"]
    draft = random_draft(target, [1], seed=7)
    # The hook Eagle3Config offers for architecture variants the fused op does not implement.
    draft.config.native_unsupported_reason = lambda: "norm_before_residual drafts are not fused"
    with pytest.raises(ValueError, match="draft_dtype='int8'.*norm_before_residual"):
        speculative_generate(target, draft, torch.tensor(PROMPTS[0]), 8, 3, draft_dtype="int8")
    with pytest.warns(UserWarning, match="norm_before_residual"):
        result = speculative_generate(target, draft, torch.tensor(PROMPTS[0]), 8, 3)
    assert result.draft_calls["native_steps"] == 0


def test_conflicting_path_arguments():
    target = TARGETS["llama"]
    draft = random_draft(target, [1], seed=8)
    ids = torch.tensor(PROMPTS[0])
    with pytest.raises(ValueError, match="draft_dtype='int8'.*torch"):
        speculative_generate(target, draft, ids, 8, 3, draft_dtype="int8", draft_backend="torch")
    with pytest.raises(ValueError, match="draft_dtype"):
        speculative_generate(target, draft, ids, 8, 3, draft_dtype="fp16")
    with pytest.raises(ValueError, match="draft_backend"):
        speculative_generate(target, draft, ids, 8, 3, draft_backend="cuda")


@requires_native
def test_a_decoder_is_reused_across_calls():
    target = TARGETS["qwen3"]
    draft = random_draft(target, [0, 2], seed=9)
    decoder = native.NativeDraftDecoder(draft, weight_dtype="int8", max_len=64)
    for prompt in PROMPTS:
        ids = torch.tensor(prompt)
        result = speculative_generate(target, decoder, ids, 15, 3)
        assert result.tokens.tolist() == greedy_reference(target, ids, 15)
        assert result.draft_calls == native_calls(len(prompt), result, 15)
    with pytest.raises(ValueError, match="max_len=64"):
        speculative_generate(target, decoder, torch.tensor(PROMPTS[2]), 60, 3)
    with pytest.raises(ValueError, match="int8 weights"):
        speculative_generate(target, decoder, torch.tensor(PROMPTS[2]), 5, 3, draft_dtype="bf16")


@requires_native
def test_eval_draft_int8_runs_every_draft_step_natively(tmp_path, capsys):
    from elsi_fast.analysis.prompts import load_prompts
    from elsi_fast.analysis.prompts import prompts_by_category
    from elsi_fast.cli import main
    from elsi_fast.decoding.evaluation import speculative_runs
    from elsi_fast.targets.loading import load_model, stop_token_ids
    from elsi_fast.targets.toy_targets import TargetRecipe, build_target
    from elsi_fast.training.train import draft_config_for

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n\n".join(f"the {w} went to the market on day {i}." for i, w in
                                              enumerate(["cat", "dog", "bird", "king"] * 6)))
    recipe = TargetRecipe(name="spec-tiny", source=str(corpus), vocab_size=300, hidden_size=16,
                          intermediate_size=24, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
                          seq_len=16, batch_size=2, steps=2, warmup=1)
    target_dir = build_target(recipe, cache_dir=tmp_path / "cache", progress=False)
    model, tokenizer = load_model(target_dir, device="cpu", dtype="float32")
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_config_for(model, [2], 64), model.get_input_embeddings().weight.detach())
    for param in draft.parameters():
        torch.nn.init.normal_(param, std=0.3)
    write_draft(draft, tmp_path / "draft")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"category": cat, "turns": [text]}) for cat, text in
                                 [("qa", "the cat went to"), ("qa", "the king went"), ("rag", "on day 3 the")]))
    out = tmp_path / "eval.json"
    assert main(["eval-draft", "--target", str(target_dir), "--draft", str(tmp_path / "draft"), "--prompts",
                 str(prompts), "--k", "3", "--max-new-tokens", "12", "--draft-dtype", "int8", "--json", str(out),
                 "--no-progress"]) == 0
    report = json.loads(out.read_text())
    assert report["draft_backend"].startswith("native cpu") and report["draft_backend"].endswith("int8")
    # The same runs through the Python API, to count the draft positions independently.
    draft = read_draft(tmp_path / "draft", embed_tokens=model.get_input_embeddings().weight.detach())
    grouped = prompts_by_category(load_prompts(str(prompts)), tokenizer, None, 256)
    runs = speculative_runs(model, draft, grouped, k=3, max_new_tokens=12, draft_dtype="int8",
                            eos_token_id=stop_token_ids(model, tokenizer))
    expected = Counter()
    for cat, results in runs.items():
        for ids, result in zip(grouped[cat], results):
            expected.update(native_calls(len(ids), result, 12))
    assert report["draft_calls"] == {key: expected[key] for key in ("native_steps", "torch_extends", "torch_steps")}
    assert report["draft_calls"]["torch_steps"] == 0
    assert "draft backend: native cpu" in capsys.readouterr().out
