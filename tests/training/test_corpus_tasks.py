"""Document tasks over corpora (elsi_fast.training.corpus_tasks): which paragraphs become passages, the
evaluation-overlap guard, determinism and growth with n, and the CLI's checks."""

from __future__ import annotations

import json

import pytest

from elsi_fast.training import corpus_tasks as ct
from conftest import assert_usage_errors  # tests/ is on sys.path


def words(n: int, stem: str) -> str:
    return " ".join(f"{stem}{i}" for i in range(n)) + "."


@pytest.fixture
def corpus(tmp_path):
    """A WikiText-like file: two articles, a section heading, masked words, short and long paragraphs."""
    text = "\n".join([
        " = First Article = ",
        "",
        " " + words(70, "alpha") + " ",
        "",
        " = = History = = ",
        "",
        # a masked sentence between two unmasked runs of 65 and 20 words: only the first is a passage
        " " + words(65, "beta") + " The <unk> was here . " + words(20, "gamma") + " ",
        "",
        " = Second Article = ",
        "",
        " " + words(10, "short") + " ",
        "",
        # 250 words in sentences of 50: cut at the last sentence end within 200 words
        " " + " ".join(words(50, f"d{j}x") for j in range(5)) + " ",
        "",
    ])
    path = tmp_path / "wiki.txt"
    path.write_text(text)
    return path


def test_passages_are_paragraphs_of_60_to_200_words_under_their_article(corpus):
    found = ct.passages(corpus)
    assert [title for _, title in found] == ["First Article", "First Article", "Second Article"]
    first, second, third = (p for p, _ in found)
    assert first == words(70, "alpha")
    assert second == words(65, "beta") and "<unk>" not in second  # the section keeps the article's title
    assert len(third.split()) == 200 and third.endswith("d3x49.")  # four sentences of 50 words


def test_wikitext_spacing_is_undone():
    assert ct._detokenize("a 1 @,@ 000 @-@ year war , ( see below ) isn 't .") == "a 1,000-year war, (see below) isn't."


def test_tasks_are_seeded_keep_their_passage_and_grow_as_a_prefix(corpus, tmp_path):
    plain = tmp_path / "novel.txt"
    plain.write_text("\n\n".join(words(60 + i, f"w{i}n") for i in range(12)))
    files = [corpus, plain]
    tasks = ct.corpus_tasks(files, 5, seed=3)
    assert len(tasks) == 5 and tasks == ct.corpus_tasks(files, 5, seed=3)
    assert tasks != ct.corpus_tasks(files, 5, seed=4)
    assert ct.corpus_tasks(files, 8, seed=3)[:5] == tasks
    pool = [p for f in files for p, _ in ct.passages(f)]
    for task in tasks:
        assert task["category"].removeprefix("corpus-") in ct.TEMPLATES
        assert sum(p in task["turns"][0] for p in pool) == 1
        assert task["question_id"].startswith("ct-3-")
    assert len(ct.corpus_tasks(files, 10**6)) == len(pool)  # every passage once
    # title questions only for passages under a heading
    for task in ct.corpus_tasks(files, 10**6, seed=1):
        if task["category"] == "corpus-title-question":
            assert "Article?" in task["turns"][0]


def test_a_passage_near_an_evaluation_prompt_is_dropped(corpus):
    every = ct.corpus_tasks([corpus], 10)
    assert len(every) == 3
    # an evaluation prompt quoting 8 words of the first passage removes that task and no other
    evaluation = ["Please explain: " + " ".join(f"alpha{i}" for i in range(30, 38))]
    kept = ct.corpus_tasks([corpus], 10, eval_texts=evaluation)
    assert len(kept) == 2 and not any("alpha30" in t["turns"][0] for t in kept)


def test_bad_input_is_one_clear_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("too short\n\nalso short\n")
    with pytest.raises(ValueError, match="corpus: no paragraph of 60-200 words"):
        ct.corpus_tasks([empty], 5)
    with pytest.raises(ValueError, match="n: expected a positive integer"):
        ct.corpus_tasks([empty], 0)


def test_cli_checks_corpus_arguments_before_the_target_loads(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["hello there"]}) + "\n")
    corpus = tmp_path / "c.txt"
    corpus.write_text(words(70, "x"))
    short = tmp_path / "short.txt"
    short.write_text(words(20, "y"))
    base = ["regenerate", "--target", "smollm2-135m-instruct", "--prompts", str(prompts), "--out",
            str(tmp_path / "out")]
    cases = [
        (["--corpus-tasks", "5"], "--corpus-tasks: needs --corpus"),
        (["--corpus", str(corpus)], "--corpus: goes with --corpus-tasks"),
        (["--corpus-tasks", "5", "--corpus", str(tmp_path / "nope.txt")], "--corpus: no such file"),
        (["--corpus-tasks", "5", "--corpus", str(corpus)], "--eval-prompts: --corpus-tasks needs"),
        (["--corpus-tasks", "5", "--corpus", str(corpus), str(short)], f"--corpus: no paragraph of 60-200 words in {short}"),
    ]
    assert_usage_errors(base, cases, capsys, tmp_path / "out")


def test_cli_answers_the_corpus_tasks_after_the_prompts_and_resumes(tmp_path, corpus, capsys):
    from elsi_fast.cli import main
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations
    from tiny_lm import TARGET, TOKENIZER

    target = tmp_path / "t"
    TARGET.save_pretrained(target)
    TOKENIZER.save_pretrained(target)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "turns": ["hello there"]}) + "\n")
    evaluation = tmp_path / "eval.jsonl"
    evaluation.write_text(json.dumps({"question_id": 9, "turns": ["an unrelated evaluation question"]}) + "\n")
    out = tmp_path / "out"
    argv = ["regenerate", "--target", str(target), "--prompts", str(prompts), "--out", str(out), "--max-new-tokens",
            "3", "--corpus", str(corpus), "--eval-prompts", str(evaluation), "--no-progress", "--corpus-tasks"]
    assert main(argv + ["2"]) == 0
    records = read_conversations(out / CONVERSATIONS_FILE)
    assert sorted(r["id"] for r in records)[0] == "1" and len(records) == 3
    tasks = {t["question_id"]: t["turns"][0] for t in map(json.loads, (out / ct.TASKS_FILE).read_text().splitlines())}
    assert {r["id"]: r["prompt"] for r in records if r["id"] in tasks} == tasks
    # more tasks later: the first two stay as they were and only the new one is answered
    assert main(argv + ["3"]) == 0
    assert "answered 1 prompts now (4 in all)" in capsys.readouterr().out
    again = read_conversations(out / CONVERSATIONS_FILE)
    assert again[:3] == records and len(again) == 4
