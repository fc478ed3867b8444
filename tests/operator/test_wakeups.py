from __future__ import annotations

import asyncio
import threading

from warmstart.operator.backoff import Backoff
from warmstart.operator.wakeups import Wakeups, check_loop


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_known_endpoint_is_due_at_each_resync_and_a_burst_of_changes_wakes_it_once():
    clock = Clock()
    wakeups = Wakeups(resync_seconds=60, clock=clock)
    wakeups.track(("ns", "a"))
    assert wakeups.take_due() == []
    for _ in range(5):  # five child events in a burst
        wakeups.now(("ns", "b"))
    assert wakeups.take_due() == [("ns", "b")]
    assert wakeups.take_due() == []
    clock.now += 60
    assert wakeups.take_due() == [("ns", "a"), ("ns", "b")]


def test_tracking_keeps_a_sooner_wake_up_and_a_reconcile_sets_the_next():
    clock = Clock()
    wakeups = Wakeups(resync_seconds=60, clock=clock)
    wakeups.after(("ns", "a"), 2)
    wakeups.track(("ns", "a"))  # every event on the endpoint: must not push the follow-up back
    wakeups.after(("ns", "a"), 30)  # a later wake-up does not replace the sooner one
    clock.now += 2
    assert wakeups.take_due() == [("ns", "a")]
    wakeups.reconciled(("ns", "a"), follow_up=5)
    clock.now += 4
    assert wakeups.take_due() == []
    clock.now += 1
    assert wakeups.take_due() == [("ns", "a")]
    wakeups.reconciled(("ns", "a"), follow_up=600)  # never later than the resync
    clock.now += 60
    assert wakeups.take_due() == [("ns", "a")]


def test_a_change_during_a_reconcile_still_wakes_the_endpoint_after_it():
    clock = Clock()
    wakeups = Wakeups(resync_seconds=3600, clock=clock)
    wakeups.track(("ns", "a"))
    wakeups.now(("ns", "a"))  # a child deleted while the handler runs, having read the children before
    clock.now += 0.01
    wakeups.reconciled(("ns", "a"))  # the handler ends
    assert wakeups.take_due() == [("ns", "a")]
    wakeups.reconciled(("ns", "a"))  # the next run, with nothing asked meanwhile: the resync
    clock.now += 3599
    assert wakeups.take_due() == []
    clock.now += 1
    assert wakeups.take_due() == [("ns", "a")]


def test_a_failed_check_is_not_woken_before_its_retry_and_a_deleted_one_never():
    clock = Clock()
    wakeups = Wakeups(resync_seconds=2, clock=clock)
    retry = Backoff(base_seconds=1, max_seconds=120).delay(4)  # the loop retries after 8 s
    wakeups.retrying(("ns", "a"), retry, by_kopf=False)
    wakeups.track(("ns", "a"))
    wakeups.track(("ns", "b"))
    wakeups.forget(("ns", "b"))
    clock.now += 2  # a resync passes
    assert wakeups.take_due() == []
    clock.now += 6
    assert wakeups.take_due() == [("ns", "a")]


def test_an_endpoint_kopf_retries_is_left_to_kopf_until_a_reconcile_succeeds():
    """One path for retries: while kopf retries the endpoint's handler, neither the resync nor a child's
    change runs a check of it (a check between kopf's retries would fail too and count apart)."""
    clock = Clock()
    wakeups = Wakeups(resync_seconds=2, clock=clock)
    wakeups.retrying(("ns", "a"), 1, by_kopf=True)
    clock.now += 60  # many resyncs
    wakeups.now(("ns", "a"))  # a child changed
    assert wakeups.take_due() == []
    wakeups.reconciled(("ns", "a"))  # kopf's retry succeeded: the child's change is still to be looked at
    assert wakeups.take_due() == [("ns", "a")]
    wakeups.retrying(("ns", "a"), 1, by_kopf=True)
    wakeups.forget(("ns", "a"))  # deleted
    wakeups.track(("ns", "a"))  # created again under the same name
    clock.now += 2
    assert wakeups.take_due() == [("ns", "a")]


def test_the_loop_checks_each_due_endpoint_until_cancelled():
    wakeups = Wakeups(resync_seconds=3600)
    touched: list[tuple[str, str]] = []

    async def run() -> None:
        wakeups.now(("ns", "a"))
        wakeups.now(("ns", "b"))
        task = asyncio.create_task(check_loop(wakeups, touched.append, workers=1, tick_seconds=0.01))
        while len(touched) < 2:
            await asyncio.sleep(0.01)
        wakeups.now(("ns", "a"))
        while len(touched) < 3:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert touched == [("ns", "a"), ("ns", "b"), ("ns", "a")]


def test_a_failing_check_does_not_stop_the_loop():
    wakeups = Wakeups(resync_seconds=3600)
    touched: list[tuple[str, str]] = []

    def touch(key: tuple[str, str]) -> None:
        if key == ("ns", "broken"):
            raise RuntimeError("a bug")
        touched.append(key)

    async def run() -> None:
        wakeups.now(("ns", "broken"))
        wakeups.now(("ns", "fine"))
        task = asyncio.create_task(check_loop(wakeups, touch, workers=1, tick_seconds=0.01))
        while not touched:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert touched == [("ns", "fine")]


def test_an_endpoint_due_during_its_own_check_is_checked_again_after_it_never_beside_it():
    wakeups = Wakeups(resync_seconds=3600)
    release = threading.Event()
    checks: list[str] = []
    running = threading.Lock()

    def check(key: tuple[str, str]) -> None:
        assert running.acquire(blocking=False), "two checks of one endpoint at once"
        checks.append("start")
        if len(checks) == 1:
            release.wait(5)
        running.release()

    async def run() -> None:
        wakeups.now(("ns", "a"))
        task = asyncio.create_task(check_loop(wakeups, check, workers=4, tick_seconds=0.01))
        while not checks:
            await asyncio.sleep(0.01)
        wakeups.now(("ns", "a"))  # a child changed while the first check read the old state
        await asyncio.sleep(0.1)
        release.set()
        while len(checks) < 2:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(run(), 10))
    assert checks == ["start", "start"]
