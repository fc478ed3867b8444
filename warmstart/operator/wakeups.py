"""When each endpoint is next looked at again without a change of its own: drift repair and follow-ups.

kopf runs every reconcile of an endpoint in that endpoint's own handler, one at a time, and retries a
failed one itself (kopf.TemporaryError). Anything else that should bring an endpoint back (a child or
snapshot that changed, a capture retry coming due, the periodic resync) only marks the endpoint due here;
the wake-up loop then touches an annotation of each due endpoint, which kopf sees as a change and hands to
that endpoint's handler. A burst of marks on one endpoint collapses into one touch.

Not a kopf timer: kopf puts a finalizer on every object a timer (or daemon) serves, and an endpoint with a
finalizer cannot be deleted once the operator is gone.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from warmstart.api import labels as L

Key = tuple[str, str]  # (namespace, name)
log = logging.getLogger(__name__)

# Touched to have kopf run an endpoint's handler; its value (a counter) means nothing else.
WAKEUP_ANNOTATION = f"{L.GROUP}/reconcile-requested"


class Wakeups:
    """The next wake-up of each known endpoint. Thread-safe: kopf runs sync handlers in threads."""

    def __init__(self, resync_seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.resync_seconds = resync_seconds
        self._clock = clock
        self._due: dict[Key, float] = {}
        # Wake-ups asked for and not yet taken: a reconcile that ends meanwhile must not drop them (it may
        # have read the endpoint's children before the change that asked).
        self._asked: dict[Key, float] = {}
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

    def retrying(self, key: Key, delay: float) -> None:
        """Its handler failed and kopf retries it after `delay`: no resync before then (kopf would hold
        it until the retry anyway)."""
        with self._lock:
            self._due[key] = self._clock() + max(delay, self.resync_seconds)

    def forget(self, key: Key) -> None:
        with self._lock:
            self._due.pop(key, None)
            self._asked.pop(key, None)

    def take_due(self) -> list[Key]:
        """The endpoints due now; each is next due at the resync (its handler will run meanwhile)."""
        now = self._clock()
        with self._lock:
            due = sorted(key for key, when in self._due.items() if when <= now)
            for key in due:
                self._due[key] = now + self.resync_seconds
                self._asked.pop(key, None)
        return due

    def keys(self) -> list[Key]:
        with self._lock:
            return sorted(self._due)


async def wake_up_loop(wakeups: Wakeups, touch: Callable[[Key], None], tick_seconds: float = 0.5) -> None:
    """Until cancelled: touch each due endpoint (a blocking call, so in a thread)."""
    while True:
        for key in wakeups.take_due():
            try:
                await asyncio.to_thread(touch, key)
            except Exception:  # a bug in one wake-up must not stop the others'; the resync tries it again
                log.exception("%s/%s: wake-up failed", *key)
        await asyncio.sleep(tick_seconds)
