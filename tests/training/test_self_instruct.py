"""Instructions written by the target (elsi_fast.training.self_instruct): the user-turn prefix of the chat
template, the duplicate and evaluation-overlap filter against a brute-force reference, sampling that
resumes to the same records, and regenerate continuing a folder whose prompt set grew."""

from __future__ import annotations

import copy
import json
import random

import pytest

from elsi_fast.analysis.prompts import Prompt, load_prompts
from elsi_fast.training import regenerate as regen
from elsi_fast.training import self_instruct as si
from conftest import assert_usage_errors  # tests/ is on sys.path
from tiny_lm import TARGET, TEXTS, TOKENIZER

CHAT = copy.deepcopy(TOKENIZER)
# A user turn ends with " castle" here: a token the tiny target writes often, so sampled turns finish.
CHAT.chat_template = ("{{ bos_token }}{% for m in messages %}user: {{ m['content'] }} castle{% endfor %}"
                      "{% if add_generation_prompt %}assistant:{% endif %}")
END = CHAT(" castle", add_special_tokens=False)["input_ids"][0]


def _jaccard(a: str, b: str) -> float:
    x, y = si._shingles(si.normalize(a)), si._shingles(si.normalize(b))
    return len(x & y) / len(x | y)


def test_user_turn_prefix_is_the_template_up_to_the_users_text():
    prefix, ends = si.user_turn_prefix(CHAT)
    assert CHAT.decode(prefix) == CHAT.bos_token + "user: "
    assert ends == sorted({END, CHAT.eos_token_id})
    with pytest.raises(ValueError, match="no chat template"):
        si.user_turn_prefix(TOKENIZER)


def test_filter_drops_duplicates_near_duplicates_and_evaluation_overlap():
    evaluation = ["Translate the following German sentence into English for me, please: Das Haus ist rot.",
                  "Write a haiku."]
    guard = si.InstructionFilter(evaluation)
    long = "Tell me a long story about a brave knight who crosses the mountains to save his small village"
    assert guard.add(long) is None
    assert guard.add(long.upper() + "!!") == "duplicate"
    assert guard.add(long.replace("small", "little")) == "near-duplicate"  # Jaccard 0.79
    assert guard.add("Explain how photosynthesis works in plants") is None
    assert guard.add("ok go") == "short"
    # a shared 8-gram with an evaluation turn, inside otherwise new text
    assert guard.add("Could you translate the following German sentence into English for me today?") == "eval-overlap"
    assert guard.add("Please write a haiku") == "eval-overlap"  # near an evaluation turn shorter than 8 words
    assert guard.add("Write a limerick about the sea and the moon") is None


