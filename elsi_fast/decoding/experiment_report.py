"""The tables of an experiment's cells (`experiments`), as data, and their plots.

Every table compares layer sets on tau, each set against a reference set (the EAGLE3 default
[2, N//2, N-3] in the claims) paired by seed and bootstrapped over prompts (`paired_stats`,
docs/experiments.md). A `Table` holds its caption, header and rows of formatted cells;
`Table.markdown` renders it. Cells are the dicts `experiments.run_cell` writes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .experiments import BASE_TAG, KS
from .paired_stats import mean_t_interval, pooled_bootstrap, prompt_rounds

REFERENCE = "eagle3-m3"  # the set every other is compared with, when the grid has it


@dataclasses.dataclass
class Table:
    """A table: a caption line, the header's column names and rows of formatted cells."""

    caption: str
    header: list[str]
    rows: list[list[str]]

    def markdown(self) -> list[str]:
        """The table as markdown lines, a blank line and the caption first."""
        return ["", self.caption, "", "| " + " | ".join(self.header) + " |", "|---" * len(self.header) + "|",
                *("| " + " | ".join(row) + " |" for row in self.rows)]


def by_set(cells: Sequence[dict], tag: str = BASE_TAG) -> dict[str, dict[int, dict]]:
    """The cells of `tag`: set name -> seed -> cell."""
    grouped: dict[str, dict[int, dict]] = {}
    for cell in cells:
        if cell["tag"] == tag:
            grouped.setdefault(cell["name"], {})[cell["seed"]] = cell
    return grouped


def _tau(cell: dict, k: str = "4", category: str = "all") -> float:
    return cell["tau"][k]["pooled"][category]


def paired_differences(runs: Mapping[int, dict], reference: Mapping[int, dict], k: str = "4",
                       category: str = "all") -> list[float]:
    """Pooled tau(set) - tau(reference) at k for every seed both have (seed -> cell maps)."""
    return [_tau(runs[s], k, category) - _tau(reference[s], k, category) for s in runs if s in reference]


def bootstrap_cells(runs: Mapping[int, dict], reference: Mapping[int, dict], emitted: Mapping[str, Sequence[int]],
                    k: str = "4", category: str | None = None) -> tuple[float, float]:
    """`paired_stats.pooled_bootstrap` of the set against the reference over the prompts of
    `category` (default all) at k, over the seeds both have. emitted: category -> emitted tokens
    per prompt (`paired_stats.emitted_tokens`), checked to be the cells' prompts."""
    categories = sorted(emitted) if category is None else [category]
    tokens = np.concatenate([np.asarray(emitted[c], dtype=np.float64) for c in categories])

    def rounds(cell: dict) -> np.ndarray:
        per_prompt = cell["tau"][k]["per_prompt"]
        counts = np.concatenate([prompt_rounds(emitted[c], per_prompt[c]) for c in categories])
        pooled = cell["tau"][k]["pooled"][category or "all"]
        if abs(tokens.sum() / counts.sum() - pooled) > 1e-9 * pooled:  # the weights belong to these prompts
            raise ValueError(f"emitted: the continuations do not match the cell's prompts ({cell['name']} "
                             f"seed {cell['seed']})")
        return counts

    return pooled_bootstrap(tokens, [(rounds(runs[s]), rounds(reference[s])) for s in runs if s in reference])


