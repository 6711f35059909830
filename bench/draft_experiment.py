"""The paper's draft claims on real targets: EAGLE3 drafts on chosen layer sets, trained the anchors'
way, tau on all 480 Spec-Bench prompts. A resumable experiment: every step (data, cache, a trained
draft, its tau) works under runs/draft-experiment/<model>/ and a rerun does only what is missing.
What a later session on a fresh clone needs is committed under bench/results/draft_experiment/<model>/
(--keep): the regenerated answers as token ids (not the prompts: `regenerate.export_answers`), the
calibration report and every finished cell's result; a rerun restores them instead of recomputing,
and rebuilds only the cache (minutes) and unfinished drafts.

    python -m bench.draft_experiment [--model smollm2-135m-instruct] [--stages data calibrate cache recipe claims]

data:      the target answers a balanced subset of train_instructions.jsonl, 100 prompts of each of
           its 8 categories (greedy, chat template, <= 128 new tokens: `regenerate`), and gives its
           greedy continuation of every Spec-Bench prompt (<= 128 new tokens, stopping at its
           end-of-turn token), once; --full-data then answers all 2397 instructions.
calibrate: `analyze` on the claims' training instructions (the balanced subset: the calibration set a
           user has is the prompts the drafts train on): the layer sets.
cache:     the target's states on both, for the union of every set's layers (bfloat16), once.
recipe:    what buys tau per CPU-hour, on ELSI m=1 (seed 0): init random / target, draft vocabulary
           2048 / 8192, training-time test 3 / 7, a data-scaling curve (training tokens), and the
           knobs that paid combined (random init, vocabulary 2048, 240 steps: `combined`).
claims:    every layer set x seeds at the chosen recipe; tau at k = 1..5 replayed exactly. With
           --variant V, the sets are trained with recipe cell V's change instead (cells
           `<set>-seed<s>-recipe-V`, the recipe stage's own cell among them): whether a recipe
           knob moves the sets' ranking, paired against the claims cells of the same set and seed.
heldout:   the seed-0 claims drafts replayed on HELD_OUT of their own training conversations per
           category, on as many unseen training instructions, and beside their Spec-Bench tau: what
           memorizing, the budget and the shift to the evaluation prompts each cost.
Rows: bench/results/draft_experiment_cpu.jsonl (one per trained draft and k).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from bench.common import device_name, record, shared_data
from elsi_fast.analysis.prompts import load_prompts
from elsi_fast.decoding.evaluation import continuation_samples, pooled_tau, replay_runs_per_k
from elsi_fast.targets.loading import load_model
from elsi_fast.training.feature_cache import build, open_cache
from elsi_fast.training.regenerate import (
    CONVERSATIONS_FILE, export_answers, read_conversations, regenerate, restore_answers,
)
from elsi_fast.analysis.report import LayerReport
from elsi_fast.training.train import train_draft
from elsi_fast.training.training_data import conversation_samples

RUNS = ROOT / "runs" / "draft-experiment"
KEEP = ROOT / "bench" / "results" / "draft_experiment"  # committed: what a fresh clone continues from
RESULTS = "draft_experiment_cpu"
KS = (1, 2, 3, 4, 5)
MAX_TOKENS = 512  # per training conversation
MAX_PROMPTS = None  # all (the smoke test takes a few)
PER_CATEGORY = 100  # training conversations per category of the claims' balanced subset (800)
FULL_DATA = False  # also regenerate all 2397 training instructions (--full-data)
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


def training_subset(prompts, tokenizer) -> list:
    """PER_CATEGORY prompts of every category of the training instructions, the shortest first (a
    balanced set that the regenerated data of any session so far covers first)."""
    chosen = {p.id for p in _first_per_category(prompts, PER_CATEGORY, tokenizer)}
    return [p for p in prompts if p.id in chosen]


def _regenerate_kept(model, tokenizer, prompts, folder: Path, keep: Path, **settings) -> None:
    """`regenerate` into `folder`, first restored from the kept answers `keep/<folder>.answers.json`
    when the folder is new; the finished answers are kept again afterwards, also when interrupted."""
    kept = keep / f"{folder.name}.answers.json"
    if not (folder / CONVERSATIONS_FILE).is_file() and kept.is_file():
        print(f"{folder.name}: {restore_answers(model, tokenizer, prompts, folder, json.loads(kept.read_text()), **settings)}"
              f" answers restored from {kept}")
    try:
        print(regenerate(model, tokenizer, prompts, folder, **settings))
    finally:  # an interrupted run keeps what it finished: `restore_answers` takes a partial export
        if (folder / CONVERSATIONS_FILE).is_file():
            keep.mkdir(parents=True, exist_ok=True)
            kept.write_text(json.dumps(export_answers(folder)))


def stage_data(model, tokenizer, out: Path, keep: Path) -> None:
    """The balanced training subset first (what the claims train on), then the evaluation
    continuations, then the rest of the training instructions (the data-scaling curve's larger
    budgets). Answers already regenerated for the full set are reused for the subset."""
    train = load_prompts(str(shared_data("prompts", "train_instructions.jsonl")), max_prompts=MAX_PROMPTS)
    subset = training_subset(train, tokenizer)
    folder = out / "train-subset"
    if not (folder / CONVERSATIONS_FILE).is_file() and (out / "train" / CONVERSATIONS_FILE).is_file():
        folder.mkdir(parents=True, exist_ok=True)
        wanted = {p.id for p in subset}
        reused = [r for r in read_conversations(out / "train" / CONVERSATIONS_FILE) if r["id"] in wanted]
        (folder / CONVERSATIONS_FILE).write_text("".join(json.dumps(r) + "\n" for r in reused))
    _regenerate_kept(model, tokenizer, subset, folder, keep, max_new_tokens=128, batch_size=48)
    evaluation = load_prompts(str(shared_data("prompts", "spec_bench_question.jsonl")), max_prompts=MAX_PROMPTS)
    _regenerate_kept(model, tokenizer, evaluation, out / "eval", keep, max_new_tokens=128, max_prompt_tokens=512,
                     batch_size=16)
    if FULL_DATA:
        _regenerate_kept(model, tokenizer, train, out / "train", keep, max_new_tokens=128, batch_size=48)


def stage_calibrate(model, tokenizer, out: Path, keep: Path) -> LayerReport:
    """`analyze` on the training subset once (resumable), its report kept."""
    from elsi_fast.analysis.analyze import analyze

    path = keep / "calibration-report.json"
    if path.is_file():
        return LayerReport.from_json(str(path))
    work = out / "calibration"
    work.mkdir(parents=True, exist_ok=True)
    train = load_prompts(str(shared_data("prompts", "train_instructions.jsonl")), max_prompts=MAX_PROMPTS)
    report = analyze(model, tokenizer, training_subset(train, tokenizer), m=(1, 3),
                     state_path=str(work / "state.pt"), model_name=out.name)
    report.plot(str(work))
    keep.mkdir(parents=True, exist_ok=True)
    report.to_json(str(path))
    for leftover in work.glob("state.pt*"):
        leftover.unlink()
    return report


def _records(out: Path, name: str) -> list[dict]:
    return read_conversations(out / name / CONVERSATIONS_FILE)


TRAIN = "train-subset"  # the conversations the cells train on


def stage_cache(model, tokenizer, out: Path, layers: list[int]) -> None:
    train = conversation_samples(_records(out, TRAIN), tokenizer, MAX_TOKENS, model.config.vocab_size)
    build(model, train, layers, out / "cache-train", dtype="bfloat16")
    build(model, continuation_samples(_records(out, "eval")), layers, out / "cache-eval", dtype="bfloat16")


def run_cell(model, tokenizer, out: Path, keep: Path, name: str, layers: list[int], seed: int, recipe: dict,
             tag: str) -> dict:
    """Train one draft (resumable) and replay its tau at every k; the cell's result is kept in
    `keep/cells/<cell>.json`, and a rerun reads it instead of recomputing."""
    cell = out / "cells" / f"{name}-seed{seed}-{tag}"
    done = keep / "cells" / f"{cell.name}.json"
    if done.is_file():
        kept = json.loads(done.read_text())
        if kept["recipe"] != recipe or kept["layers"] != layers:  # a changed RECIPE must not reuse old cells
            raise ValueError(f"{done} was trained with layers {kept['layers']}, recipe {kept['recipe']}; this run "
                             f"asks for {layers}, {recipe}: give the new recipe its own tag")
        return kept
    train = conversation_samples(_records(out, TRAIN), tokenizer, MAX_TOKENS, model.config.vocab_size)
    started = time.process_time()
    draft, summary = train_draft(model, tokenizer, layers, train, out_dir=cell,
                                 feature_cache=open_cache(out / "cache-train"), seed=seed, seq_len=MAX_TOKENS,
                                 save_every=10, **recipe)
    train_cpu = time.process_time() - started
    records, cache = _records(out, "eval"), open_cache(out / "cache-eval")
    began = time.process_time()
    runs = replay_runs_per_k(draft, records, cache, KS, batch_size=16)
    eval_cpu = time.process_time() - began
    taus = {k: {"pooled": pooled_tau(runs[k]),
                "per_prompt": {cat: [r.tau for r in results] for cat, results in runs[k].items()}} for k in KS}
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
                       "train_cpu_seconds": train_cpu, "eval_cpu_seconds": eval_cpu, "prompts": len(records),
                       "max_new_tokens": 128, "loadavg": os.getloadavg()})
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps(result))
    return json.loads(done.read_text())  # the same (string) keys whether computed now or read


# The recipe stage's cells on ELSI m=1, seed 0: a same-code rerun of the base cell (reproducibility),
# the data-scaling curve (the base cell is its 120-step point), then the recipe's other knobs.
RECIPE_VARIANTS = {"base": {}, "rerun": {}, "steps30": {"steps": 30, "warmup": 3},
                   "steps60": {"steps": 60, "warmup": 6}, "steps240": {"steps": 240, "warmup": 24},
                   "ttt7": {"ttt_steps": 7}, "vocab2048": {"draft_vocab_size": 2048},
                   "random-init": {"init": "random"},
                   # the knobs that bought tau per CPU-hour, together (init, vocabulary, the longest run)
                   "combined": {"init": "random", "draft_vocab_size": 2048, "steps": 240, "warmup": 24}}


def stage_recipe(model, tokenizer, out: Path, keep: Path, sets: dict, tags: list[str]) -> None:
    layers = sets["elsi-m1"]
    for tag in tags:
        change = RECIPE_VARIANTS[tag]
        # the base recipe's cell is the claims' ELSI m=1 seed-0 cell
        result = run_cell(model, tokenizer, out, keep, "elsi-m1", layers, 0, {**RECIPE, **change},
                          "claims" if tag == "base" else f"recipe-{tag}")
        print(f"recipe {tag:<12} tau(k=4) {result['tau']['4']['pooled']['all']:.3f}, "
              f"train {result['train_cpu_seconds'] / 60:.1f} CPU-min, {result['train_tokens']} tokens")


def stage_claims(model, tokenizer, out: Path, keep: Path, sets: dict, seeds: list[int],
                 variant: str | None = None) -> None:
    recipe, tag = ({**RECIPE, **RECIPE_VARIANTS[variant]}, f"recipe-{variant}") if variant else (RECIPE, "claims")
    for seed in seeds:  # every set at one seed before the next seed: partial results stay balanced
        for name, layers in sets.items():
            result = run_cell(model, tokenizer, out, keep, name, layers, seed, recipe, tag)
            print(f"{name:<16} seed {seed} {tag}: tau(k=4) {result['tau']['4']['pooled']['all']:.3f}")


HELD_OUT = 12  # conversations per category of each of the heldout stage's two replay sets


def stage_heldout(model, tokenizer, out: Path, keep: Path, sets: dict) -> dict:
    """tau(k=4) of every seed-0 claims draft on HELD_OUT of its own training conversations per
    category (held in), on as many training instructions it never saw (held out: the next shortest
    of each category, answered by the target the same way), and on Spec-Bench."""
    from elsi_fast.draft import read_draft

    path = keep / "heldout.json"
    done = json.loads(path.read_text()) if path.is_file() else {}
    train = load_prompts(str(shared_data("prompts", "train_instructions.jsonl")), max_prompts=MAX_PROMPTS)
    seen = {p.id for p in training_subset(train, tokenizer)}
    unseen = [p for p in train if p.id not in seen]
    _regenerate_kept(model, tokenizer, _first_per_category(unseen, HELD_OUT, tokenizer), out / "heldout", keep,
                     max_new_tokens=128, batch_size=48)
    layers = sorted({l for layers in sets.values() for l in layers})
    replays = {}
    for part, records in (("heldin", _first_per_category(_records(out, TRAIN), HELD_OUT)),
                          ("heldout", _records(out, "heldout"))):
        replays[part] = records, build(model, continuation_samples(records), layers, out / f"cache-{part}",
                                       dtype="bfloat16")
    embed = model.get_input_embeddings().weight.detach()
    for name in sets:
        cell = out / "cells" / f"{name}-seed0-claims"
        kept = keep / "cells" / f"{cell.name}.json"
        if name in done or not kept.is_file():
            continue
        draft = read_draft(cell, embed_tokens=embed)
        done[name] = {"layers": sets[name], "prompts": {part: len(records) for part, (records, _) in replays.items()},
                      "specbench_tau": json.loads(kept.read_text())["tau"]["4"]["pooled"]}
        for part, (records, cache) in replays.items():
            done[name][f"{part}_tau"] = pooled_tau(replay_runs_per_k(draft, records, cache, (4,), batch_size=16)[4])
        path.write_text(json.dumps(done, indent=1))
        print(f"{name:<16} tau(k=4) held in {done[name]['heldin_tau']['all']:.3f}, held out "
              f"{done[name]['heldout_tau']['all']:.3f}, Spec-Bench {done[name]['specbench_tau']['all']:.3f}")
    return done


def _first_per_category(items: list, n: int, tokenizer=None) -> list:
    """The first `n` items of every category (prompts: the shortest first, when `tokenizer` is given)."""
    from elsi_fast.analysis.prompts import encode_prompt

    groups: dict[str, list] = {}
    for item in items:
        groups.setdefault(item["category"] if isinstance(item, dict) else item.category, []).append(item)
    if tokenizer is not None:
        groups = {c: sorted(g, key=lambda p: (len(encode_prompt(p, tokenizer)), p.id)) for c, g in groups.items()}
    return [item for group in groups.values() for item in group[:n]]


_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _interval(values: list[float]) -> tuple[float, float]:
    """(mean, 95% Student-t half-width) of `values` (half-width nan for one value)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, float("nan")
    sd = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5
    return mean, _T975.get(n - 1, 1.96) * sd / n**0.5


