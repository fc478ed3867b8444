"""Fixtures shared by the node mechanics' tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from warmstart.checkpoint.sandbox import Sandbox


@pytest.fixture
def sandboxes() -> Iterator[list[Sandbox]]:
    """Sandboxes a test started (append them here): each is stopped when the test ends."""
    started: list[Sandbox] = []
    yield started
    for sandbox in started:
        sandbox.stop(grace=2)
