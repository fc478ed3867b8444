"""A deduplicating work queue of endpoint keys, drained by worker threads.

Events on children and snapshots only say "endpoint X may need work"; many such events in a burst collapse
into one reconcile. A per-key lock, shared with the kopf handlers, keeps reconciles of one endpoint serial.
A reconcile that fails, whichever path ran it, is retried from here only, with a per-key exponential
backoff that a success resets.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

Key = tuple[str, str]  # (namespace, name)
log = logging.getLogger(__name__)


class KeyLocks:
    def __init__(self) -> None:
        self._locks: defaultdict[Key, threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()

    def lock(self, key: Key) -> threading.Lock:
        with self._guard:
            return self._locks[key]

    def forget(self, key: Key) -> None:
        with self._guard:
            self._locks.pop(key, None)


@dataclass(frozen=True)
class RetryBackoff:
    """base, 2 x base, 4 x base, ... up to cap seconds after the 1st, 2nd, 3rd, ... failure in a row."""

    base_seconds: float = 1.0
    cap_seconds: float = 120.0

    def delay(self, failures: int) -> float:
        exponent = min(max(failures - 1, 0), 32)  # 2**32 x base is past any cap; keeps the float finite
        return min(self.cap_seconds, self.base_seconds * 2**exponent)


class WorkQueue:
    """FIFO of unique keys. `work(key)` returns a delay in seconds to requeue after, or None when done."""

    def __init__(
        self, work: Callable[[Key], float | None], workers: int = 4, backoff: RetryBackoff | None = None
    ) -> None:
        self._work = work
        self.backoff = backoff or RetryBackoff()
        self._failures: dict[Key, int] = {}
        self._retrying: set[Key] = set()  # a retry is scheduled: other periodic paths leave the key alone
        self._pending: list[Key] = []
        self._queued: set[Key] = set()
        self._active: set[Key] = set()
        self._again: set[Key] = set()  # enqueued while being worked on: run once more afterwards
        self._cond = threading.Condition()
        self._stopped = False
        self._threads = [
            threading.Thread(target=self._loop, name=f"reconcile-{i}", daemon=True) for i in range(workers)
        ]
        self._timers: set[threading.Timer] = set()

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            timers = list(self._timers)
        for timer in timers:
            timer.cancel()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=5)

    def add(self, key: Key) -> None:
        with self._cond:
            if self._stopped:
                return
            if key in self._active:
                self._again.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._pending.append(key)
                self._cond.notify()

    def add_after(self, key: Key, seconds: float) -> None:
        self._schedule(key, seconds, retry=False)

    def _schedule(self, key: Key, seconds: float, retry: bool) -> None:
        def fire() -> None:
            with self._cond:
                self._timers.discard(timer)
                if retry:
                    self._retrying.discard(key)
            self.add(key)

        timer = threading.Timer(seconds, fire)
        timer.daemon = True
        with self._cond:
            if self._stopped:
                return
            self._timers.add(timer)
        timer.start()

    def retry_later(self, key: Key) -> float:
        """Count a failure of `key` and schedule its retry after the backoff; returns the delay. A retry
        already scheduled is kept (it comes sooner than a longer backoff would)."""
        with self._cond:
            failures = self._failures.get(key, 0) + 1
            self._failures[key] = failures
            delay = self.backoff.delay(failures)
            if key in self._retrying or self._stopped:
                return delay
            self._retrying.add(key)
        self._schedule(key, delay, retry=True)
        return delay

    def reset(self, key: Key) -> None:
        """`key` reconciled, or is gone: its next failure starts the backoff from the base again."""
        with self._cond:
            self._failures.pop(key, None)

    def failures(self, key: Key) -> int:
        with self._cond:
            return self._failures.get(key, 0)

    def backing_off(self, key: Key) -> bool:
        with self._cond:
            return key in self._retrying

    def __len__(self) -> int:
        with self._cond:
            return len(self._pending)

    def _take(self) -> Key | None:
        with self._cond:
            while not self._pending and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            key = self._pending.pop(0)
            self._queued.discard(key)
            self._active.add(key)
            return key

    def _finish(self, key: Key) -> None:
        with self._cond:
            self._active.discard(key)
            again = key in self._again
            self._again.discard(key)
        if again:
            self.add(key)

    def _loop(self) -> None:
        while (key := self._take()) is not None:
            try:
                delay = self._work(key)
            except Exception:  # a bug in one reconcile must not kill the worker thread
                delay = None
                seconds = self.retry_later(key)
                log.exception("%s/%s: reconcile crashed; retrying in %.0f s", *key, seconds)
            finally:
                self._finish(key)
            if delay is not None:
                self.add_after(key, delay)
