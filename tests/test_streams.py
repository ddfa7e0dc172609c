"""bert-impl-serve's model streams (modeling_bert_impl/server/batching.py): several stream workers taking batches from
the one queue, each on threads of its own; a batch alone on every stream's threads, and on one while the cores are
contended; each answer its own request's; a failing batch failing its own requests only; stopping drains every stream.
Stand-in models (functions of the batch's ids) here; the real model across streams over HTTP, and the flags, in
test_server.py; the benchmark beside a busy core and under a CPU quota (slow)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from modeling_bert_impl.server.batching import Batcher, stream_plan
from modeling_bert_impl.server.engine import Encoding



def job(value: int, tokens: int = 1) -> list[Encoding]:
    return [Encoding([value] * tokens, [0] * tokens)]


def first_ids(encodings: list[Encoding]) -> torch.Tensor:
    """A stand-in model: each input's first id, its output row."""
    return torch.tensor([e.ids[0] for e in encodings])


def test_stream_plan_from_the_usable_threads_and_the_flags():
    assert stream_plan(2) == (2, 1) and stream_plan(8) == (8, 1) and stream_plan(1) == (1, 1)
    assert stream_plan(8, streams=2) == (2, 4) and stream_plan(8, threads_per_stream=2) == (4, 2)
    assert stream_plan(2, streams=1) == (1, 2)  # one worker on every thread: the server before streams
    assert stream_plan(2, streams=4) == (4, 1) and stream_plan(2, threads_per_stream=4) == (1, 4)  # as given
    assert stream_plan(4, streams=3, threads_per_stream=2) == (3, 2)


def test_requests_queued_for_two_free_streams_run_at_once_each_on_its_own_thread(torch_threads):
    """Work for two free streams is shared between them: both run at once (a barrier both must reach), each on one
    thread; a request alone on an idle server runs on both streams' threads, the other stream waiting for it."""
    both = threading.Barrier(2, timeout=30)
    seen = []

    def run(encodings):
        seen.append((len(encodings), torch.get_num_threads()))
        if encodings[0].ids[0] < 100:
            both.wait()  # fails (BrokenBarrierError) unless the other stream runs its batch meanwhile
        return first_ids(encodings)

    batcher = Batcher(run, 100, None, 100, streams=2, threads_per_stream=1)
    futures = [batcher.submit(job(i, 10)) for i in range(4)]  # queued before the streams start
    batcher.start()
    try:
        assert [f.result(timeout=30).tolist() for f in futures] == [[0], [1], [2], [3]]
        assert sorted(seen) == [(2, 1), (2, 1)]  # two batches of two, one thread each
        seen.clear()
        assert batcher.submit(job(100)).result(timeout=30).tolist() == [100]
        assert seen == [(1, 2)]  # alone: every thread
    finally:
        batcher.stop()


def test_no_stream_idle_while_batches_wait(torch_threads):
    """With every stream's batch held and more requests queued, a stream that finishes takes the next batch at once,
    while the others still hold theirs (no stream waits for the slowest to finish)."""
    gates = {i: threading.Event() for i in range(3)}
    started = []

    def run(encodings):
        value = encodings[0].ids[0]
        started.append(value)
        if value in gates:
            assert gates[value].wait(timeout=30)
        return first_ids(encodings)

    batcher = Batcher(run, 10, None, 100, streams=3, threads_per_stream=1)
    futures = [batcher.submit(job(i, 10)) for i in range(5)]  # a batch each: 10 tokens
    batcher.start()
    try:
        deadline = time.monotonic() + 30
        while len(started) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert sorted(started) == [0, 1, 2] and len(batcher.queue) == 2  # three streams busy, two batches wait
        gates[1].set()
        assert futures[1].result(timeout=30).tolist() == [1]
        assert futures[3].result(timeout=30).tolist() == [3]  # the freed stream took the next at once ...
        assert futures[4].result(timeout=30).tolist() == [4]
        assert not futures[0].done() and not futures[2].done()  # ... and the one after, while 0 and 2 are held
    finally:
        for gate in gates.values():
            gate.set()
        batcher.stop()
    assert [f.result().tolist() for f in futures] == [[0], [1], [2], [3], [4]]


def test_a_failing_batch_in_one_stream_fails_its_own_requests_while_the_others_serve(torch_threads):
    """A batch that raises in one stream (held until the other stream has served more requests) answers its own
    requests with the error; the other stream's batches, before and after, their rows; the failed stream serves on."""
    fail_now = threading.Event()

    def run(encodings):
        if encodings[0].ids[0] == 13:
            assert fail_now.wait(timeout=30)
            raise RuntimeError("a fault inside the model")
        return first_ids(encodings)

    batches = []
    batcher = Batcher(run, 1, None, 100, streams=2, threads_per_stream=1,
                      on_batch=lambda stream, *rest: batches.append(stream))
    bad, first = batcher.submit(job(13)), batcher.submit(job(0))  # a batch each, one a stream
    batcher.start()
    try:
        served = [first.result(timeout=30).tolist()] + [batcher.submit(job(i)).result(timeout=30).tolist()
                                                         for i in range(1, 5)]  # the other stream
        assert served == [[0], [1], [2], [3], [4]] and batches == [1] * 5 and not bad.done()
        fail_now.set()
        with pytest.raises(RuntimeError, match="a fault inside the model"):
            bad.result(timeout=30)
        assert [batcher.submit(job(i)).result(timeout=30).tolist() for i in range(20, 24)] == [[20], [21], [22], [23]]
        assert batcher.alive()
    finally:
        fail_now.set()
        batcher.stop()


