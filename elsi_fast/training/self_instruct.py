"""Instructions written by the target itself (Magpie, Xu et al. 2024), for `regenerate --self-instruct`.

An aligned chat model given only its chat template up to the start of a user turn writes a
plausible user instruction. `self_instruct` samples such turns in batches (temperature 1 by
default, as Magpie does), keeps those that ended with the end-of-turn token, and filters them:

- exact duplicates after normalization (lower case, words only);
- near duplicates: Jaccard similarity of word 3-gram sets >= `near_duplicate` (MinHash
  signatures, 16 bands x 4 rows, to find candidates; the exact Jaccard decides);
- anything close to the evaluation prompts (Spec-Bench, MT-bench): a shared word 8-gram, or a
  near duplicate of one of their turns, so that evaluation stays unseen (docs/method.md section 6).

With `openings` (Magpie's prefix control), each batch's turns start with one of a list of words
("Write a Python function", "Imagine you are", ...) in turn, which the target continues: a small
target's free turns are mostly short chat, and the openings spread them over the kinds of task a
user asks for (writing, role-play, reasoning, maths, code, extraction, summaries, translation).
The turns keep their opening, which the filter sees too.

Every sampled turn is appended to `out/instructions_raw.jsonl` (one batch at a time, batch b
seeded with seed + b), so an interrupted run continues where it stopped (with the same engine or
another: `self_instruct.json` keeps the first, and a turn another engine sampled names it in
`"engine"`) and the filter is a pure function of that file; `out/instructions.jsonl` holds the
kept instructions in the prompts format (`question_id`, `category`, `turns`) that `load_prompts`
reads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .._infra.interrupt import DeferredInterrupt

RAW_FILE = "instructions_raw.jsonl"
KEPT_FILE = "instructions.jsonl"
CATEGORY = "self-instruct"
_SENTINEL = "\x00ELSI-FAST-USER-TURN\x00"
_WORD = re.compile(r"[^\W_]+")
_BANDS, _ROWS = 16, 4
_EVAL_NGRAM = 8


# Task openings spread over the kinds of request in chat benchmarks and user logs (category names
# only: no evaluation prompt is used, and the filter still keeps every turn away from them).
OPENINGS = (
    "Write a short story about", "Write a blog post about", "Write a poem about", "Write an email to",
    "Imagine you are", "Pretend to be", "Explain why", "Explain how", "What is the difference between",
    "Solve this problem:", "Calculate", "If a train", "Write a Python function that", "How do I fix this code:",
    "Write a SQL query", "Extract the names and dates from this text:", "Summarize this article:",
    "Summarize the following paragraph in one sentence:", "Translate into French:", "Translate this sentence:",
    "Give me a list of", "Compare", "Describe the history of", "What are the main causes of",
    "Rewrite this paragraph to be more formal:", "Classify the following", "Plan a", "Help me prepare",
)


def user_turn_prefix(tokenizer) -> tuple[list[int], list[int]]:
    """(the chat template's tokens up to where a user turn's text starts, the ids that end a user
    turn). Raises ValueError when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("target: its tokenizer has no chat template, so there is no user turn to sample")
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                             add_generation_prompt=False)
    if _SENTINEL not in rendered:
        raise ValueError("target: its chat template does not place the user's text verbatim")
    head, tail = rendered.split(_SENTINEL, 1)
    # As encode_prompt does for the answers: the rendered template carries BOS and the role markers.
    prefix = tokenizer(head, add_special_tokens=False)["input_ids"]
    tail_ids = tokenizer(tail, add_special_tokens=False)["input_ids"] if tail.strip() else []
    ends = {tail_ids[0]} if tail_ids else set()
    if tokenizer.eos_token_id is not None:
        ends.add(tokenizer.eos_token_id)
    if not ends:
        raise ValueError("target: neither its chat template nor its tokenizer names a token that ends a turn")
    return prefix, sorted(ends)


def normalize(text: str) -> list[str]:
    """The words of `text`, lower case (what the filters compare)."""
    return _WORD.findall(text.lower())


def _shingles(words: list[str], n: int = 3) -> set[str]:
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)} if len(words) >= n else {" ".join(words)}


# Multiply-shift hash family over 64-bit shingle hashes: fixed odd multipliers, so signatures are
# the same on every machine and run.
_RNG = np.random.default_rng(20241)
_MUL = (_RNG.integers(1, 2**63, size=_BANDS * _ROWS, dtype=np.uint64) * np.uint64(2) + np.uint64(1))
_ADD = _RNG.integers(0, 2**63, size=_BANDS * _ROWS, dtype=np.uint64)


