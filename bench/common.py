"""Shared benchmark plumbing: timing with device sync, the results-file writer, the shared data
folder and the test references the benchmarks time against.

bench/ is a package: run its scripts from the repository root as `python -m bench.<name>`.
Every result is one JSON object a line in bench/results/<file>.jsonl with the keys
benchmark, device, date, commit, metric, value, unit, baseline, ratio, params.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]  # the repository root
RESULTS_DIR = os.path.join(ROOT, "bench", "results")
SHARED_DATA_ENV = "ELSI_FAST_SHARED_DATA"


def shared_data(*parts: str) -> Path:
    """A path in the shared data folder (models, prompts, corpus): $ELSI_FAST_SHARED_DATA, else
    ../shared/data beside the repository root. Raises FileNotFoundError naming the folder when it
    is missing."""
    override = os.environ.get(SHARED_DATA_ENV)
    folder = Path(override) if override else ROOT.parent / "shared" / "data"
    if not folder.is_dir():
        where = (f"${SHARED_DATA_ENV}" if override
                 else f"../shared/data beside {ROOT}; set ${SHARED_DATA_ENV} to another folder")
        raise FileNotFoundError(f"the shared data folder {folder} is missing ({where})")
    return folder.joinpath(*parts)


def tests_module(path: str) -> ModuleType:
    """A helper module of tests/ (`path` relative to it, e.g. "torch_references.py") loaded by its
    path: tests/ is not a package and not on sys.path when a benchmark runs."""
    spec = importlib.util.spec_from_file_location(f"elsi_fast_tests_{Path(path).stem}", ROOT / "tests" / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_model() -> str:
    """The CPU's model name and the SIMD extensions that decide which kernels run, from /proc/cpuinfo.

    Read on every call: a result row must name the machine it was measured on, and sessions move
    between Intel and AMD hosts.
    """
    from elsi_fast._infra._backends import cpu_flags

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        fields = {key.strip(): value.strip() for key, value in fields.items()}
        model = fields.get("model name", model)
        # A virtual machine may name only the brand ("AMD EPYC"): family and model tell the
        # microarchitecture (AMD family 23 is Zen 1-2, 25 is Zen 3-4).
        if not any(ch.isdigit() for ch in model) and "cpu family" in fields:
            model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    except OSError:
        pass
    flags = cpu_flags()
    isa = [name for name, flag in (("avx512", "avx512f"), ("vnni", "avx512_vnni"), ("bf16", "avx512_bf16"),
                                   ("amx", "amx_tile"), ("avx2", "avx2")) if flag in flags]
    return f"{model} [{' '.join(isa) or 'no avx2'}]"


def device_name(device: torch.device | str = "cpu", threads: int | None = None) -> str:
    """'NVIDIA H200' for CUDA; 'AMD EPYC [avx512 vnni bf16 avx2] (2 threads)' for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({threads or torch.get_num_threads()} threads)"


def git_commit() -> str:
    """Short HEAD, with '-dirty' when tracked files differ from it (results then are not HEAD's)."""
    root = os.path.dirname(RESULTS_DIR)
    try:
        head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                       stderr=subprocess.DEVNULL).strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ":(top)", ":(top,exclude)bench/results"],
                               cwd=root, stderr=subprocess.DEVNULL).returncode != 0
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


GNU_TIME = "/usr/bin/time"


def run_peak_rss(cmd: list[str], *, capture: bool = False, **kwargs: Any) -> tuple[subprocess.CompletedProcess, int | None]:
    """`subprocess.run(cmd)` under GNU time: (the finished process, its peak resident set size in bytes,
    None when GNU time wrote no report).

    GNU time's %M, not this process's wait4 or getrusage(RUSAGE_CHILDREN): a child of this process
    keeps at exec the high-water mark of the address space it was forked with (Linux takes the larger
    of the old and the new one), so a parent holding a model would set the floor of every reading.
    With `capture`, stdout and stderr come back as text.
    """
    if not os.access(GNU_TIME, os.X_OK):
        raise FileNotFoundError(f"{GNU_TIME} (GNU time) is missing: apt-get install time")
    with tempfile.NamedTemporaryFile("r") as report:
        done = subprocess.run([GNU_TIME, "-f", "%M", "-o", report.name, *cmd], capture_output=capture, text=True,
                              **kwargs)
        # the last word: a failed command's report starts with "Command exited with non-zero status N"
        words = report.read().split()
    done.args = cmd
    return done, int(words[-1]) * 1024 if words and words[-1].isdigit() else None


def first_per_category(records: list[dict[str, Any]], n: int) -> list[int]:
    """Indices of the first `n` records of every category, in record order: the same prompt subset
    for every engine and draft a benchmark compares."""
    by_category: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_category.setdefault(r["category"], []).append(i)
    return sorted(i for indices in by_category.values() for i in indices[:n])


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, reps: int = 10, device: str | torch.device = "cpu") -> float:
    """Median wall time of `fn()` in seconds; synchronizes CUDA around each call."""
    is_cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if is_cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def record(
    file: str,
    benchmark: str,
    metric: str,
    value: float,
    unit: str,
    *,
    device: str,
    baseline: float | None = None,
    ratio: float | None = None,
    params: dict | None = None,
) -> dict:
    """Append one result to bench/results/<file>.jsonl and return it."""
    row = {
        "benchmark": benchmark,
        "device": device,
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "commit": git_commit(),
        "metric": metric,
        "value": value,
        "unit": unit,
        "baseline": baseline,
        "ratio": ratio,
        "params": params or {},
    }
    out_dir = os.environ.get("ELSI_FAST_RESULTS_DIR", RESULTS_DIR)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{file}.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
    return row
