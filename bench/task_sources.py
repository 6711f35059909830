"""Task prompts whose source texts a target writes itself: German sentences to translate, news
stories to summarize. The two Spec-Bench task kinds the drafts accept least (docs/real-models.md:
translation 1.37, summarization 1.47 at k=4), and the two the self-instructed data cannot cover: a
user turn sampled from the chat template is short, and SmolLM2 writes no German.

A source text is sampled (temperature 1, one seed per text) by plain continuation of a section
header on elsi-fast's native forward of a named real target's GGUF file: Gemma 3 270M for German
(multilingual; SmolLM2 is English-only), SmolLM2 for English news. It is cut at a sentence end,
screened for length and letters, and passed through the self-instruct filter: exact and near
duplicates dropped, and anything with an 8-gram or a near match in Spec-Bench or MT-bench (so the
evaluation stays unseen). Each kept text is wrapped in one of a few task wordings, in turn, and
written as prompts JSONL for `elsi-fast regenerate --prompts`, which lets the draft's target
answer them. A rerun with the same --out keeps the file (delete it to sample again).

    .venv/bin/python -m bench.task_sources translation --n 1000 --out runs/tasks/translation.jsonl
    .venv/bin/python -m bench.task_sources summarization --n 450 --out runs/tasks/summarization.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

# kind: (source model, section headers the text continues, new tokens per text, words kept (min, max),
# task wordings). The headers name a newspaper section only; the wordings are the tasks' plain names.
KINDS = {
    "translation": ("gemma3-270m",
                    [f"Aus der Zeitung, Ressort {s}:\n\n" for s in
                     ("Politik", "Wirtschaft", "Sport", "Kultur", "Wissenschaft", "Reise", "Gesundheit", "Technik",
                      "Lokales", "Panorama", "Bildung", "Umwelt")],
                    64, (6, 60),
                    ["Translate German to English:", "Translate into English:",
                     "Translate the following German text to English:", "What does this German sentence mean in English?"]),
    "summarization": ("smollm2-135m-instruct",
                      [f"{s} news\n\n" for s in
                       ("Politics", "Business", "Sports", "Entertainment", "Science", "Travel", "Health", "Technology",
                        "Local", "World", "Education", "Weather")],
                      448, (150, 800),
                      ["Summarize:", "Summarize the following article:", "Write a short summary of this news story:",
                       "Give the main points of this article:"]),
}
_MARKUP = re.compile(r"<[^>]{1,40}>|\*\*|__|#+ ")


def source_text(raw: str, kind: str) -> str | None:
    """The part of a sampled continuation kept as a source text, or None: German, the sentence the
    sampling stopped after; news, whole sentences up to the last sentence end (a story cut mid-sentence
    would ask the target to summarize a fragment)."""
    _, _, _, (low, high), _ = KINDS[kind]
    text = _MARKUP.sub("", raw).replace("\r", "").strip()
    if kind == "translation":
        # the sentence the sampling stopped after, without a headline before it, on one line
        text = " ".join(text.split("\n\n")[-1].split())
        if not text.endswith((".", "!", "?")):
            return None
    else:
        # the end of the last sentence: its mark, and a closing quote after it
        end = max(text.rfind(". ") + 1, text.rfind(".\n") + 1, text.rfind("!") + 1, text.rfind("?") + 1,
                  text.rfind('."') + 2)
        text = text[:end].strip() if end > 1 else ""
    words = text.split()
    letters = sum(c.isalpha() for c in text)
    if not low <= len(words) <= high or letters < 0.7 * len(text.replace(" ", "")):
        return None
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=sorted(KINDS))
    p.add_argument("--n", type=int, required=True, help="task prompts to keep")
    p.add_argument("--out", type=Path, required=True, help="prompts JSONL to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-prompts", nargs="+", default=None,
                   help="prompt files that must stay unseen (default: the shared Spec-Bench and MT-bench)")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error(f"--n: must be positive, got {args.n}")
    if args.out.exists():
        print(f"{args.out} exists: kept (delete it to sample again)")
        return 0

    from bench.common import shared_data
    from elsi_fast.decoding.native_batch import NativeBatchGenerator
    from elsi_fast.targets import catalog
    from elsi_fast.targets.loading import end_of_generation_ids, gguf_tokenizer
    from elsi_fast.targets.native_forward import NativeForward
    from elsi_fast.training.self_instruct import InstructionFilter, evaluation_texts

    model, headers, new_tokens, _, wordings = KINDS[args.kind]
    eval_files = args.eval_prompts or [str(shared_data("prompts", f)) for f in
                                       ("spec_bench_question.jsonl", "mt_bench_question.jsonl")]
    guard = InstructionFilter(evaluation_texts(eval_files))
    gguf = catalog.resolve(model)
    tokenizer = gguf_tokenizer(gguf)
    ends = end_of_generation_ids(tokenizer)
    stop = list(ends)
    if args.kind == "translation":  # one sentence each: stop at its end instead of sampling past it
        stop += [ids[0] for mark in (".", "!", "?")
                 if len(ids := tokenizer(mark, add_special_tokens=False)["input_ids"]) == 1]
    engine = NativeBatchGenerator(NativeForward(gguf, capacity=64 + new_tokens,
                                                num_threads=args.threads, sequences=8), end_of_generation=ends)
    encoded = [tokenizer(h)["input_ids"] for h in headers]
    kept: list[str] = []
    dropped = {"unusable": 0}
    sampled, generated, started, batch = 0, 0, time.perf_counter(), 64
    while len(kept) < args.n:
        prompts = [encoded[(sampled + j) % len(headers)] for j in range(batch)]
        seeds = [args.seed + sampled + j for j in range(batch)]
        for _, tokens in engine.generate(prompts, new_tokens, 1.0, seeds, stop):
            generated += len(tokens)
            text = source_text(tokenizer.decode(tokens, skip_special_tokens=True), args.kind)
            reason = "unusable" if text is None else guard.add(text)
            if reason is None and len(kept) < args.n:
                kept.append(text)
            elif reason is not None:
                dropped[reason] = dropped.get(reason, 0) + 1
        sampled += batch
        print(f"{args.kind}: {len(kept)} kept of {sampled} sampled; {generated / (time.perf_counter() - started):.1f} "
              f"new tokens/s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    prefix = {"translation": "tt", "summarization": "ts"}[args.kind]
    with open(args.out, "w") as f:
        for i, text in enumerate(kept):
            wording = wordings[i % len(wordings)]
            f.write(json.dumps({"question_id": f"{prefix}-{args.seed}-{i}", "category": f"task-{args.kind}",
                                "turns": [f"{wording} {text}"], "source_model": model}) + "\n")
    print(f"{args.out}: {len(kept)} prompts of {sampled} sampled texts (dropped: {dropped})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