def test_stopping_drains_every_stream(torch_threads):
    """stop() with every stream busy and requests queued answers all of them, then ends every stream."""
    def run(encodings):
        time.sleep(0.02)
        return first_ids(encodings)

    batcher = Batcher(run, 1, None, 100, streams=3, threads_per_stream=1)
    futures = [batcher.submit(job(i)) for i in range(12)]
    batcher.start()
    batcher.stop()
    assert [f.result(timeout=0).tolist() for f in futures] == [[i] for i in range(12)]
    assert not any(worker.is_alive() for worker in batcher.workers)


def test_64_concurrent_clients_across_streams_each_get_their_own_answer(torch_threads):
    """64 submitters at once, each its own ids, many times over, through four streams of a model that takes a moment:
    every answer is its own request's rows, and every stream ran batches."""
    def run(encodings):
        time.sleep(0.001)
        return torch.tensor([[e.ids[0], len(e.ids)] for e in encodings])

    streams = []
    batcher = Batcher(run, 64, None, 1000, streams=4, threads_per_stream=1,
                      on_batch=lambda stream, *rest: streams.append(stream))
    batcher.start()

    def client(c: int) -> bool:
        for r in range(10):
            sizes = [1 + (c + r + k) % 5 for k in range(1 + c % 3)]
            rows = batcher.submit([Encoding([1000 * c + r] * n, [0] * n) for n in sizes]).result(timeout=60)
            if rows.tolist() != [[1000 * c + r, n] for n in sizes]:
                return False
        return True

    try:
        with ThreadPoolExecutor(64) as pool:
            assert all(pool.map(client, range(64)))
    finally:
        batcher.stop()
    assert set(streams) == {0, 1, 2, 3}


def test_wide_batches_take_one_thread_while_the_cores_are_contended(torch_threads):
    """The stream policy on a scripted clock: batches alone run on both streams' threads while those are fast; two in a
    row 1.5x slower than their best (another process took a core) switch them to one thread, with a probe on two after
    4 one-thread batches, then 8; a probe that beats one thread switches back. Batches of another size keep their own
    best time."""
    now = [0.0]
    threads_used = []

    def run(encodings):  # a model whose time depends on the threads it gets and on whether a neighbour is there
        two = torch.get_num_threads() == 2
        now[0] += (1.0 if two else 1.5) if not neighbour[0] else (3.0 if two else 1.6)
        return first_ids(encodings)

    neighbour = [False]
    batcher = Batcher(run, 100, None, 100, streams=2, threads_per_stream=1, clock=lambda: now[0],
                      on_batch=lambda stream, inputs, tokens, seconds, threads: threads_used.append(threads))
    batcher.start()
    try:
        def alone(count: int) -> list[int]:
            threads_used.clear()
            for _ in range(count):
                batcher.submit(job(1, 16)).result(timeout=30)
            return list(threads_used)

        assert alone(3) == [2, 2, 2]
        neighbour[0] = True
        assert alone(2 + 4 + 1 + 8 + 1) == [2, 2] + [1] * 4 + [2] + [1] * 8 + [2]
        neighbour[0] = False
        assert alone(16 + 1 + 2) == [1] * 16 + [2, 2, 2]  # the next probe beats one thread: back to two
    finally:
        batcher.stop()


@pytest.mark.slow
def test_the_server_benchmark_beside_a_busy_core_and_under_a_cpu_quota(minilm_dir):
    """benchmarks/bench_server.py's parts beside other work, briefly: `--busy 1` keeps a core busy while the load runs
    and leaves no busy process behind; `--cpu-quota 1.5` starts the server in a cgroup of its own (its periods counted
    there, so it ran inside); `--client parse` parses every answer (no errors). Skipped, saying so, where this machine
    lets no cgroup be made."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    command = [sys.executable, os.path.join(root, "benchmarks", "bench_server.py"), "--servers", "bert-impl fp32",
               "--clients", "2", "--workloads", "single", "--seconds", "3", "--busy", "1", "--cpu-quota", "1.5",
               "--client", "parse"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=root,
                          env={**os.environ, "BERT_IMPL_MINILM_DIR": minilm_dir})
    if "no cgroup with a CPU quota can be made here" in done.stdout:
        pytest.skip(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "beside: 1 busy cores, CPU quota 1.5, client parse" in done.stdout
    row = next(line for line in done.stdout.splitlines() if "2 clients:" in line)
    assert "errors 0" in row, row
    throttled, periods = (int(n) for n in row.split("throttled ")[1].split(" periods")[0].split(" of "))
    assert periods > 0 and 0 <= throttled <= periods, row
    left = subprocess.run(["pgrep", "-f", "while True: pass"], capture_output=True, text=True).stdout.split()
    assert not left, f"busy processes left running: {left}"
