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
"""

import math
import os

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
