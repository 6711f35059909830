"""Draft training throughput: this tree's trainer against a baseline commit's, on real conversations.

    python -m bench.bench_train [--conversations 96] [--steps 12] [--reps 2] [--baseline 5ac09af]
        [--labels target|answers] [--draft-vocab-size 4096] [--baseline-precision auto]

Both train the same draft (ELSI m=1 [11] on SmolLM2 by default, random init, draft vocabulary
4096, 3 training-time-test steps, batches of 16; labels the target's distribution, or with
`--labels answers` the answers' tokens, as the long runs train) from one bfloat16 feature cache of the first
`--conversations` of a `regenerate` folder (`--data`, default runs/data-smollm2), with the same
seed and batches, so the loss curves must agree (to bf16 rounding where this tree trains in bf16).
Each run is a fresh process, alternating baseline / this tree `--reps` times; the rows give the
median training tokens/s (every real token of the batch, as `train_summary.json` counts them) and
the loss after `--steps` steps. The baseline is a git worktree of `--baseline` under /tmp.
  -> bench/results/train_cpu.jsonl (issue goal: >= 3x the baseline's tokens/s at an equal loss)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import device_name, record

ROOT = Path(__file__).resolve().parents[1]

# Run in the code tree under test (cwd), so `elsi_fast` is that tree's; prints one JSON line.
WORKER = """
import json, sys, torch
from pathlib import Path
try:
    from elsi_fast.targets.loading import load_model
    from elsi_fast.training.feature_cache import open_cache
    from elsi_fast.training.regenerate import read_conversations
    from elsi_fast.training.train import SUMMARY_FILE, train_draft
    from elsi_fast.training.training_data import conversation_samples
except ModuleNotFoundError:  # a baseline commit before the package's subpackages
    from elsi_fast.feature_cache import open_cache
    from elsi_fast.loading import load_model
    from elsi_fast.regenerate import read_conversations
    from elsi_fast.train import SUMMARY_FILE, train_draft
    from elsi_fast.training_data import conversation_samples
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
model, tokenizer = load_model(args["model"], device="cpu", dtype="float32", argument="--model",
                              device_argument="--device", progress=False)
records = read_conversations(args["data"])[: args["conversations"]]
samples = conversation_samples(records, tokenizer, 512, model.config.vocab_size)
extra = {"precision": args["precision"]} if args["precision"] else {}
if args["labels"] != "target":  # a baseline commit before `labels` knew only the target's
    extra["labels"] = args["labels"]
trained = train_draft(model, tokenizer, args["layers"], samples, out_dir=args["out"],
                      feature_cache=open_cache(args["cache"]), steps=args["steps"], batch_size=16, lr=3e-3, warmup=2,
                      ttt_steps=3, draft_vocab_size=args["draft_vocab_size"], init="random", seq_len=512, seed=0, save_every=10**6,
                      resume=False, progress=False, **extra)
# train_draft returns (draft, summary); a baseline commit's returned the draft only and wrote the file
summary = trained.summary if hasattr(trained, "summary") else json.loads((Path(args["out"]) / SUMMARY_FILE).read_text())
print(json.dumps({"tok_s": summary["tokens_per_second_this_run"],
                  "losses": [h["loss"] for h in summary["history"]],
                  "precision": summary.get("precision_this_run", "float32")}))
"""


def _run(tree: Path, settings: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", WORKER, json.dumps(settings)], cwd=tree, check=True,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _baseline_tree(commit: str) -> Path:
    tree = Path(tempfile.gettempdir()) / f"elsi-train-baseline-{commit}"
    if not tree.is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), commit], cwd=ROOT, check=True,
                       capture_output=True)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--data", default=str(ROOT / "runs" / "data-smollm2"))
    parser.add_argument("--layers", type=int, nargs="+", default=[11])
    parser.add_argument("--conversations", type=int, default=96)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", default="5ac09af", help="the commit of today's trainer")
    parser.add_argument("--baseline-precision", default=None,
                        help="the baseline's precision argument (default: none, its trainer's own default)")
    parser.add_argument("--labels", choices=("target", "answers"), default="target")
    parser.add_argument("--draft-vocab-size", type=int, default=4096)
    parser.add_argument("--note", default="", help="conditions to record, e.g. a paused background job")
    args = parser.parse_args()

    import torch

    from elsi_fast.targets.loading import load_model
    from elsi_fast.training.feature_cache import build
    from elsi_fast.training.regenerate import CONVERSATIONS_FILE, read_conversations
    from elsi_fast.training.training_data import conversation_samples

    torch.set_num_threads(args.threads)
    data = Path(args.data).resolve() / CONVERSATIONS_FILE  # the workers run in other trees
    work = Path(tempfile.mkdtemp(prefix="bench-train-"))
    model, tokenizer = load_model(args.model, device="cpu", dtype="float32", argument="--model",
                                  device_argument="--device", progress=False)
    samples = conversation_samples(read_conversations(data)[: args.conversations], tokenizer, 512,
                                   model.config.vocab_size)
    build(model, samples, args.layers, work / "cache", dtype="bfloat16", progress=False)
    del model
    trees = {"baseline": _baseline_tree(args.baseline), "new": ROOT}
    runs: dict[str, list[dict]] = {"baseline": [], "new": []}
    for rep in range(args.reps):
        for name, tree in trees.items():
            settings = {"model": args.model, "data": str(data), "conversations": args.conversations,
                        "layers": args.layers, "steps": args.steps, "threads": args.threads,
                        "labels": args.labels, "draft_vocab_size": args.draft_vocab_size,
                        "cache": str(work / "cache"), "out": str(work / f"{name}-{rep}"),
                        "precision": "auto" if name == "new" else args.baseline_precision}
            runs[name].append(_run(tree, settings))
            print(name, rep, f"{runs[name][-1]['tok_s']:.0f} tokens/s, final loss {runs[name][-1]['losses'][-1]:.4f}")
    base = statistics.median(r["tok_s"] for r in runs["baseline"])
    new = statistics.median(r["tok_s"] for r in runs["new"])
    base_loss, new_loss = runs["baseline"][0]["losses"], runs["new"][0]["losses"]
    params = {"model": args.model, "layers": args.layers, "conversations": args.conversations, "steps": args.steps,
              "batch_size": 16, "draft_vocab_size": args.draft_vocab_size, "labels": args.labels, "ttt_steps": 3,
              "cache_dtype": "bfloat16",
              "threads": args.threads, "reps": args.reps, "baseline_commit": args.baseline,
              "baseline_precision": args.baseline_precision or "its default",
              "precision": runs["new"][0]["precision"], "load": os.getloadavg()[0], "note": args.note,
              "loss_baseline": base_loss, "loss_new": new_loss}
    device = device_name("cpu", args.threads)
    record("train_cpu", "train_draft", "train_tokens_per_s", new, "tokens/s", device=device, baseline=base,
           ratio=new / base, params=params)
    record("train_cpu", "train_draft", f"loss_after_{args.steps}_steps", new_loss[-1], "nats", device=device,
           baseline=base_loss[-1], ratio=new_loss[-1] / base_loss[-1], params=params)
    print(f"this tree {new:.0f} tokens/s against {base:.0f} ({new / base:.2f}x); loss after {args.steps} steps "
          f"{new_loss[-1]:.4f} against {base_loss[-1]:.4f}")


if __name__ == "__main__":
    main()
