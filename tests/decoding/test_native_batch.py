"""Batched generation on the native forward (`decoding.native_batch`) on a tiny GGUF Llama: each
answer equals the same prompt decoded alone (greedy: `NativeForward.greedy`; sampled: the same
seeded draws from the one-sequence logits), whatever it was batched with and in whatever order the
answers finish."""

from __future__ import annotations

import numpy as np
import pytest

from elsi_fast._infra._extension import _C
from elsi_fast.decoding.native_batch import NativeBatchGenerator
from elsi_fast.targets.native_forward import NativeForward
from conftest import assert_usage_errors  # tests/ is on sys.path
from tiny_gguf import write_tiny

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(_C is None, reason="native extension not built")

PROMPTS = [[3, 17, 69], [5], [23, 23, 7, 8, 9, 10, 11, 12, 13, 14], [42, 8], [61, 30, 2, 9], [1, 2, 3]]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny(path, q_type="Q4_1")
    return path


def sampled_alone(model: NativeForward, prompt: list[int], new: int, temperature: float, seed: int,
                  stop: set[int]) -> list[int]:
    """Plain softmax sampling, one sequence, float64 probabilities: the reference draws."""
    rng = np.random.default_rng(seed)

    def draw(logits):
        p = np.exp((logits.astype(np.float64) - logits.max()) / temperature)
        return int(rng.choice(len(p), p=p / p.sum()))

    model.reset()
    out = [draw(model.prefill(prompt))]
    while len(out) < new and out[-1] not in stop:
        out.append(draw(model.forward([out[-1]])[0][0]))
    return out


@pytest.mark.parametrize("sequences", [1, 3, 8])
def test_greedy_answers_equal_each_prompt_decoded_alone(path, sequences):
    one = NativeForward(path, capacity=32)
    stop = [0, 2]
    expected = [one.greedy(p, 12, stop) for p in PROMPTS]
    assert any(e[-1] in stop for e in expected) and any(len(e) == 12 for e in expected)  # both endings occur
    generator = NativeBatchGenerator(NativeForward(path, capacity=32, sequences=sequences))
    got = dict(generator.generate(PROMPTS, 12, 0.0, list(range(len(PROMPTS))), stop))
    assert got == dict(enumerate(expected))


def test_sampled_answers_depend_on_their_prompt_and_seed_only(path):
    one = NativeForward(path, capacity=32)
    seeds = [7, 8, 9, 10, 11, 12]
    expected = [sampled_alone(one, p, 10, 0.9, s, {0}) for p, s in zip(PROMPTS, seeds)]
    batched = NativeBatchGenerator(NativeForward(path, capacity=32, sequences=4))
    assert dict(batched.generate(PROMPTS, 10, 0.9, seeds, [0])) == dict(enumerate(expected))
    assert dict(batched.generate(PROMPTS, 10, 0.9, [s + 1 for s in seeds], [0])) != dict(enumerate(expected))


def test_an_end_of_generation_token_ends_the_answer_as_the_first_stop_id(path):
    one = NativeForward(path, capacity=32)
    free = [one.greedy(p, 12) for p in PROMPTS]
    end = free[0][3]  # a token the first answer writes: it ends there now
    generator = NativeBatchGenerator(NativeForward(path, capacity=32, sequences=2), end_of_generation=[end])
    got = dict(generator.generate(PROMPTS, 12, 0.0, [0] * len(PROMPTS), stop=[99]))
    for i, answer in enumerate(free):
        cut = next((k for k, t in enumerate(answer) if t == end), None)
        assert got[i] == (answer if cut is None else answer[:cut] + [99])


def test_bad_input_is_refused_in_one_line(path):
    generator = NativeBatchGenerator(NativeForward(path, capacity=16, sequences=2))
    for args, message in [
        ((PROMPTS, 0, 0.0, [0] * 6, [0]), "max_new_tokens: must be positive"),
        ((PROMPTS, 4, 0.0, [0] * 6, []), "stop: at least one"),
        ((PROMPTS, 4, 0.0, [0], [0]), r"seeds: one per prompt \(6\), got 1"),
        (([[1], []], 4, 0.0, [0, 0], [0]), "prompts: prompt 1 is empty"),
        ((PROMPTS, 8, 0.0, [0] * 6, [0]), r"prompts: prompt 2 \(10 tokens\) and 8 new tokens exceed the KV cache "
                                          "capacity of 16"),
    ]:
        with pytest.raises(ValueError, match=message):
            list(generator.generate(*args))
    with pytest.raises(ValueError, match="at most 8 sequences"):
        NativeBatchGenerator(NativeForward(path, capacity=16, sequences=9))


