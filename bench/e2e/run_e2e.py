"""End-to-end test of the paper's claims on a target trained here (see bench/e2e/README.md).

Stages (`all` runs them in order; each is resumable: finished pieces are reused):
  prepare    build/load the natural-language target, run `analyze`, fix the layer sets
  sweep      token-entropy filter thresholds: kept fraction and cross-prompt variance reduction
  worker     train the drafts of one shard of (layer set, seed) jobs and measure their tau
  aggregate  mean and 95% CI per method and category -> bench/results/e2e_cpu.jsonl and table.md

Every draft gets the same budget (steps x batch x seq_len tokens, same data order per seed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# (label, report method, m) in table order
METHODS = [
    ("ELSI m=1", "elsi", 1),
    ("ELSI m=3", "elsi", 3),
    ("ELSI-C m=3", "elsi-c", 3),
    ("EAGLE3 default m=3", "eagle3", 3),
    ("low-entropy m=3", "low-entropy", 3),
    ("last layer m=1", "last", 1),
]
FILTER_THRESHOLDS = (0.5, 1.0, 2.0, 3.0)  # nats
SPEC_BENCH_CATEGORIES = ("translation", "summarization", "qa", "math_reasoning", "rag")
# Two-sided 95% Student t quantiles by degrees of freedom.
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["all", "prepare", "sweep", "worker", "aggregate"])
    p.add_argument("--out", default=str(HERE / "out"), help="working folder (report, drafts, per-run results)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--draft-vocab-size", type=int, default=1024)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--prompts-per-category", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--calibration-prompts", type=int, default=96)
    p.add_argument("--workers", type=int, default=2, help="parallel worker processes (one thread each)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (shared CPU: 1)")
    p.add_argument("--shard", type=int, default=0)
    return p.parse_args(argv)


def _target():
    from elsi_fast.targets.loading import load_model
    from elsi_fast.targets.toy_targets import NATURAL_LANGUAGE, build_target

    path = build_target(NATURAL_LANGUAGE)
    model, tokenizer = load_model(path, device="cpu", dtype="float32")
    return path, model, tokenizer


def calibration_texts(n: int) -> list[str]:
    """n windows of ~600 characters spread evenly over the target's training text."""
    from elsi_fast.targets.toy_targets import NATURAL_LANGUAGE, training_texts

    docs = training_texts(NATURAL_LANGUAGE)
    per_doc = max(1, n // len(docs))
    texts = []
    for doc in docs:
        for i in range(per_doc):
            start = (len(doc) - 600) * (2 * i + 1) // (2 * per_doc)
            texts.append(doc[start : start + 600])
    return texts


def eval_prompts(tokenizer, per_category: int, max_tokens: int) -> dict[str, list[list[int]]]:
    """Held-out prompts by category: Spec-Bench (first turn, evenly spaced ids) and held-out corpus text."""
    from bench.common import shared_data
    from elsi_fast.analysis.prompts import encode_prompt, load_prompts
    from elsi_fast.targets.toy_targets import NATURAL_LANGUAGE, heldout_texts

    prompts = load_prompts(str(shared_data("prompts", "spec_bench_question.jsonl")))
    grouped: dict[str, list] = {}
    for prompt in prompts:
        category = prompt.category if prompt.category in SPEC_BENCH_CATEGORIES else "mt_bench"
        grouped.setdefault(category, []).append(prompt)
    out = {}
    for category, items in sorted(grouped.items()):
        step = len(items) // per_category
        out[category] = [encode_prompt(items[i * step], tokenizer)[:max_tokens] for i in range(per_category)]
    held = heldout_texts(NATURAL_LANGUAGE)
    out["heldout_corpus"] = [tokenizer(text[:2000])["input_ids"][:max_tokens] for text in held]
    return out


def prepare(args) -> dict:
    """Analysis and layer sets; cached in OUT/plan.json."""
    out = Path(args.out)
    plan_path = out / "plan.json"
    if plan_path.is_file():
        return json.loads(plan_path.read_text())
    out.mkdir(parents=True, exist_ok=True)
    from elsi_fast.analysis.analyze import analyze

    path, model, tokenizer = _target()
    start = time.perf_counter()
    report = analyze(model, tokenizer, calibration_texts(args.calibration_prompts), m=(1, 3), batch_size=8,
                     max_tokens=128, model_name=f"elsi-fast {path.name}", progress=True)
    analysis_seconds = time.perf_counter() - start
    report.to_json(str(out / "report.json"))
    report.plot(str(out))
    print(report.table(), flush=True)
    sets = {label: report.select(method, m) for label, method, m in METHODS}
    plan = {"target": str(path), "sets": sets, "analysis_seconds": analysis_seconds,
            "target_summary": json.loads((path / "recipe.json").read_text())}
    plan_path.write_text(json.dumps(plan, indent=1))
    return plan


def sweep(args) -> list[dict]:
    """Analysis at several token-entropy thresholds (same prompts); cached in OUT/sweep.json."""
    path = Path(args.out) / "sweep.json"
    if path.is_file():
        return json.loads(path.read_text())
    from elsi_fast.analysis.analyze import analyze

    _, model, tokenizer = _target()
    texts = calibration_texts(args.calibration_prompts)
    rows = []
    for threshold in FILTER_THRESHOLDS:
        report = analyze(model, tokenizer, texts, m=(1, 3), batch_size=8, max_tokens=128,
                         min_token_entropy=threshold, progress=False)
        entropies = [layer["entropy_prompt_mean"] for layer in report.layers]
        rows.append({"min_token_entropy": threshold, "kept_fraction": report.tokens["kept_fraction"],
                     **report.entropy_variance, "peak_layer": max(range(len(entropies)), key=entropies.__getitem__),
                     "elsi_m1": report.select("elsi", 1), "elsi_m3": report.select("elsi", 3)})
        print(rows[-1], flush=True)
    path.write_text(json.dumps(rows, indent=1))
    return rows


def jobs(plan: dict, seeds: list[int]) -> list[tuple[tuple[int, ...], int]]:
    """Unique (layer set, seed) pairs: methods that pick the same set share its drafts."""
    unique = sorted({tuple(layers) for layers in plan["sets"].values()})
    return [(layers, seed) for seed in seeds for layers in unique]


def run_name(layers, seed) -> str:
    return f"layers{'-'.join(map(str, layers))}_seed{seed}"


def worker(args) -> None:
    import torch

    from elsi_fast.decoding.evaluation import evaluate_tau
    from elsi_fast.targets.toy_targets import NATURAL_LANGUAGE, training_texts
    from elsi_fast.training.train import train_draft

    torch.set_num_threads(args.threads)
    plan = json.loads((Path(args.out) / "plan.json").read_text())
    _, model, tokenizer = _target()
    texts = training_texts(NATURAL_LANGUAGE)
    prompts = eval_prompts(tokenizer, args.prompts_per_category, args.prompt_tokens)
    runs = Path(args.out) / "runs"
    runs.mkdir(exist_ok=True)
    my_jobs = jobs(plan, args.seeds)[args.shard :: args.workers]
    for layers, seed in my_jobs:
        name = run_name(layers, seed)
        result_path = runs / f"{name}.json"
        if result_path.is_file():
            continue
        start = time.perf_counter()
        draft, summary = train_draft(model, tokenizer, list(layers), texts, out_dir=Path(args.out) / "drafts" / name,
                                     draft_vocab_size=args.draft_vocab_size, steps=args.steps,
                                     batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                                     warmup=max(1, args.steps // 10), ttt_steps=args.ttt_steps, seed=seed,
                                     progress=False)
        train_seconds = time.perf_counter() - start
        start = time.perf_counter()
        taus = evaluate_tau(model, draft, prompts, k=args.k, max_new_tokens=args.max_new_tokens)
        result = {"layers": list(layers), "seed": seed, "tau": taus, "train_seconds": train_seconds,
                  "eval_seconds": time.perf_counter() - start, "final_loss": summary["final_loss"],
                  "final_top1": statistics.mean(h["top1"] for h in summary["history"][-10:])}
        tmp = result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, result_path)
        print(f"[shard {args.shard}] {name}: tau(all)={taus['all']:.3f} train {train_seconds:.0f}s "
              f"eval {result['eval_seconds']:.0f}s", flush=True)


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% Student-t confidence interval."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    return mean, T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def aggregate(args) -> str:
    from bench.common import device_name, record

    out = Path(args.out)
    plan = json.loads((out / "plan.json").read_text())
    report = json.loads((out / "report.json").read_text())
    results = {}
    for path in sorted((out / "runs").glob("*.json")):
        r = json.loads(path.read_text())
        results[(tuple(r["layers"]), r["seed"])] = r
    categories = sorted(next(iter(results.values()))["tau"])
    device = device_name("cpu")
    params_common = {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                     "ttt_steps": args.ttt_steps, "k": args.k, "max_new_tokens": args.max_new_tokens,
                     "draft_vocab_size": args.draft_vocab_size, "target": Path(plan["target"]).name,
                     "workers": args.workers, "threads_per_worker": args.threads}
    baseline = plan["sets"]["EAGLE3 default m=3"]
    lines = ["| method | layers | " + " | ".join(categories) + " | Δ all vs EAGLE3 (paired) | final top-1 |",
             "|---" * (len(categories) + 4) + "|"]
    for label, _, m in METHODS:
        layers = tuple(plan["sets"][label])
        runs = [results[(layers, s)] for s in args.seeds if (layers, s) in results]
        if not runs:
            continue
        cells = []
        for cat in categories:
            mean, ci = mean_ci([r["tau"][cat] for r in runs])
            cells.append(f"{mean:.3f} ± {ci:.3f}")
            record("e2e_cpu", "e2e_tau", f"tau/{cat}", mean, "tokens/forward", device=device,
                   params={**params_common, "method": label, "m": m, "layers": list(layers),
                           "seeds": [r["seed"] for r in runs], "ci95": ci,
                           "per_seed": [r["tau"][cat] for r in runs]})
        paired = [results[(layers, s)]["tau"]["all"] - results[(tuple(baseline), s)]["tau"]["all"]
                  for s in args.seeds if (layers, s) in results and (tuple(baseline), s) in results]
        d_mean, d_ci = mean_ci(paired) if paired else (float("nan"), float("nan"))
        top1 = statistics.fmean(r["final_top1"] for r in runs)
        lines.append(f"| {label} | {list(layers)} | " + " | ".join(cells) + f" | {d_mean:+.3f} ± {d_ci:.3f} | {top1:.3f} |")
    variance = report.get("entropy_variance", {})
    entropies = [layer["entropy_prompt_mean"] for layer in report["layers"]]
    n = report["num_hidden_layers"]
    peak = max(range(len(entropies)), key=entropies.__getitem__)
    # h_0 is the embedding; the "activation wave" is about the blocks' outputs h_1 .. h_N.
    peak_blocks = max(range(1, len(entropies)), key=entropies.__getitem__)
    dataset = [layer["entropy_dataset"] for layer in report["layers"]]
    peak_dataset = max(range(len(dataset)), key=dataset.__getitem__)
    if "reduction" in variance:
        record("e2e_cpu", "e2e_analysis", "cross_prompt_variance_reduction", variance["reduction"], "fraction",
               device=device, params={"unfiltered": variance["unfiltered"], "filtered": variance["filtered"],
                                      "min_token_entropy": report["options"]["min_token_entropy"]})
    record("e2e_cpu", "e2e_analysis", "entropy_peak_layer", peak, "layer index", device=device,
           params={"num_hidden_layers": n, "entropy_prompt_mean": entropies, "dataset_peak": peak_dataset,
                   "peak_among_h1_to_hN": peak_blocks})
    sweep_path = out / "sweep.json"
    if sweep_path.is_file():
        lines += ["", "| min token entropy (nats) | tokens kept | cross-prompt var. unfiltered | filtered | reduction "
                  "| entropy peak | ELSI m=1 | ELSI m=3 |", "|---" * 8 + "|"]
        for row in json.loads(sweep_path.read_text()):
            record("e2e_cpu", "e2e_filter_sweep", "cross_prompt_variance_reduction", row["reduction"], "fraction",
                   device=device, params=row)
            lines.append(f"| {row['min_token_entropy']} | {100 * row['kept_fraction']:.1f}% | {row['unfiltered']:.4g} "
                         f"| {row['filtered']:.4g} | {100 * row['reduction']:+.1f}% | {row['peak_layer']} "
                         f"| {row['elsi_m1']} | {row['elsi_m3']} |")
    text = "\n".join(lines)
    text += (f"\n\nentropy curve (prompt mode, h_0..h_{n}): " + " ".join(f"{e:.2f}" for e in entropies)
             + f"\npeak at layer {peak} of {n} (dataset mode: {peak_dataset}); among h_1..h_{n}: {peak_blocks}"
             + f"\ncross-prompt variance reduction from token-entropy filtering: {variance}"
             + f"\ncompartments: {report.get('compartments')}\nanalysis seconds: {plan['analysis_seconds']:.1f}\n")
    (out / "table.md").write_text(text)
    print(text)
    return text


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.stage in ("prepare", "all"):
        import torch

        torch.set_num_threads(max(args.threads, 1))
        prepare(args)
    if args.stage in ("sweep", "all"):
        sweep(args)
    if args.stage == "worker":
        worker(args)
    if args.stage == "all":
        start = time.perf_counter()
        base = [sys.executable, "-m", "bench.e2e.run_e2e", "worker", *sys.argv[2:]]
        procs = [subprocess.Popen([*base, "--shard", str(i)]) for i in range(args.workers)]
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a worker failed: exit codes {codes}")
        print(f"workers done in {time.perf_counter() - start:.0f}s", flush=True)
    if args.stage in ("aggregate", "all"):
        aggregate(args)


if __name__ == "__main__":
    main()
