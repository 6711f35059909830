"""Thread choice: cores from affinity and cgroup quota, minus the share others keep busy."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from elsi_fast._infra import threads


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A fake machine: `set(cores, cpus, load, quota)` sets affinity, machine cores, load, cgroup."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu_max = tmp_path / "cpu.max"
    monkeypatch.setattr(threads, "_CGROUP_V2", str(cpu_max))
    monkeypatch.setattr(threads, "_CGROUP_V1", (str(tmp_path / "none"), str(tmp_path / "none")))

    def set_machine(cores: int, cpus: int, load: float, quota: str = "max 100000") -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: cpus)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
        monkeypatch.setattr(threads, "busy_cores_now", lambda: load)  # the cores others keep busy now
        cpu_max.write_text(quota + "\n")

    return set_machine


@pytest.mark.parametrize(
    "cores, cpus, load, quota, expected",
    [
        (2, 2, 0.1, "max 100000", 2),   # idle 2-core machine: both cores
        (2, 2, 11.0, "max 100000", 1),  # load 11 on 2 cores: one thread, never more than the free cores
        (2, 2, 1.0, "max 100000", 1),   # one core busy
        (8, 64, 16.0, "max 100000", 6),  # 8 of 64 cores, a quarter of the machine busy
        (8, 8, 0.0, "300000 100000", 3),  # cgroup quota of 3 CPUs caps the affinity
        (8, 8, 0.0, "150000 100000", 1),  # 1.5 CPUs: 1 thread (never oversubscribe the quota)
    ],
)
def test_default_threads(machine, cores, cpus, load, quota, expected):
    machine(cores, cpus, load, quota)
    assert threads.default_threads() == expected


def test_busy_cores_now_counts_other_processes_not_this_one(monkeypatch):
    """/proc/stat ticks over the window, less this process's own: 2 cores, 10 ticks each, of which
    12 busy, 5 of them this process's -> 0.7 cores busy elsewhere."""
    machine = iter([(100, 1000), (112, 1020)])
    own = iter([40, 45])
    monkeypatch.setattr(threads, "_cpu_jiffies", lambda: next(machine))
    monkeypatch.setattr(threads, "_own_jiffies", lambda: next(own))
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert threads.busy_cores_now() == pytest.approx(0.7)


def test_a_recent_load_average_does_not_cost_threads_on_an_idle_machine(machine, monkeypatch):
    machine(2, 2, 0.0)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.5, 1.0))  # the set-up command a moment ago
    assert threads.default_threads() == 2
    monkeypatch.setattr(threads, "busy_cores_now", lambda: None)  # off Linux: the load average
    assert threads.default_threads() == 1


def test_omp_num_threads_wins(machine, monkeypatch):
    machine(8, 8, 0.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.default_threads() == 3


def test_configure_before_torch_sets_passive_wait_and_the_count():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    probe = ("import os, sys; from elsi_fast._infra.threads import configure; assert 'torch' not in sys.modules; "
             "n = configure(2); import torch; print(n, torch.get_num_threads(), os.environ['OMP_WAIT_POLICY'])")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2", "2", "PASSIVE"]


def test_configure_rejects_zero():
    with pytest.raises(ValueError, match="--threads"):
        threads.configure(0)


@pytest.mark.parametrize("others_busy, limit, expected", [(0.0, None, 2), (1.0, None, 1), (2.0, None, 1),
                                                          (0.0, 1, 1), (0.4, None, 2), (0.6, None, 1)])
def test_free_cores_measures_others_from_the_first_call(machine, monkeypatch, others_busy, limit, expected):
    """Others' busy cores come from /proc/stat ticks minus this process's own, from the first call on:
    the 1-minute load average (here 2.0: this process and the last minute's work) is no guide."""
    machine(2, 2, load=2.0)
    ticks = {"busy": 1000, "total": 5000, "own": 300}
    monkeypatch.setattr(threads, "_cpu_jiffies", lambda: (ticks["busy"], ticks["total"]))
    monkeypatch.setattr(threads, "_own_jiffies", lambda: ticks["own"])
    team = threads.FreeCores(limit=limit, first_window=0.01)
    # 100 ticks per core pass: this process runs 50 of them, others `others_busy` cores' worth
    ticks.update(busy=ticks["busy"] + 50 + round(100 * others_busy), total=ticks["total"] + 200, own=ticks["own"] + 50)
    assert team() == expected
    assert team() == expected  # within the interval: the same answer, nothing sampled


def test_free_cores_off_linux_falls_back_to_the_load_average(machine, monkeypatch):
    machine(2, 2, load=1.0)
    monkeypatch.setattr(threads, "_cpu_jiffies", lambda: None)
    assert threads.FreeCores()() == 1
