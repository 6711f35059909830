"""Keep a finished long-run draft in the repository: bf16 weights and the facts that make it reproducible.

    python -m bench.keep_draft runs/long-run/smollm2-135m-instruct/elsi-m1-seed0-steps480 \
        --model smollm2-135m-instruct --set elsi-m1 --data runs/data-smollm2-3897

Writes bench/results/drafts/<model>/<set>-<layers>/: the EAGLE3 folder (`config.json`,
`model.safetensors`, bf16, what `eval-draft --draft`, `serve --draft` and vLLM read) and
`training.json`: target, layers, conversations, answer_tokens, tokens_seen, steps, the recipe, the
draft vocabulary's coverage and the tau table of the kept step (k = 1..5 on each evaluation set of
bench/results/draft_long_run_cpu.jsonl). Refuses a draft over 30 MB, so the repository stays small.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DRAFTS = ROOT / "bench" / "results" / "drafts"
CURVE = ROOT / "bench" / "results" / "draft_long_run_cpu.jsonl"
MAX_BYTES = 30 * 2**20


def tau_table(cell: str, step: int) -> dict[str, dict[str, float]]:
    """{set: {"k=K": tau}} of one kept step, from the long run's curve rows."""
    table: dict[str, dict[str, float]] = {}
    for line in CURVE.read_text().splitlines():
        row = json.loads(line)
        p = row["params"]
        if p["cell"] == cell and p["step"] == step:
            table.setdefault(p["set"], {})[f"k={row['metric'].removeprefix('tau_k')}"] = round(row["value"], 4)
    return table


def keep(cell: Path, model: str, layer_set: str, data: Path) -> Path:
    import torch

    from bench.draft_long_run import KEEP, held_sets
    from elsi_fast.draft import read_draft, write_draft
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations
    from elsi_fast.training.train import SUMMARY_FILE

    summary = json.loads((cell / SUMMARY_FILE).read_text())
    step = summary["history"][-1]["step"]
    table = tau_table(cell.name, step)
    if not table:
        raise SystemExit(f"cell: no curve rows for {cell.name} step {step} in {CURVE}; run the long run's curve stage first")
    layers = list(summary["layers"])
    if "conversations" in summary:  # recorded by draft_long_run when the cell trained
        conversations, answer_tokens = summary["conversations"], summary["answer_tokens"]
    else:  # an older cell: the data folder must be as it was then
        train = held_sets(read_conversations(data / CONVERSATIONS_FILE), KEEP / model, summary["seed"])[0]
        conversations, answer_tokens = len(train), sum(len(r["response_ids"]) for r in train)
    out = DRAFTS / model / f"{layer_set}-{'-'.join(map(str, layers))}"
    draft = read_draft(cell).to(torch.bfloat16)
    write_draft(draft, out)
    size = sum(f.stat().st_size for f in out.iterdir())
    if size > MAX_BYTES:
        raise SystemExit(f"cell: the bf16 draft takes {size / 2**20:.1f} MB, over the 30 MB a kept draft may take")
    facts = {
        "target": model,
        "layers": layers,
        "layer_set": layer_set,
        "conversations": conversations,
        "answer_tokens": answer_tokens,
        # A continued cell (draft_long_run --init-from) counts its parents' tokens and steps too.
        "tokens_seen": summary.get("parent_tokens", 0) + sum(h["tokens"] for h in summary["history"]),
        "steps": summary.get("parent_steps", 0) + step,
        "recipe": {key: summary.get(key) for key in ("init", "init_from", "draft_vocab_size", "ttt_steps",
                                                     "batch_size", "lr", "warmup", "seq_len", "weight_decay", "seed",
                                                     "label_temperature", "labels")
                   if key in summary},
        "draft_vocab_coverage": summary.get("draft_vocab_coverage"),
        "final_loss": summary["final_loss"],
        "tau": table,
        "tau_note": "tokens per target forward, greedy, pooled over prompts; held-in / held-out: 200 training / "
                    "unseen conversations each; held-out-128: the held-out answers' first 128 tokens; spec-bench: the "
                    "480 Spec-Bench prompts, 128 new tokens "
                    "(bench/draft_long_run.py)",
        "source": str(cell.relative_to(ROOT)) if cell.is_relative_to(ROOT) else str(cell),
    }
    if "init_from" in facts["recipe"]:  # the parent cell, named as in the source field
        parent = Path(facts["recipe"]["init_from"])
        facts["recipe"]["init_from"] = str(parent.relative_to(ROOT)) if parent.is_relative_to(ROOT) else str(parent)
    (out / "training.json").write_text(json.dumps(facts, indent=1) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cell", type=Path, help="the long run's cell folder (its final draft and train_summary.json)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--set", required=True, help="the layer set's name (elsi-m1, eagle3-m3, ...)")
    parser.add_argument("--data", type=Path, required=True,
                        help="the regenerate folder the cell trained on (read only for a cell whose summary does not "
                        "record its data)")
    args = parser.parse_args(argv)
    print(keep(args.cell.resolve(), args.model, args.set, args.data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
