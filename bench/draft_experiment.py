"""The paper's draft claims on real targets: EAGLE3 drafts on chosen layer sets, trained the anchors'
way, tau on all 480 Spec-Bench prompts. A resumable experiment: every step (data, cache, a trained
draft, its tau) works under runs/draft-experiment/<model>/ and a rerun does only what is missing.
The cells, their replayed tau, the paired statistics and the tables are the library's
(`elsi_fast.decoding.experiments`, `experiment_report`, `paired_stats`: docs/experiments.md); this
script holds the stages over the shared data and the kept state.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from bench.common import device_name, record, shared_data
from elsi_fast.analysis.prompts import load_prompts
from elsi_fast.decoding import experiments
from elsi_fast.decoding.evaluation import continuation_samples, pooled_tau, replay_runs_per_k
from elsi_fast.decoding.experiment_report import (
    Table, by_set, claims_tables, plot_claims, plot_scaling, recipe_cells, recipe_table, rerun_note, variant_tables,
)
from elsi_fast.decoding.experiments import Cell, ExperimentData, finished_cell, layer_sets, read_cells
from elsi_fast.decoding.paired_stats import emitted_tokens
from elsi_fast.targets.loading import load_model
from elsi_fast.training.feature_cache import build, open_cache
from elsi_fast.training.regenerate import (
    CONVERSATIONS_FILE, export_answers, read_conversations, regenerate, restore_answers,
)
from elsi_fast.analysis.report import LayerReport
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
    """The layer sets of the claims (input-to-layer ids), in the claims' order: elsi-m1, elsi-m3,
    eagle3-m3, low-entropy-m3 (SmolLM2: then elsi-c-m3, last-m1, uniform-m3)."""
    sets = {**layer_sets(report, ["elsi"], [1, 3]), **layer_sets(report, ["eagle3", "low-entropy"], [3])}
    if model.startswith("smollm2"):
        sets.update(layer_sets(report, ["elsi-c", "last", "uniform"], [3]))
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
    """Train one draft (resumable, in `out/cells/<cell>`) and replay its tau at every k
    (`experiments.run_cell`); the cell's result is kept in `keep/cells/<cell>.json`, and a rerun
    reads it instead of recomputing. A new cell also writes one row per k."""
    cell = Cell(name, layers, seed, recipe, tag)
    done = finished_cell(cell, keep / "cells")
    if done is not None:
        return done
    records = _records(out, "eval")
    data = ExperimentData(model, tokenizer, conversation_samples(_records(out, TRAIN), tokenizer, MAX_TOKENS,
                                                                 model.config.vocab_size),
                          open_cache(out / "cache-train"), records, open_cache(out / "cache-eval"), MAX_TOKENS)
    result, _ = experiments.run_cell(cell, data, keep / "cells", out / "cells", ks=KS, progress=True)
    device, taus = device_name("cpu"), result["tau"]
    for k in KS:
        record(RESULTS, "draft_tau", f"tau/k={k}", taus[str(k)]["pooled"]["all"], "tokens/forward", device=device,
               params={"model": out.name, "set": name, "layers": layers, "seed": seed, "tag": tag, "recipe": recipe,
                       "per_category": taus[str(k)]["pooled"], "train_tokens": result["train_tokens"],
                       "train_cpu_seconds": result["train_cpu_seconds"],
                       "eval_cpu_seconds": result["eval_cpu_seconds"], "prompts": len(records),
                       "max_new_tokens": 128, "loadavg": os.getloadavg()})
    return result


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
    from elsi_fast.draft import Eagle3Draft

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
        draft = Eagle3Draft.from_pretrained(cell, embed_tokens=embed)
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

def _emitted_tokens(keep: Path) -> dict[str, list[int]]:
    """Tokens each kept evaluation answer emits through verification rounds, per Spec-Bench category
    (`paired_stats.emitted_tokens`; the kept answers carry no category)."""
    category = {p.id: p.category for p in load_prompts(str(shared_data("prompts", "spec_bench_question.jsonl")))}
    return emitted_tokens(json.loads((keep / "eval.answers.json").read_text())["answers"], category)


def stage_report(keep: Path, images: Path | None = None) -> str:
    """Markdown tables (and plots into `images`) of the finished cells kept in `keep`
    (`experiment_report`): tau per set and category at k = 4, paired differences against the
    EAGLE3 default over seeds and prompts, tau against k; the recipe cells, the variants, the
    rerun and the held-out replays."""
    cells = read_cells(keep / "cells")
    sets = json.loads((keep / "sets.json").read_text())
    emitted = _emitted_tokens(keep)
    claims = by_set(cells)
    lines = [f"### {keep.name}: claims cells ({sum(map(len, claims.values()))} drafts)"]
    for table in claims_tables(cells, sets, emitted):
        lines += table.markdown()
    recipe = recipe_cells(cells, "elsi-m1", 0)
    if recipe:
        lines += recipe_table(recipe, "ELSI m=1, seed 0").markdown()
    for table in variant_tables(cells, sets, emitted):
        lines += table.markdown()
    base, rerun = claims.get("elsi-m1", {}).get(0), next((c for c in cells if c["tag"] == "recipe-rerun"), None)
    if base and rerun:
        lines += ["", rerun_note(base, rerun, "ELSI m=1 seed-0")]
    if (keep / "heldout.json").is_file():
        heldout = json.loads((keep / "heldout.json").read_text())
        counts = next(iter(heldout.values()))["prompts"]
        lines += Table(f"held in ({counts['heldin']} training conversations), held out ({counts['heldout']} unseen "
                       "training instructions) and Spec-Bench (480), seed-0 claims drafts, tau at k=4:",
                       ["set", "layers", "held in", "held out", "Spec-Bench"],
                       [[name, str(h["layers"]), f"{h['heldin_tau']['all']:.3f}", f"{h['heldout_tau']['all']:.3f}",
                         f"{h['specbench_tau']['all']:.3f}"] for name, h in heldout.items()]).markdown()
    prefix, steps = keep.name.split("-")[0], ("claims", *(f"recipe-{t}" for t in RECIPE_VARIANTS if t.startswith("steps")))
    scaling = [c for c in recipe if c["tag"] in steps]
    if images is not None and claims:
        plot_claims(cells, sets, images, prefix, keep.name, prompts="all 480 prompts")
    if images is not None and len(scaling) > 1:
        plot_scaling(scaling, images, prefix, keep.name, "ELSI m=1, seed 0", prompts="all 480 prompts")
    return "\n".join(lines)


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
