"""The ceiling test: a draft that memorizes a few dozen conversations must reach held-in tau >= 3.

    python -m bench.draft_ceiling [--model smollm2-135m-instruct] [--set eagle3-m3] [--steps 600]

Issue 33, item 3. The draft is trained and measured through the user's own commands, so a high
held-in tau proves that training and decoding agree on positions, the training-time-test shift,
the draft vocabulary map and the layer ids; a mismatch in any of them caps tau near 1 however
long the draft trains (docs/method.md, section 6):

1. 6 training instructions of each of the 8 categories of train_instructions.jsonl (seeded);
2. `elsi-fast regenerate --engine transformers`: the fp32 target's own greedy answers, the same
   target `eval-draft` decodes with (answers from a quantized engine would differ in places);
3. `elsi-fast train-draft` on those 48 conversations with a draft vocabulary covering every answer
   token (a token outside it can never be drafted), random init, from an offline feature cache;
4. `elsi-fast eval-draft` live on the same 48 instructions (k = 4, greedy, at most as many new
   tokens as the answers were given, each stopping at the end of its answer as the answers did).

Rows: bench/results/draft_ceiling_cpu.jsonl (tau overall and per category, the final loss, the
training tokens/s). Work goes to runs/ceiling/<model>/; every stage resumes.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

from bench.common import device_name, record, shared_data

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "draft_ceiling_cpu"
PER_CATEGORY = 6
MAX_NEW_TOKENS = 128
MAX_PROMPT_TOKENS = 1024  # regenerate's default cut, so eval-draft sees the prompts the answers came from
RECIPE = {"init": "random", "ttt_steps": 3, "batch_size": 8, "lr": 3e-3}


def pick_instructions(path: Path, per_category: int, seed: int) -> list[dict]:
    """`per_category` records of every category, by a seeded shuffle, in file order."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_category: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_category.setdefault(r["category"], []).append(i)
    rng = random.Random(seed)
    chosen = sorted(i for indices in by_category.values() for i in rng.sample(indices, per_category))
    return [records[i] for i in chosen]


def covering_vocab_size(conversations: Path, multiple: int = 64) -> int:
    """Distinct answer tokens of the conversations, rounded up: the draft vocabulary covers them all."""
    tokens = set()
    for line in conversations.read_text().splitlines():
        tokens.update(json.loads(line)["response_ids"])
    return -(-len(tokens) // multiple) * multiple


def cli(*args: str) -> None:
    command = [sys.executable, "-m", "elsi_fast", *args]
    print("+ elsi-fast " + " ".join(args), flush=True)
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--set", default="eagle3-m3", help="a layer set of the draft experiment's sets.json")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--note", default="", help="conditions to record in the rows (e.g. another job beside)")
    args = parser.parse_args()

    layers = json.loads((ROOT / "bench" / "results" / "draft_experiment" / args.model / "sets.json").read_text())[args.set]
    work = ROOT / "runs" / "ceiling" / args.model
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    if not prompts.is_file():
        chosen = pick_instructions(shared_data("prompts", "train_instructions.jsonl"), PER_CATEGORY, args.seed)
        prompts.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    target = ["--target", args.model, "--threads", str(args.threads)]
    data = work / "data"
    cli("regenerate", *target, "--prompts", str(prompts), "--out", str(data), "--engine", "transformers",
        "--max-new-tokens", str(MAX_NEW_TOKENS), "--batch-size", "16", "--no-progress")
    conversations = data / "conversations.jsonl"
    vocab = covering_vocab_size(conversations)
    draft = work / f"draft-{args.set}-steps{args.steps}"
    summary_path = draft / "train_summary.json"
    finished = summary_path.is_file() and json.loads(summary_path.read_text()).get("steps") == args.steps
    if not finished:  # a rerun of a finished draft would overwrite its summary with a run of no steps
        cli("train-draft", *target, "--layers", *map(str, layers), "--data", str(conversations), "--out", str(draft),
            "--steps", str(args.steps), "--batch-size", str(RECIPE["batch_size"]), "--lr", str(RECIPE["lr"]),
            "--ttt-steps", str(RECIPE["ttt_steps"]), "--init", RECIPE["init"], "--draft-vocab-size", str(vocab),
            "--cache-dir", str(work / f"cache-{'-'.join(map(str, layers))}"), "--seed", str(args.seed), "--no-progress")
    result = draft / "eval-held-in.json"
    if not result.is_file():
        cli("eval-draft", *target, "--draft", str(draft), "--prompts", str(prompts), "--k", "4",
            "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--json",
            str(result), "--no-progress")
    evaluated = json.loads(result.read_text())
    tau = evaluated["tau"]
    summary = json.loads(summary_path.read_text())
    params = {"model": args.model, "set": args.set, "layers": layers, "conversations": PER_CATEGORY * 8,
              "draft_vocab_size": vocab, "steps": args.steps, "recipe": RECIPE, "k": 4,
              "max_new_tokens": MAX_NEW_TOKENS, "max_prompt_tokens": MAX_PROMPT_TOKENS, "per_category": tau,
              "final_loss": summary["final_loss"],
              "tokens_per_second": summary.get("tokens_per_second_this_run"), "threads": args.threads,
              "stop_ids": evaluated.get("stop_ids"), "note": args.note, "goal": 3.0}
    device = device_name("cpu", args.threads)
    record(RESULTS, "draft_ceiling", "tau_k4_held_in", tau["all"], "tokens/forward", device=device, params=params)
    print(f"held-in tau(k=4) {tau['all']:.3f} (goal >= 3): "
          + ", ".join(f"{c} {t:.2f}" for c, t in tau.items() if c != "all"))


if __name__ == "__main__":
    main()