def _emitted_tokens(keep: Path) -> dict[str, list[int]]:
    """Tokens each replayed evaluation prompt emits through verification rounds (accepted + rounds),
    per category in record order, as `evaluation.replay_runs_per_k` replays them: the continuation's
    budget less the prefill's token, prompts with fewer than 2 new tokens left out. The same for
    every draft, so a prompt's rounds are emitted / tau and a pooled tau can be resampled."""
    category = {p.id: p.category for p in load_prompts(str(shared_data("prompts", "spec_bench_question.jsonl")))}
    emitted: dict[str, list[int]] = {}
    for answer in json.loads((keep / "eval.answers.json").read_text())["answers"]:
        response = answer["response_ids"]
        if len(response) < 2:
            continue
        budget = response.index(response[-1]) + 1 if answer.get("stop") == "eos" else len(response)
        emitted.setdefault(category[answer["id"]], []).append(budget - 1)
    return emitted


def _pooled_bootstrap(runs: dict, reference: dict, emitted: dict[str, list[int]], k: str = "4",
                      category: str | None = None, draws: int = 4000) -> tuple[float, float]:
    """95% bootstrap interval of pooled tau(set) - tau(reference) at k over the prompts (of
    `category`, default all): prompts resampled, each resample's pooled tau = emitted / rounds
    summed over its prompts (the statistic the tables report), the difference averaged over the
    seeds both have. Prompt-to-prompt noise, not seed noise."""
    import numpy as np

    categories = sorted(emitted) if category is None else [category]
    tokens = np.concatenate([np.asarray(emitted[c], dtype=np.float64) for c in categories])

    def rounds(cell: dict) -> np.ndarray:
        per_prompt = cell["tau"][k]
        counts = np.concatenate([np.asarray(emitted[c]) / np.asarray(per_prompt["per_prompt"][c]) for c in categories])
        pooled = per_prompt["pooled"][category or "all"]
        if abs(tokens.sum() / counts.sum() - pooled) > 1e-9 * pooled:  # the weights belong to these prompts
            raise ValueError(f"eval.answers.json does not match the cell's prompts ({cell['name']} seed {cell['seed']})")
        return counts

    seeds = [s for s in runs if s in reference]
    pairs = [(rounds(runs[s]), rounds(reference[s])) for s in seeds]
    picks = np.random.default_rng(0).integers(0, len(tokens), (draws, len(tokens)))
    resampled = tokens[picks].sum(axis=1)
    diffs = np.mean([resampled / mine[picks].sum(axis=1) - resampled / theirs[picks].sum(axis=1)
                     for mine, theirs in pairs], axis=0)
    return float(np.quantile(diffs, 0.025)), float(np.quantile(diffs, 0.975))


