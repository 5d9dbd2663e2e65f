"""Work that a request's deadline left unfinished, finished off the request's thread.

A request waits for the tiers below the root only until its deadline
(:attr:`Tiers.deadline <kvstore.store.tiers.Tiers.deadline>`); the pull it started goes on
here, so that the next request with that prefix restores it from this machine.
:class:`Background` is bounded in every way: one job per key (an entry's prefix) at a
time, at most ``queue_size`` waiting (more are shed and counted), run by ``workers``
threads, and stopped at close (what waits is dropped, what runs is waited for up to the
close's timeout).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

DEFAULT_QUEUE = 64  # jobs waiting before more are shed
DEFAULT_WORKERS = 2


class Background:
    """A bounded queue of keyed jobs and the threads that run them; thread-safe."""

    def __init__(self, *, queue_size: int = DEFAULT_QUEUE, workers: int = DEFAULT_WORKERS,
                 name: str = "kvstore-background") -> None:
        if queue_size < 1 or workers < 1:
            raise ValueError(f"queue_size and workers must be >= 1, got {queue_size}, {workers}")
        self.queue_size = queue_size
        self._n_workers = workers
        self._name = name
        self._cv = threading.Condition()
        self._jobs: dict[Hashable, cf.Future[Any]] = {}  # waiting or running, by key
        self._waiting: collections.deque[tuple[Hashable, Callable[[], Any], cf.Future[Any]]] = \
            collections.deque()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.shed = 0  # jobs not queued: the queue was full

    def submit(self, key: Hashable, fn: Callable[[], Any]) -> cf.Future[Any] | None:
        """Queue ``fn`` under ``key`` and return its future; the future of the job already
        waiting or running under ``key`` if there is one; None when the queue is full (the
        job is shed and counted) or closed."""
        with self._cv:
            if self._closed:
                return None
            fut = self._jobs.get(key)
            if fut is not None:
                return fut
            if len(self._waiting) >= self.queue_size:
                self.shed += 1
                return None
            fut = cf.Future()
            self._jobs[key] = fut
            self._waiting.append((key, fn, fut))
            if len(self._threads) < self._n_workers:
                t = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._threads.append(t)
                t.start()
            self._cv.notify()
            return fut

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (jobs are refused, not shed)."""
        return self._closed

    def __len__(self) -> int:
        """Jobs waiting or running."""
        with self._cv:
            return len(self._jobs)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                key, fn, fut = self._waiting.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits on it
                    fut.set_exception(e)
            with self._cv:
                self._jobs.pop(key, None)
                self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until no job waits or runs; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs, timeout)

    def close(self, timeout: float | None = None) -> int:
        """Drop the waiting jobs (their futures are cancelled), wait for the running ones up
        to ``timeout`` and stop the threads; returns how many jobs were still running."""
        with self._cv:
            self._closed = True
            while self._waiting:
                key, _, fut = self._waiting.popleft()
                fut.cancel()
                self._jobs.pop(key, None)
            self._cv.notify_all()
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        with self._cv:
            return len(self._jobs)
