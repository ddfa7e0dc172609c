"""Dynamic batching over model streams: requests wait in one bounded queue, and S stream workers (threads) take from its
head as many as fit `max_batch_tokens` real tokens and `max_batch_requests` inputs, run them as one padding-free batch,
and hand each request the rows of its own inputs. There is no fixed wait: a request that arrives alone runs at once,
and those that arrive while batches run form the next ones. A batch that fails fails its own requests only.

Threads (CPU): each stream runs its batches on `threads_per_stream` (M) threads of its own, so a core that another
process holds slows the stream whose thread shares it, not every batch: one model worker running every batch on all the
cores waits at each parallel region for the thread that has no core (benchmarks/NOTES.md, "Model streams"). A batch
that runs alone (the queue empty once it is taken, no other stream busy) runs on all S x M threads, the streams'
together, while the others wait for it: a lone request's latency is one worker's. Such wide batches go through a
`QueryThreads` on their token counts: while they run `QueryThreads.SLOWER` times slower than their best, the cores are
contended and they run on one thread. Where the queue holds work for several free streams, each takes its share of it.
Stream 0 takes a lone request, so that one thread only ever runs wide batches (each thread that runs parallel regions
keeps an OpenMP pool, and libgomp's idle threads spin only briefly while it manages more threads than there are CPUs).
"""

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..inference.threads import QueryThreads
from .engine import Encoding


@dataclass
class Job:
    """One request's inputs, and the future its rows of the batch's output are set on."""

    encodings: list[Encoding]
    future: Future = field(default_factory=Future)
    gone: Callable[[], bool] = bool  # whether its request is gone (its client left): read by the worker, unlocked

    @property
    def tokens(self) -> int:
        return sum(len(e.ids) for e in self.encodings)


@dataclass
class Batch:
    """What a stream took: its jobs and the threads it runs on (None: as they are)."""

    jobs: list[Job]
    threads: int | None
    wide: bool

    @property
    def encodings(self) -> list[Encoding]:
        return [e for job in self.jobs for e in job.encodings]

    @property
    def tokens(self) -> int:
        return sum(job.tokens for job in self.jobs)


