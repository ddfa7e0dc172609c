"""How many threads the CPU inference engine's models compute with: as many as the process may run at once, not as
many as the machine has cores.

torch sizes its thread pool from the machine's cores. A process pinned to some of them (its CPU affinity: `taskset`,
Kubernetes' static CPU manager) or held to a CPU quota (its cgroup's `cpu.max`, as `docker run --cpus` and Kubernetes'
CPU limits set it) may run fewer threads at once than that: each parallel region then waits for threads that are not
scheduled, or throttled, and a single query's latency stretches by whole scheduler periods. So the engine's functions
(`optimize_for_inference`, `quantize_for_inference`, `compile_for_inference`) lower torch's threads to
`usable_cpus()` (`size_threads`), and say so once in the log, unless the user chose them (`OMP_NUM_THREADS` or
`MKL_NUM_THREADS` set): they never raise them.

How OpenMP's idle threads wait (spinning on their cores a while after each parallel region, or sleeping) is fixed
when torch loads OpenMP, before any of this runs: docs/cpu-inference.md says how to start a serving process whose
threads sleep.

A single query beside another process that holds one of the cores waits at every parallel region for the thread that
shares its core, and takes several times its quiet time on two threads; on one thread it takes its one-thread time,
quiet or not (benchmarks/NOTES.md, "Single queries beside a busy core"). `QueryThreads` tells the two cases apart by
the calls' own times and runs single queries on one thread while the cores are contended.
"""

import ctypes
import math
import os
import time

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

USER_THREADS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the user chose torch's threads


def usable_cpus(affinity: set[int] | None = None, quota: float | None = None) -> int:
    """The CPUs the process may run on at once: its affinity's (given, or the process's), capped by its cgroup CPU
    quota rounded up (given, or read: `cgroup_cpu_quota`); at least 1."""
    affinity = os.sched_getaffinity(0) if affinity is None and hasattr(os, "sched_getaffinity") else affinity
    cpus = len(affinity) if affinity else os.cpu_count() or 1
    quota = cgroup_cpu_quota() if quota is None else quota
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)


