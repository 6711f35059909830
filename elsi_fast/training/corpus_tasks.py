"""Document tasks over text corpora, for `regenerate --corpus-tasks`: prompts that hand the target a
passage and ask it to summarize, list, extract or rewrite it.

Why: drafts trained on short instructions and the target's own Magpie turns learn little of what a
summary or a question about a given document looks like, where the answer copies and condenses the
prompt; Spec-Bench's summarization, RAG and extraction prompts are of that kind, and the kept drafts
score lowest there (docs/real-models.md). These prompts are built from corpora the user names (the
repository's tests use the shared folder's Wikipedia, novels and stories), never from the evaluation
sets: every prompt passes `self_instruct.InstructionFilter`, which drops any sharing a word 8-gram
with, or near-duplicating, an evaluation prompt, and duplicates among themselves.

Passages are paragraphs (blocks between blank lines, their lines joined) of 60-200 words, a longer
one cut at its last sentence end within 200 words; WikiText's tokenized spacing is undone, a
sentence holding its `<unk>` mask is left out (the runs of sentences around it are passages), and
its `= Title =` headings name the article that the title question asks about. The selection is a pure
function of the corpus files, `n` and `seed`, and each prompt's id names its seed and position, so
`regenerate` resumes it like any prompt file.

Documents (`documents`; `corpus_tasks(kind="documents")`, `regenerate --corpus-documents`) are consecutive
paragraphs of one article joined into 250-450 words (SmolLM2 prompts of 360-940 tokens). Why: 141
of Spec-Bench's 160 summarization and RAG prompts fill the 512 tokens they are cut to, so their
answers start past position 512, while 17 of SmolLM2's 20,107 training conversations had a prompt
of 400 tokens or more (the paragraph tasks run to about 250, the self-written turns to about 100;
docs/real-models.md, "Long prompts"): a third of Spec-Bench asked the draft for what it never
trained on. Trained on alone, they held those two categories and lowered the rest (same section).

Copies (`corpus_tasks(kind="copies")`, `regenerate --corpus-copies`) ask the target to repeat a
passage word for word. Why: a greedy target copies from its prompt and from itself, and prompt
lookup predicts those tokens with no draft at all, yet the kept drafts had not learned to copy
(their first token was as often right where lookup's was as elsewhere; docs/real-models.md,
"Copying"). A repeated passage is the plainest lesson in copying, answered by the target itself.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
from pathlib import Path
from typing import Iterable, Sequence

from .self_instruct import InstructionFilter, evaluation_texts

TASKS_FILE = "corpus_tasks.jsonl"
DOCUMENTS_FILE = "corpus_documents.jsonl"
COPIES_FILE = "corpus_copies.jsonl"
MIN_WORDS, MAX_WORDS = 60, 200
DOCUMENT_WORDS = (250, 450)
# (task, template): {passage} is the passage, {title} the article it comes from (title tasks are
# offered only for passages under a heading).
TEMPLATES: dict[str, str] = {
    "summarize": "Summarize the following passage in two or three sentences.\n\n{passage}",
    "key-points": "{passage}\n\nWhat are the three most important points of this passage? Answer as a short list.",
    "extract": "List every person, place, date and number mentioned in the text below.\n\n{passage}",
    "simplify": "Rewrite this paragraph in plain, simple English for a young reader.\n\n{passage}",
    "headline": "Write a one-line headline for this text.\n\n{passage}",
    "title-question": "{passage}\n\nUsing only the passage above, what does it tell us about {title}?",
}
# The document tasks: summaries, key points and extractions of a long text, and the question about its
# article placed after it, as RAG prompts place theirs.
DOCUMENT_TEMPLATES: dict[str, str] = {
    "summarize": "Summarize the following article.\n\n{passage}",
    "summary-after": "{passage}\n\nWrite a short summary of the text above.",
    "key-points": TEMPLATES["key-points"].replace("this passage", "this text"),
    "extract": TEMPLATES["extract"],
    "title-question": "{passage}\n\nUsing only the text above, what does it tell us about {title}?",
}
# The copy tasks: the passage repeated whole, the instruction before or after it.
COPY_TEMPLATES: dict[str, str] = {
    "repeat": "Repeat the following text exactly.\n\n{passage}",
    "copy-after": "{passage}\n\nCopy the text above word for word.",
    "quote": "Quote this passage in full, without changing a word:\n\n{passage}",
    "write-again": "Here is a paragraph:\n\n{passage}\n\nWrite it out again exactly as it is.",
}
_SENTENCE_END = re.compile(r"[.!?][\"')\]]?$")
# WikiText's tokenization: " @-@ " for a hyphen inside a word, spaces before punctuation.
_WIKI_FIXES = ((" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."), (" ,", ","), (" .", "."), (" ;", ";"), (" :", ":"),
               (" '", "'"), ("( ", "("), (" )", ")"), (" n't", "n't"))


def _detokenize(text: str) -> str:
    for old, new in _WIKI_FIXES:
        text = text.replace(old, new)
    return text


def _heading(line: str) -> tuple[int, str]:
    """(level, text) of a WikiText heading line ("= Title =" is 1, "= = Section = =" 2), else (0, "")."""
    inner, level = line.strip(), 0
    while inner.startswith("= ") and inner.endswith(" ="):
        inner, level = inner[2:-2].strip(), level + 1
    return level, inner


def _cut(words: list[str], low: int = MIN_WORDS, high: int = MAX_WORDS) -> list[str] | None:
    """The words if within `high`, else their longest sentence-ending prefix of `low`..`high` words."""
    if len(words) <= high:
        return words
    ends = [i for i in range(low, high + 1) if _SENTENCE_END.search(words[i - 1])]
    return words[: ends[-1]] if ends else None


def _runs(path: str | os.PathLike) -> list[tuple[list[str], str | None, int]]:
    """(words, title or None, article number) of each unmasked run of sentences of one corpus file, in
    file order: a paragraph, or the pieces of one around its `<unk>` sentences. The article number
    grows at each `= Title =` heading (a file without headings is one article)."""
    out: list[tuple[list[str], str | None, int]] = []
    title: str | None = None
    article = 0
    block: list[str] = []

    def flush() -> None:
        text = _detokenize(" ".join(line.strip() for line in block))
        block.clear()
        # WikiText masks rare words as <unk>: the runs of whole sentences between them stay.
        for number, run in enumerate(re.split(r"[^.!?]*<unk>[^.!?]*[.!?]*", text)):
            run = run.strip()
            if number and run[:1].islower():  # the masked sentence ended at an abbreviation's period
                end = re.search(r"[.!?]\s+", run)
                run = run[end.end():] if end else ""
            if run:
                out.append((run.split(), title, article))

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            level, inner = _heading(line)
            if level:
                flush()
                if level == 1:  # an article's title; its sections (= = x = =) keep it
                    title, article = _detokenize(inner), article + 1
            elif line.strip():
                block.append(line)
            else:
                flush()
    flush()
    return out


def passages(path: str | os.PathLike) -> list[tuple[str, str | None]]:
    """(passage, title or None) of one corpus file, in file order (see the module docstring)."""
    out = []
    for words, title, _ in _runs(path):
        words = _cut(words)
        if words is not None and len(words) >= MIN_WORDS:
            out.append((" ".join(words), title))
    return out


def documents(path: str | os.PathLike, words: tuple[int, int] = DOCUMENT_WORDS) -> list[tuple[str, str | None]]:
    """(document, title or None) of one corpus file, in file order: consecutive runs of one article
    joined by blank lines while they fit in `words[1]` words (a longer run cut at a sentence end,
    one without any left out), kept when they reach `words[0]`."""
    low, high = words
    out: list[tuple[str, str | None]] = []
    parts: list[str] = []
    count, current, current_title = 0, 0, None

    def flush() -> None:
        nonlocal count
        if count >= low:
            out.append(("\n\n".join(parts), current_title))
        parts.clear()
        count = 0

    for run, title, article in _runs(path):
        if article != current:
            flush()
            current, current_title = article, title
        run = _cut(run, low, high)
        if run is None:  # no sentence end within the budget: a break in the text
            flush()
            continue
        if count + len(run) > high:
            flush()
        parts.append(" ".join(run))
        count += len(run)
    flush()
    return out


# kind -> (split of a corpus file, templates, word range, id prefix, category family, prompts file)
KINDS = {
    "paragraphs": (passages, TEMPLATES, (MIN_WORDS, MAX_WORDS), "ct", "corpus", TASKS_FILE),
    "documents": (documents, DOCUMENT_TEMPLATES, DOCUMENT_WORDS, "cd", "document", DOCUMENTS_FILE),
    "copies": (passages, COPY_TEMPLATES, (MIN_WORDS, MAX_WORDS), "cc", "copy", COPIES_FILE),
}


def corpus_tasks(corpus_paths: Sequence[str | os.PathLike], n: int, *, eval_texts: Iterable[str] = (),
                 seed: int = 0, kind: str = "paragraphs") -> list[dict]:
    """Up to `n` document-task prompts in the prompts format (`question_id`, `category`, `turns`):
    passages of the corpora in a seeded order, each with a task drawn by the same generator, kept
    when `InstructionFilter` (evaluation overlap, duplicates) keeps the whole prompt. `kind`
    (`KINDS`): "paragraphs" (TEMPLATES, ids `ct-`, categories `corpus-`), "documents" (the
    DOCUMENT_TEMPLATES tasks on `documents`; `cd-`, `document-`) or "copies" (COPY_TEMPLATES on
    paragraphs; `cc-`, `copy-`)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive integer, got {n!r}")
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    split, templates, (low, high), prefix, family, _ = KINDS[kind]
    pool = [p for path in corpus_paths for p in split(path)]
    if not pool:
        what = "document" if split is documents else "paragraph"
        raise ValueError(f"corpus: no {what} of {low}-{high} words in {', '.join(map(str, corpus_paths))}")
    rng = random.Random(seed)
    order = list(range(len(pool)))
    rng.shuffle(order)
    guard = InstructionFilter(eval_texts)
    kept: list[dict] = []
    for position in order:
        passage, title = pool[position]
        tasks = [t for t in templates if title is not None or "{title}" not in templates[t]]
        task = tasks[rng.randrange(len(tasks))]
        prompt = templates[task].format(passage=passage, title=title)
        if guard.add(prompt) is None:
            kept.append({"question_id": f"{prefix}-{seed}-{position}", "category": f"{family}-{task}",
                         "turns": [prompt]})
            if len(kept) == n:
                break
    return kept