def test_filter_keeps_what_a_brute_force_reference_keeps():
    """Texts that are either near copies (Jaccard >= 0.85, which 16 bands of 4 rows find with
    probability > 0.999) or unrelated (Jaccard 0): the MinHash candidates and the exact Jaccard
    give the brute-force greedy answer."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(400)]
    bases = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(30)]
    texts = []
    for base in bases:
        texts.append(base)
        for _ in range(2):
            tokens = base.split()
            tokens[rng.randrange(len(tokens))] = "zz" + str(rng.randrange(10**6))
            texts.append(" ".join(tokens))
    rng.shuffle(texts)
    kept_ref: list[str] = []
    for text in texts:
        if all(_jaccard(text, k) < 0.7 for k in kept_ref):
            kept_ref.append(text)
    kept, dropped = si.filter_instructions([{"finished": True, "text": t} for t in texts], [])
    assert [r["text"] for r in kept] == kept_ref
    assert dropped == {"near-duplicate": len(texts) - len(kept_ref)}


def test_sampling_resumes_to_the_same_records_and_writes_loadable_prompts(tmp_path):
    whole = si.self_instruct(TARGET, CHAT, tmp_path / "whole", 10**6, max_instruction_tokens=10, batch_size=4,
                             max_batches=4, progress=False)
    si.self_instruct(TARGET, CHAT, tmp_path / "split", 10**6, max_instruction_tokens=10, batch_size=4, max_batches=2,
                     progress=False)
    with open(tmp_path / "split" / si.RAW_FILE, "a") as f:
        f.write('{"id": "si-0-2-0", "ba')  # a line cut by a crash
    split = si.self_instruct(TARGET, CHAT, tmp_path / "split", 10**6, max_instruction_tokens=10, batch_size=4,
                             max_batches=4, progress=False)
    raw = [(tmp_path / name / si.RAW_FILE).read_text() for name in ("whole", "split")]
    assert raw[0] == raw[1] and whole["sampled"] == split["sampled"] == 16
    assert whole["kept"] + sum(whole["dropped"].values()) == 16
    records = [json.loads(line) for line in raw[0].splitlines()]
    prefix, ends = si.user_turn_prefix(CHAT)
    for record in records:
        assert len(record["ids"]) <= 10 and not set(ends) & set(record["ids"])
        if not record["finished"]:
            assert len(record["ids"]) == 10
    assert whole["kept"] > 0
    prompts = load_prompts(whole["path"])
    assert len(prompts) == whole["kept"] and all(p.category == si.CATEGORY and p.chat for p in prompts)
    with pytest.raises(ValueError, match="other settings"):
        si.self_instruct(TARGET, CHAT, tmp_path / "whole", 5, temperature=0.5, progress=False)


def test_openings_start_each_batchs_turns_in_turn_and_a_plain_folder_continues_with_them(tmp_path):
    openings = ["the king said", "a castle"]
    args = dict(max_instruction_tokens=10, batch_size=3, progress=False)
    si.self_instruct(TARGET, CHAT, tmp_path / "a", 10**6, max_batches=2, **args)  # plain turns first
    si.self_instruct(TARGET, CHAT, tmp_path / "a", 10**6, max_batches=5, openings=openings, **args)
    settings = json.loads((tmp_path / "a" / "self_instruct.json").read_text())
    assert settings["openings"] == {"texts": openings, "from_batch": 2}
    records = [json.loads(line) for line in (tmp_path / "a" / si.RAW_FILE).read_text().splitlines()]
    assert [r["batch"] for r in records] == [b for b in range(5) for _ in range(3)]
    for r in records:
        opening = None if r["batch"] < 2 else openings[(r["batch"] - 2) % 2]
        assert r.get("opening") == opening and len(r["ids"]) <= 10
        if opening is not None:
            start = CHAT(opening, add_special_tokens=False)["input_ids"]
            assert r["ids"][: len(start)] == start and r["text"].startswith(opening)
    # The same command continues (to the same records as one run); another list is refused.
    si.self_instruct(TARGET, CHAT, tmp_path / "b", 10**6, max_batches=2, **args)
    si.self_instruct(TARGET, CHAT, tmp_path / "b", 10**6, max_batches=3, openings=openings, **args)
    si.self_instruct(TARGET, CHAT, tmp_path / "b", 10**6, max_batches=5, openings=openings, **args)
    assert (tmp_path / "b" / si.RAW_FILE).read_text() == (tmp_path / "a" / si.RAW_FILE).read_text()
    for other in (openings[::-1], None):
        with pytest.raises(ValueError, match="openings: .* 2 other openings"):
            si.self_instruct(TARGET, CHAT, tmp_path / "a", 10**6, max_batches=6, openings=other, **args)
    with pytest.raises(ValueError, match="max_instruction_tokens: 1 leaves no room"):
        si.self_instruct(TARGET, CHAT, tmp_path / "c", 10**6, max_batches=1, openings=openings,
                         **{**args, "max_instruction_tokens": 1})
    assert len(si.OPENINGS) == len(set(si.OPENINGS)) == 28  # the CLI's help names the count


def test_regenerate_continues_when_the_prompt_set_grows_and_refuses_a_changed_prompt(tmp_path):
    prompts = [Prompt(text=TEXTS[i][:30], id=f"p{i}", chat=True) for i in range(5)]
    regen.regenerate(TARGET, TOKENIZER, prompts[:3], tmp_path, max_new_tokens=4, batch_size=2, progress=False)
    grown = regen.regenerate(TARGET, TOKENIZER, prompts, tmp_path, max_new_tokens=4, batch_size=2, progress=False)
    assert grown["answered_now"] == 2
    assert sorted(r["id"] for r in regen.read_conversations(tmp_path / regen.CONVERSATIONS_FILE)) == \
        [f"p{i}" for i in range(5)]
    changed = [Prompt(text="something else", id="p0", chat=True)] + prompts[1:]
    with pytest.raises(ValueError, match="other settings, prompts"):
        regen.regenerate(TARGET, TOKENIZER, changed, tmp_path, max_new_tokens=4, batch_size=2, progress=False)


def test_cli_self_instruct_arguments_are_checked_before_the_target_loads(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["hello there"]}) + "\n")
    base = ["regenerate", "--target", "TARGET", "--prompts", str(prompts),
            "--out", str(tmp_path / "out")]
    target = tmp_path / "t"
    TARGET.save_pretrained(target)
    CHAT.save_pretrained(target)
    base[2] = str(target)
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    cases = [
        (["--self-instruct", "10"], "--eval-prompts: --self-instruct needs"),
        (["--eval-prompts", str(prompts)], "--eval-prompts: only with --self-instruct, --corpus-tasks, --corpus-documents or --corpus-copies"),
        (["--self-instruct", "10", "--eval-prompts", str(tmp_path / "nope.jsonl")], "--eval-prompts: no such file"),
        (["--self-instruct", "10", "--eval-prompts", str(prompts), "--instruction-temperature", "0"],
         "--instruction-temperature: must be a number > 0"),
        (["--self-instruct", "0", "--eval-prompts", str(prompts)], "--self-instruct"),
        (["--instruction-openings", "builtin"], "--instruction-openings: only with --self-instruct"),
        (["--self-instruct", "10", "--eval-prompts", str(prompts), "--instruction-openings", str(tmp_path / "no")],
         "--instruction-openings: no such file"),
        (["--self-instruct", "10", "--eval-prompts", str(prompts), "--instruction-openings", str(blank)],
         "--instruction-openings: " + str(blank) + " holds no opening"),
    ]
    assert_usage_errors(base, cases, capsys, tmp_path / "out")


def test_cli_restore_rebuilds_the_folder_and_continues(tmp_path, capsys):
    """`regenerate --restore` takes kept answers (here gzipped) made with the same settings, writes
    them without generating, and answers only the prompts they lack; other settings are refused."""
    import gzip

    from elsi_fast.cli import main

    target = tmp_path / "t"
    TARGET.save_pretrained(target)
    TOKENIZER.save_pretrained(target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [TEXTS[i][:30]]}) + "\n" for i in range(5)))
    run = ["regenerate", "--target", str(target), "--prompts", str(prompts), "--max-new-tokens", "4", "--no-progress"]
    assert main(run + ["--out", str(tmp_path / "a"), "--max-prompts", "3"]) == 0
    with gzip.open(tmp_path / "kept.json.gz", "wt") as f:
        json.dump(regen.export_answers(tmp_path / "a"), f)
    capsys.readouterr()
    assert main(run + ["--out", str(tmp_path / "a"), "--restore", str(tmp_path / "kept.json.gz")]) == 2
    assert "--restore: " in (err := capsys.readouterr().err) and "already holds conversations" in err
    assert main(run + ["--out", str(tmp_path / "b"), "--max-prompts", "3", "--restore", str(tmp_path / "kept.json.gz")]) == 0
    assert "restored 3 answers" in capsys.readouterr().out
    assert main(run + ["--out", str(tmp_path / "b"), "--restore", str(tmp_path / "kept.json.gz")]) == 2  # b has them now
    assert main(run + ["--out", str(tmp_path / "c"), "--max-prompts", "3", "--max-new-tokens", "5",
                       "--restore", str(tmp_path / "kept.json.gz")]) == 2
    assert "--restore: those answers were regenerated with other settings" in capsys.readouterr().err
    assert not (tmp_path / "c" / regen.CONVERSATIONS_FILE).exists()
    assert main(run + ["--out", str(tmp_path / "b")]) == 0  # continues with the two prompts not kept
    assert len(regen.read_conversations(tmp_path / "b" / regen.CONVERSATIONS_FILE)) == 5
    a = {r["id"]: r for r in regen.read_conversations(tmp_path / "a" / regen.CONVERSATIONS_FILE)}
    b = {r["id"]: r for r in regen.read_conversations(tmp_path / "b" / regen.CONVERSATIONS_FILE)}
    assert all(b[i] == a[i] for i in a)


def test_cli_regenerate_answers_several_prompt_files_in_order_and_refuses_repeated_ids(tmp_path, capsys):
    """`--prompts A B` answers A's prompts and then B's (a base target's data from two instruction sets);
    ids that repeat across the files are refused before the target loads (exit 2, one line)."""
    from elsi_fast.cli import main

    target = tmp_path / "t"
    TARGET.save_pretrained(target)
    TOKENIZER.save_pretrained(target)
    first, second, clash = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    first.write_text("".join(json.dumps({"question_id": i, "turns": [TEXTS[i][:30]]}) + "\n" for i in range(2)))
    second.write_text("".join(json.dumps({"question_id": f"s{i}", "turns": [TEXTS[i + 2][:30]]}) + "\n" for i in range(2)))
    clash.write_text(json.dumps({"question_id": 1, "turns": ["another prompt"]}) + "\n")
    run = ["regenerate", "--target", str(target), "--max-new-tokens", "3", "--no-progress", "--out", str(tmp_path / "o")]
    capsys.readouterr()
    assert main(run + ["--prompts", str(first), str(clash)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--prompts: the files' prompt ids repeat" in err
    assert not (tmp_path / "o").exists()
    assert main(run + ["--prompts", str(first), str(second), "--max-prompts", "3"]) == 0
    records = regen.read_conversations(tmp_path / "o" / regen.CONVERSATIONS_FILE)
    assert {r["id"]: r["prompt"] for r in records} == {"0": TEXTS[0][:30], "1": TEXTS[1][:30], "s0": TEXTS[2][:30]}
