"""LayerReport: the result of `elsi_fast.analyze`, with selection, JSON, plots and serving configs.

All layer indices are input-to-layer (docs/method.md section 2): 0 = embeddings, l = input of block l,
N = last block's output before the final norm.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..engines import layer_ids, serving
from . import selection as sel
from .analysis_options import DEFAULTS

METHODS = ("elsi", "elsi-c", "eagle3", "low-entropy", "last", "uniform")
_OPTIMIZED = ("elsi", "elsi-c", "low-entropy")
_SERIALIZED = (
    "model", "num_hidden_layers", "layers", "cka", "compartments", "selections", "tokens", "options",
    "boundaries", "novelty", "pair_gain", "greedy_gains", "search", "set_values", "prompts", "entropy_variance",
    "memory", "timing",
)


@dataclass
class LayerReport:
    """Per-layer statistics and layer selections of one analysis.

    layers: N+1 dicts (index, entropy_prompt_mean/std, entropy_dataset, ...); cka: [N+1][N+1];
    selections: {method: {str(m): [layer indices]}}; greedy_gains: each greedy step's gain, with
    search[method][m] = "exhaustive" when the selection is the exact optimum over all m-subsets
    (then it may differ from the greedy path) or "greedy"; pair_gain[a][b] = H2({a, b}) - H2({a}),
    with H2 the prompt-mode Renyi-2 entropy of the concatenation (exact and O(1) per pair; f's
    Shannon entropy would cost one eigensolve per pair and prompt); set_entropy: f, the prompt-mode
    Shannon entropy of a layer set's concatenation, and set_renyi2 its Renyi-2 counterpart
    (available in the session that ran `analyze`, not after `from_json`; a repeated layer counts
    once); prompt_store: that session's `prompt_store.PromptModeStore` (per-prompt statistics, e.g.
    to select on a subset of the prompts). timing: pass_seconds, selection_seconds (everything
    after the pass).
    """

    model: str
    num_hidden_layers: int
    layers: list[dict]
    cka: list[list[float]]
    tokens: dict
    options: dict
    compartments: list[list[int]] = field(default_factory=list)
    boundaries: list[int] = field(default_factory=list)
    novelty: list[float] = field(default_factory=list)
    selections: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    greedy_gains: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    search: dict[str, dict[str, str]] = field(default_factory=dict)
    set_values: dict[str, dict[str, float]] = field(default_factory=dict)
    pair_gain: list[list[float]] = field(default_factory=list)
    prompts: dict = field(default_factory=dict)
    entropy_variance: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    set_entropy: Callable[[Sequence[tuple[int, ...]]], np.ndarray] | None = field(default=None, repr=False)
    set_renyi2: Callable[[Sequence[tuple[int, ...]]], np.ndarray] | None = field(default=None, repr=False)
    prompt_store: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # A report from an older version lacks newer settings: they take today's defaults.
        self.options = {**DEFAULTS.to_dict(), **self.options}

    # -----------------------------------------------------------------------------------------
    # Selection
    # -----------------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """N + 1 hidden states."""
        return self.num_hidden_layers + 1

    def _candidates(self) -> list[int]:
        candidates = self.options["candidates"]
        return layer_ids.common_candidate_layers(self.num_hidden_layers) if candidates is None else list(candidates)

    def _objective(self, method: str) -> Callable:
        if self.set_entropy is None:
            raise ValueError(
                f"method: {method!r} needs the prompt-mode set entropies, which are only available in the "
                "session that ran analyze(); rerun analyze with this m"
            )

        if method == "elsi-c":
            return sel.cka_penalized(self.set_entropy, np.asarray(self.cka), self.options["beta"])
        return self.set_entropy

    def compute_selections(self) -> None:
        """Compartments, pair gains and every method's selection for each m in options['m']."""
        cka = np.asarray(self.cka, dtype=np.float64)
        half_width = self.options["novelty_half_width"]
        self.novelty = sel.novelty_curve(cka, half_width).tolist()
        self.boundaries = sel.novelty_boundaries(cka, half_width, self.options["novelty_threshold"])
        self.compartments = sel.compartments_from_boundaries(self.boundaries, self.num_layers)
        if self.set_renyi2 is not None:
            self.pair_gain = sel.pair_gain_matrix(self.set_renyi2, list(range(self.num_layers))).tolist()
        for m in self.options["m"]:
            for method in ("elsi", "elsi-c", "low-entropy", "uniform"):
                self.select(method, m)
        # The fixed-size rules are the reference points whatever m was asked for.
        if self.num_hidden_layers >= 3:
            self.select("eagle3", 3)
        self.select("last", 1)

    def select(self, method: str, m: int) -> list[int]:
        """Layer indices (input-to-layer) chosen by `method` for `m` layers.

        method: "elsi" (max prompt-mode entropy of the concatenation), "elsi-c" (minus beta x mean
        pairwise CKA; one layer per compartment if options['one_per_compartment']), "low-entropy"
        (the control: minimum entropy), "eagle3" ([2, N//2, N-3], m=3 only), "last" ([N], m=1
        only), "uniform" (evenly spaced).
        """
        if method not in METHODS:
            raise ValueError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"m: must be a positive integer, got {m!r}")
        m = int(m)
        stored = self.selections.get(method, {}).get(str(m))
        if stored is not None:
            return list(stored)
        n = self.num_hidden_layers
        gains = None
        if method == "eagle3":
            if m != 3:
                raise ValueError(f"m: the eagle3 rule picks exactly 3 layers, got m={m}")
            layers = layer_ids.eagle3_default_layers(n)
        elif method == "last":
            if m != 1:
                raise ValueError(f"m: the last-layer baseline is one layer, got m={m}")
            layers = sel.last_layer(n)
        elif method == "uniform":
            layers = sel.uniform_layers(n, m)
        else:
            objective = self._objective(method)
            compartments = (
                self.compartments if method == "elsi-c" and self.options["one_per_compartment"] else None
            )
            # The control may also take the embeddings (the paper's {0, 1, N-1}).
            candidates = sorted({0, *self._candidates()}) if method == "low-entropy" else self._candidates()
            choice = sel.select(
                objective,
                candidates,
                m,
                maximize=method != "low-entropy",
                compartments=compartments,
                max_exhaustive=self.options["max_exhaustive"],
            )
            layers, gains = choice.layers, choice.gains
            self.search.setdefault(method, {})[str(m)] = "exhaustive" if choice.exhaustive else "greedy"
        self.selections.setdefault(method, {})[str(m)] = list(layers)
        if gains is not None:
            self.greedy_gains.setdefault(method, {})[str(m)] = list(gains)
        if self.set_entropy is not None:
            value = float(self._objective("elsi")([tuple(layers)])[0])
            self.set_values.setdefault(method, {})[str(m)] = value
        return list(layers)

    # -----------------------------------------------------------------------------------------
    # Serving
    # -----------------------------------------------------------------------------------------

    def _default_m(self) -> int:
        ms = list(self.options["m"])
        return 3 if 3 in ms else max(ms)

    def serving_notes(self, engine: str, m: int | None = None, method: str = "elsi") -> list[str]:
        """Caveats for serving the selection with `engine` (m != 3, h_N, repeated layers)."""
        layers = self.select(method, self._default_m() if m is None else m)
        return serving.engine_notes(layers, engine, self.num_hidden_layers)

    def serving_config(self, engine: str, m: int | None = None, method: str = "elsi") -> dict:
        """Draft-config snippet for `engine` ("vllm", "speculators", "sglang", "specforge",
        "trtllm", "llamacpp") in that engine's index convention; caveats are issued as UserWarnings."""
        layers = self.select(method, self._default_m() if m is None else m)
        config = serving.serving_config(layers, engine, self.num_hidden_layers)
        for note in serving.engine_notes(layers, engine, self.num_hidden_layers):
            warnings.warn(f"{engine}: {note}", UserWarning, stacklevel=2)
        return config

    # -----------------------------------------------------------------------------------------
    # JSON
    # -----------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {key: _plain(getattr(self, key)) for key in _SERIALIZED}

    def to_json(self, path: str) -> None:
        """Write report.json (indices input-to-layer)."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_json(cls, path: str) -> "LayerReport":
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError(f"path: {path} does not hold a LayerReport JSON object")
        missing = [k for k in ("model", "num_hidden_layers", "layers", "cka", "tokens", "options") if k not in data]
        if missing:
            raise ValueError(f"path: {path} lacks the LayerReport keys {missing}")
        return cls(**{k: v for k, v in data.items() if k in _SERIALIZED})

    # -----------------------------------------------------------------------------------------
    # Text and plots
    # -----------------------------------------------------------------------------------------

    def table(self) -> str:
        """Plain-text summary: per-layer entropies and every method's selections."""
        lines = [
            f"model: {self.model}  (N={self.num_hidden_layers} blocks; h_0..h_{self.num_hidden_layers}, "
            "input-to-layer indices)",
            f"tokens: {self.tokens.get('kept')} kept of {self.tokens.get('candidates')} "
            f"({100 * self.tokens.get('kept_fraction', 0):.1f}%, min_token_entropy="
            f"{self.options['min_token_entropy']} nats)",
        ]
        variance = self.entropy_variance
        if "reduction" in variance:
            change = variance["reduction"]
            effect = f"the filter cut it by {100 * change:.1f}%" if change > 0 else \
                f"the filter raised it by {-100 * change:.1f}%" if change < 0 else "the filter left it unchanged"
            lines.append(
                f"cross-prompt variance of layer entropy: {variance['unfiltered']:.4g} without the token filter, "
                f"{variance['filtered']:.4g} with it: {effect}"
            )
        if self.memory:
            gram_tokens = self.options["gram_tokens"]
            lines.append(
                f"prompt-mode store: {self.memory['gram_store_bytes'] / 2**20:.1f} MiB on disk for "
                f"{self.prompts.get('in_prompt_mode')} prompts ("
                f"{'all kept tokens' if gram_tokens is None else f'<= {gram_tokens} tokens each'}"
                f"{_store_bound(self.options)}, "
                f"{self.options['gram_dtype']}), {self.memory.get('prompt_statistics_bytes', 0) / 2**20:.1f} MiB "
                f"in RAM; accumulators {self.memory['accumulator_bytes'] / 2**20:.1f} MiB"
            )
        if "sets_screened" in self.timing:
            lines.append(
                f"set searches: {self.timing['sets_screened']} candidate sets screened on prompt samples "
                f"(Renyi-2 control variates, z={self.options['screen_z']}), {self.timing['sets_evaluated_exactly']} "
                f"evaluated on every prompt; {self.timing['prompt_set_eigensolves']} (set, prompt) eigensolves"
            )
        lines.append("")
        lines.append(f"{'layer':>5}  {'H prompt (mean±std)':>20}  {'H dataset':>9}  {'H2 dataset':>10}  compartment")
        compartment_of = {l: i for i, (a, b) in enumerate(self.compartments) for l in range(a, b + 1)}
        for entry in self.layers:
            index = entry["index"]
            lines.append(
                f"{index:>5}  {entry['entropy_prompt_mean']:>11.3f} ± {entry['entropy_prompt_std']:<6.3f}  "
                f"{entry['entropy_dataset']:>9.3f}  {entry.get('renyi2_dataset', float('nan')):>10.3f}  "
                f"{compartment_of.get(index, '')}"
            )
        lines.append("")
        lines.append(f"{'method':<12} {'m':>2}  {'layers':<16} {'H(concat)':>9}  {'search':<10}  greedy-path gains")
        for method in METHODS:
            for m, layers in sorted(self.selections.get(method, {}).items(), key=lambda kv: int(kv[0])):
                value = self.set_values.get(method, {}).get(m)
                gains = self.greedy_gains.get(method, {}).get(m)
                search = self.search.get(method, {}).get(m, "rule")
                lines.append(
                    f"{method:<12} {m:>2}  {str(layers):<16} {'' if value is None else f'{value:9.3f}':>9}  "
                    f"{search:<10}  {'' if gains is None else ' '.join(f'{g:+.3f}' for g in gains)}"
                )
        if any(self.greedy_gains.values()):
            lines.append("greedy-path gains: f gained at each step of the greedy search; an exhaustive search returns "
                         "the exact optimum, which can differ from that path")
        return "\n".join(lines)

    def plot(self, out_dir: str) -> list[str]:
        """Save entropy.png, cka.png and pair_gain.png in out_dir; returns their paths."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import TwoSlopeNorm

        os.makedirs(out_dir, exist_ok=True)
        paths = [_save(self._plot_entropy(plt), out_dir, "entropy.png")]

        fig, ax = plt.subplots(figsize=(4.6, 4), dpi=90)
        image = ax.imshow(np.asarray(self.cka), cmap="viridis", vmin=0, vmax=1, origin="upper")
        for boundary in self.boundaries:
            ax.axhline(boundary - 0.5, color="white", lw=1.5)
            ax.axvline(boundary - 0.5, color="white", lw=1.5)
        _layer_ticks(ax, self.num_layers, "xy")
        ax.set_xlabel("layer")
        ax.set_ylabel("layer")
        ax.set_title("linear CKA (lines: compartment boundaries)", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046)
        fig.tight_layout()
        paths.append(_save(fig, out_dir, "cka.png"))

        if self.pair_gain:
            gain = np.asarray(self.pair_gain)
            # Diverging around 0: a loss (red) and a gain (blue) never share a color.
            bound = max(float(np.abs(gain).max()), 1e-12)
            fig, ax = plt.subplots(figsize=(4.6, 4), dpi=90)
            image = ax.imshow(gain, cmap="RdBu", norm=TwoSlopeNorm(0.0, -bound, bound), origin="upper")
            _layer_ticks(ax, self.num_layers, "xy")
            ax.set_xlabel("added layer b")
            ax.set_ylabel("first layer a")
            ax.set_title("pair gain H2({a,b}) - H2({a}) (Renyi-2, nats)", fontsize=9)
            fig.colorbar(image, ax=ax, fraction=0.046, label="nats (red: loss, blue: gain)")
            fig.tight_layout()
            paths.append(_save(fig, out_dir, "pair_gain.png"))
        return paths

    def _plot_entropy(self, plt):
        """Prompt-mode and dataset-mode entropy in two panels (two scales, never one axis shared),
        and below them the chosen layers, one row per method, so no marker hides another."""
        mean = np.array([e["entropy_prompt_mean"] for e in self.layers])
        std = np.array([e["entropy_prompt_std"] for e in self.layers])
        dataset = np.array([e["entropy_dataset"] for e in self.layers])
        m = self._default_m()
        rows = [(f"ELSI m={size}", self.selections.get("elsi", {}).get(str(size)), "*", "C3")
                for size in sorted({int(k) for k in self.selections.get("elsi", {})})]
        rows.append((f"ELSI-C m={m}", self.selections.get("elsi-c", {}).get(str(m)), "D", "C4"))
        rows.append(("EAGLE3 rule", self.selections.get("eagle3", {}).get("3"), "v", "C2"))
        rows = [row for row in rows if row[1]]

        fig, (top, middle, bottom) = plt.subplots(
            3, 1, sharex=True, figsize=(6.4, 5.2), dpi=90,
            gridspec_kw={"height_ratios": [3, 2, 0.35 * max(1, len(rows)) + 0.3]},
        )
        # The band is the standard error of the mean over prompts: the cross-prompt std (in the
        # table) is several times the differences between layers and would flatten the curve.
        prompts = self.entropy_variance.get("filtered_prompts") or self.prompts.get("in_prompt_mode") or 1
        sem = std / np.sqrt(prompts)
        _plot_over_depth(top, mean, "o-", "C0", sem)
        top.set_ylabel(f"prompt mode (nats)\nmean ± s.e. over {prompts} prompts", fontsize=8)
        _plot_over_depth(middle, dataset, "s-", "C1")
        middle.set_ylabel("dataset mode (nats)\nall kept tokens pooled", fontsize=8)
        for row, (label, chosen, marker, color) in enumerate(rows):
            bottom.scatter(sorted(set(chosen)), [row] * len(set(chosen)), marker=marker, s=70, color=color, zorder=3)
        bottom.set_yticks(range(len(rows)), [label for label, *_ in rows], fontsize=7)
        bottom.set_ylim(len(rows) - 0.5, -0.5)
        bottom.grid(axis="x", alpha=0.3)
        _layer_ticks(bottom, self.num_layers, "x")
        bottom.set_xlabel("layer l (h_0 = embeddings, h_l = input of block l)")
        for ax in (top, middle):
            ax.grid(alpha=0.3)
        name = os.path.basename(self.model.rstrip("/")) or self.model
        top.set_title(f"{name}: matrix entropy over depth and chosen layers", fontsize=9)
        fig.align_ylabels()
        fig.tight_layout(h_pad=0.4)
        return fig

def _layer_stride(num_layers: int) -> int:
    """Tick stride that keeps about 12 labels or fewer, on a round step (1, 2, 5, 10, ...)."""
    for stride in (1, 2, 5, 10, 20, 50, 100):
        if num_layers / stride <= 12:
            return stride
    return -(-num_layers // 12)


def _layer_ticks(ax, num_layers: int, axes: str) -> None:
    """Integer layer ticks 0, s, 2s, ... (and the last layer) on the named axes, so labels of a
    30-block model neither overlap nor fall between layers."""
    stride = _layer_stride(num_layers)
    ticks = list(range(0, num_layers, stride))
    if num_layers - 1 - ticks[-1] >= max(2, stride // 2):
        ticks.append(num_layers - 1)
    if "x" in axes:
        ax.set_xticks(ticks)
        ax.set_xticks(range(num_layers), minor=True)
    if "y" in axes:
        ax.set_yticks(ticks)
        ax.set_yticks(range(num_layers), minor=True)


def _plot_over_depth(ax, values: np.ndarray, style: str, color: str, band: np.ndarray | None = None) -> None:
    """values[l] over l = 0..N, with an optional +-band. When h_0 (the embeddings) lies far outside
    the range of h_1..h_N, the y-range comes from h_1..h_N and h_0 is a marker at the edge with its
    value, so the outlier does not flatten the curve."""
    index = np.arange(len(values))
    low, high = (values, values) if band is None else (values - band, values + band)
    lo, hi = float(low[1:].min()), float(high[1:].max())
    span = max(hi - lo, 1e-9)
    start = 1 if len(values) >= 3 and not lo - span <= values[0] <= hi + span else 0
    ax.plot(index[start:], values[start:], style, color=color)
    if band is not None:
        ax.fill_between(index[start:], low[start:], high[start:], color=color, alpha=0.25)
    if start:
        pad = 0.15 * span
        ax.set_ylim(lo - pad, hi + pad)
        above = values[0] > hi
        edge = hi + pad if above else lo - pad
        ax.plot([0], [edge], marker="^" if above else "v", color=color, clip_on=False, zorder=4)
        ax.annotate(f"h_0 = {values[0]:.2f}\n(off scale)", (0, edge), xytext=(6, -20 if above else 4),
                    textcoords="offset points", fontsize=7)


def _save(fig, out_dir: str, name: str) -> str:
    import matplotlib.pyplot as plt

    path = os.path.join(out_dir, name)
    fig.savefig(path)
    plt.close(fig)
    return path


def _plain(value: Any) -> Any:
    """JSON-ready copy: tuples to lists, numpy scalars and arrays to Python."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _store_bound(options: dict[str, Any]) -> str:
    """', within the 1 GiB bound' when the store was bounded (`AnalyzeOptions.max_store_bytes`)."""
    bound = options.get("max_store_bytes")
    return "" if bound is None else f", within the {bound / 2**30:.3g} GiB bound"
