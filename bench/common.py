"""Shared benchmark plumbing: timing with device sync, and the results-file writer.

Every result is one JSON object a line in bench/results/<file>.jsonl with the keys
benchmark, device, date, commit, metric, value, unit, baseline, ratio, params.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import time
from typing import Any, Callable

import torch

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def device_name(device: torch.device | str = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def git_commit() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=os.path.dirname(RESULTS_DIR), text=True,
            stderr=subprocess.DEVNULL,
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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
