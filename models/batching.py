"""Continuous batching of target forwards: what concurrent sequences need at the same moment runs as one forward.

Every `TargetRunner` made with a `Batcher` hands its forwards to it (`TargetRunner.forward` -> `Batcher.forward`)
and blocks until they are done; everything around the forward (tree acceptance, sampling, memory rows) stays in the
caller's thread, so the per-sequence code is the same whether it runs alone or in a batch. One scheduler thread
takes the waiting requests in arrival order, up to `max_batch_tokens` new tokens and `max_batch_size` sequences,
and runs them as one packed forward (`models.target.forward_packed`). Before a forward it waits for the operations
in flight (`begin`/`end`) that have no request in yet, at most `max_wait_s` and at most a quarter of the last
forward's duration (`WAIT_SHARE`: streams that decode in lockstep stay in one batch instead of drifting into a
pipeline of small ones, for a bounded share of a forward), and not at all once every operation in flight has its
request in: a lone client pays no wait. A batch that fails is undone and its requests run one by one, so one
sequence's failure reaches that sequence only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from models.target import ForwardRequest, Target, TargetRunner, TargetStep, forward_packed

WAIT_SHARE = 0.25  # the longest wait for stragglers, as a share of the last forward's duration


@dataclass
class Histogram:
    """A Prometheus-style histogram: cumulative bucket counts, sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.bounds)

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0


@dataclass
class BatchStats:
    """What the scheduler did, for /metrics and the benchmark."""

    batch_size: Histogram = field(default_factory=lambda: Histogram((1, 2, 4, 8, 16, 32, 64)))
    batch_tokens: Histogram = field(default_factory=lambda: Histogram((1, 4, 16, 64, 128, 256, 512, 1024)))
    queue_s: Histogram = field(default_factory=lambda: Histogram((0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05,
                                                                   0.1, 0.25, 0.5, 1.0, 2.5)))
    forward_s: Histogram = field(default_factory=lambda: Histogram((0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                                                     2.5)))
    forwards: int = 0
    split_batches: int = 0  # batches that failed and ran request by request


@dataclass
class _Pending:
    runner: TargetRunner
    request: ForwardRequest
    enqueued: float
    done: threading.Event = field(default_factory=threading.Event)
    step: TargetStep | None = None
    error: BaseException | None = None


class Batcher:
    """The scheduler: `forward` from any thread, one packed forward at a time on the scheduler thread."""

    def __init__(self, target: Target, max_wait_s: float = 0.02, max_batch_tokens: int = 512,
                 max_batch_size: int = 64, wait_share: float | None = WAIT_SHARE):
        """`wait_share` None: wait up to `max_wait_s` whatever a forward takes."""
        self.target = target
        self.wait_share = wait_share
        self.max_wait_s, self.max_batch_tokens, self.max_batch_size = max_wait_s, max_batch_tokens, max_batch_size
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        self._active = 0  # operations in flight (between begin and end), each of which may send a request
        self._closed = False
        self._last_forward_s = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True, name="moa-batcher")
        self._thread.start()

    # ---- callers --------------------------------------------------------------------------------------------
    def forward(self, runner: TargetRunner, request: ForwardRequest) -> TargetStep:
        """Run `request` on `runner`'s cache in the next batch; blocks until done (re-raises its error)."""
        item = _Pending(runner, request, time.perf_counter())
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._queue.append(item)
            self._cond.notify_all()
        item.done.wait()
        if item.error is not None:
            raise item.error
        return item.step

    def begin(self) -> None:
        """An operation that will send forwards has started (lets the scheduler know whom to wait for)."""
        with self._cond:
            self._active += 1

    def end(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    @property
    def depth(self) -> int:
        """Operations in flight plus requests waiting outside one."""
        return max(self._active, len(self._queue))

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(10)

    # ---- scheduler thread -----------------------------------------------------------------------------------
    def _take(self) -> list[_Pending] | None:
        """The next batch (None once closed): wait for a first request, then briefly for the rest of those in flight."""
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            if self._closed:
                for p in self._queue:
                    p.error = RuntimeError("the batcher is closed")
                    p.done.set()
                return None
            # from now, not from the first request's arrival: one that came during the last forward would not wait
            # at all for the streams that forward has just released
            wait = self.max_wait_s if self.wait_share is None else min(self.max_wait_s,
                                                                       self.wait_share * self._last_forward_s)
            deadline = time.perf_counter() + wait
            while (len(self._queue) < min(self._active, self.max_batch_size)
                   and sum(p.request.n for p in self._queue) < self.max_batch_tokens):
                left = deadline - time.perf_counter()
                if left <= 0 or self._closed:
                    break
                self._cond.wait(left)
            batch, tokens = [], 0
            for p in self._queue:
                if batch and (tokens + p.request.n > self.max_batch_tokens or len(batch) >= self.max_batch_size):
                    break
                batch.append(p)
                tokens += p.request.n
            del self._queue[:len(batch)]
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            start = time.perf_counter()
            try:
                steps = forward_packed(self.target, [(p.runner, p.request) for p in batch])
            except BaseException as e:  # undone: run them one by one, so that only the failing request fails
                if len(batch) == 1:
                    batch[0].error = e
                    steps = None
                else:
                    self.stats.split_batches += 1
                    steps = []
                    for p in batch:
                        try:
                            steps.append(forward_packed(self.target, [(p.runner, p.request)])[0])
                        except BaseException as err:
                            p.error = err
                            steps.append(None)
            seconds = time.perf_counter() - start
            self._last_forward_s = seconds
            s = self.stats
            s.forwards += 1
            s.batch_size.observe(len(batch))
            s.batch_tokens.observe(sum(p.request.n for p in batch))
            s.forward_s.observe(seconds)
            for i, p in enumerate(batch):
                s.queue_s.observe(start - p.enqueued)
                if steps is not None:
                    p.step = steps[i]
                p.done.set()
