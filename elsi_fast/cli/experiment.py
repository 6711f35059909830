"""`elsi-fast experiment run|status|report`: a grid of drafts (layer set x seed), resumable, compared paired.

`run` trains one draft per cell (`elsi_fast.decoding.experiments`: every --methods/--m set of a
report.json at every --seeds, one recipe) from one feature cache of the training conversations,
replays its tau at every --ks on the evaluation continuations (no target forward), and keeps each
finished cell as OUT/cells/<cell>.json; a rerun skips finished cells and resumes an interrupted
one. `status` lists the grid's cells; `report` prints the paired-difference tables
(`elsi_fast.decoding.experiment_report`). docs/experiments.md describes the layout of OUT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from . import UsageError, positive_int
from ..targets.loading import DTYPES
from .analyze import MODEL_HELP, check_device, check_model, check_out_folder
from .draft import _layers_from_report, load_target
from .replay import read_replay_records

EXPERIMENT_FILE = "experiment.json"  # the grid and what every cell shares
SHARED = ("target", "dtype", "train", "eval", "recipe", "ks", "seq_len", "cache_dtype")  # fixed per OUT
FIXED_M = {"eagle3": 3, "last": 1}  # elsi_fast.decoding.experiments.FIXED_M (no torch import here)
REFERENCE = "eagle3-m3"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "experiment",
        help="train and compare a grid of drafts (layer sets x seeds), resumable, with paired statistics",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=("run", "status", "report"))
    parser.add_argument("--out", required=True, help=f"the experiment's folder ({EXPERIMENT_FILE}, cells/, work/)")
    parser.add_argument("--target", default=None, help=f"run: {MODEL_HELP}")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="run: target weights dtype (default float32)")
    parser.add_argument("--device", default=None, help="run: cpu or cuda (default: cuda if available)")
    parser.add_argument("--report", help="run: report.json of `elsi-fast analyze` (the layer sets)")
    parser.add_argument("--methods", nargs="+", default=["elsi", "eagle3"],
                        help="run: selection methods (default elsi eagle3); eagle3 is always 3 layers, last 1")
    parser.add_argument("--m", type=positive_int, nargs="+", default=[1, 3], help="run: layer counts (default 1 3)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run: seeds (default 0 1 2)")
    parser.add_argument("--train", help="run: training conversations (`elsi-fast regenerate` folder or its .jsonl)")
    parser.add_argument("--eval", help="run: the target's greedy continuations of the evaluation prompts (a "
                        "regenerate folder at temperature 0, as eval-draft --replay)")
    parser.add_argument("--ks", type=positive_int, nargs="+", default=[1, 2, 3, 4, 5],
                        help="run: draft tokens per round replayed (default 1 2 3 4 5)")
    recipe = parser.add_argument_group("run: the recipe of every cell (train-draft's options)")
    recipe.add_argument("--steps", type=positive_int, default=120, help="optimizer steps (default 120)")
    recipe.add_argument("--batch-size", type=positive_int, default=16, help="conversations per step (default 16)")
    recipe.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    recipe.add_argument("--warmup", type=int, default=12, help="warmup steps (default 12)")
    recipe.add_argument("--ttt-steps", type=positive_int, default=3, help="training-time-test depth (default 3)")
    recipe.add_argument("--draft-vocab-size", type=positive_int, default=8192, help="(default 8192)")
    recipe.add_argument("--init", choices=("random", "target"), default="target", help="(default target)")
    recipe.add_argument("--seq-len", type=positive_int, default=512,
                        help="tokens per training conversation (default 512)")
    recipe.add_argument("--cache-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="precision of the cached target states (default float32)")
    parser.add_argument("--reference", default=None,
                        help=f"report: the set the others are compared with (default {REFERENCE} when the grid has it)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=handler, check=check, interrupted=interrupted)


def _experiment(out: str) -> dict:
    path = os.path.join(out, EXPERIMENT_FILE)
    if not os.path.isfile(path):
        raise UsageError(f"--out: {out} holds no {EXPERIMENT_FILE}; start it with `elsi-fast experiment run`")
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError:
        raise UsageError(f"--out: {path} is not valid JSON") from None


def check(args: argparse.Namespace) -> None:
    check_out_folder(args.out)
    if args.action != "run":
        args.experiment = _experiment(args.out)
        return
    for option in ("target", "report", "train", "eval"):
        if getattr(args, option) is None:
            raise UsageError(f"--{option}: experiment run needs it")
    check_model(args.target, "--target")
    check_device(args.device)
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr: must be a positive number, got {args.lr}")
    if args.warmup < 0:
        raise UsageError(f"--warmup: must be >= 0, got {args.warmup}")
    sets = {}
    for method in args.methods:
        for m in [FIXED_M[method]] if method in FIXED_M else args.m:
            try:
                sets[f"{method}-m{m}"] = _layers_from_report(args.report, method, m)
            except UsageError as exc:  # train-draft's message names its own --method
                raise UsageError(str(exc).replace("--method/--m:", "--methods/--m:", 1)) from None
    train = os.path.join(args.train, "conversations.jsonl") if os.path.isdir(args.train) else args.train
    from ..training.training_data import is_conversations_file

    if not is_conversations_file(train):
        raise UsageError(f"--train: {args.train} is not a conversations file of `elsi-fast regenerate`")
    eval_folder, args.eval_records = read_replay_records(args.eval, "--eval")
    recipe = {"init": args.init, "draft_vocab_size": args.draft_vocab_size, "ttt_steps": args.ttt_steps,
              "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "warmup": args.warmup}
    wanted = {"target": args.target, "dtype": args.dtype, "train": os.path.abspath(train),
              "eval": os.path.abspath(eval_folder), "recipe": recipe, "ks": list(args.ks), "seq_len": args.seq_len,
              "cache_dtype": args.cache_dtype}
    layers = sorted({layer for chosen in sets.values() for layer in chosen})
    if os.path.isfile(os.path.join(args.out, EXPERIMENT_FILE)):
        held = _experiment(args.out)
        changed = [key for key in SHARED if held.get(key) != wanted[key]]
        if changed:
            raise UsageError(f"--out: {args.out} is an experiment with other {', '.join(changed)} "
                             f"({', '.join(f'{k}={held.get(k)}' for k in changed)}); use another --out")
        if set(layers) - set(held["layers"]):
            raise UsageError(f"--methods/--m: layers {sorted(set(layers) - set(held['layers']))} are not in the states "
                             f"of {args.out} (layers {held['layers']}); run this grid in another --out")
        layers = held["layers"]
        sets = {**held["sets"], **sets}
        args.seeds = list(dict.fromkeys([*held["seeds"], *args.seeds]))
    args.experiment = {**wanted, "layers": layers, "sets": sets, "seeds": list(args.seeds)}


def interrupted(args: argparse.Namespace) -> str:
    return (f"finished cells are kept in {os.path.join(args.out, 'cells')} and an unfinished draft's training state "
            f"in {os.path.join(args.out, 'work')}: rerun the same command to continue")


def _cells(experiment: dict):
    from ..decoding.experiments import grid

    return grid(experiment["sets"], experiment["seeds"], experiment["recipe"])


def handler(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if args.action == "run":
        _run(args, out)
    if args.action == "status":
        _status(args.experiment, out)
        return 0
    print(_report(args.experiment, out, args.reference))
    return 0


def _run(args: argparse.Namespace, out: Path) -> None:
    from ..decoding.evaluation import continuation_samples
    from ..decoding.experiments import ExperimentData, run_cell
    from ..training.feature_cache import build
    from ..training.training_data import conversation_samples, load_conversations

    experiment = args.experiment
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{EXPERIMENT_FILE}.tmp"
    tmp.write_text(json.dumps(experiment, indent=1))
    os.replace(tmp, out / EXPERIMENT_FILE)
    model, tokenizer = load_target(args)
    samples = conversation_samples(load_conversations(experiment["train"]), tokenizer, experiment["seq_len"],
                                   model.config.vocab_size)
    progress = not args.no_progress
    caches = [build(model, chosen, experiment["layers"], out / name, dtype=experiment["cache_dtype"], progress=progress)
              for name, chosen in (("train-states", samples), ("eval-states", continuation_samples(args.eval_records)))]
    data = ExperimentData(model, tokenizer, samples, caches[0], args.eval_records, caches[1], experiment["seq_len"])
    for cell in _cells(experiment):
        result, fresh = run_cell(cell, data, out / "cells", out / "work", ks=experiment["ks"], progress=progress)
        print(f"{cell.stem:<32} {'trained' if fresh else 'kept   '} tau(k={experiment['ks'][-1]}) "
              f"{result['tau'][str(experiment['ks'][-1])]['pooled']['all']:.3f}")


def _status(experiment: dict, out: Path) -> None:
    from ..decoding.experiments import cell_status

    counts: dict[str, int] = {}
    for cell in _cells(experiment):
        status = cell_status(cell, out / "cells", out / "work")
        counts[status] = counts.get(status, 0) + 1
        print(f"{cell.stem:<32} {cell.layers!s:<16} {status}")
    print(", ".join(f"{count} {status}" for status, count in sorted(counts.items())))
    print(f"a finished cell's draft: {out / 'work' / '<cell>'}; its tau on other k: elsi-fast eval-draft --target "
          f"{experiment['target']} --draft {out / 'work' / '<cell>'} --replay {experiment['eval']} "
          f"--states {out / 'eval-states'}")


def _report(experiment: dict, out: Path, reference: str | None) -> str:
    from ..decoding.experiment_report import claims_tables
    from ..decoding.experiments import read_cells
    from ..decoding.paired_stats import emitted_tokens

    sets = experiment["sets"]
    reference = reference or (REFERENCE if REFERENCE in sets else next(iter(sets)))
    if reference not in sets:
        raise UsageError(f"--reference: {reference} is not a set of this experiment; choose from {list(sets)}")
    records = read_replay_records(experiment["eval"], "--eval")[1]
    emitted = emitted_tokens(records, {r["id"]: r.get("category") or "text" for r in records})
    cells = [c for c in read_cells(out / "cells") if c["name"] in sets and c["seed"] in experiment["seeds"]]
    if not cells:
        return f"{out}: no finished cell yet"
    ks = experiment["ks"]
    label = "EAGLE3" if reference == REFERENCE else reference
    lines = [f"### {out.name}: {len(cells)} cells of {experiment['target']}"]
    for table in claims_tables(cells, sets, emitted, reference=reference, label=label, ks=ks,
                               at=4 if 4 in ks else ks[-1]):
        lines += table.markdown()
    return "\n".join(lines)
