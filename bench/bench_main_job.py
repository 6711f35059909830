"""The README's main job, timed as a new user runs it: `elsi-fast analyze` on SmolLM2 with its defaults.

    python -m bench.bench_main_job [--out runs/main-job]

Runs the README's command in a subprocess (the target already dequantized in the cache, as after
the set-up command's first load) and records its wall time, the pass and selection seconds, the
prompt-mode store and the picks to bench/results/main_job_cpu.jsonl. Issue 34's goal: at most
5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, device_name, record, shared_data

GOAL_SECONDS = 300


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "main-job"))
    parser.add_argument("--note", default="", help="conditions to record (e.g. another job beside)")
    args = parser.parse_args(argv)
    shutil.rmtree(args.out, ignore_errors=True)
    command = [str(Path(sys.executable).with_name("elsi-fast")), "analyze", "--model", "smollm2-135m-instruct",
               "--prompts", str(shared_data("prompts", "spec_bench_question.jsonl")), "--out", args.out,
               "--m", "1", "2", "3", "--no-progress"]
    load = list(os.getloadavg())
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    wall = time.perf_counter() - started
    report = json.loads((Path(args.out) / "report.json").read_text())
    picks = {f"{method} m={m}": layers for method in ("elsi", "elsi-c") for m, layers in report["selections"][method].items()}
    row = record("main_job_cpu", "main_job", "wall_seconds", wall, "s", device=device_name("cpu"),
                 baseline=GOAL_SECONDS, ratio=GOAL_SECONDS / wall,
                 params={"model": "smollm2-135m-instruct", "command": " ".join(command[1:]),
                         "prompts": report["prompts"]["count"], "pass_seconds": report["timing"]["pass_seconds"],
                         "selection_seconds": report["timing"]["selection_seconds"],
                         "store_mib": report["memory"]["gram_store_bytes"] / 2**20, "picks": picks,
                         "threads": os.cpu_count(), "load": load, "baseline_is": "the 5-minute goal",
                         "note": args.note})
    print(f"main job: {wall:.1f} s (goal {GOAL_SECONDS} s); picks {picks}")
    return 0 if row else 1


if __name__ == "__main__":
    raise SystemExit(main())
