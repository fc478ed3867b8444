"""Shared fixtures. Component fixtures live in tests/<component>/conftest.py or beside their tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytest_plugins = ["kube_plugin"]


@pytest.fixture
def repo_root() -> Path:
    return REPO


@pytest.fixture
def python_exe() -> str:
    return sys.executable


def pytest_report_header(config: pytest.Config) -> str:
    return f"warmstart cache: {os.environ.get('WARMSTART_CACHE', '~/.cache/warmstart')}"
