"""Wall and CPU time of `elsi-fast demo --train-drafts`: a first run on an empty cache, then a cached run.

    .venv/bin/python -m bench.e2e.time_demo [--threads N]

Rows go to bench/results/e2e_cpu.jsonl (benchmark "demo_time"). The CPU time (user + system of
the demo process) is reported beside the wall time because on a shared machine the wall time
mostly measures the other tenants.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time


def _run(cmd: list[str], env: dict) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    from bench.common import device_name, record

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for the demo (default: unset)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "ELSI_FAST_CACHE": os.path.join(tmp, "cache")}
        if args.threads:
            env["OMP_NUM_THREADS"] = str(args.threads)
        cmd = [sys.executable, "-m", "elsi_fast", "demo", "--out", os.path.join(tmp, "demo"), "--train-drafts",
               "--no-progress"]
        # device_name reports this process's torch threads; the demo runs with its own setting.
        device = device_name("cpu").split(" (")[0] + f" (demo with OMP_NUM_THREADS={args.threads or 'unset'})"
        for label in ("first_run", "cached_run"):
            wall, cpu = _run(cmd, env)
            record("e2e_cpu", "demo_time", f"{label}_wall", wall, "s", device=device,
                   params={"cpu_seconds": cpu, "load_average": os.getloadavg()})
            print(f"{label}: wall {wall:.0f}s, cpu {cpu:.0f}s, load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
