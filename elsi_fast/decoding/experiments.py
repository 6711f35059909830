"""Experiment cells: one draft per (layer set, seed, recipe), trained offline, its tau replayed.

A claim about layer sets is a grid of cells (docs/experiments.md): every set (a selection method
and its layer count m, named "<method>-m<m>") at every seed, trained the same way (the recipe:
`train_draft` settings) from one feature cache of the training conversations, and replayed at
every k on the target's greedy continuations of the evaluation prompts
(`evaluation.replay_runs_per_k`: no target forward). Seeds fix the data order and the draft's
start for every set, so sets compare paired by seed (`paired_stats`).

A cell's JSON file is its state. `run_cell` skips a cell whose file exists (it must name the same
layers and recipe), trains a missing one in its own work folder (an interrupted training resumes
from its saved state: `train_draft`), and writes the file atomically once tau is replayed, so a
file is whole or absent. The file holds {"name", "layers", "seed", "tag", "recipe",
"train_tokens", "final_loss", "final_top1", "train_cpu_seconds", "train_tokens_per_second",
"eval_cpu_seconds", "tau": {"<k>": {"pooled": {category: tau, "all": tau},
"per_prompt": {category: [tau per prompt, record order]}}}}.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..training.train import STATE_FILE, train_draft
from .evaluation import pooled_tau, replay_runs_per_k

KS = (1, 2, 3, 4, 5)
BASE_TAG = "claims"  # the tag of cells trained with the experiment's own recipe
FIXED_M = {"eagle3": 3, "last": 1}  # rules whose layer count is fixed (LayerReport.select)
CELL_FIELDS = ("name", "layers", "seed", "tag", "recipe", "train_tokens", "final_loss", "tau")


def set_name(method: str, m: int) -> str:
    """The name of a layer set: "<method>-m<m>" (e.g. "elsi-m1", "eagle3-m3")."""
    return f"{method}-m{m}"


@dataclasses.dataclass(frozen=True)
class Cell:
    """One draft of the grid. name: its layer set ("<method>-m<m>"); layers: input-to-layer ids;
    seed: of the initialization and data order; recipe: `train_draft` keyword arguments (init,
    draft_vocab_size, ttt_steps, steps, batch_size, lr, warmup, ...); tag: BASE_TAG, or the name of
    a recipe variant ("recipe-<variant>")."""

    name: str
    layers: list[int]
    seed: int
    recipe: Mapping[str, Any]
    tag: str = BASE_TAG

    @property
    def stem(self) -> str:
        """The cell's file and work-folder name."""
        return f"{self.name}-seed{self.seed}-{self.tag}"


def layer_sets(report, methods: Sequence[str], ms: Sequence[int]) -> dict[str, list[int]]:
    """name -> layers of every (method, m) pair, in the order given; a rule of fixed size
    (FIXED_M: eagle3 3 layers, last 1) takes its own m whatever `ms` says."""
    sets: dict[str, list[int]] = {}
    for method in methods:
        for m in ([FIXED_M[method]] if method in FIXED_M else ms):
            sets[set_name(method, m)] = report.select(method, m)
    return sets


def grid(sets: Mapping[str, Sequence[int]], seeds: Sequence[int], recipe: Mapping[str, Any],
         tag: str = BASE_TAG) -> list[Cell]:
    """Every set at every seed, one seed after the other (every set at a seed before the next
    seed: a grid stopped part-way still holds balanced, paired results)."""
    return [Cell(name, list(layers), seed, dict(recipe), tag) for seed in seeds for name, layers in sets.items()]


def read_cell(path: str | os.PathLike) -> dict:
    """A cell file, checked to hold the fields a cell has (module docstring)."""
    try:
        result = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"cell: {path} is not valid JSON ({exc}); delete it to run the cell again") from None
    missing = [f for f in CELL_FIELDS if not isinstance(result, dict) or f not in result]
    if missing:
        raise ValueError(f"cell: {path} lacks {missing}; it is not a cell file")
    return result