def _paired(runs: dict, reference: dict, k: str = "4", category: str = "all") -> list[float]:
    """Pooled tau(set) - tau(reference) at k for every seed both have."""
    return [runs[s]["tau"][k]["pooled"][category] - reference[s]["tau"][k]["pooled"][category] for s in runs if s in reference]


def stage_report(keep: Path, images: Path | None = None) -> str:
    """Markdown tables (and plots into `images`) of the finished claims cells kept in `keep`: tau per
    set and category at k = 4, paired differences against the EAGLE3 default over seeds, tau
    against k; and the recipe cells."""
    cells = [json.loads(p.read_text()) for p in sorted((keep / "cells").glob("*.json"))]
    claims = [c for c in cells if c["tag"] == "claims"]
    sets = json.loads((keep / "sets.json").read_text())
    lines = [f"### {keep.name}: claims cells ({len(claims)} drafts)", ""]
    by_set: dict[str, dict[int, dict]] = {}
    for cell in claims:
        by_set.setdefault(cell["name"], {})[cell["seed"]] = cell
    categories = sorted({c for cell in claims for c in cell["tau"]["4"]["pooled"] if c != "all"})
    lines += ["Δ vs EAGLE3: the paired difference of pooled tau over seeds (mean ± 95% t half-width), and a "
              "95% bootstrap interval of the pooled difference (prompts resampled, seeds averaged).", "",
              "| set | layers | seeds | " + " | ".join(["all", *categories]) + " | Δ all vs EAGLE3 (paired) |",
              "|---" * (5 + len(categories)) + "|"]
    reference = by_set.get("eagle3-m3", {})
    emitted = _emitted_tokens(keep)
    for name in sets:
        runs = by_set.get(name, {})
        if not runs:
            continue
        row = [name, str(sets[name]), str(len(runs))]
        for category in ["all", *categories]:
            mean, half = _interval([r["tau"]["4"]["pooled"][category] for r in runs.values()])
            row.append(f"{mean:.3f} ± {half:.3f}")
        paired = _paired(runs, reference)
        if name != "eagle3-m3" and paired:
            mean, half = _interval(paired)
            low, high = _pooled_bootstrap(runs, reference, emitted)
            row.append(f"{mean:+.3f} ± {half:.3f} (n={len(paired)} seeds); prompts [{low:+.3f}, {high:+.3f}]")
        else:
            row.append("0" if name == "eagle3-m3" else "-")
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "tau against k (mean over seeds):", "", "| set | " + " | ".join(f"k={k}" for k in KS) + " |",
              "|---" * (1 + len(KS)) + "|"]
    for name, runs in by_set.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{_interval([r['tau'][str(k)]['pooled']['all'] for r in runs.values()])[0]:.3f}" for k in KS) + " |")
    compared = {name: runs for name, runs in by_set.items() if name != "eagle3-m3" and set(runs) & set(reference)}
    lines += ["", "Δ vs EAGLE3 at each k: paired over seeds (mean ± 95% t half-width) and the 95% bootstrap "
              "interval over prompts:", "", "| set | " + " | ".join(f"k={k}" for k in KS) + " |", "|---" * (1 + len(KS)) + "|"]
    for name, runs in compared.items():
        row = []
        for k in map(str, KS):
            mean, half = _interval(_paired(runs, reference, k))
            low, high = _pooled_bootstrap(runs, reference, emitted, k)
            row.append(f"{mean:+.3f} ± {half:.3f} [{low:+.3f}, {high:+.3f}]")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    lines += ["", "Δ vs EAGLE3 per category at k=4 (mean over paired seeds; 95% bootstrap interval over the category's prompts):", "",
              "| set | " + " | ".join(categories) + " |", "|---" * (1 + len(categories)) + "|"]
    for name, runs in compared.items():
        row = []
        for category in categories:
            mean = _interval(_paired(runs, reference, "4", category))[0]
            low, high = _pooled_bootstrap(runs, reference, emitted, "4", category=category)
            row.append(f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
    recipe = [c for c in cells if c["name"] == "elsi-m1" and c["seed"] == 0 and
              (c["tag"] == "claims" or c["tag"].startswith("recipe-"))]
    if recipe:
        lines += ["", "recipe (ELSI m=1, seed 0):", "",
                  "| cell | init | draft vocab | TTT | steps | train tokens | train CPU-min | tau k=4 | tau per train CPU-hour |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for c in recipe:
            r = c["recipe"]
            tau = c["tau"]["4"]["pooled"]["all"]
            lines.append(f"| {c['tag']} | {r['init']} | {r['draft_vocab_size']} | {r['ttt_steps']} | {r['steps']} | "
                         f"{c['train_tokens']} | {c['train_cpu_seconds'] / 60:.1f} | {tau:.3f} | "
                         f"{(tau - 1) / (c['train_cpu_seconds'] / 3600):.2f} |")
    lines += _variant_tables(cells, by_set, sets, emitted)
    base, rerun = by_set.get("elsi-m1", {}).get(0), next((c for c in cells if c["tag"] == "recipe-rerun"), None)
    if base and rerun:
        gaps = [abs(a - b) for k in KS for cat in base["tau"][str(k)]["per_prompt"]
                for a, b in zip(base["tau"][str(k)]["per_prompt"][cat], rerun["tau"][str(k)]["per_prompt"][cat])]
        lines += ["", f"Reproducibility: the ELSI m=1 seed-0 cell retrained and replayed with the same code gives "
                  f"tau(k=4) {rerun['tau']['4']['pooled']['all']:.4f} (kept cell {base['tau']['4']['pooled']['all']:.4f}); "
                  f"final loss {rerun['final_loss']:.4f} vs {base['final_loss']:.4f}; the largest per-prompt tau "
                  f"difference over k = 1..5 is {max(gaps):.4f}."]
    if (keep / "heldout.json").is_file():
        heldout = json.loads((keep / "heldout.json").read_text())
        counts = next(iter(heldout.values()))["prompts"]
        lines += ["", f"held in ({counts['heldin']} training conversations), held out ({counts['heldout']} unseen "
                  "training instructions) and Spec-Bench (480), seed-0 claims drafts, tau at k=4:", "",
                  "| set | layers | held in | held out | Spec-Bench |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {h['layers']} | {h['heldin_tau']['all']:.3f} | {h['heldout_tau']['all']:.3f} | "
                  f"{h['specbench_tau']['all']:.3f} |" for name, h in heldout.items()]
    scaling = sorted((c for c in recipe if c["tag"] in ("claims", *(f"recipe-{t}" for t in RECIPE_VARIANTS if t.startswith("steps")))),
                     key=lambda c: c["train_tokens"])
    if images is not None and claims:
        _plots(by_set, sets, categories, images, keep.name)
    if images is not None and len(scaling) > 1:
        _scaling_plot(scaling, images, keep.name)
    return "\n".join(lines)


def _variant_tables(cells: list[dict], by_set: dict, sets: dict, emitted: dict[str, list[int]]) -> list[str]:
    """For each recipe variant trained on more than one set (`--variant`): tau(k=4) of every
    (set, seed) cell beside its claims cell, the variant's effect paired by set and seed, and each
    set's difference from the EAGLE3 default under the variant against the same under the recipe
    (paired by seed; with the 95% bootstrap interval over prompts under the variant): whether the
    knob moves the ranking."""
    variants: dict[str, dict[str, dict[int, dict]]] = {}
    for c in cells:
        if c["tag"].startswith("recipe-") and c["name"] in sets:
            variants.setdefault(c["tag"], {}).setdefault(c["name"], {})[c["seed"]] = c
    lines: list[str] = []
    for tag, by_name in variants.items():
        if len(by_name) < 2:
            continue
        lines += ["", f"{tag} against the claims recipe (tau at k=4; Δ: paired by set and seed; "
                  "Δ vs EAGLE3: paired by seed within each recipe):", "",
                  f"| set | seeds | {tag} | claims | Δ ({tag} − claims) | Δ vs EAGLE3, {tag} | Δ vs EAGLE3, claims |",
                  "|---|---|---|---|---|---|---|"]
        reference = by_name.get("eagle3-m3", {})
        for name in sets:
            runs = by_name.get(name, {})
            if not runs:
                continue
            seeds = sorted(runs)
            tau = lambda cell: cell["tau"]["4"]["pooled"]["all"]  # noqa: E731
            mine = " / ".join(f"{tau(runs[s]):.3f}" for s in seeds)
            claims = " / ".join(f"{tau(by_set[name][s]):.3f}" if s in by_set.get(name, {}) else "-" for s in seeds)
            effect = [tau(runs[s]) - tau(by_set[name][s]) for s in seeds if s in by_set.get(name, {})]
            row = [name, ", ".join(map(str, seeds)), mine, claims, _mean_half(effect)]
            if name == "eagle3-m3":
                row += ["0", "0"]
            else:
                both = {s: c for s, c in runs.items() if s in reference and s in by_set.get(name, {})}
                low, high = _pooled_bootstrap(both, reference, emitted) if both else (float("nan"),) * 2
                row += [f"{_mean_half(_paired(both, reference))}; prompts [{low:+.3f}, {high:+.3f}]",
                        _mean_half(_paired({s: by_set[name][s] for s in both}, by_set.get("eagle3-m3", {})))]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _mean_half(values: list[float]) -> str:
    """'mean ± 95% t half-width (n=..)', the mean alone for one value, '-' for none."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:+.3f} (n=1)"
    mean, half = _interval(values)
    return f"{mean:+.3f} ± {half:.3f} (n={len(values)})"


def _scaling_plot(cells: list[dict], images: Path, model: str) -> None:
    """tau at k = 1..5 against the training tokens seen (the data-scaling curve of the recipe)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 3.4), dpi=90)
    tokens = [c["train_tokens"] for c in cells]
    for k in KS:
        ax.plot(tokens, [c["tau"][str(k)]["pooled"]["all"] for c in cells], "o-", label=f"k={k}")
    ax.set_xscale("log")
    ax.set_xlabel("training loss tokens (ELSI m=1, seed 0)")
    ax.set_ylabel("tau (all 480 prompts)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title(f"{model}: tau against training data", fontsize=9)
    fig.tight_layout()
    fig.savefig(images / f"{model.split('-')[0]}_tau_vs_tokens.png")
    plt.close(fig)


def _plots(by_set: dict, sets: dict, categories: list[str], images: Path, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images.mkdir(parents=True, exist_ok=True)
    names = [n for n in sets if n in by_set]
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=90)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        stats = [_interval([r["tau"]["4"]["pooled"][c] for r in by_set[name].values()]) for c in ["all", *categories]]
        ax.bar([x + i * width for x in range(len(stats))], [m for m, _ in stats], width,
               yerr=[0 if h != h else h for _, h in stats], label=f"{name} {sets[name]}", capsize=2)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(1 + len(categories))], ["all", *categories], fontsize=8, rotation=35, ha="right")
    ax.set_ylabel("tau at k=4 (mean ± 95% CI over seeds)", fontsize=8)
    lows = [min(r["tau"]["4"]["pooled"][c] for r in runs.values() for c in ["all", *categories]) for runs in by_set.values()]
    ax.set_ylim(max(1.0, min(lows) - 0.2), None)
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(f"{model}: acceptance length per category and layer set", fontsize=9)
    fig.tight_layout()
    fig.savefig(images / f"{model.split('-')[0]}_tau_by_category.png")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4.6, 3.4), dpi=90)
    for name in names:
        ax.plot(KS, [_interval([r["tau"][str(k)]["pooled"]["all"] for r in by_set[name].values()])[0] for k in KS],
                "o-", label=name)
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel("tau (all 480 prompts)")
    ax.set_xticks(KS)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(images / f"{model.split('-')[0]}_tau_vs_k.png")
    plt.close(fig)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` keeps finished answers as Ctrl-C does
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--stages", nargs="+", default=["data", "calibrate", "cache", "recipe", "claims"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sets", nargs="+", default=None,
                        help="claims: only these layer sets, in this order (default: all, in the claims' order)")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPE_VARIANTS), choices=list(RECIPE_VARIANTS),
                        help="recipe stage: which cells, in this order (default all)")
    parser.add_argument("--variant", choices=[v for v in RECIPE_VARIANTS if RECIPE_VARIANTS[v]], default=None,
                        help="claims: train the sets with this recipe cell's change instead of the recipe")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--runs", type=Path, default=RUNS, help="working state: data, caches, drafts")
    parser.add_argument("--keep", type=Path, default=None,
                        help=f"committed state a fresh clone continues from (default {KEEP.relative_to(ROOT)}; "
                             "--smoke: under --runs)")
    parser.add_argument("--smoke", action="store_true", help="a minute-long check on a few prompts and steps")
    parser.add_argument("--full-data", action="store_true", help="data stage: also all 2397 training instructions")
    args = parser.parse_args()
    global FULL_DATA, MAX_PROMPTS, PER_CATEGORY
    FULL_DATA = args.full_data
    if args.smoke:
        MAX_PROMPTS, PER_CATEGORY = 12, 4
        RECIPE.update(steps=3, warmup=1, batch_size=4)
        os.environ.setdefault("ELSI_FAST_RESULTS_DIR", str(args.runs / "results"))
    from elsi_fast._infra.threads import configure

    configure(args.threads)
    out = args.runs / args.model
    keep = (args.keep or (args.runs / "keep" if args.smoke else KEEP)) / args.model
    if args.stages == ["report"]:
        print(stage_report(keep, ROOT / "docs" / "img" if not args.smoke else args.runs / "img"))
        return
    model, tokenizer = load_model(args.model, device="cpu", dtype="float32")
    out.mkdir(parents=True, exist_ok=True)
    if "data" in args.stages:
        stage_data(model, tokenizer, out, keep)
    report = stage_calibrate(model, tokenizer, out, keep)
    sets = sets_of(report, args.model)
    (keep / "sets.json").write_text(json.dumps(sets, indent=1))
    unknown = sorted(set(args.sets or []) - set(sets))
    if unknown:
        parser.error(f"--sets: {unknown} are not layer sets of {args.model}; choose from {list(sets)}")
    print("layer sets:", sets)
    if "cache" in args.stages:
        stage_cache(model, tokenizer, out, sorted({l for layers in sets.values() for l in layers}))
    if "recipe" in args.stages:
        stage_recipe(model, tokenizer, out, keep, sets, args.recipes)
    if "heldout" in args.stages:
        stage_heldout(model, tokenizer, out, keep, sets)
    if "claims" in args.stages:
        stage_claims(model, tokenizer, out, keep, {name: sets[name] for name in args.sets} if args.sets else sets,
                     args.seeds, args.variant)


if __name__ == "__main__":
    main()
