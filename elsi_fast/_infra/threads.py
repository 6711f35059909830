"""How many CPU threads a run uses, chosen from the cores this process may actually use.

torch's default is one thread per core of the machine, and its OpenMP workers spin-wait between
parallel regions. On a machine shared with other jobs that combination collapses: spinning workers
hold cores that the thread they wait for needs, and every barrier waits for the most-preempted
thread (10-200x slower at load 11-24 on 2 cores). So the CLI

- counts the cores available to the process (CPU affinity and the cgroup CPU quota, not the
  machine's core count),
- leaves out the share of them other processes keep busy (the 1-minute load average), so it does
  not add more runnable threads than there are free cores,
- makes idle OpenMP workers sleep instead of spin (OMP_WAIT_POLICY=PASSIVE), which must be set
  before torch loads its OpenMP runtime; the native decode step's own thread team follows
  torch.get_num_threads() and sleeps when a barrier waits longer than 500 us
  (csrc/draft_decode_cpu.cpp, Team).

This module imports nothing heavy: the CLI calls `configure` before it imports torch.
"""

from __future__ import annotations

import math
import os
import sys
import time

_CGROUP_V2 = "/sys/fs/cgroup/cpu.max"
_CGROUP_V1 = ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")


def _cgroup_cpus() -> float | None:
    """CPUs allowed by the cgroup CPU quota (containers, Slurm), or None when unlimited."""
    try:
        with open(_CGROUP_V2) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(_CGROUP_V1[0]) as f:
            quota = int(f.read())
        with open(_CGROUP_V1[1]) as f:
            period = int(f.read())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by the cgroup quota (at least 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    quota = _cgroup_cpus()
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return max(1, cores)


def busy_cores_now(window: float = 0.1) -> float | None:
    """Machine cores other processes keep busy over the next `window` seconds (/proc/stat less
    this process's own time); None off Linux."""
    before, own_before = _cpu_jiffies(), _own_jiffies()
    if before is None or own_before is None:
        return None
    time.sleep(window)
    after, own_after = _cpu_jiffies(), _own_jiffies()
    span = (after[1] - before[1]) / (os.cpu_count() or 1)  # ticks per core in the window
    if span <= 0:
        return None
    return max(0.0, (after[0] - before[0] - (own_after - own_before)) / span)


def busy_fraction() -> float:
    """Share of the machine other processes keep busy now, in [0, 1]: measured over 0.1 s
    (`busy_cores_now`), not from the 1-minute load average, which still counts the minute before:
    right after the README's set-up command (pip and the compiler) it gave an idle 2-core machine
    1 thread. Off Linux, the load average."""
    busy = busy_cores_now()
    if busy is None:
        try:
            busy = os.getloadavg()[0]
        except (AttributeError, OSError):
            return 0.0
    return min(1.0, max(0.0, busy / (os.cpu_count() or 1)))


def default_threads() -> int:
    """Threads for a run: the available cores not kept busy by others, at least 1.

    OMP_NUM_THREADS, when set, wins (the user's process-wide choice)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    cores = available_cores()
    return max(1, min(cores, round(cores * (1.0 - busy_fraction()))))


def configure(threads: int | None = None) -> int:
    """Set this process's thread count (`threads`, else `default_threads()`); returns it.

    Call before the first `import torch` where possible: only then does OMP_WAIT_POLICY reach
    the OpenMP runtime. A user's own OMP_WAIT_POLICY is kept.
    """
    if threads is not None and threads < 1:
        raise ValueError(f"--threads: must be >= 1, got {threads}")
    count = default_threads() if threads is None else threads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "torch" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = str(count)
    import torch

    torch.set_num_threads(count)
    return count


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) clock ticks of all CPUs since boot, from /proc/stat (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def _own_jiffies() -> int | None:
    """Clock ticks this process has run (user + system, all its threads)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) + int(fields[12])


class FreeCores:
    """The cores other processes leave free right now, for a thread team that must not wait on a
    descheduled member.

    A fork-join step with a barrier per phase runs at the pace of its slowest thread: when another
    process keeps one of two cores busy, a 2-thread native draft step took 4-7x its idle time while
    one thread was unaffected (docs/method.md section 5). The 1-minute load average reacts too late
    for that; this samples /proc/stat and this process's own CPU time at most every `interval`
    seconds and returns the available cores minus the cores others kept busy over the last
    interval (at least 1). The first call measures too: over the time since construction, waiting
    until `first_window` seconds have passed (once). Off Linux it returns `default_threads()`.
    """

    def __init__(self, interval: float = 0.5, limit: int | None = None, first_window: float = 0.05):
        self.interval = interval
        self.limit = limit
        self.first_window = first_window
        estimate = default_threads()  # measured over 0.1 s: once
        self._free = min(estimate, limit or estimate)  # off Linux: the only estimate
        self._measured = False
        self._last = self._sample()

    @staticmethod
    def _sample() -> tuple[float, int, int, int] | None:
        cpu, own = _cpu_jiffies(), _own_jiffies()
        return None if cpu is None or own is None else (time.monotonic(), cpu[0], cpu[1], own)

    def __call__(self) -> int:
        if self._last is None:
            return self._free
        elapsed = time.monotonic() - self._last[0]
        if self._measured and elapsed < self.interval:
            return self._free
        if not self._measured and elapsed < self.first_window:
            # The first answer is measured too, not the 1-minute load average's guess: that average
            # counts this process itself and the last minute's work, and on an idle 2-core machine
            # it gave a fresh team 1 thread where 2 were 1.3-1.6x faster (docs/performance.md).
            time.sleep(self.first_window - elapsed)
        sample = self._sample()
        if sample is None:
            return self._free
        _, busy, total, mine = self._last
        cores = os.cpu_count() or 1
        span = (sample[2] - total) / cores  # ticks per core in the interval
        if span > 0:
            others = max(0.0, (sample[1] - busy - (sample[3] - mine)) / span)
            free = available_cores() - round(others)
            self._free = max(1, min(free, self.limit or free))
            self._measured = True
        self._last = sample
        return self._free
