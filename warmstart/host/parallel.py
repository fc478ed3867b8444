"""Thread pools for I/O-bound work (file reads, hashing, copies release the GIL): the one place they live."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def default_workers() -> int:
    """Enough threads to keep a disk or NFS mount busy; hashing itself is bounded by the cores."""
    return max(4, min(32, (os.cpu_count() or 1) * 2))


def parallel_map(function: Callable[[T], R], items: Iterable[T], *, workers: int | None = None) -> list[R]:
    """`function` over `items` in threads, results in input order; the first exception propagates."""
    work = list(items)
    if not work:
        return []
    with ThreadPoolExecutor(max_workers=min(workers or default_workers(), len(work))) as pool:
        return list(pool.map(function, work))


def run_heaviest_first(jobs: list[tuple[int, Callable[[], R]]], *, workers: int | None = None) -> list[R]:
    """Run (weight, job) pairs in threads, heaviest first (a big one does not finish last alone); results in
    the order given."""
    order = sorted(range(len(jobs)), key=lambda index: jobs[index][0], reverse=True)
    results = parallel_map(lambda index: jobs[index][1](), order, workers=workers)
    by_index = dict(zip(order, results, strict=True))
    return [by_index[index] for index in range(len(jobs))]


def share_among_threads(
    work: Callable[[Iterator[T]], None], items: Iterator[T], threads: int, *, name: str = "worker"
) -> None:
    """`threads` threads running `work` on one shared queue of `items`, each with its own state (e.g. its own
    pinned buffer); the first error stops them all."""
    lock = threading.Lock()
    errors: list[BaseException] = []

    def shared() -> Iterator[T]:
        """One thread's turn at `items`, one at a time under the lock; none once any thread failed."""
        while not errors:
            with lock:
                try:
                    item = next(items)
                except StopIteration:
                    return
            yield item

    def guarded() -> None:
        try:
            work(shared())
        except BaseException as exc:  # re-raised in the caller below
            errors.append(exc)

    pool = [threading.Thread(target=guarded, name=f"{name}-{i}", daemon=True) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    if errors:
        raise errors[0]