def stream_plan(usable: int, streams: int | None = None, threads_per_stream: int | None = None) -> tuple[int, int]:
    """(streams, threads per stream) on `usable` threads: one-thread streams, one a thread, where neither is given; a
    given one decides the other (usable // given, at least 1)."""
    if streams is None and threads_per_stream is None:
        return usable, 1
    if streams is None:
        return max(1, usable // threads_per_stream), threads_per_stream
    return streams, threads_per_stream or max(1, usable // streams)


class Batcher:
    """The queue and its stream workers. `run` takes a batch's encodings and returns one output row per input.
    `threads_per_stream`: None leaves torch's threads as they are (CUDA; one stream); else batches run on that many
    threads, and on `streams` x as many when alone. `on_batch(stream, inputs, tokens, seconds, threads)` after each
    batch, `on_drop()` for a cancelled job left unrun."""

    def __init__(self, run: Callable[[list[Encoding]], torch.Tensor], max_batch_tokens: int,
                 max_batch_requests: int | None, max_concurrent_requests: int, on_batch: Callable | None = None,
                 on_drop: Callable | None = None, streams: int = 1, threads_per_stream: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.run, self.on_batch, self.on_drop, self.clock = run, on_batch, on_drop, clock
        self.max_batch_tokens, self.max_batch_requests = max_batch_tokens, max_batch_requests
        self.max_concurrent_requests = max_concurrent_requests
        self.streams, self.threads_per_stream = streams, threads_per_stream
        self.wide_threads = None if threads_per_stream is None else streams * threads_per_stream
        self.wide_governor = QueryThreads(clock)  # a wide batch's threads: all, or one while the cores are contended
        self.queue: deque[Job] = deque()
        self.ready = threading.Condition()
        self.stopping = False
        self.busy = [False] * streams  # each stream: running a batch
        self.wide_running = False  # a batch runs on every stream's threads: the others wait
        self.workers = [threading.Thread(target=self.serve, args=(i,), name=f"bert-impl-stream-{i}", daemon=True)
                        for i in range(streams)]

    def start(self) -> None:
        for worker in self.workers:
            worker.start()

    def stop(self) -> None:
        """Finish the requests queued, then end the streams."""
        with self.ready:
            self.stopping = True
            self.ready.notify_all()
        for worker in self.workers:
            worker.join()

    def alive(self) -> bool:
        return all(worker.is_alive() for worker in self.workers)

    def full(self) -> bool:
        """Whether `max_concurrent_requests` are waiting (overload): the next request is refused."""
        return len(self.queue) >= self.max_concurrent_requests

    def submit(self, encodings: list[Encoding], gone: Callable[[], bool] = bool) -> Future | None:
        """Queue a request; its future, or None where the queue is `full`. `gone()`: whether the request is gone
        since, so that its job is dropped unrun."""
        job = Job(encodings, gone=gone)
        with self.ready:
            if self.full():
                return None
            self.queue.append(job)
            self.ready.notify_all()
        return job.future

    def may_take(self, stream: int) -> bool:
        """Whether `stream` takes from the queue now: work waits, no wide batch holds the threads, and it is stream 0
        or another stream is busy (a lone request is stream 0's). The lock held."""
        return bool(self.queue) and not self.wide_running and (stream == 0 or any(self.busy))

    def next_batch(self, stream: int) -> Batch | None:
        """The next batch for `stream` (marked busy), or None once stopping with nothing queued; cancelled jobs are
        dropped, and those taken can no longer be cancelled (their futures running)."""
        with self.ready:
            while True:
                self.ready.wait_for(lambda: self.may_take(stream) or (self.stopping and not self.queue))
                if not self.queue:  # stopping, drained
                    return None
                free = self.busy.count(False)
                share = math.ceil(sum(job.tokens for job in self.queue) / free)  # of the work queued, for the free
                jobs = self.take(min(self.max_batch_tokens, share))
                if jobs:
                    break
            wide = self.streams == 1 or (not self.queue and not any(self.busy))  # alone: on every thread
            self.busy[stream], self.wide_running = True, wide
            if self.queue:  # more for the other streams
                self.ready.notify_all()
        return Batch(jobs, self.wide_threads if wide else self.threads_per_stream, wide)

    def take(self, max_tokens: int | None = None) -> list[Job]:
        """The jobs at the head of the queue that fit one batch of `max_tokens` (`max_batch_tokens` where None; the
        first job always, alone if it is larger), the cancelled ones dropped; the lock held."""
        max_tokens = self.max_batch_tokens if max_tokens is None else max_tokens
        jobs, tokens, inputs = [], 0, 0
        while self.queue:
            job = self.queue[0]
            too_many = self.max_batch_requests is not None and inputs + len(job.encodings) > self.max_batch_requests
            if jobs and (tokens + job.tokens > max_tokens or too_many):
                break
            self.queue.popleft()
            if not job.gone() and job.future.set_running_or_notify_cancel():  # else its request is gone
                jobs.append(job)
                tokens, inputs = tokens + job.tokens, inputs + len(job.encodings)
            elif self.on_drop is not None:
                self.on_drop()
        return jobs

    def serve(self, stream: int) -> None:
        """A stream worker: batches in turn until stopped and drained."""
        while (batch := self.next_batch(stream)) is not None:
            start = self.clock()
            try:
                outputs, threads = self.compute(batch)
            except Exception as error:  # the batch's requests get it; the stream goes on
                outputs = error
            finally:
                with self.ready:
                    self.busy[stream] = False
                    self.wide_running = self.wide_running and not batch.wide
                    self.ready.notify_all()
            if isinstance(outputs, Exception):
                for job in batch.jobs:
                    job.future.set_exception(outputs)
                continue
            if self.on_batch is not None:
                self.on_batch(stream, len(outputs), batch.tokens, self.clock() - start, threads)
            for job, rows in zip(batch.jobs, outputs.split([len(job.encodings) for job in batch.jobs])):
                job.future.set_result(rows)

    def compute(self, batch: Batch) -> tuple[torch.Tensor, int]:
        """The batch's output rows on its threads (a wide batch's as `wide_governor` chooses), and those threads."""
        if batch.threads is None:
            return self.run(batch.encodings), torch.get_num_threads()
        if torch.get_num_threads() != batch.threads:
            torch.set_num_threads(batch.threads)
        if not batch.wide or batch.threads == 1:
            return self.run(batch.encodings), batch.threads
        used = []
        outputs = self.wide_governor(batch.tokens.bit_length(),  # batches within a power of two of tokens compared
                                     lambda: (used.append(torch.get_num_threads()), self.run(batch.encodings))[1])
        return outputs, used[0]
