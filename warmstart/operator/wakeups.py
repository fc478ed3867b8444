"""When each endpoint is next looked at again without a change of its own: drift repair and follow-ups.

kopf runs an endpoint's handler when the endpoint itself changes (its spec, labels, annotations). Anything
else that should bring an endpoint back (a child or snapshot that changed, a capture retry coming due, the
periodic resync) marks the endpoint due here, and the check loop reconciles each due endpoint in this
process, at most `workers` at once; a per-endpoint lock keeps that from overlapping the endpoint's kopf
handler. A burst of marks on one endpoint collapses into one check.

This is the operator's one mechanism for periodic drift checks, chosen over the others because it costs
the API server nothing when nothing changed:
- touching an annotation to make kopf run the handler wrote the endpoint twice per resync (the touch, then
  kopf's record of the handled state);
- a kopf timer (or daemon) puts a finalizer on every object it serves, and an endpoint with a finalizer
  cannot be deleted once the operator is gone;
- children deleted or edited by hand are seen at once anyway, from the watches on them (kopf's events).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

Key = tuple[str, str]  # (namespace, name)
log = logging.getLogger(__name__)


class Wakeups:
    """The next wake-up of each known endpoint. Thread-safe: kopf runs sync handlers in threads."""

    def __init__(self, resync_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.resync_seconds = resync_seconds
        self._clock = clock
        self._due: dict[Key, float] = {}
        # Wake-ups asked for and not yet taken: a reconcile that ends meanwhile must not drop them (it may
        # have read the endpoint's children before the change that asked).
        self._asked: dict[Key, float] = {}
        # Endpoints whose kopf handler failed and is retried by kopf: not checked here meanwhile, so that
        # kopf's retries are the one path (their backoff, their count) until the handler succeeds.
        self._held_by_kopf: set[Key] = set()
        self._lock = threading.Lock()

    def track(self, key: Key) -> None:
        """An endpoint exists: due for a resync, unless it already has a wake-up."""
        with self._lock:
            self._due.setdefault(key, self._clock() + self.resync_seconds)

    def now(self, key: Key) -> None:
        """Something the endpoint depends on changed: wake it up at the next tick."""
        self.after(key, 0.0)

    def after(self, key: Key, seconds: float) -> None:
        """Wake it up within `seconds` (an earlier wake-up already set is kept)."""
        when = self._clock() + seconds
        with self._lock:
            self._due[key] = min(when, self._due.get(key, when))
            self._asked[key] = min(when, self._asked.get(key, when))

    def reconciled(self, key: Key, follow_up: float | None = None) -> None:
        """Its handler just ran: next wake-up at the resync, or at `follow_up` seconds if sooner, or at a
        wake-up asked for and not yet taken."""
        seconds = min(self.resync_seconds, follow_up) if follow_up is not None else self.resync_seconds
        when = self._clock() + seconds
        with self._lock:
            self._due[key] = min(when, self._asked.get(key, when))
            self._held_by_kopf.discard(key)

    def retrying(self, key: Key, delay: float, by_kopf: bool) -> None:
        """A reconcile failed and is retried after `delay`: by kopf (its handler's retries), in which case
        the check loop leaves the endpoint alone until a reconcile succeeds, or by the check loop."""
        with self._lock:
            self._due[key] = self._clock() + max(delay, self.resync_seconds)
            if by_kopf:
                self._held_by_kopf.add(key)

    def forget(self, key: Key) -> None:
        with self._lock:
            self._due.pop(key, None)
            self._asked.pop(key, None)
            self._held_by_kopf.discard(key)

    def take_due(self) -> list[Key]:
        """The endpoints due now; each is next due at the resync (its handler will run meanwhile)."""
        now = self._clock()
        with self._lock:
            due = sorted(
                key for key, when in self._due.items() if when <= now and key not in self._held_by_kopf
            )
            for key in due:
                self._due[key] = now + self.resync_seconds
                self._asked.pop(key, None)
        return due


async def check_loop(
    wakeups: Wakeups, check: Callable[[Key], None], workers: int, tick_seconds: float = 0.5
) -> None:
    """Until cancelled: run `check` (a blocking call, so in a thread) for each due endpoint, `workers` at
    once. An endpoint due again while its check runs is checked again after it."""
    limit = asyncio.Semaphore(workers)
    running: dict[Key, asyncio.Task[None]] = {}

    async def one(key: Key) -> None:
        async with limit:
            try:
                await asyncio.to_thread(check, key)
            except Exception:  # a bug in one check must not stop the others'; the resync tries it again
                log.exception("%s/%s: check failed", *key)
            finally:
                running.pop(key, None)

    try:
        while True:
            for key in wakeups.take_due():
                if key in running:
                    wakeups.now(key)
                else:
                    running[key] = asyncio.create_task(one(key), name=f"check {key[0]}/{key[1]}")
            await asyncio.sleep(tick_seconds)
    finally:
        for task in list(running.values()):
            task.cancel()