def read_cells(folder: str | os.PathLike) -> list[dict]:
    """Every cell file in `folder`, in file-name order."""
    return [read_cell(path) for path in sorted(Path(folder).glob("*.json"))]


def finished_cell(cell: Cell, results: str | os.PathLike) -> dict | None:
    """The cell's result if its file exists in `results`, else None; a file of other layers or
    another recipe under the same name is refused (a changed recipe must not reuse old cells)."""
    path = Path(results) / f"{cell.stem}.json"
    if not path.is_file():
        return None
    kept = read_cell(path)
    if kept["recipe"] != dict(cell.recipe) or kept["layers"] != list(cell.layers):
        raise ValueError(f"cell: {path} was trained with layers {kept['layers']}, recipe {kept['recipe']}; this run "
                         f"asks for {list(cell.layers)}, {dict(cell.recipe)}: give the new recipe its own tag or folder")
    return kept


def write_cell(result: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Write a cell file atomically (a temporary file in the same folder, then os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def replay_taus(draft, records: Sequence[dict], cache, ks: Sequence[int] = KS, *,
                batch_size: int = 16) -> dict[str, dict]:
    """tau of `draft` replayed on the continuations `records` (their states in `cache`) at every k:
    str(k) -> {"pooled": {category: tau, "all": tau}, "per_prompt": {category: [tau, ...]}}."""
    runs = replay_runs_per_k(draft, records, cache, tuple(ks), batch_size=batch_size)
    return {str(k): {"pooled": pooled_tau(runs[k]),
                     "per_prompt": {cat: [r.tau for r in results] for cat, results in runs[k].items()}} for k in ks}


@dataclasses.dataclass
class ExperimentData:
    """What every cell of a grid shares: the target (its embedding and head; it runs no forward
    here), the training samples and their feature cache, and the evaluation continuations
    (`regenerate` records, greedy) with theirs. seq_len: tokens per training conversation."""

    target: Any
    tokenizer: Any
    train_samples: Sequence
    train_cache: Any
    eval_records: Sequence[dict]
    eval_cache: Any
    seq_len: int


def run_cell(cell: Cell, data: ExperimentData, results: str | os.PathLike, work: str | os.PathLike, *,
             ks: Sequence[int] = KS, save_every: int = 10, progress: bool = False) -> tuple[dict, bool]:
    """The cell's result and whether it was computed now (False: read from its file in `results`).
    A missing cell trains in `work/<stem>` (resuming a training interrupted there), replays its
    tau at every k of `ks`, and writes `results/<stem>.json` atomically."""
    done = finished_cell(cell, results)
    if done is not None:
        return done, False
    started = time.process_time()
    draft, summary = train_draft(data.target, data.tokenizer, list(cell.layers), data.train_samples,
                                 out_dir=Path(work) / cell.stem, feature_cache=data.train_cache, seed=cell.seed,
                                 seq_len=data.seq_len, save_every=save_every, progress=progress, **cell.recipe)
    train_cpu = time.process_time() - started
    began = time.process_time()
    taus = replay_taus(draft, data.eval_records, data.eval_cache, ks)
    result = {"name": cell.name, "layers": list(cell.layers), "seed": cell.seed, "tag": cell.tag,
              "recipe": dict(cell.recipe), "train_tokens": sum(h["tokens"] for h in summary["history"]),
              "final_loss": summary["final_loss"], "final_top1": summary["history"][-1]["top1"],
              "train_cpu_seconds": train_cpu, "train_tokens_per_second": summary["tokens_per_second_this_run"],
              "eval_cpu_seconds": time.process_time() - began, "tau": taus}
    write_cell(result, Path(results) / f"{cell.stem}.json")
    return result, True


def cell_status(cell: Cell, results: str | os.PathLike, work: str | os.PathLike) -> str:
    """"done" (its file exists), "started" (a training state waits in its work folder) or "todo"."""
    if (Path(results) / f"{cell.stem}.json").is_file():
        return "done"
    return "started" if (Path(work) / cell.stem / STATE_FILE).is_file() else "todo"
