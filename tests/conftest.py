"""Shared fixtures. Component fixtures live in tests/<component>/conftest.py or beside their tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import criu_command_or_skip

from warmstart.checkpoint.sandbox import Sandbox

REPO = Path(__file__).resolve().parent.parent

pytest_plugins = ["kube_plugin", "node_plugin"]


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def python_exe() -> str:
    return sys.executable


@pytest.fixture
def sandboxes() -> Iterator[list[Sandbox]]:
    """Sandboxes a test started (append them here): each is stopped when the test ends."""
    started: list[Sandbox] = []
    yield started
    for sandbox in started:
        sandbox.stop(grace=2)


@pytest.fixture(scope="session")
def criu_command() -> str:
    """A CRIU >= 4 command line; skips when not root (CRIU and namespaces need it) or none is set up."""
    return criu_command_or_skip()


def pytest_report_header(config: pytest.Config) -> str:
    return f"warmstart cache: {os.environ.get('WARMSTART_CACHE', '~/.cache/warmstart')}"
