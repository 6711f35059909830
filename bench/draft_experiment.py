"""The paper's draft claims on real targets: EAGLE3 drafts on chosen layer sets, trained the anchors'
way, tau on all 480 Spec-Bench prompts. A resumable experiment: every cell (data, cache, a trained
draft, its tau) is kept under runs/draft-experiment/<model>/ and a rerun does only what is missing,
so it continues across sessions.

    python bench/draft_experiment.py [--model smollm2-135m-instruct] [--stages data calibrate cache recipe claims]

data:      the target answers train_instructions.jsonl (greedy, chat template, <= 128 new tokens:
           `regenerate`) and gives its greedy continuation of every Spec-Bench prompt (<= 128 new
           tokens, stopping at its end-of-turn token), once.
calibrate: `analyze` on the training instructions (the calibration set a user has): the layer sets.
cache:     the target's states on both, for the union of every set's layers (bfloat16), once.
recipe:    what buys tau per CPU-hour, on ELSI m=1 (seed 0): init random / target, draft vocabulary
           2048 / 8192, training-time test 3 / 7, and a data-scaling curve (training tokens).
claims:    every layer set x seeds at the chosen recipe; tau at k = 1..5 replayed exactly.
Rows: bench/results/draft_experiment_cpu.jsonl (one per trained draft and k).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import device_name, record  # noqa: E402
from elsi_fast.evaluation import continuation_samples, pooled_tau, replay_runs  # noqa: E402
from elsi_fast.feature_cache import build, open_cache  # noqa: E402
from elsi_fast.loading import load_model  # noqa: E402
from elsi_fast.prompts import load_prompts  # noqa: E402
from elsi_fast.regenerate import CONVERSATIONS_FILE, read_conversations, regenerate  # noqa: E402
from elsi_fast.report import LayerReport  # noqa: E402
from elsi_fast.train import train_draft  # noqa: E402
from elsi_fast.training_data import conversation_samples  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "prompts"
RUNS = ROOT / "runs" / "draft-experiment"
RESULTS = "draft_experiment_cpu"
KS = (1, 2, 3, 4, 5)
MAX_TOKENS = 512  # per training conversation
MAX_PROMPTS = None  # all (the smoke test takes a few)
# The recipe every claims cell uses unless the recipe stage says otherwise (chosen from its cells).
RECIPE = {"init": "target", "draft_vocab_size": 8192, "ttt_steps": 3, "steps": 120, "batch_size": 16,
          "lr": 3e-3, "warmup": 12}


def sets_of(report: LayerReport, model: str) -> dict[str, list[int]]:
    """The layer sets of the claims (input-to-layer ids)."""
    sets = {"elsi-m1": report.select("elsi", 1), "elsi-m3": report.select("elsi", 3),
            "eagle3-m3": report.select("eagle3", 3), "low-entropy-m3": report.select("low-entropy", 3)}
    if model.startswith("smollm2"):
        sets.update({"elsi-c-m3": report.select("elsi-c", 3), "last-m1": report.select("last", 1),
                     "uniform-m3": report.select("uniform", 3)})
    return sets


def stage_data(model, tokenizer, out: Path) -> None:
    train = load_prompts(str(DATA / "train_instructions.jsonl"), max_prompts=MAX_PROMPTS)
    print(regenerate(model, tokenizer, train, out / "train", max_new_tokens=128, batch_size=16))
    evaluation = load_prompts(str(DATA / "spec_bench_question.jsonl"), max_prompts=MAX_PROMPTS)
    print(regenerate(model, tokenizer, evaluation, out / "eval", max_new_tokens=128, max_prompt_tokens=512,
                     batch_size=8))


def stage_calibrate(model, tokenizer, out: Path) -> LayerReport:
    from elsi_fast.analysis import analyze

    path = out / "calibration" / "report.json"
    if path.is_file():
        return LayerReport.from_json(str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    report = analyze(model, tokenizer, load_prompts(str(DATA / "train_instructions.jsonl"), max_prompts=MAX_PROMPTS),
                     m=(1, 3),
                     state_path=str(path.parent / "state.pt"), model_name=out.name)
    report.to_json(str(path))
    report.plot(str(path.parent))
    for leftover in path.parent.glob("state.pt*"):
        leftover.unlink()
    return report


def _records(out: Path, name: str) -> list[dict]:
    return read_conversations(out / name / CONVERSATIONS_FILE)


def stage_cache(model, tokenizer, out: Path, layers: list[int]) -> None:
    train = conversation_samples(_records(out, "train"), tokenizer, MAX_TOKENS, model.config.vocab_size)
    build(model, train, layers, out / "cache-train", dtype="bfloat16")
    build(model, continuation_samples(_records(out, "eval")), layers, out / "cache-eval", dtype="bfloat16")


def run_cell(model, tokenizer, out: Path, name: str, layers: list[int], seed: int, recipe: dict, tag: str) -> dict:
    """Train one draft (resumable) and replay its tau at every k; the cell's result is kept in
    result.json, and a rerun reads it instead of recomputing."""
    cell = out / "cells" / f"{name}-seed{seed}-{tag}"
    done = cell / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    train = conversation_samples(_records(out, "train"), tokenizer, MAX_TOKENS, model.config.vocab_size)
    started = time.process_time()
    draft = train_draft(model, tokenizer, layers, train, out_dir=cell, feature_cache=open_cache(out / "cache-train"),
                        seed=seed, seq_len=MAX_TOKENS, save_every=10, **recipe)
    train_cpu = time.process_time() - started
    summary = json.loads((cell / "train_summary.json").read_text())
    records, cache = _records(out, "eval"), open_cache(out / "cache-eval")
    taus, eval_cpu = {}, {}
    for k in KS:
        began = time.process_time()
        runs = replay_runs(draft, records, cache, k=k, batch_size=48)
        eval_cpu[k] = time.process_time() - began
        taus[k] = {"pooled": pooled_tau(runs),
                   "per_prompt": {cat: [r.tau for r in results] for cat, results in runs.items()}}
    result = {"name": name, "layers": layers, "seed": seed, "tag": tag, "recipe": recipe,
              "train_tokens": sum(h["tokens"] for h in summary["history"]), "final_loss": summary["final_loss"],
              "final_top1": summary["history"][-1]["top1"], "train_cpu_seconds": train_cpu,
              "train_tokens_per_second": summary["tokens_per_second_this_run"], "eval_cpu_seconds": eval_cpu,
              "tau": taus}
    device = device_name("cpu")
    for k in KS:
        record(RESULTS, "draft_tau", f"tau/k={k}", taus[k]["pooled"]["all"], "tokens/forward", device=device,
               params={"model": out.name, "set": name, "layers": layers, "seed": seed, "tag": tag, "recipe": recipe,
                       "per_category": taus[k]["pooled"], "train_tokens": result["train_tokens"],
                       "train_cpu_seconds": train_cpu, "prompts": len(records), "max_new_tokens": 128,
                       "loadavg": os.getloadavg()})
    done.write_text(json.dumps(result))
    return json.loads(done.read_text())  # the same (string) keys whether computed now or read


def stage_recipe(model, tokenizer, out: Path, sets: dict) -> None:
    layers = sets["elsi-m1"]
    variants = {"base": {}, "random-init": {"init": "random"}, "vocab2048": {"draft_vocab_size": 2048},
                "ttt7": {"ttt_steps": 7}, "steps30": {"steps": 30, "warmup": 3}, "steps60": {"steps": 60, "warmup": 6},
                "steps240": {"steps": 240, "warmup": 24}}
    for tag, change in variants.items():
        # the base recipe's cell is the claims' ELSI m=1 seed-0 cell
        result = run_cell(model, tokenizer, out, "elsi-m1", layers, 0, {**RECIPE, **change},
                          "claims" if tag == "base" else f"recipe-{tag}")
        print(f"recipe {tag:<12} tau(k=4) {result['tau']['4']['pooled']['all']:.3f}, "
              f"train {result['train_cpu_seconds'] / 60:.1f} CPU-min, {result['train_tokens']} tokens")


def stage_claims(model, tokenizer, out: Path, sets: dict, seeds: list[int]) -> None:
    for seed in seeds:  # every set at one seed before the next seed: partial results stay balanced
        for name, layers in sets.items():
            result = run_cell(model, tokenizer, out, name, layers, seed, RECIPE, "claims")
            print(f"{name:<16} seed {seed}: tau(k=4) {result['tau']['4']['pooled']['all']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--stages", nargs="+", default=["data", "calibrate", "cache", "recipe", "claims"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--smoke", action="store_true", help="a minute-long check on a few prompts and steps")
    args = parser.parse_args()
    if args.smoke:
        global MAX_PROMPTS
        MAX_PROMPTS = 12
        RECIPE.update(steps=3, warmup=1, batch_size=4)
        os.environ.setdefault("ELSI_FAST_RESULTS_DIR", str(args.runs / "results"))
    from elsi_fast.threads import configure

    configure(args.threads)
    model, tokenizer = load_model(args.model, device="cpu", dtype="float32")
    out = args.runs / args.model
    out.mkdir(parents=True, exist_ok=True)
    if "data" in args.stages:
        stage_data(model, tokenizer, out)
    report = stage_calibrate(model, tokenizer, out)
    sets = sets_of(report, args.model)
    (out / "sets.json").write_text(json.dumps(sets, indent=1))
    print("layer sets:", sets)
    if "cache" in args.stages:
        stage_cache(model, tokenizer, out, sorted({l for layers in sets.values() for l in layers}))
    if "recipe" in args.stages:
        stage_recipe(model, tokenizer, out, sets)
    if "claims" in args.stages:
        stage_claims(model, tokenizer, out, sets, args.seeds)


if __name__ == "__main__":
    main()
