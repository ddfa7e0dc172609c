"""Dynamic batching: requests wait in one bounded queue, and one model worker thread takes from its head as many as fit
`max_batch_tokens` real tokens and `max_batch_requests` inputs, runs them as one padding-free batch, and hands each
request the rows of its own inputs. There is no fixed wait: a request that arrives alone runs at once, and those that
arrive while a batch runs form the next one. A batch that fails fails its own requests only."""

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

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


class Batcher:
    """The queue and its model worker. `run` takes a batch's encodings and returns one output row per input."""

    def __init__(self, run: Callable[[list[Encoding]], torch.Tensor], max_batch_tokens: int,
                 max_batch_requests: int | None, max_concurrent_requests: int, on_batch: Callable | None = None,
                 on_drop: Callable | None = None):
        self.run, self.on_batch, self.on_drop = run, on_batch, on_drop  # on_drop(): a cancelled job left unrun
        self.max_batch_tokens, self.max_batch_requests = max_batch_tokens, max_batch_requests
        self.max_concurrent_requests = max_concurrent_requests
        self.queue: deque[Job] = deque()
        self.ready = threading.Condition()
        self.stopping = False
        self.worker = threading.Thread(target=self.serve, name="bert-impl-model-worker", daemon=True)

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        """Finish the requests queued, then end the worker."""
        with self.ready:
            self.stopping = True
            self.ready.notify()
        self.worker.join()

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
            self.ready.notify()
        return job.future

    def next_batch(self) -> list[Job]:
        """The jobs at the head of the queue that fit one batch (the first always, alone if it is larger), or [] once
        stopping with nothing queued; cancelled jobs are dropped, and those taken can no longer be cancelled (their
        futures running). Called by the worker."""
        jobs = []
        with self.ready:
            while not jobs:
                self.ready.wait_for(lambda: self.queue or self.stopping)
                if not self.queue:  # stopping, drained
                    break
                jobs = self.take()
        return jobs

    def take(self) -> list[Job]:
        """The jobs at the head of the queue that fit one batch, the cancelled ones dropped; the lock held."""
        jobs, tokens, inputs = [], 0, 0
        while self.queue:
            job = self.queue[0]
            too_many = self.max_batch_requests is not None and inputs + len(job.encodings) > self.max_batch_requests
            if jobs and (tokens + job.tokens > self.max_batch_tokens or too_many):
                break
            self.queue.popleft()
            if not job.gone() and job.future.set_running_or_notify_cancel():  # else its request is gone
                jobs.append(job)
                tokens, inputs = tokens + job.tokens, inputs + len(job.encodings)
            elif self.on_drop is not None:
                self.on_drop()
        return jobs

    def serve(self) -> None:
        """The worker: batches in turn until stopped and drained."""
        while jobs := self.next_batch():
            encodings = [e for job in jobs for e in job.encodings]
            try:
                outputs = self.run(encodings)
            except Exception as error:  # the batch's requests get it; the worker goes on
                for job in jobs:
                    job.future.set_exception(error)
                continue
            if self.on_batch is not None:
                self.on_batch(len(encodings), sum(job.tokens for job in jobs))
            for job, rows in zip(jobs, outputs.split([len(job.encodings) for job in jobs])):
                job.future.set_result(rows)