def cgroup_cpu_quota(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs' worth of time the process's cgroup may use (quota / period), the smallest on the way to the root; None
    without a quota. cgroup v2 (`cpu.max`, "max" for none) and v1 (`cpu.cfs_quota_us`, -1 for none)."""
    try:
        with open(proc) as f:
            entries = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    quotas = []
    for _, controllers, path in entries:
        if controllers == "":  # v2: one hierarchy
            quotas += [_v2_quota(os.path.join(root, folder)) for folder in _up_to_root(path)]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
            base = os.path.join(root, controllers)
            quotas += [_v1_quota(os.path.join(base, folder)) for folder in _up_to_root(path)]
    quotas = [q for q in quotas if q is not None]
    return min(quotas) if quotas else None


def _up_to_root(path: str) -> list[str]:
    """A cgroup path and its ancestors, relative to the hierarchy's root ("/a/b" -> ["a/b", "a", ""])."""
    parts = [p for p in path.split("/") if p]
    return ["/".join(parts[:n]) for n in range(len(parts), -1, -1)]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _v2_quota(folder: str) -> float | None:
    value = _read(os.path.join(folder, "cpu.max"))
    if not value or value.split()[0] == "max":
        return None
    quota, *period = value.split()
    return int(quota) / int(period[0] if period else 100000)


def _v1_quota(folder: str) -> float | None:
    quota, period = _read(os.path.join(folder, "cpu.cfs_quota_us")), _read(os.path.join(folder, "cpu.cfs_period_us"))
    if quota is None or period is None or int(quota) <= 0:
        return None
    return int(quota) / int(period)


def size_threads(engine: str) -> None:
    """Lower torch's threads to `usable_cpus()` where they are more and the user chose none (`USER_THREADS`), saying
    so once in the log."""
    if any(os.environ.get(name) for name in USER_THREADS):
        return
    threads, usable = torch.get_num_threads(), usable_cpus()
    if threads > usable:
        torch.set_num_threads(usable)
        logger.warning_once(
            f"{engine}: torch had {threads} threads, and this process may run {usable} at once (its CPU affinity and "
            f"cgroup CPU quota): set to {usable}. Set OMP_NUM_THREADS before starting Python to choose them yourself")


OMP_PAUSE_HARD = 2  # OpenMP 5.0's omp_pause_hard


def free_thread_pool() -> bool:
    """Free the calling thread's OpenMP threads, for a process whose models compute on another thread from now on (a
    server's model streams): call it on the thread that loaded the model. libgomp (torch's OpenMP on Linux) keeps each
    thread's pool of threads until that thread ends, and while it manages more threads than there are CPUs, its idle
    threads spin about 1,000 times after each parallel region instead of about 300,000, and then sleep: every region
    then waits for a thread to wake, and the model worker's batches run at about one thread's speed
    (benchmarks/NOTES.md, "The server's model worker"). True where freed (with libgomp's `omp_pause_resource_all`: the
    next parallel region on this thread makes a new pool); False where no libgomp is loaded (other OpenMP runtimes
    decide how long to spin by other rules) or only one older than OpenMP 5.0's pause (GCC 9: torch 2.6 bundles an
    older one)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/libgomp" in line}
    except OSError:
        return False
    freed = False
    for path in sorted(paths):
        pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        freed = (pause is not None and pause(OMP_PAUSE_HARD) == 0) or freed
    return freed


class QueryThreads:
    """How many threads a call runs with (a compiled program's single queries; a server's batches that run alone):
    the calling thread's torch threads while the cores are free, one while another process holds one of them. Told
    from the calls' own times, per query length (or any size the caller keys them by): after `SLOW_CALLS` calls in a
    row slower than `SLOWER` x the fastest seen at full threads, the calls run on one thread, and now and then one at
    full threads again (after `FIRST_PROBE` calls, then twice as many each time, at most `LAST_PROBE`), which ends the
    one-thread spell where it beats the last one-thread call. A process that starts beside the neighbour takes that
    pace as its fastest and stays at full threads."""

    SLOWER = 1.5
    SLOW_CALLS = 2
    FIRST_PROBE, LAST_PROBE = 4, 32
    LENGTHS = 64  # query lengths whose times are kept (the tables are emptied when full)

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.fastest: dict[int, float] = {}  # query length -> fastest seconds at full threads
        self.one_thread: dict[int, float] = {}  # query length -> the last one-thread call's seconds
        self.slow_calls = 0  # full-thread calls in a row slower than SLOWER x the fastest
        self.spell = False  # single queries on one thread
        self.until_probe = 0  # one-thread calls before the next full-thread one
        self.probe_every = self.FIRST_PROBE

    def __call__(self, length: int, run):
        """run() for a query of `length` tokens, on the threads chosen; its result."""
        threads = torch.get_num_threads()
        one = threads > 1 and self.spell and self.until_probe > 0
        if one:
            torch.set_num_threads(1)
        start = self.clock()
        try:
            result = run()
        finally:
            if one:
                torch.set_num_threads(threads)
        seconds = self.clock() - start
        if one:
            self.until_probe -= 1
            self.keep(self.one_thread, length, seconds)
        elif threads > 1:
            self.full_threads(length, seconds)
        return result

    def full_threads(self, length: int, seconds: float) -> None:
        """A full-thread call's time: the fastest kept; the one-thread spell begun, or (a probe) ended or prolonged."""
        fastest = self.fastest.get(length)
        if fastest is None or seconds < fastest:
            self.keep(self.fastest, length, seconds)
        if self.spell:  # a probe: full threads against the last one-thread call of this length
            if seconds < self.one_thread.get(length, self.SLOWER * (fastest or seconds)):
                self.spell, self.slow_calls = False, 0
            else:
                self.probe_every = min(2 * self.probe_every, self.LAST_PROBE)
                self.until_probe = self.probe_every
            return
        self.slow_calls = self.slow_calls + 1 if fastest is not None and seconds > self.SLOWER * fastest else 0
        if self.slow_calls >= self.SLOW_CALLS:
            self.spell, self.probe_every = True, self.FIRST_PROBE
            self.until_probe = self.probe_every

    def keep(self, table: dict[int, float], length: int, seconds: float) -> None:
        if len(table) >= self.LENGTHS and length not in table:
            table.clear()
        table[length] = seconds
