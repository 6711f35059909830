"""The paper's analysis claims on the two real targets (SmolLM2-135M-Instruct, Gemma 3 270M), all 480
Spec-Bench prompts. Resumable: every finished cell stays under runs/real-models/<model>/ and a rerun
does only what is missing.

    python -m bench.real_models [--models smollm2-135m-instruct gemma3-270m] [--stages analyze sweep]

analyze: `elsi_fast.analyze` with the defaults (m = 1, 2, 3), its pass resumable from state.pt;
         report.json, the plots (copied to docs/img/<model>_*.png) and serving configs; then pick
         stability: ELSI / ELSI-C picks on two disjoint random halves of the prompts (stratified by
         category) and per category, from the pass's own prompt-mode store (no second forward).
sweep:   the token-entropy filter at 0, 0.25, 0.5, 1, 2 nats: one forward pass keeps every
         prompt's candidate hidden states and token entropies just long enough to compute each
         layer's prompt-mode entropy at every threshold, (a) over all kept tokens and (b) over 32
         evenly spaced kept tokens (equal counts: prompt-mode entropy grows with the token count),
         on the prompts that keep >= 32 tokens at every threshold. The cross-prompt variance (mean
         over layers of the variance over prompts) with and without the filter is the paper's
         statistic (35.6-48.4% reduction on 4-8B chat models).
Rows: bench/results/real_models_cpu.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]

from bench.common import device_name, record, shared_data
from elsi_fast.analysis.analyze import analyze
from elsi_fast.analysis.prompt_store import PromptModeStore
from elsi_fast.analysis.prompts import encode_prompt, load_prompts
from elsi_fast.analysis.report import LayerReport
from elsi_fast.analysis.selection import ScreenedObjective, cka_penalized, select
from elsi_fast.analysis.set_entropy import SetEntropySolver
from elsi_fast.engines.layer_ids import common_candidate_layers
from elsi_fast.engines.serving import serving_configs
from elsi_fast.metrics import linear_token_entropy, normalize_tokens, spectrum_entropy
from elsi_fast.targets.capture import capture_hidden_states, decoder_layers
from elsi_fast.targets.loading import load_model

RUNS = ROOT / "runs" / "real-models"
IMAGES = ROOT / "docs" / "img"
THRESHOLDS = (0.0, 0.25, 0.5, 1.0, 2.0)
EQUAL_TOKENS = 32
RESULTS = "real_models_cpu"


def _short(model: str) -> str:
    return model.split("-")[0]  # smollm2, gemma3


def stage_analyze(name: str, model, tokenizer, prompts, out: Path, images: Path) -> None:
    report_path = out / "report.json"
    if report_path.is_file() and (out / "stability.json").is_file():
        print(f"{name}: analysis done earlier ({report_path})")
        return
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report = analyze(model, tokenizer, prompts, m=(1, 2, 3), state_path=str(out / "state.pt"), model_name=name)
    report.to_json(str(report_path))
    plots = report.plot(str(out))
    (out / "serving_configs.json").write_text(json.dumps(serving_configs(report), indent=1))
    for plot in plots:
        shutil.copy(plot, images / f"{_short(name)}_{os.path.basename(plot)}")
    stability = pick_stability(report, prompts)
    (out / "stability.json").write_text(json.dumps(stability, indent=1))
    for path in out.glob("state.pt*"):
        path.unlink()  # the report and stability hold every result
    _record_analysis(name, report, stability, time.perf_counter() - started)
    print(report.table())


def _subset_report(report: LayerReport, store: PromptModeStore, keep: list[int]) -> dict:
    """ELSI and ELSI-C picks (m = 1, 2, 3) on the prompts at insertion indices `keep` of `store`
    (the full run's CKA for ELSI-C's penalty: CKA per subset would need another pass)."""
    subset = PromptModeStore(store.dim, dtype=store.dtype)
    for i, record_ in enumerate(store.records()):
        if i in keep:
            subset.add_record(*record_)
    solver = SetEntropySolver(subset)
    objective = ScreenedObjective(solver.prompt_set_entropy, solver.surrogate, len(subset), report.options["screen_z"])
    candidates = common_candidate_layers(report.num_hidden_layers)
    picks = {}
    for m in (1, 2, 3):
        picks[f"elsi/{m}"] = select(objective, candidates, m, max_exhaustive=report.options["max_exhaustive"]).layers
        penalized = cka_penalized(objective, np.asarray(report.cka), report.options["beta"])
        picks[f"elsi-c/{m}"] = select(penalized, candidates, m, max_exhaustive=report.options["max_exhaustive"]).layers
    return {"prompts": len(subset), "picks": {k: list(v) for k, v in picks.items()}}


def pick_stability(report: LayerReport, prompts) -> dict:
    """Picks on two disjoint halves (stratified random split, seed 0) and per category."""
    store = report.prompt_store
    category_of = {i: prompts[index].category or "text" for i, index in enumerate(store.prompt_index)}
    rng = np.random.default_rng(0)
    halves: list[list[int]] = [[], []]
    for category in sorted(set(category_of.values())):
        members = [i for i, c in category_of.items() if c == category]
        rng.shuffle(members)
        halves[0] += members[::2]
        halves[1] += members[1::2]
    full = {f"{method}/{m}": report.select(method, m) for method in ("elsi", "elsi-c") for m in (1, 2, 3)}
    out = {"full": {"prompts": len(store), "picks": full},
           "halves": [_subset_report(report, store, sorted(h)) for h in halves],
           "categories": {c: _subset_report(report, store, [i for i, k in category_of.items() if k == c])
                          for c in sorted(set(category_of.values()))}}
    return out


def _record_analysis(name: str, report: LayerReport, stability: dict, seconds: float) -> None:
    device = device_name("cpu")
    params = {"model": name, "prompts": report.prompts["count"], "tokens": report.tokens, "threads": torch.get_num_threads(),
              "loadavg": os.getloadavg()}
    prompt_mode = [e["entropy_prompt_mean"] for e in report.layers]
    dataset = [e["entropy_dataset"] for e in report.layers]
    record(RESULTS, "real_model_analysis", "entropy_curve_prompt_mode", max(prompt_mode), "nats", device=device,
           params={**params, "curve": prompt_mode, "argmax": int(np.argmax(prompt_mode))})
    record(RESULTS, "real_model_analysis", "entropy_curve_dataset_mode", max(dataset), "nats", device=device,
           params={**params, "curve": dataset, "argmax": int(np.argmax(dataset))})
    record(RESULTS, "real_model_analysis", "compartments", len(report.compartments), "count", device=device,
           params={**params, "compartments": report.compartments, "boundaries": report.boundaries})
    record(RESULTS, "real_model_analysis", "variance_reduction_default_filter",
           report.entropy_variance.get("reduction"), "fraction", device=device,
           params={**params, **report.entropy_variance, "min_token_entropy": report.options["min_token_entropy"]})
    for method, by_m in report.selections.items():
        for m, layers in by_m.items():
            record(RESULTS, "real_model_analysis", f"set_entropy/{method}/m={m}",
                   report.set_values.get(method, {}).get(m), "nats", device=device, params={**params, "layers": layers})
    agree = {key: [h["picks"][key] for h in stability["halves"]] for key in stability["full"]["picks"]}
    record(RESULTS, "real_model_analysis", "picks_equal_on_disjoint_halves",
           sum(a == b for a, b in agree.values()) / len(agree), "fraction", device=device,
           params={**params, "halves": agree, "full": stability["full"]["picks"],
                   "categories": {c: v["picks"] for c, v in stability["categories"].items()}})
    record(RESULTS, "real_model_analysis", "pass_seconds", report.timing["pass_seconds"], "s", device=device,
           params={**params, "stage_seconds": seconds, "timing": report.timing})


def _prompt_entropies(rows: list[torch.Tensor]) -> np.ndarray:
    """Prompt-mode entropy [L] of one prompt's rows (each [n, d], n >= 2): centered over the prompt,
    rows L2-normalized, spectrum of the n x n Gram in float64."""
    z = normalize_tokens(torch.stack(rows).double(), "center_l2")
    return spectrum_entropy(torch.linalg.eigvalsh(z @ z.transpose(-2, -1))).numpy()


def stage_sweep(name: str, model, tokenizer, prompts, out: Path, batch_size: int = 8) -> None:
    cell = out / "sweep.npz"
    if cell.is_file():
        print(f"{name}: sweep done earlier ({cell})")
    else:
        _run_sweep(model, tokenizer, prompts, cell, batch_size)
    data = np.load(cell)
    _record_sweep(name, data, len(prompts))


def _run_sweep(model, tokenizer, prompts, cell: Path, batch_size: int) -> None:
    from tqdm.auto import tqdm

    head = model.get_output_embeddings()
    blocks = len(decoder_layers(model))
    special = set(tokenizer.all_special_ids or [])
    ids = [encode_prompt(p, tokenizer)[:512] for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
    num = len(THRESHOLDS)
    all_kept = np.full((len(ids), num, blocks + 1), np.nan)
    equal = np.full((len(ids), num, blocks + 1), np.nan)
    kept_counts = np.zeros((len(ids), num), dtype=np.int64)
    bar = tqdm(total=sum(map(len, ids)), unit="tok", unit_scale=True, desc="sweep")
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            width = max(len(ids[i]) for i in batch)
            input_ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for b, i in enumerate(batch):
                input_ids[b, : len(ids[i])] = torch.tensor(ids[i])
                mask[b, : len(ids[i])] = 1
            with capture_hidden_states(model) as cap:
                final = model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
            for b, i in enumerate(batch):
                positions = [t for t in range(1, len(ids[i])) if ids[i][t] not in special]
                rows = [cap.states[layer][b, positions].float() for layer in range(blocks + 1)]
                entropy = linear_token_entropy(final[b, positions], head.weight, head.bias)
                for k, threshold in enumerate(THRESHOLDS):
                    keep = torch.nonzero(entropy >= threshold).flatten()
                    kept_counts[i, k] = len(keep)
                    if len(keep) >= 2:
                        all_kept[i, k] = _prompt_entropies([r[keep] for r in rows])
                    if len(keep) >= EQUAL_TOKENS:
                        pick = keep[torch.linspace(0, len(keep) - 1, EQUAL_TOKENS).round().long()]
                        equal[i, k] = _prompt_entropies([r[pick] for r in rows])
            bar.update(sum(len(ids[i]) for i in batch))
    bar.close()
    np.savez(cell, all_kept=all_kept, equal=equal, kept_counts=kept_counts,
             candidates=np.array([len([t for t in range(1, len(x)) if x[t] not in special]) for x in ids]),
             categories=np.array([p.category or "text" for p in prompts]))


def _variance(values: np.ndarray) -> float:
    """Mean over layers of the variance over prompts (rows)."""
    return float(values.var(0).mean())


def _record_sweep(name: str, data, num_prompts: int) -> None:
    device = device_name("cpu")
    counts, candidates = data["kept_counts"], data["candidates"]
    usable = (counts >= EQUAL_TOKENS).all(1)  # the same prompts at every threshold
    print(f"{name}: {int(usable.sum())} of {num_prompts} prompts keep >= {EQUAL_TOKENS} tokens at every threshold")
    for mode in ("all_kept", "equal"):
        values = data[mode][usable]
        base = _variance(values[:, 0])
        for k, threshold in enumerate(THRESHOLDS):
            filtered = _variance(values[:, k])
            kept = float(counts[usable, k].sum() / candidates[usable].sum())
            reduction = 1.0 - filtered / base
            record(RESULTS, "real_model_filter_sweep", f"variance_reduction/{mode}", reduction, "fraction", device=device,
                   params={"model": name, "threshold": threshold, "tokens": "all kept" if mode == "all_kept" else
                           f"{EQUAL_TOKENS} evenly spaced kept", "prompts": int(usable.sum()), "kept_fraction": kept,
                           "variance_unfiltered": base, "variance_filtered": filtered})
            print(f"  {mode:<8} threshold {threshold:4.2f}: kept {100 * kept:5.1f}%, variance {base:.5f} -> "
                  f"{filtered:.5f} ({100 * reduction:+.1f}%)")


def _reduction_with_interval(values: np.ndarray, k: int, resamples: int = 2000) -> str:
    """1 - variance at threshold k / unfiltered variance of `values` [prompts, thresholds, layers],
    with a 95% percentile bootstrap interval over prompts (seed 0)."""
    def reduction(rows: np.ndarray) -> float:
        return 1.0 - _variance(rows[:, k]) / _variance(rows[:, 0])

    rng = np.random.default_rng(0)
    draws = [reduction(values[rng.integers(0, len(values), len(values))]) for _ in range(resamples)]
    low, high = np.percentile(draws, [2.5, 97.5])
    return f"{100 * reduction(values):+.1f}% [{100 * low:+.1f}, {100 * high:+.1f}]"


def stage_report(names: list[str], runs: Path) -> str:
    """Markdown tables of the finished cells (the numbers docs/real-models.md quotes)."""
    lines = []
    for name in names:
        out = runs / name
        if not (out / "report.json").is_file():
            continue
        report = LayerReport.from_json(str(out / "report.json"))
        prompt = [e["entropy_prompt_mean"] for e in report.layers]
        dataset = [e["entropy_dataset"] for e in report.layers]
        lines += [f"### {name}", "",
                  f"- prompt-mode entropy h_0..h_{report.num_hidden_layers}: " + " ".join(f"{v:.2f}" for v in prompt),
                  "- dataset-mode entropy: " + " ".join(f"{v:.2f}" for v in dataset),
                  f"- peaks: prompt mode h_{int(np.argmax(prompt))} ({max(prompt):.3f}), dataset mode "
                  f"h_{int(np.argmax(dataset))} ({max(dataset):.3f})",
                  f"- compartments: {report.compartments} (boundaries {report.boundaries})",
                  f"- tokens kept {100 * report.tokens['kept_fraction']:.1f}% at {report.options['min_token_entropy']} nats; "
                  f"cross-prompt variance {report.entropy_variance.get('unfiltered', float('nan')):.4g} -> "
                  f"{report.entropy_variance['filtered']:.4g} ({100 * report.entropy_variance.get('reduction', 0):+.1f}%)",
                  f"- pass {report.timing['pass_seconds']:.0f} s, selection {report.timing['selection_seconds']:.0f} s", "",
                  "| method | m | layers | H(concat) |", "|---|---|---|---|"]
        for method, by_m in report.selections.items():
            for m, layers in sorted(by_m.items()):
                lines.append(f"| {method} | {m} | {layers} | {report.set_values.get(method, {}).get(m, float('nan')):.3f} |")
        if (out / "stability.json").is_file():
            stability = json.loads((out / "stability.json").read_text())
            lines += ["", "| picks | all prompts | half A | half B | " + " | ".join(stability["categories"]) + " |",
                      "|---" * (4 + len(stability["categories"])) + "|"]
            for key, full in stability["full"]["picks"].items():
                halves = [h["picks"][key] for h in stability["halves"]]
                cats = [c["picks"][key] for c in stability["categories"].values()]
                lines.append(f"| {key} | {full} | {halves[0]} | {halves[1]} | " + " | ".join(map(str, cats)) + " |")
        if (out / "sweep.npz").is_file():
            data = np.load(out / "sweep.npz")
            counts, candidates = data["kept_counts"], data["candidates"]
            usable = (counts >= EQUAL_TOKENS).all(1)
            lines += ["", f"token-entropy filter ({int(usable.sum())} prompts keeping >= {EQUAL_TOKENS} tokens at every "
                      "threshold): variance reduction of per-layer prompt-mode entropy [95% bootstrap interval over "
                      "prompts]", "",
                      "| threshold (nats) | tokens kept | all kept tokens | 32 tokens each |", "|---|---|---|---|"]
            for k, threshold in enumerate(THRESHOLDS):
                kept = counts[usable, k].sum() / candidates[usable].sum()
                cells = [_reduction_with_interval(data[mode][usable], k) for mode in ("all_kept", "equal")]
                lines.append(f"| {threshold} | {100 * kept:.1f}% | {cells[0]} | {cells[1]} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    parser.add_argument("--stages", nargs="+", default=["analyze", "sweep"], choices=["analyze", "sweep", "report"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--max-prompts", type=int, default=None, help="a smoke test on the first N prompts")
    parser.add_argument("--runs", type=Path, default=RUNS, help=f"where the cells are kept (default {RUNS})")
    args = parser.parse_args()
    if args.max_prompts is not None:
        os.environ.setdefault("ELSI_FAST_RESULTS_DIR", str(args.runs / "results"))  # smoke rows stay out of bench/
    from elsi_fast._infra.threads import configure

    configure(args.threads)
    if args.stages == ["report"]:
        print(stage_report(args.models, args.runs))
        return
    prompts = load_prompts(str(shared_data("prompts", "spec_bench_question.jsonl")), max_prompts=args.max_prompts)
    images = IMAGES if args.max_prompts is None else args.runs / "img"
    images.mkdir(parents=True, exist_ok=True)
    for name in args.models:
        model, tokenizer = load_model(name, device="cpu", dtype="float32")
        out = args.runs / name
        if "analyze" in args.stages:
            stage_analyze(name, model, tokenizer, prompts, out, images)
        if "sweep" in args.stages:
            stage_sweep(name, model, tokenizer, prompts, out)


if __name__ == "__main__":
    main()