def test_regenerate_and_self_instruct_with_the_native_engine_on_smollm2(smollm2, tmp_path):
    """`regenerate --engine native`: each answer is the native greedy decoding of its rendered prompt,
    cut at the file's end of turn, and the folder names the engine."""
    import json

    from conftest import catalog_file
    from elsi_fast.analysis.prompts import Prompt, encode_prompt
    from elsi_fast.targets.loading import end_of_generation_ids
    from elsi_fast.training import regenerate as regen
    from elsi_fast.training.self_instruct import self_instruct

    model, tokenizer = smollm2
    gguf_file = catalog_file("smollm2-135m-instruct")
    prompts = [Prompt(text=t, id=f"p{i}", chat=True) for i, t in enumerate(
        ["Name a colour.", "Say hello.", "What is 2 + 2?", "Write one word about the sea."])]
    generator = NativeBatchGenerator(NativeForward(gguf_file, capacity=96, sequences=3),
                                     end_of_generation=end_of_generation_ids(tokenizer))
    regen.regenerate(model, tokenizer, prompts, tmp_path, max_new_tokens=16, engine="native", server=generator,
                     progress=False)
    one = NativeForward(gguf_file, capacity=96)
    stop = regen._stop_ids(model, tokenizer)
    ends = set(end_of_generation_ids(tokenizer)) | set(stop)
    records = {r["id"]: r for r in regen.read_conversations(tmp_path / regen.CONVERSATIONS_FILE)}
    assert any(r["stop"] == "eos" for r in records.values())
    for i, prompt in enumerate(prompts):
        greedy = one.greedy(encode_prompt(prompt, tokenizer), 16, sorted(ends))
        if greedy[-1] in ends and greedy[-1] not in stop:
            greedy[-1] = stop[0]
        assert records[f"p{i}"]["response_ids"] == greedy
    assert json.loads((tmp_path / regen.SETTINGS_FILE).read_text())["engine"] == "native"
    written = self_instruct(model, tokenizer, tmp_path / "si", 2, temperature=1.0, batch_size=3, max_batches=1,
                            max_instruction_tokens=16,
                            server=generator, progress=False)
    assert written["sampled"] == 3
    assert json.loads((tmp_path / "si" / "self_instruct.json").read_text())["engine"] == "native"
    # Another engine continues the folder: the settings keep the first, its turns name it.
    grown = self_instruct(model, tokenizer, tmp_path / "si", 10, temperature=1.0, batch_size=3, max_batches=2,
                          max_instruction_tokens=16, progress=False)
    raw = [json.loads(line) for line in (tmp_path / "si" / "instructions_raw.jsonl").read_text().splitlines()]
    assert grown["sampled"] == 6 and [r["batch"] for r in raw] == [0, 0, 0, 1, 1, 1]
    assert [r.get("engine") for r in raw] == [None] * 3 + ["transformers"] * 3
    assert json.loads((tmp_path / "si" / "self_instruct.json").read_text())["engine"] == "native"


def test_cli_checks_the_native_engines_arguments_before_loading(tmp_path, capsys):
    import json

    from tiny_lm import TARGET, TOKENIZER

    TARGET.save_pretrained(tmp_path / "hf")
    TOKENIZER.save_pretrained(tmp_path / "hf")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["hello there"]}) + "\n")
    base = ["regenerate", "--prompts", str(prompts), "--out", str(tmp_path / "out")]
    cases = [
        (["--target", str(tmp_path / "hf"), "--engine", "native"], "--engine: native runs a GGUF target"),
        (["--target", "smollm2-135m-instruct", "--engine", "native", "--slots", "9"],
         "--slots: the native forward batches 1..8 sequences, got 9"),
        (["--target", "smollm2-135m-instruct", "--slots", "4"], "--slots: only with --engine llama.cpp or native"),
    ]
    assert_usage_errors(base, cases, capsys, tmp_path / "out")
