"""How far a draft vocabulary of V tokens lets tau go: coverage and the ceiling of a perfect draft.

    python -m bench.draft_vocab_ceiling [--model smollm2-135m-instruct] [--data runs/data-smollm2]
                                        [--sizes 2048 4096 8192 16384 32768] [--k 4]

The draft vocabulary is the V most frequent answer tokens of the long run's training split
(`training.train.draft_vocab_ids`, as `train_draft` picks it; the held sets of
`bench.draft_long_run.held_sets` left out). A token outside it can never be drafted, so a round
ends at the first one. For each V this reports the share of answer tokens inside the vocabulary
(training answers, and the target's own greedy continuations of the 480 Spec-Bench prompts per
category) and the tau at k a draft would reach if it proposed every in-vocabulary token right:
the ceiling the vocabulary alone sets, pooled as `decoding.evaluation.pooled_tau` pools
(tokens per verification round, the prefill's token not counted, rounds of min(k, left - 1)).
  -> bench/results/draft_vocab_ceiling_cpu.jsonl: spec_bench_coverage/V=<V>,
     spec_bench_ceiling_tau_k<k>/V=<V> (per category in params)
`--drafts DIR ...` measures kept drafts' own vocabularies instead (a continued draft's grows from its
parent's, `train.grown_draft_vocab_ids`, so it is not the top V of today's data):
  -> spec_bench_coverage/draft, spec_bench_ceiling_tau_k<k>/draft (params.draft: the folder)
Needs the data folder and the long run's Spec-Bench continuations (runs/long-run/<model>/spec-bench,
written by `bench.draft_long_run`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import ROOT, device_name, record

RESULTS = "draft_vocab_ceiling_cpu"


def ceiling_rounds(answer: list[int], vocabulary: set[int], k: int) -> tuple[int, int]:
    """(tokens emitted in rounds, rounds) of greedy chain decoding of `answer` with a draft that
    proposes every in-vocabulary token right: a round accepts up to the first token outside."""
    emitted, rounds, i = 0, 0, 1  # token 0 comes from the prefill
    while i < len(answer):
        round_k = min(k, len(answer) - i - 1)
        n = 0
        while n < round_k and answer[i + n] in vocabulary:
            n += 1
        emitted, rounds, i = emitted + n + 1, rounds + 1, i + n + 1
    return emitted, rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", default=str(ROOT / "runs" / "data-smollm2"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--drafts", nargs="+", default=[], metavar="DIR",
                        help="kept draft folders whose own vocabularies to measure (instead of --sizes)")
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()

    import torch

    from bench.draft_long_run import KEEP, held_sets
    from elsi_fast.draft.formats import read_draft
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations
    from elsi_fast.training.train import draft_vocab_ids

    train, _, _ = held_sets(read_conversations(Path(args.data) / CONVERSATIONS_FILE), KEEP / args.model)
    answers = torch.tensor([t for r in train for t in r["response_ids"]])
    vocab_size = int(answers.max()) + 1
    spec_bench = read_conversations(ROOT / "runs" / "long-run" / args.model / "spec-bench" / CONVERSATIONS_FILE)
    vocabularies = []  # (label, metric suffix, vocabulary, params)
    for folder in args.drafts:
        try:
            draft = read_draft(folder)
        except (OSError, ValueError, KeyError) as error:
            raise SystemExit(f"--drafts: {folder} is not a readable draft folder ({error})") from None
        size = draft.config.draft_vocab_size
        # A kept folder is overwritten when its draft is continued: its steps tell the rows apart.
        facts = Path(folder) / "training.json"
        steps = json.loads(facts.read_text()).get("steps") if facts.is_file() else None
        vocabularies.append((folder, "draft", set(draft.draft_to_target(torch.arange(size)).tolist()),
                             {"draft": folder, "draft_steps": steps, "draft_vocab_size": size}))
    for size in [] if args.drafts else args.sizes:
        top = set(draft_vocab_ids(answers, max(vocab_size, size), size).tolist())
        vocabularies.append((f"V={size}", f"V={size}", top, {"draft_vocab_size": size}))
    for label, metric, vocabulary, chosen in vocabularies:
        train_coverage = sum(t in vocabulary for t in answers.tolist()) / len(answers)
        inside, total, emitted, rounds = {}, {}, {}, {}
        for r in spec_bench:
            ids, cat = r["response_ids"], r["category"]
            e, n = ceiling_rounds(ids, vocabulary, args.k)
            for key in (cat, "all"):
                inside[key] = inside.get(key, 0) + sum(t in vocabulary for t in ids)
                total[key] = total.get(key, 0) + len(ids)
                emitted[key], rounds[key] = emitted.get(key, 0) + e, rounds.get(key, 0) + n
        coverage = {key: inside[key] / total[key] for key in total}
        tau = {key: emitted[key] / rounds[key] for key in rounds}
        print(f"{label}: training answers {train_coverage:.3f}, Spec-Bench {coverage['all']:.3f} "
              f"(translation {coverage.get('translation', float('nan')):.3f}), ceiling tau(k={args.k}) {tau['all']:.3f}")
        params = {"model": args.model, **chosen, "k": args.k, "conversations": len(train),
                  "answer_tokens": len(answers), "train_coverage": train_coverage, "spec_bench_prompts": len(spec_bench)}
        record(RESULTS, "draft_vocab_ceiling", f"spec_bench_coverage/{metric}", coverage["all"], "fraction",
               device=device_name("cpu"), params={**params, "per_category": coverage})
        record(RESULTS, "draft_vocab_ceiling", f"spec_bench_ceiling_tau_k{args.k}/{metric}", tau["all"],
               "tokens/forward", device=device_name("cpu"), params={**params, "per_category": tau})


if __name__ == "__main__":
    main()
