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
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path
from typing import Iterable, Sequence

from .self_instruct import InstructionFilter

TASKS_FILE = "corpus_tasks.jsonl"
MIN_WORDS, MAX_WORDS = 60, 200
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


def _cut(words: list[str]) -> list[str] | None:
    """The paragraph's words if within MAX_WORDS, else its longest sentence-ending prefix within it."""
    if len(words) <= MAX_WORDS:
        return words
    ends = [i for i in range(MIN_WORDS, MAX_WORDS + 1) if _SENTENCE_END.search(words[i - 1])]
    return words[: ends[-1]] if ends else None


def passages(path: str | os.PathLike) -> list[tuple[str, str | None]]:
    """(passage, title or None) of one corpus file, in file order (see the module docstring)."""
    out: list[tuple[str, str | None]] = []
    title: str | None = None
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
            words = _cut(run.split())
            if words is not None and len(words) >= MIN_WORDS:
                out.append((" ".join(words), title))

    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            level, inner = _heading(line)
            if level:
                flush()
                if level == 1:  # an article's title; its sections (= = x = =) keep it
                    title = _detokenize(inner)
            elif line.strip():
                block.append(line)
            else:
                flush()
    flush()
    return out


def corpus_tasks(corpus_paths: Sequence[str | os.PathLike], n: int, *, eval_texts: Iterable[str] = (),
                 seed: int = 0) -> list[dict]:
    """Up to `n` document-task prompts in the prompts format (`question_id`, `category`, `turns`):
    passages of the corpora in a seeded order, each with a task drawn by the same generator, kept
    when `InstructionFilter` (evaluation overlap, duplicates) keeps the whole prompt."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected a positive integer, got {n!r}")
    pool = [p for path in corpus_paths for p in passages(path)]
    if not pool:
        raise ValueError(f"corpus: no paragraph of {MIN_WORDS}-{MAX_WORDS} words in {', '.join(map(str, corpus_paths))}")
    rng = random.Random(seed)
    order = list(range(len(pool)))
    rng.shuffle(order)
    guard = InstructionFilter(eval_texts)
    kept: list[dict] = []
    for position in order:
        passage, title = pool[position]
        tasks = [t for t in TEMPLATES if title is not None or "{title}" not in TEMPLATES[t]]
        task = tasks[rng.randrange(len(tasks))]
        prompt = TEMPLATES[task].format(passage=passage, title=title)
        if guard.add(prompt) is None:
            kept.append({"question_id": f"ct-{seed}-{position}", "category": f"corpus-{task}", "turns": [prompt]})
            if len(kept) == n:
                break
    return kept


def write_corpus_tasks(corpus_paths: Sequence[str | os.PathLike], out_dir: str | os.PathLike, n: int, *,
                       eval_texts: Iterable[str] = (), seed: int = 0) -> Path:
    """`corpus_tasks` written to `out_dir/corpus_tasks.jsonl` (rewritten alike on a resumed run)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / TASKS_FILE
    records = corpus_tasks(corpus_paths, n, eval_texts=eval_texts, seed=seed)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
