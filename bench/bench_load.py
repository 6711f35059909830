"""The README's main job and worked example, without and with a synthetic CPU load, as a user runs them.

    flock /tmp/elsi-bench.lock .venv/bin/python -m bench.bench_load [--hogs 10] [--skip-demo] [--modes ...]

Jobs (each a fresh `elsi-fast` process with the CLI's default thread choice):
- "demo": `elsi-fast demo` on an empty target cache (trains the demo target, then analyzes it);
- "worked_example": `elsi-fast analyze` of stories260K on the 480 Spec-Bench prompts;
- "cpu_reference": a one-thread pure-Python loop of fixed work: the share of a core the scheduler
  gives one thread in each condition, the bound for any single-threaded job.
Conditions (`--conditions`):
- "no_added_load": the machine as it is, other tenants included, after waiting (`--settle`) for the
  1-minute load average to fall below 0.5 (the load average is recorded);
- "one_tenant": `--hogs` busy processes (a pure CPU loop each, normal priority) in one other
  session, like one other user's `make -j10` or 10-worker job;
- "tenants": the same processes each in its own session, like that many users with one busy
  process each.
Linux schedules sessions as groups (autogroup, on by default in the common distributions' kernels
and on this one): one other tenant leaves the job half the machine however many processes it runs;
ten tenants leave it 2/12 of it. The load starts 30 s before a condition's first job (so that
the 1-minute load average the thread choice reads sees it) and stops after its last.
Thread modes of the worked example (`--modes`; the other jobs run "default" only):
- "default": the CLI's own choice (elsi_fast._infra.threads);
- "all_cores": one thread per available core (`--threads`), idle workers sleeping;
- "spinning": the behavior before the thread choice existed, one thread per core and OpenMP
  workers that spin (OMP_WAIT_POLICY=ACTIVE), stopped at --spin-timeout seconds (a lower bound then).
Target: every job under load within 2x of its time without added load. Rows go to
bench/results/load_cpu.jsonl (metric "<job>_<condition>_<mode>_wall", ratio = this run / the
default mode without added load), with the threads each job chose (read from its progress bar),
its CPU seconds and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_MODES = ("default", "all_cores", "spinning")
_CONDITIONS = ("no_added_load", "one_tenant", "tenants")
_THREADS = re.compile(r"\(threads: (\d+)\)")


_CPU_REFERENCE = "import time\nstart = time.process_time()\nx = 0\nfor i in range(60_000_000):\n    x += i\nprint(time.process_time() - start)"


def _job(name: str, tmp: str, run: int) -> list[str]:
    if name == "cpu_reference":
        return [sys.executable, "-c", _CPU_REFERENCE]
    from bench.common import shared_data

    cli = [sys.executable, "-m", "elsi_fast"]
    if name == "demo":
        return cli + ["demo", "--out", os.path.join(tmp, f"demo-{run}")]
    return cli + ["analyze", "--model", str(shared_data("models", "stories260K", "stories260K.bin")),
                  "--prompts", str(shared_data("prompts", "spec_bench_question.jsonl")),
                  "--out", os.path.join(tmp, f"stories260K-{run}"), "--m", "1", "2", "3"]


def _run(cmd: list[str], env: dict, timeout: float | None) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        finished, stderr = done.returncode == 0, done.stderr
        if not finished:
            print(done.stderr[-2000:], file=sys.stderr)
    except subprocess.TimeoutExpired as exc:
        finished, stderr = False, (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    threads = sorted({int(t) for t in _THREADS.findall(stderr)})
    return {"wall": wall, "cpu_seconds": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "finished": finished, "threads": threads, "load_before": load_before, "load_after": os.getloadavg()[0]}


def _start_hogs(count: int, condition: str) -> list[subprocess.Popen]:
    """`count` busy processes, never in the job's session (hogs there would compete inside its
    scheduling group, which no other user's job does): "tenants" one new session each,
    "one_tenant" all in one new session (children of one launcher). Each returned process leads a
    process group that `_stop_hogs` kills whole."""
    busy = "while True: pass"
    if condition == "tenants":
        return [subprocess.Popen([sys.executable, "-c", busy], start_new_session=True) for _ in range(count)]
    launcher = (f"import subprocess, sys\nbusy = [subprocess.Popen([sys.executable, '-c', {busy!r}]) for _ in range({count})]\n"
                "for process in busy:\n    process.wait()")
    return [subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True)]


def _stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        try:
            os.killpg(hog.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for hog in hogs:
        hog.wait()


def _wait_for_quiet(limit: float) -> None:
    deadline = time.monotonic() + limit
    while os.getloadavg()[0] >= 0.5 and time.monotonic() < deadline:
        time.sleep(5)
    print(f"1-minute load average {os.getloadavg()[0]:.2f} at the start", flush=True)


def _record(job: str, condition: str, mode: str, result: dict, reference: dict | None, hogs: int) -> None:
    """One row per run, written as soon as it ends (a long run cut short keeps the finished rows)."""
    from bench.common import cpu_model, record

    ratio = result["wall"] / reference["wall"] if reference and reference is not result else None
    record("load_cpu", "load", f"{job}_{condition}_{mode}_wall", result["wall"], "s",
           device=f"{cpu_model()} ({os.cpu_count()} cores)",
           baseline=reference["wall"] if ratio is not None else None, ratio=ratio,
           params={"condition": condition, "hogs": 0 if condition == "no_added_load" else hogs,
                   "threads": result["threads"],
                   "finished": result["finished"], "cpu_seconds": result["cpu_seconds"],
                   "load_average_before": result["load_before"], "load_average_after": result["load_after"],
                   "omp_wait_policy": "ACTIVE" if mode == "spinning" else "PASSIVE",
                   "thread_choice": "one thread (pure Python)" if job == "cpu_reference" else
                   "CLI default" if mode == "default" else "--threads (all available cores)",
                   "command": " ".join(_job(job, "TMP", 0)[1:])})
    if ratio is not None:
        print(f"{job} {condition} {mode}: {ratio:.2f}x the default without added load", flush=True)


def main() -> None:
    from elsi_fast._infra.threads import available_cores

    # A SIGTERM (timeout, kill) unwinds through `finally`, which stops the load processes.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hogs", type=int, default=10, help="busy processes of the synthetic load (default 10)")
    parser.add_argument("--conditions", nargs="+", choices=_CONDITIONS, default=list(_CONDITIONS),
                        help="load conditions (default: all; no_added_load always runs first)")
    parser.add_argument("--skip-demo", action="store_true", help="only the worked example and the CPU reference")
    parser.add_argument("--demo-conditions", nargs="+", choices=_CONDITIONS, default=["no_added_load", "one_tenant"],
                        help="conditions the demo runs in (default: no_added_load one_tenant; under 'tenants' it "
                        "takes about 6x its idle time, like any job that needs a core)")
    parser.add_argument("--settle", type=float, default=300.0,
                        help="seconds to wait at most for the 1-minute load average to fall below 0.5 before "
                        "the runs without added load, so that they and the thread choice see the machine at rest "
                        "(default 300)")
    parser.add_argument("--spin-timeout", type=float, default=150.0,
                        help="seconds allowed to the spinning mode (default 150)")
    parser.add_argument("--modes", nargs="+", choices=_MODES, default=["default"],
                        help="thread modes of the worked example (default: default)")
    args = parser.parse_args()
    modes = ["default", *[m for m in args.modes if m != "default"]]
    conditions = ["no_added_load", *[c for c in args.conditions if c != "no_added_load"]]
    runs = []
    for condition in conditions:
        runs.append((condition, "cpu_reference", "default"))
        runs += [(condition, "worked_example", mode) for mode in modes]
        if not args.skip_demo and condition in args.demo_conditions:
            runs.append((condition, "demo", "default"))
    base_env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    results: dict[tuple[str, str, str], dict] = {}
    _wait_for_quiet(args.settle)
    with tempfile.TemporaryDirectory() as tmp:
        hogs: list[subprocess.Popen] = []
        loaded = "no_added_load"
        try:
            for run, (condition, job, mode) in enumerate(runs):
                if condition != loaded:
                    _stop_hogs(hogs)
                    hogs = _start_hogs(args.hogs, condition)
                    loaded = condition
                    time.sleep(30)  # let the 1-minute load average see them, as it would see real tenants
                env = {**base_env, "ELSI_FAST_CACHE": os.path.join(tmp, f"cache-{run}")}
                cmd = _job(job, tmp, run)
                timeout = None
                if mode != "default":
                    cmd += ["--threads", str(available_cores())]
                if mode == "spinning":
                    env["OMP_WAIT_POLICY"] = "ACTIVE"
                    timeout = args.spin_timeout
                result = _run(cmd, env, timeout)
                results[(condition, job, mode)] = result
                _record(job, condition, mode, result, results.get(("no_added_load", job, "default")), args.hogs)
                print(f"{job:<15} {condition:<14} {mode:<10} wall {result['wall']:7.1f}s cpu {result['cpu_seconds']:7.1f}s "
                      f"threads {result['threads']} load {result['load_before']:.1f}->{result['load_after']:.1f}"
                      + ("" if result["finished"] else " (did not finish)"), flush=True)
        finally:
            _stop_hogs(hogs)


if __name__ == "__main__":
    main()
