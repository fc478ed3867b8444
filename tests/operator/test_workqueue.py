from __future__ import annotations

import threading

from warmstart.operator.backoff import Backoff
from warmstart.operator.workqueue import Resync, WorkQueue


def test_keys_are_deduplicated_and_rerun_when_added_during_work():
    seen: list[tuple[str, str]] = []
    started, release, done = threading.Event(), threading.Event(), threading.Event()

    def work(key):
        seen.append(key)
        if len(seen) == 1:
            started.set()
            release.wait(10)
        if len(seen) == 2:
            done.set()
        return None

    queue = WorkQueue(work, workers=1)
    queue.start()
    try:
        queue.add(("ns", "a"))
        assert started.wait(10)
        for _ in range(5):  # while "a" runs: collapse into exactly one more run
            queue.add(("ns", "a"))
        release.set()
        assert done.wait(10)
    finally:
        queue.stop()
    assert seen == [("ns", "a"), ("ns", "a")]


def test_pending_duplicates_collapse():
    queue = WorkQueue(lambda key: None, workers=1)  # not started: nothing drains
    for name in ("a", "b", "a", "a", "b"):
        queue.add(("ns", name))
    assert len(queue) == 2


def test_a_returned_delay_requeues_and_crashes_do_not_kill_workers():
    calls: list[int] = []
    finished = threading.Event()

    def work(key):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")  # requeued after 30 s: not waited for here
        if len(calls) == 2:
            return 0.01
        finished.set()
        return None

    queue = WorkQueue(work, workers=1)
    queue.start()
    try:
        queue.add(("ns", "x"))
        queue.add_after(("ns", "y"), 0.01)
        assert finished.wait(10)
    finally:
        queue.stop()
    assert len(calls) == 3


def test_retry_backoff_doubles_from_the_base_up_to_the_cap():
    backoff = Backoff(base_seconds=1.0, max_seconds=8.0)
    assert [backoff.delay(n) for n in range(1, 7)] == [1, 2, 4, 8, 8, 8]
    assert backoff.delay(10_000) == 8  # no overflow however long it keeps failing


def test_a_failing_key_is_retried_from_one_schedule_and_a_success_resets_it():
    runs = threading.Semaphore(0)
    queue = WorkQueue(lambda key: runs.release(), workers=1, backoff=Backoff(0.05, 0.05))
    queue.start()
    try:
        key = ("ns", "a")
        assert queue.retry_later(key) == 0.05
        assert queue.backing_off(key)
        queue.retry_later(key)  # a second failure while the retry is pending: no second schedule
        assert queue.failures(key) == 2
        assert runs.acquire(timeout=10)
        assert not runs.acquire(timeout=0.5)  # ran once, not once per failure
        assert not queue.backing_off(key)
        queue.reset(key)
        assert queue.failures(key) == 0
    finally:
        queue.stop()


def test_resync_queues_every_known_key_but_those_waiting_for_a_retry():
    queue = WorkQueue(lambda key: None, workers=1, backoff=Backoff(base_seconds=3600))  # not started
    resync = Resync(queue, interval=3600)
    for name in ("a", "b", "c"):
        resync.track(("ns", name))
    resync.forget(("ns", "c"))
    queue.retry_later(("ns", "b"))  # its retry is scheduled an hour away: the resync leaves it alone
    try:
        assert resync.sweep() == 1
        assert len(queue) == 1 and queue.backing_off(("ns", "b"))
        assert resync.keys() == [("ns", "a"), ("ns", "b")]
    finally:
        queue.stop()


def test_resync_runs_on_its_own_every_interval():
    swept = threading.Event()
    queue = WorkQueue(lambda key: swept.set(), workers=1)
    resync = Resync(queue, interval=0.05)
    resync.track(("ns", "a"))
    queue.start()
    resync.start()
    try:
        assert swept.wait(10)
    finally:
        resync.stop()
        queue.stop()
