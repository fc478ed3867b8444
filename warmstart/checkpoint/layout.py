"""What a checkpoint snapshot holds (paths relative to its root in the store): capture writes it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

CRIU_DIR = "criu"  # CRIU image files
LOGS_DIR = "logs"  # CRIU's own dump log
SANDBOX_FILES_DIR = "sandbox"  # files the engine holds open under the sandbox mountpoint, by relative path


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Record the seconds the block took as `timings[name]` (also when it raises)."""
    started = time.monotonic()
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - started, 6)
