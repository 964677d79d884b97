"""The decoding engine: one asyncio task owns a ``wiola.fast.rows.Rows`` and steps it.

Requests are ``Job``s (one generated sequence each). Between two steps the engine lets waiting
jobs join (up to ``max_batch`` live rows) and lets cancelled ones leave; then one ``Rows.step``
advances every live row at once. ``join``, ``leave`` and ``step`` all run in one worker thread
(``Rows`` is not thread-safe; the event loop stays free to accept and stream meanwhile), and each
step's tokens go to their jobs' queues. A job that finishes (eos, its token budget) is freed by
``Rows`` itself; one that is cancelled (a stop string, a client that went away) leaves before the
next step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from wiola.fast.rows import RowRequest, Rows, RowToken


@dataclass(eq=False)
class Job:
    """One sequence to generate. ``(job, RowToken)`` pairs, then ``(job, None)`` once it has
    ended, arrive on ``queue`` (jobs of one HTTP request share it); a join that fails puts
    ``(job, ValueError)`` there instead."""

    request: RowRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    index: int = 0  # the choice it answers
    row: int | None = None
    done: bool = False
    cancelled: bool = False


class Engine:
    """Continuous batching over ``Rows(model, max_batch)``; ``start()`` inside the event loop,
    ``submit(job)`` to enqueue, ``cancel(job)`` to drop, ``stop()`` to end after in-flight jobs."""

    def __init__(self, model, max_batch: int) -> None:
        self.rows = Rows(model, max_rows=max_batch)
        self.max_batch = max_batch
        self.waiting: collections.deque[Job] = collections.deque()
        self.live: dict[int, Job] = {}
        self.leaving: list[int] = []
        self.steps = 0
        self.left = 0  # rows that left before they finished (cancelled: a stop string, a client gone)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wiola-engine")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def backend(self) -> str:
        return self.rows.backend

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="wiola-engine")

    async def stop(self) -> None:
        """Finish the jobs in flight and waiting, then end the loop."""
        self._stopping = True
        if self._wake is not None:
            self._wake.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=True)

    def submit(self, job: Job) -> None:
        self.waiting.append(job)
        self._wake.set()

    def cancel(self, job: Job) -> None:
        """Stop generating ``job``: its row (if any) leaves before the next step."""
        if job.done or job.cancelled:
            return
        job.cancelled = True
        if job.row is not None:
            self.leaving.append(job.row)
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self.waiting = collections.deque(j for j in self.waiting if not j.cancelled)
            if not self.live and not self.waiting:
                if self._stopping:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            joins = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.max_batch - len(self.live)))]
            leaves, self.leaving = self.leaving, []
            for row in leaves:
                self.left += self.live.pop(row, None) is not None
            try:
                joined, tokens = await loop.run_in_executor(self._executor, self._tick, joins, leaves)
            except Exception as e:  # a broken step: fail every job rather than hang them
                logging.getLogger("wiola.serve").error("decoding failed; the jobs in flight end with it", exc_info=e)
                for job in [*self.live.values(), *joins]:
                    self._end(job, RuntimeError(f"decoding failed: {e}"))
                self.live.clear()
                continue
            for job, row in joined:
                if isinstance(row, Exception):
                    self._end(job, row)
                else:
                    job.row = row
                    self.live[row] = job
                    if job.cancelled:  # cancelled while joining
                        self.leaving.append(row)
            for token in tokens:
                self._deliver(token)

    def _tick(self, joins: list[Job], leaves: list[int]) -> tuple[list[tuple[Job, int | Exception]], list[RowToken]]:
        """In the worker thread: rows leave, jobs join, one step for every live row. Where a
        join or the step raises otherwise than for a bad request, every row leaves: the loop
        fails every job it holds, and the rows stay free for the next ones."""
        for row in leaves:
            with contextlib.suppress(ValueError):  # finished in the step that raced the cancel
                self.rows.leave(row)
        joined: list[tuple[Job, int | Exception]] = []
        try:
            for job in joins:
                try:
                    joined.append((job, self.rows.join(job.request)))
                except ValueError as e:
                    joined.append((job, e))
            tokens = self.rows.step() if self.rows.live else []
        except Exception:
            for row in self.rows.live:
                self.rows.leave(row)
            raise
        self.steps += 1
        return joined, tokens

    def _deliver(self, token: RowToken) -> None:
        job = self.live.get(token.row)
        if job is None:
            return
        if token.finish_reason is not None:
            del self.live[token.row]  # Rows freed the row
        if job.cancelled:
            return
        job.queue.put_nowait((job, token))
        if token.finish_reason is not None:
            self._end(job, None)

    def _end(self, job: Job, error: Exception | None) -> None:
        job.done = True
        job.queue.put_nowait((job, error))