def mean_half(values: Sequence[float]) -> str:
    """'mean ± 95% t half-width (n=..)', the mean alone for one value, '-' for none."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:+.3f} (n=1)"
    mean, half = mean_t_interval(values)
    return f"{mean:+.3f} ± {half:.3f} (n={len(values)})"


def claims_tables(cells: Sequence[dict], sets: Mapping[str, Sequence[int]], emitted: Mapping[str, Sequence[int]],
                  reference: str = REFERENCE, label: str = "EAGLE3", ks: Sequence[int] = KS,
                  at: int = 4) -> list[Table]:
    """The base-recipe cells' tables: tau per set and category at k=`at` with the paired difference
    from `reference` (called `label`), tau against k, and the paired differences at every k of
    `ks` and per category at k=`at`."""
    grouped = by_set(cells)
    categories = sorted({c for runs in grouped.values() for cell in runs.values() for c in cell["tau"][str(at)]["pooled"]
                         if c != "all"})
    ref = grouped.get(reference, {})
    main = Table(f"Δ vs {label}: the paired difference of pooled tau over seeds (mean ± 95% t half-width), and a "
                 "95% bootstrap interval of the pooled difference (prompts resampled, seeds averaged).",
                 ["set", "layers", "seeds", "all", *categories, f"Δ all vs {label} (paired)"], [])
    for name in sets:
        runs = grouped.get(name, {})
        if not runs:
            continue
        row = [name, str(list(sets[name])), str(len(runs))]
        for category in ["all", *categories]:
            mean, half = mean_t_interval([_tau(r, str(at), category) for r in runs.values()])
            row.append(f"{mean:.3f} ± {half:.3f}")
        paired = paired_differences(runs, ref, str(at))
        if name != reference and paired:
            mean, half = mean_t_interval(paired)
            low, high = bootstrap_cells(runs, ref, emitted, str(at))
            row.append(f"{mean:+.3f} ± {half:.3f} (n={len(paired)} seeds); prompts [{low:+.3f}, {high:+.3f}]")
        else:
            row.append("0" if name == reference else "-")
        main.rows.append(row)
    per_k = Table("tau against k (mean over seeds):", ["set", *(f"k={k}" for k in ks)],
                  [[name, *(f"{mean_t_interval([_tau(r, str(k)) for r in runs.values()])[0]:.3f}" for k in ks)]
                   for name, runs in grouped.items()])
    compared = {name: runs for name, runs in grouped.items() if name != reference and set(runs) & set(ref)}
    delta_k = Table(f"Δ vs {label} at each k: paired over seeds (mean ± 95% t half-width) and the 95% bootstrap "
                    "interval over prompts:", ["set", *(f"k={k}" for k in ks)], [])
    delta_category = Table(f"Δ vs {label} per category at k={at} (mean over paired seeds; 95% bootstrap interval over "
                           "the category's prompts):", ["set", *categories], [])
    for name, runs in compared.items():
        row = [name]
        for k in map(str, ks):
            mean, half = mean_t_interval(paired_differences(runs, ref, k))
            low, high = bootstrap_cells(runs, ref, emitted, k)
            row.append(f"{mean:+.3f} ± {half:.3f} [{low:+.3f}, {high:+.3f}]")
        delta_k.rows.append(row)
        row = [name]
        for category in categories:
            mean = mean_t_interval(paired_differences(runs, ref, str(at), category))[0]
            low, high = bootstrap_cells(runs, ref, emitted, str(at), category=category)
            row.append(f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]")
        delta_category.rows.append(row)
    return [main, per_k, delta_k, delta_category]


def recipe_cells(cells: Sequence[dict], name: str, seed: int = 0) -> list[dict]:
    """The cells of set `name` at `seed` under the base recipe and every recipe variant."""
    return [c for c in cells if c["name"] == name and c["seed"] == seed and
            (c["tag"] == BASE_TAG or c["tag"].startswith("recipe-"))]


def recipe_table(cells: Sequence[dict], label: str) -> Table:
    """One row per recipe cell (`recipe_cells`): the knobs, the training cost and tau at k=4."""
    table = Table(f"recipe ({label}):", ["cell", "init", "draft vocab", "TTT", "steps", "train tokens",
                                          "train CPU-min", "tau k=4", "tau per train CPU-hour"], [])
    for c in cells:
        r, tau, hours = c["recipe"], _tau(c), c["train_cpu_seconds"] / 3600
        table.rows.append([c["tag"], str(r["init"]), str(r["draft_vocab_size"]), str(r["ttt_steps"]), str(r["steps"]),
                           str(c["train_tokens"]), f"{c['train_cpu_seconds'] / 60:.1f}", f"{tau:.3f}",
                           f"{(tau - 1) / hours:.2f}"])
    return table


def variant_tables(cells: Sequence[dict], sets: Mapping[str, Sequence[int]], emitted: Mapping[str, Sequence[int]],
                   reference: str = REFERENCE, label: str = "EAGLE3") -> list[Table]:
    """For each recipe variant trained on more than one set: tau(k=4) of every (set, seed) cell
    beside its base cell, the variant's effect paired by set and seed, and each set's difference
    from `reference` under the variant against the same under the base recipe (paired by seed;
    with the bootstrap interval over prompts under the variant): whether the knob moves the ranking."""
    base = by_set(cells)
    variants: dict[str, dict[str, dict[int, dict]]] = {}
    for c in cells:
        if c["tag"].startswith("recipe-") and c["name"] in sets:
            variants.setdefault(c["tag"], {}).setdefault(c["name"], {})[c["seed"]] = c
    tables = []
    for tag, by_name in variants.items():
        if len(by_name) < 2:
            continue
        table = Table(f"{tag} against the claims recipe (tau at k=4; Δ: paired by set and seed; Δ vs {label}: "
                      "paired by seed within each recipe):",
                      ["set", "seeds", tag, "claims", f"Δ ({tag} − claims)", f"Δ vs {label}, {tag}",
                       f"Δ vs {label}, claims"], [])
        ref = by_name.get(reference, {})
        for name in sets:
            runs, mine_base = by_name.get(name, {}), base.get(name, {})
            if not runs:
                continue
            seeds = sorted(runs)
            effect = [_tau(runs[s]) - _tau(mine_base[s]) for s in seeds if s in mine_base]
            row = [name, ", ".join(map(str, seeds)), " / ".join(f"{_tau(runs[s]):.3f}" for s in seeds),
                   " / ".join(f"{_tau(mine_base[s]):.3f}" if s in mine_base else "-" for s in seeds), mean_half(effect)]
            if name == reference:
                row += ["0", "0"]
            else:
                both = {s: c for s, c in runs.items() if s in ref and s in mine_base}
                low, high = bootstrap_cells(both, ref, emitted) if both else (float("nan"),) * 2
                row += [f"{mean_half(paired_differences(both, ref))}; prompts [{low:+.3f}, {high:+.3f}]",
                        mean_half(paired_differences({s: mine_base[s] for s in both}, base.get(reference, {})))]
            table.rows.append(row)
        tables.append(table)
    return tables


def rerun_note(base: dict, rerun: dict, label: str, ks: Sequence[int] = KS) -> str:
    """A cell retrained and replayed with the same code beside its kept result: reproducibility."""
    gaps = [abs(a - b) for k in ks for cat in base["tau"][str(k)]["per_prompt"]
            for a, b in zip(base["tau"][str(k)]["per_prompt"][cat], rerun["tau"][str(k)]["per_prompt"][cat])]
    return (f"Reproducibility: the {label} cell retrained and replayed with the same code gives "
            f"tau(k=4) {_tau(rerun):.4f} (kept cell {_tau(base):.4f}); final loss {rerun['final_loss']:.4f} vs "
            f"{base['final_loss']:.4f}; the largest per-prompt tau difference over k = 1..5 is {max(gaps):.4f}.")


def plot_claims(cells: Sequence[dict], sets: Mapping[str, Sequence[int]], images: Path, prefix: str,
                title: str, prompts: str = "all prompts", ks: Sequence[int] = KS) -> None:
    """`<prefix>_tau_by_category.png` (tau at k=4 per set and category, mean ± 95% t over seeds)
    and `<prefix>_tau_vs_k.png` into `images`; `prompts` names the prompt set on the tau axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = by_set(cells)
    categories = sorted({c for runs in grouped.values() for cell in runs.values() for c in cell["tau"]["4"]["pooled"]
                         if c != "all"})
    images.mkdir(parents=True, exist_ok=True)
    names = [n for n in sets if n in grouped]
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=90)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        stats = [mean_t_interval([_tau(r, "4", c) for r in grouped[name].values()]) for c in ["all", *categories]]
        ax.bar([x + i * width for x in range(len(stats))], [m for m, _ in stats], width,
               yerr=[0 if h != h else h for _, h in stats], label=f"{name} {list(sets[name])}", capsize=2)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(1 + len(categories))], ["all", *categories], fontsize=8,
                  rotation=35, ha="right")
    ax.set_ylabel("tau at k=4 (mean ± 95% CI over seeds)", fontsize=8)
    lows = [min(_tau(r, "4", c) for r in runs.values() for c in ["all", *categories]) for runs in grouped.values()]
    ax.set_ylim(max(1.0, min(lows) - 0.2), None)
    ax.legend(fontsize=6, ncol=2)
    ax.set_title(f"{title}: acceptance length per category and layer set", fontsize=9)
    fig.tight_layout()
    fig.savefig(images / f"{prefix}_tau_by_category.png")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4.6, 3.4), dpi=90)
    for name in names:
        ax.plot(ks, [mean_t_interval([_tau(r, str(k)) for r in grouped[name].values()])[0] for k in ks], "o-",
                label=name)
    ax.set_xlabel("k (draft tokens per round)")
    ax.set_ylabel(f"tau ({prompts})")
    ax.set_xticks(list(ks))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(images / f"{prefix}_tau_vs_k.png")
    plt.close(fig)


def plot_scaling(cells: Sequence[dict], images: Path, prefix: str, title: str, series: str,
                 prompts: str = "all prompts", ks: Sequence[int] = KS) -> None:
    """`<prefix>_tau_vs_tokens.png`: tau at every k against the training tokens of `cells`, the
    runs of one set and seed (`series` names them on the token axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = sorted(cells, key=lambda c: c["train_tokens"])
    fig, ax = plt.subplots(figsize=(4.6, 3.4), dpi=90)
    for k in ks:
        ax.plot([c["train_tokens"] for c in cells], [_tau(c, str(k)) for c in cells], "o-", label=f"k={k}")
    ax.set_xscale("log")
    ax.set_xlabel(f"training loss tokens ({series})")
    ax.set_ylabel(f"tau ({prompts})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6)
    ax.set_title(f"{title}: tau against training data", fontsize=9)
    fig.tight_layout()
    fig.savefig(images / f"{prefix}_tau_vs_tokens.png")
    plt.close(fig)
