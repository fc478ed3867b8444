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

from warmstart.operator.backoff import Backoff

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


class WorkQueue:
    """FIFO of unique keys. `work(key)` returns a delay in seconds to requeue after, or None when done."""

    def __init__(
        self, work: Callable[[Key], float | None], workers: int = 4, backoff: Backoff | None = None
    ) -> None:
        self._work = work
        self.backoff = backoff or Backoff()
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


class Resync:
    """Drift repair: every `interval` seconds, each known key not waiting for a retry goes on the queue (a
    child edited by hand comes back, status catches up with pods that changed without an event to us).

    The operator's own loop rather than a kopf timer: kopf puts a finalizer on every object a timer
    serves, and an endpoint with a finalizer cannot be deleted once the operator is gone."""

    def __init__(self, queue: WorkQueue, interval: float) -> None:
        self.queue = queue
        self.interval = interval
        self._keys: set[Key] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="resync", daemon=True)

    def track(self, key: Key) -> None:
        with self._lock:
            self._keys.add(key)

    def forget(self, key: Key) -> None:
        with self._lock:
            self._keys.discard(key)

    def keys(self) -> list[Key]:
        with self._lock:
            return sorted(self._keys)

    def sweep(self) -> int:
        """Queue every known key not backing off; returns how many were queued."""
        due = [key for key in self.keys() if not self.queue.backing_off(key)]
        for key in due:
            self.queue.add(key)
        return len(due)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.sweep()