def write_corpus_tasks(corpus_paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike, n: int, *,
                       eval_prompts: Sequence[str | os.PathLike] = (), seed: int = 0, kind: str = "paragraphs") -> Path:
    """`corpus_tasks`, kept away from every turn of the `eval_prompts` files, written to the kind's
    prompts file in `out_dir` (`KINDS`: corpus_tasks.jsonl, corpus_documents.jsonl or
    corpus_copies.jsonl; rewritten alike on a resumed run), and beside it their recipe (the same
    name, `.json`: the files as given, n, seed, kind, and the prompts' SHA-256), from which
    `rebuild_corpus_tasks` writes them again: a kept data folder stores the recipe, not the corpora's
    text (bench/keep_data.py)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = corpus_tasks(corpus_paths, n, eval_texts=evaluation_texts(eval_prompts), seed=seed, kind=kind)
    path = out / KINDS[kind][-1]
    text = "".join(json.dumps(r) + "\n" for r in records)
    path.write_text(text)
    recipe = {"corpora": [str(p) for p in corpus_paths], "eval_prompts": [str(p) for p in eval_prompts], "n": n,
              "seed": seed, "kind": kind, "sha256": hashlib.sha256(text.encode()).hexdigest()}
    path.with_suffix(".json").write_text(json.dumps(recipe, indent=1) + "\n")
    return path


def recipe_kind(recipe: dict) -> str:
    """The kind of a kept recipe; recipes written before copies existed say `long` instead."""
    return recipe.get("kind") or ("documents" if recipe.get("long") else "paragraphs")


def rebuild_corpus_tasks(recipe: dict, out_dir: str | os.PathLike) -> Path:
    """The prompts file of a `write_corpus_tasks` recipe written into `out_dir` again, from the
    corpora it names; a ValueError if they are missing or give other prompts than the recipe's."""
    missing = [p for p in recipe["corpora"] + recipe["eval_prompts"] if not os.path.isfile(p)]
    if missing:
        raise ValueError(f"corpus: no such file: {missing[0]} (the corpora and evaluation prompts the tasks were "
                         "built from, as given to regenerate; run from the same folder)")
    path = write_corpus_tasks(recipe["corpora"], out_dir, recipe["n"], eval_prompts=recipe["eval_prompts"],
                              seed=recipe["seed"], kind=recipe_kind(recipe))
    if hashlib.sha256(path.read_bytes()).hexdigest() != recipe["sha256"]:
        raise ValueError(f"corpus: the prompts rebuilt from {', '.join(recipe['corpora'])} differ from the kept ones "
                         "(other versions of the corpora or evaluation prompts)")
    return path
