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


def test_documents_join_consecutive_runs_of_one_article_within_the_word_budget(corpus, tmp_path):
    # the fixture at a budget of 60-120 words: alpha (70) alone, as beta (65) would pass 120 with it
    # (gamma, the rest of beta's paragraph after the masked sentence, starts mid-sentence and goes);
    # the second article's 10 words and its 250-word paragraph (cut at a sentence end within 120:
    # 100 words) pack into 110
    found = ct.documents(corpus, (60, 120))
    assert [(d.split("\n\n"), t) for d, t in found] == [
        ([words(70, "alpha")], "First Article"),
        ([words(65, "beta")], "First Article"),
        ([words(10, "short"), " ".join(words(50, f"d{j}x") for j in range(2))], "Second Article"),
    ]
    # runs never cross an article: a budget that would hold everything still gives one per article
    assert [t for _, t in ct.documents(corpus, (1, 10**4))] == ["First Article", "Second Article"]
    # a file without headings is one text; under the lower bound nothing is kept
    plain = tmp_path / "novel.txt"
    plain.write_text("\n\n".join(words(30, f"p{i}n") for i in range(9)))
    assert [len(d.split()) for d, _ in ct.documents(plain, (50, 100))] == [90, 90, 90]
    assert ct.documents(plain, (300, 400)) == []


def test_long_tasks_hold_one_document_each_under_their_own_ids(corpus, tmp_path):
    plain = tmp_path / "novel.txt"
    plain.write_text("\n\n".join(words(60, f"w{i}n") for i in range(40)))
    tasks = ct.corpus_tasks([corpus, plain], 100, seed=2, kind="documents")
    pool = [d for f in (corpus, plain) for d, _ in ct.documents(f)]
    # the second article (10 + 250 words) and the 2,400 words of the novel in runs of 7 (420 words),
    # the last 5 (300) kept
    assert len(tasks) == len(pool) == 7
    for task in tasks:
        assert task["question_id"].startswith("cd-2-") and task["category"].removeprefix("document-") in ct.DOCUMENT_TEMPLATES
        assert sum(d in task["turns"][0] for d in pool) == 1
        assert "{title}" not in task["turns"][0] and "about None" not in task["turns"][0]
    short = tmp_path / "short.txt"
    short.write_text("\n\n".join(words(60, f"s{i}n") for i in range(4)))  # 240 words in all
    with pytest.raises(ValueError, match="corpus: no document of 250-450 words"):
        ct.corpus_tasks([short], 5, kind="documents")


def test_a_recipe_rebuilds_the_same_prompts_and_refuses_other_corpora(corpus, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the recipe holds the paths as given: relative ones resolve from here
    evaluation = tmp_path / "eval.jsonl"
    evaluation.write_text(json.dumps({"turns": ["Please explain: " + " ".join(f"alpha{i}" for i in range(30, 38))]}))
    path = ct.write_corpus_tasks([corpus.name], tmp_path / "a", 10, eval_prompts=[evaluation.name], seed=1)
    recipe = json.loads(path.with_suffix(".json").read_text())
    assert recipe["corpora"] == ["wiki.txt"] and recipe["n"] == 10 and recipe["kind"] == "paragraphs"
    assert len(path.read_text().splitlines()) == 2  # the alpha passage is near the evaluation prompt
    again = ct.rebuild_corpus_tasks(recipe, tmp_path / "b")
    assert again.read_bytes() == path.read_bytes() and again.name == ct.TASKS_FILE
    corpus.write_text(corpus.read_text().replace("beta1 ", "beta1x "))
    with pytest.raises(ValueError, match="corpus: the prompts rebuilt from wiki.txt differ from the kept ones"):
        ct.rebuild_corpus_tasks(recipe, tmp_path / "c")
    with pytest.raises(ValueError, match="corpus: no such file: nope.txt"):
        ct.rebuild_corpus_tasks({**recipe, "corpora": ["nope.txt"]}, tmp_path / "d")
    # a recipe kept before kinds existed names its kind by `long`
    corpus.write_text(corpus.read_text().replace("beta1x ", "beta1 "))
    older = {k: v for k, v in recipe.items() if k != "kind"}
    assert ct.rebuild_corpus_tasks({**older, "long": False}, tmp_path / "e").read_bytes() == path.read_bytes()


def test_copy_tasks_hold_one_whole_passage_under_their_own_ids(corpus, tmp_path):
    plain = tmp_path / "novel.txt"
    plain.write_text("\n\n".join(words(60 + i, f"w{i}n") for i in range(12)))
    files = [corpus, plain]
    copies = ct.corpus_tasks(files, 10**6, seed=5, kind="copies")
    pool = [p for f in files for p, _ in ct.passages(f)]
    assert len(copies) == len(pool)
    for task in copies:
        assert task["question_id"].startswith("cc-5-") and task["category"].removeprefix("copy-") in ct.COPY_TEMPLATES
        assert sum(p in task["turns"][0] for p in pool) == 1
    # the same passages in the same order as the paragraph tasks of that seed, other prompts
    tasks = ct.corpus_tasks(files, 10**6, seed=5)
    assert [t["question_id"][3:] for t in tasks] == [c["question_id"][3:] for c in copies]
    path = ct.write_corpus_tasks(files, tmp_path / "out", 4, seed=5, kind="copies")
    assert path.name == ct.COPIES_FILE and json.loads(path.with_suffix(".json").read_text())["kind"] == "copies"
    with pytest.raises(ValueError, match="kind: expected one of paragraphs, documents, copies"):
        ct.corpus_tasks(files, 3, kind="long")


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
    long_text = tmp_path / "long.txt"
    long_text.write_text("\n\n".join(words(60, f"z{i}n") for i in range(6)))
    base = ["regenerate", "--target", "smollm2-135m-instruct", "--prompts", str(prompts), "--out",
            str(tmp_path / "out")]
    cases = [
        (["--corpus-tasks", "5"], "--corpus-tasks: needs --corpus"),
        (["--corpus", str(corpus)], "--corpus: goes with --corpus-tasks"),
        (["--corpus-tasks", "5", "--corpus", str(tmp_path / "nope.txt")], "--corpus: no such file"),
        (["--corpus-tasks", "5", "--corpus", str(corpus)], "--eval-prompts: --corpus-tasks needs"),
        (["--corpus-tasks", "5", "--corpus", str(corpus), str(short)], f"--corpus: no paragraph of 60-200 words in {short}"),
        (["--corpus-documents", "5"], "--corpus-documents: needs --corpus"),
        (["--corpus-documents", "5", "--corpus", str(corpus)], f"--corpus: no document of 250-450 words in {corpus}"),
        (["--corpus-documents", "5", "--corpus", str(long_text)], "--eval-prompts: --corpus-documents needs"),
        (["--corpus-copies", "5"], "--corpus-copies: needs --corpus"),
        (["--corpus-copies", "5", "--corpus", str(short)], f"--corpus: no paragraph of 60-200 words in {short}"),
        (["--corpus-copies", "5", "--corpus", str(corpus)], "--eval-prompts: --corpus-copies needs"),
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
    # the long documents come after the tasks: the fixture's second article is the one document
    assert main(argv + ["3", "--corpus-documents", "5"]) == 0
    last = read_conversations(out / CONVERSATIONS_FILE)
    (document,) = map(json.loads, (out / ct.DOCUMENTS_FILE).read_text().splitlines())
    assert last[:4] == again and [(r["id"], r["prompt"]) for r in last[4:]] == [(document["question_id"],
                                                                               document["turns"][0])]
