"""The inference engine's threads: sized from what the process may run at once (its CPU affinity, its cgroup CPU
quota, v2 and v1, read from files laid out here as the kernel lays them out), never raised, left alone where the user
chose them, said once in the log (modeling_bert_impl/inference/threads.py); a thread's OpenMP threads freed."""

import subprocess
import sys

import pytest
import torch
import transformers
from transformers.testing_utils import CaptureLogger

import modeling_bert_impl as bi
from helpers import SMALL
from modeling_bert_impl.inference import threads


def write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_cgroup_quota_v2_is_the_smallest_on_the_way_to_the_root(tmp_path):
    """cgroup v2: the process's cgroup `cpu.max` and its ancestors' ("max" for none); quota / period; None without."""
    write(tmp_path / "self", "0::/pods/pod1/app\n")
    write(tmp_path / "root/pods/pod1/app/cpu.max", "max 100000\n")
    write(tmp_path / "root/pods/pod1/cpu.max", "150000 100000\n")
    write(tmp_path / "root/pods/cpu.max", "400000 100000\n")
    assert threads.cgroup_cpu_quota(str(tmp_path / "self"), str(tmp_path / "root")) == 1.5
    write(tmp_path / "root/pods/pod1/cpu.max", "max 100000\n")
    write(tmp_path / "root/pods/cpu.max", "max\n")
    assert threads.cgroup_cpu_quota(str(tmp_path / "self"), str(tmp_path / "root")) is None
    assert threads.cgroup_cpu_quota(str(tmp_path / "missing"), str(tmp_path / "root")) is None


def test_the_cgroup_quota_v1_reads_the_cpu_controller(tmp_path):
    """cgroup v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us` in the cpu controller's hierarchy (-1: none)."""
    write(tmp_path / "self", "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n")
    write(tmp_path / "root/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "50000\n")
    write(tmp_path / "root/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(tmp_path / "root/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(tmp_path / "root/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert threads.cgroup_cpu_quota(str(tmp_path / "self"), str(tmp_path / "root")) == 0.5


def test_usable_cpus_from_affinity_and_quota():
    assert threads.usable_cpus({0, 1, 2, 3}, None) == 4
    assert threads.usable_cpus({0, 1, 2, 3}, 1.5) == 2  # a quota rounds up: 1.5 CPUs keep two threads busy
    assert threads.usable_cpus({5}, 8.0) == 1
    assert threads.usable_cpus({0, 1}, 0.25) == 1


def test_an_engine_lowers_the_threads_to_the_usable_cpus_and_says_so_once(torch_threads, monkeypatch):
    """With more torch threads than the process may run at once (a faked affinity of one CPU), making an inference
    model lowers them and says so, once; fewer are never raised; with OMP_NUM_THREADS set they are the user's."""
    model = bi.BertImplModel(bi.BertImplConfig(**SMALL)).eval()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 1)
    logger = transformers.logging.get_logger(threads.__name__)
    logger.warning_once.cache_clear()
    torch.set_num_threads(2)
    with CaptureLogger(logger) as said:
        bi.optimize_for_inference(model)
        torch.set_num_threads(2)
        bi.optimize_for_inference(model)
    assert torch.get_num_threads() == 1
    assert said.out.count("may run 1 at once") == 1 and "OMP_NUM_THREADS" in said.out
    monkeypatch.setattr(threads, "usable_cpus", lambda: 4)
    bi.optimize_for_inference(model)
    assert torch.get_num_threads() == 1  # never raised
    monkeypatch.setattr(threads, "usable_cpus", lambda: 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    bi.optimize_for_inference(model)
    assert torch.get_num_threads() == 2  # the user's


def test_single_queries_take_one_thread_while_the_cores_are_contended(torch_threads):
    """QueryThreads on a scripted clock: quiet calls stay at full threads; a single slow call (a hiccup) changes
    nothing; two calls in a row 1.5x slower than the fastest start one-thread calls, with a full-thread probe after 4,
    8, 16 and then every 32 of them; a probe faster than the last one-thread call ends the spell; one thread
    throughout where torch has one."""
    torch.set_num_threads(2)
    now = [0.0]
    governor = threads.QueryThreads(clock=lambda: now[0])

    def call(full_seconds: float, one_seconds: float = 1.5) -> int:
        def run():  # the program: its time depends on the threads it runs with
            now[0] += full_seconds if torch.get_num_threads() == 2 else one_seconds
            return torch.get_num_threads()
        return governor(16, run)

    assert [call(1.0) for _ in range(4)] == [2, 2, 2, 2]  # quiet: fastest 1.0
    assert [call(1.6), call(1.0)] == [2, 2]  # one slow call, then a fast one: no spell
    assert [call(2.5), call(2.5)] == [2, 2]  # a neighbour arrives: two slow calls in a row start the spell
    spell = [call(2.5) for _ in range(4 + 1 + 8 + 1 + 16 + 1)]  # probes at full threads, slower than one thread
    assert spell == [1] * 4 + [2] + [1] * 8 + [2] + [1] * 16 + [2]
    assert torch.get_num_threads() == 2  # put back after each one-thread call
    assert [call(1.1) for _ in range(33)] == [1] * 32 + [2]  # the neighbour left: the next probe beats one thread
    assert [call(1.0) for _ in range(3)] == [2, 2, 2]  # the spell ended
    torch.set_num_threads(1)
    assert [call(5.0) for _ in range(4)] == [1, 1, 1, 1]


FREE_POOL = """
import os, time, torch
from modeling_bert_impl.inference import free_thread_pool
torch.set_num_threads(2)
x = torch.randn(512, 512)
def threads():
    return len(os.listdir("/proc/self/task"))
def settled(count):  # a pool's threads end a moment after they are told to
    deadline = time.monotonic() + 10
    while threads() != count and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()
alone = threads()
expected = x @ x  # a parallel region: this thread's pool starts
with_pool = threads()
freed = free_thread_pool()
after = settled(alone)
again = x @ x  # the next region makes a new pool
import ctypes
paths = {line.split()[-1] for line in open("/proc/self/maps") if "/libgomp" in line}
pausable = any(hasattr(ctypes.CDLL(path), "omp_pause_resource_all") for path in paths)
print(alone, with_pool, freed, after, threads(), torch.equal(again, expected), bool(paths), pausable)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="counts a process's threads in /proc")
def test_free_thread_pool_ends_this_threads_openmp_threads():
    """In a process of its own: a parallel region starts the calling thread's OpenMP threads; `free_thread_pool` ends
    them (libgomp, torch's OpenMP on Linux), and the next region starts them again with the same answer. Skipped where
    the libgomp torch bundles has no omp_pause_resource_all (torch 2.6's, from GCC 8)."""
    done = subprocess.run([sys.executable, "-c", FREE_POOL], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    alone, with_pool, freed, after, again, same, gomp, pausable = done.stdout.split()
    if freed == "False":
        assert pausable == "False", "libgomp has omp_pause_resource_all, and the pool was not freed"
        pytest.skip("torch's OpenMP here is not libgomp" if gomp == "False" else
                    "this torch's libgomp predates OpenMP 5.0's omp_pause_resource_all (GCC 9): nothing to free with")
    assert int(with_pool) > int(alone) and int(after) == int(alone) and int(again) == int(with_pool)
    assert same == "True"