def _signature(shingles: set[str]) -> np.ndarray:
    base = np.array([int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little") for s in shingles],
                    dtype=np.uint64)
    with np.errstate(over="ignore"):
        mixed = (base[:, None] * _MUL[None, :] + _ADD[None, :]) >> np.uint64(32)
    return mixed.min(axis=0)


class InstructionFilter:
    """Exact and near-duplicate removal and the evaluation-overlap guard; `add(text)` returns None
    when the text is kept, else the reason it was dropped."""

    def __init__(self, eval_texts: Iterable[str] = (), near_duplicate: float = 0.7, eval_near: float = 0.5,
                 min_words: int = 3):
        if not 0 < near_duplicate <= 1 or not 0 < eval_near <= 1:
            raise ValueError("near_duplicate, eval_near: expected Jaccard thresholds in (0, 1]")
        self.near, self.eval_near, self.min_words = near_duplicate, eval_near, min_words
        self._exact: set[str] = set()
        self._sets: list[tuple[set[str], bool]] = []  # (shingles, is an evaluation prompt)
        self._buckets: dict[tuple[int, bytes], list[int]] = {}
        self._eval_ngrams: set[str] = set()
        for text in eval_texts:
            words = normalize(text)
            self._eval_ngrams |= {" ".join(words[i : i + _EVAL_NGRAM]) for i in range(len(words) - _EVAL_NGRAM + 1)}
            if words:
                self._index(_shingles(words), True)

    def _index(self, shingles: set[str], is_eval: bool) -> None:
        number = len(self._sets)
        self._sets.append((shingles, is_eval))
        for band, key in enumerate(self._band_keys(shingles)):
            self._buckets.setdefault((band, key), []).append(number)

    @staticmethod
    def _band_keys(shingles: set[str]) -> list[bytes]:
        signature = _signature(shingles)
        return [signature[b * _ROWS : (b + 1) * _ROWS].tobytes() for b in range(_BANDS)]

    def add(self, text: str) -> str | None:
        words = normalize(text)
        if len(words) < self.min_words:
            return "short"
        key = " ".join(words)
        if key in self._exact:
            return "duplicate"
        if any(" ".join(words[i : i + _EVAL_NGRAM]) in self._eval_ngrams for i in range(len(words) - _EVAL_NGRAM + 1)):
            return "eval-overlap"
        shingles = _shingles(words)
        candidates = {n for band, k in enumerate(self._band_keys(shingles)) for n in self._buckets.get((band, k), ())}
        for number in sorted(candidates):
            other, is_eval = self._sets[number]
            jaccard = len(shingles & other) / len(shingles | other)
            if is_eval and jaccard >= self.eval_near:
                return "eval-overlap"
            if not is_eval and jaccard >= self.near:
                return "near-duplicate"
        self._exact.add(key)
        self._index(shingles, False)
        return None


def _read_raw(path: Path) -> list[dict]:
    records = []
    if path.is_file():
        with open(path) as f:
            for line in f:
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break  # a line cut by a crash: its batch is sampled again
    return records


def _screen(guard: InstructionFilter, records: Iterable[dict], kept: list[dict], dropped: dict[str, int]) -> None:
    """Append the records `guard` keeps to `kept`; count the others by reason in `dropped`."""
    for record in records:
        reason = "unfinished" if not record["finished"] else guard.add(record["text"])
        if reason is None:
            kept.append(record)
        else:
            dropped[reason] = dropped.get(reason, 0) + 1


def filter_instructions(raw: Sequence[dict], eval_texts: Iterable[str], **thresholds: float) -> tuple[list[dict], dict[str, int]]:
    """The kept records of `raw` in order, and the count of each reason for a drop."""
    kept: list[dict] = []
    dropped: dict[str, int] = {}
    _screen(InstructionFilter(eval_texts, **thresholds), raw, kept, dropped)
    return kept, dropped


def self_instruct(target, tokenizer, out_dir: str | os.PathLike, n: int, *, eval_texts: Sequence[str] = (),
                  temperature: float = 1.0, max_instruction_tokens: int = 128, batch_size: int = 32, seed: int = 0,
                  max_batches: int | None = None, openings: Sequence[str] | None = None, progress: bool = True,
                  server=None) -> dict[str, Any]:
    """Sample user turns until `n` survive the filter (see the module docstring), or `max_batches`
    batches have been sampled in all; writes `out_dir/instructions.jsonl` and returns a summary:
    sampled, kept, dropped by reason, this run's new tokens and their rate. With `server` (an
    `elsi_fast.engines.llamacpp_server.LlamaServer` or a `decoding.native_batch.NativeBatchGenerator` on
    the target's GGUF file) that engine samples them, each turn seeded by its position; else
    transformers, each batch seeded. `openings`: the user turns' first words, one per batch in turn
    (`OPENINGS` is a list); a folder sampled without them may continue with them, from its next
    batch on (`self_instruct.json` keeps the list and that batch), but not with another list."""
    from .regenerate import _generate

    for name, value in (("n", n), ("max_instruction_tokens", max_instruction_tokens), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if not temperature > 0:
        raise ValueError(f"temperature: expected a number > 0 (the turns are sampled), got {temperature!r}")
    openings = None if openings is None else [str(o).strip() for o in openings]
    if openings is not None and (not openings or not all(openings)):
        raise ValueError("openings: expected a non-empty list of non-empty texts")
    prefix, ends = user_turn_prefix(tokenizer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"prefix": prefix, "ends": ends, "temperature": float(temperature), "seed": seed,
                "max_instruction_tokens": max_instruction_tokens, "batch_size": batch_size,
                "engine": server.ENGINE if server is not None else "transformers"}
    settings_path = out / "self_instruct.json"
    # Another engine may continue a folder, as in `regenerate`: the settings keep the first engine
    # and each turn another one samples names it.
    engine = settings["engine"]
    raw_path = out / RAW_FILE
    raw = _read_raw(raw_path)
    batch_number = (raw[-1]["batch"] + 1) if raw else 0
    varying = ("engine", "openings")
    if settings_path.is_file():
        before = json.loads(settings_path.read_text())
        if {k: v for k, v in before.items() if k not in varying} != {k: v for k, v in settings.items() if k not in varying}:
            raise ValueError(f"out: {out} holds instructions sampled with other settings or another chat template")
        kept_openings = before.get("openings", {}).get("texts")
        if kept_openings is not None and kept_openings != openings:
            raise ValueError(f"openings: {out} samples its turns from {len(kept_openings)} other openings "
                             "(self_instruct.json); give the same list")
        settings = before
    if openings is not None and "openings" not in settings:
        settings["openings"] = {"texts": openings, "from_batch": batch_number}
    settings_path.write_text(json.dumps(settings, indent=1))
    other_engine = {"engine": engine} if engine != settings["engine"] else {}
    raw_path.write_text("".join(json.dumps(r) + "\n" for r in raw))  # drop a cut last line
    guard = InstructionFilter(eval_texts)
    kept, dropped = [], {}
    _screen(guard, raw, kept, dropped)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else ends[0]
    device = target.get_input_embeddings().weight.device
    generated, started = 0, time.perf_counter()
    from tqdm.auto import tqdm

    bar = tqdm(total=n, initial=min(len(kept), n), unit="instruction", disable=not progress, desc="self-instruct")
    target.eval()
    with DeferredInterrupt("the sampled instructions") as interrupt, open(raw_path, "a") as sink:
        while len(kept) < n and (max_batches is None or batch_number < max_batches):
            opening = _opening(settings, batch_number)
            start = tokenizer(opening, add_special_tokens=False)["input_ids"] if opening else []
            budget = max_instruction_tokens - len(start)
            if budget < 1:
                raise ValueError(f"max_instruction_tokens: {max_instruction_tokens} leaves no room after the "
                                 f"opening {opening!r}")
            if server is None:
                rows = _generate(target, [prefix + start] * batch_size, [budget] * batch_size, temperature,
                                 seed + batch_number, ends, pad, device, finish_fraction=1.0)
            else:
                rows = [[]] * batch_size
                seeds = [seed + batch_number * batch_size + j for j in range(batch_size)]
                for j, tokens in server.generate([prefix + start] * batch_size, budget, temperature, seeds, ends):
                    rows[j] = tokens
            batch = []
            for j, row in enumerate(rows):
                finished = bool(row) and row[-1] in ends
                ids = start + (row[:-1] if finished else row)
                batch.append({"id": f"si-{seed}-{batch_number}-{j}", "batch": batch_number, "finished": finished,
                              "ids": ids, "text": tokenizer.decode(ids, skip_special_tokens=True).strip(),
                              **({"opening": opening} if opening else {}), **other_engine})
                generated += len(row)
            sink.write("".join(json.dumps(r) + "\n" for r in batch))
            sink.flush()
            before = len(kept)
            _screen(guard, batch, kept, dropped)
            raw += batch
            bar.update(min(len(kept), n) - min(before, n))
            batch_number += 1
            bar.set_postfix(new_tok_s=f"{generated / (time.perf_counter() - started):.1f}", sampled=len(raw))
            interrupt.raise_if_requested()
    bar.close()
    (out / KEPT_FILE).write_text("".join(
        json.dumps({"question_id": r["id"], "category": CATEGORY, "turns": [r["text"]]}) + "\n" for r in kept[:n]))
    seconds = time.perf_counter() - started
    return {"sampled": len(raw), "kept": min(len(kept), n), "dropped": dropped, "new_tokens": generated,
            "seconds": seconds, "new_tokens_per_s": generated / seconds if seconds else 0.0,
            "path": str(out / KEPT_FILE)}


def _opening(settings: dict, batch_number: int) -> str | None:
    """The first words of batch `batch_number`'s turns: the openings in turn from their first batch."""
    openings = settings.get("openings")
    if openings is None or batch_number < openings["from_batch"]:
        return None
    return openings["texts"][(batch_number - openings["from_batch"]) % len(openings["texts"])]


def evaluation_texts(paths: Iterable[str | os.PathLike]) -> list[str]:
    """Every turn of the prompt files at `paths` (Spec-Bench / MT-bench JSONL): what must stay unseen."""
    texts = []
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    texts.extend(t for t in json.loads(line).get("turns", []) if isinstance(t, str))
    return texts
