"""Calibration prompts: Spec-Bench / MT-bench JSONL, plain text, or a folder of text files.

A JSONL line is an instruction (`{"turns": [...], "category": ...}`, or a `prompt`/`text`
field); it gets the tokenizer's chat template when there is one. Plain text is used as is.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Prompt:
    """One calibration prompt.

    `chat` marks an instruction that should be wrapped in the tokenizer's chat template;
    `input_ids` is filled by `encode_prompt` (or `load_prompts(..., tokenizer=...)`).
    """

    text: str
    category: str | None = None
    id: str | None = None
    chat: bool = False
    input_ids: list[int] | None = field(default=None, repr=False)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise ValueError(f"prompts: {path} is not UTF-8 text ({exc})") from exc
    except PermissionError as exc:
        raise ValueError(f"prompts: cannot read {path} ({exc.strerror})") from exc


def _prompt_from_record(record: Any, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise ValueError(f"prompts: {where}: expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError(f"prompts: {where}: 'turns' must be a non-empty list of strings")
        # Later MT-bench turns refer to the model's own first answer, which a calibration pass
        # does not have; the first turn is the self-contained instruction.
        text = turns[0]
    elif isinstance(record.get("prompt"), str):
        text = record["prompt"]
    elif isinstance(record.get("text"), str):
        text = record["text"]
    else:
        raise ValueError(f"prompts: {where}: needs a 'turns' list or a 'prompt'/'text' string")
    ident = record.get("question_id", record.get("id"))
    return Prompt(
        text=text,
        category=record.get("category"),
        id=None if ident is None else str(ident),
        chat=True,
    )


def _load_jsonl(path: str) -> list[Prompt]:
    prompts = []
    for line_no, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"prompts: {path}:{line_no}: invalid JSON ({exc.msg})") from exc
        prompts.append(_prompt_from_record(record, f"{path}:{line_no}"))
    return prompts


def _load_text(path: str) -> list[Prompt]:
    # Paragraphs (blank-line separated) are prompts: a book or corpus file becomes many samples.
    paragraphs = [p.strip() for p in _read_text(path).split("\n\n")]
    name = os.path.basename(path)
    return [Prompt(text=p, id=f"{name}:{i}") for i, p in enumerate(x for x in paragraphs if x)]


def load_prompts(path: str, tokenizer: Any = None, max_prompts: int | None = None) -> list[Prompt]:
    """Read prompts from a .jsonl/.json-lines file, a text file, or a folder of .txt files.

    With `tokenizer`, each prompt's `input_ids` are filled in (see `encode_prompt`).
    Raises FileNotFoundError for a missing path and ValueError for an empty or unreadable file.
    """
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts: must be >= 1, got {max_prompts}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"prompts: no such file or folder: {path}")
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".txt"))
        if not files:
            raise ValueError(f"prompts: folder {path} has no .txt files")
        prompts = []
        for name in files:
            text = _read_text(os.path.join(path, name)).strip()
            if text:
                prompts.append(Prompt(text=text, id=name))
    elif path.endswith((".jsonl", ".json")):
        prompts = _load_jsonl(path)
    else:
        prompts = _load_text(path)
    if not prompts:
        raise ValueError(f"prompts: {path} contains no prompts (empty file?)")
    if max_prompts is not None:
        prompts = prompts[:max_prompts]
    if tokenizer is not None:
        for prompt in prompts:
            prompt.input_ids = encode_prompt(prompt, tokenizer)
    return prompts


def encode_prompt(prompt: Prompt | str, tokenizer: Any) -> list[int]:
    """Token ids of one prompt, with the tokenizer's special tokens (BOS).

    An instruction (`prompt.chat`) is rendered with the chat template when the tokenizer has one,
    as a single user message followed by the generation prompt.
    """
    if isinstance(prompt, str):
        prompt = Prompt(text=prompt)
    if prompt.input_ids is not None:
        return list(prompt.input_ids)
    if prompt.chat and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.text}], tokenize=False, add_generation_prompt=True
        )
        # The rendered template already carries BOS and the role markers.
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt.text)["input_ids"])


def spread_over_categories(prompts: list[Prompt], n: int) -> list[Prompt]:
    """At most `n` of `prompts`, taken in turn from each category (in the order categories first
    appear; prompts without one form a category of their own) and returned in file order.

    A budget of prompts that covers every kind of text: the first `n` of Spec-Bench are all from
    its first few categories. With one category it is the first `n` prompts."""
    if n < 1:
        raise ValueError(f"n: must be >= 1, got {n}")
    queues: dict[str | None, list[int]] = {}
    for i, prompt in enumerate(prompts):
        queues.setdefault(prompt.category, []).append(i)
    picked: list[int] = []
    depth = 0
    while len(picked) < min(n, len(prompts)):
        for queue in queues.values():
            if depth < len(queue) and len(picked) < n:
                picked.append(queue[depth])
        depth += 1
    return [prompts[i] for i in sorted(picked)]


def prompts_by_category(prompts: list[Prompt], tokenizer: Any, max_prompts: int | None = None,
                        max_tokens: int | None = None) -> dict[str, list[list[int]]]:
    """Token ids of `prompts` (see `encode_prompt`), grouped by their category ("text" when none):
    at most `max_prompts` per category, each cut to its last `max_tokens` tokens (as `regenerate`
    cuts them): the end of a prompt is what the answer continues, and a chat prompt's end is the
    generation prompt, without which the model goes on writing the user's turn."""
    grouped: dict[str, list[list[int]]] = {}
    for prompt in prompts:
        ids = encode_prompt(prompt, tokenizer)
        ids = ids[-max_tokens:] if max_tokens is not None else ids
        bucket = grouped.setdefault(prompt.category or "text", [])
        if max_prompts is None or len(bucket) < max_prompts:
            bucket.append(ids)
    return grouped
