"""Fixtures for worker tests: real `warmstart worker` processes on CPU with the tiny model, on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the worker tests run the builtin engine, which needs torch")
pytest.importorskip("httpx", reason="the worker tests talk HTTP through httpx (the `dev` extra)")

from worker_helpers import Worker  # noqa: E402


@pytest.fixture(scope="session")
def worker_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache dir with the tiny model already generated, so each worker start only loads it."""
    from warmstart.engines.builtin.model_dir import ensure_model

    cache = tmp_path_factory.mktemp("cache")
    ensure_model(cache / "models" / "tiny-0", "tiny", seed=0)
    return cache


@pytest.fixture
def start_worker(worker_cache: Path, tmp_path: Path) -> Iterator:
    started: list[Worker] = []

    def start(*args: str) -> Worker:
        workdir = tmp_path / f"worker-{len(started)}"
        workdir.mkdir()
        worker = Worker(worker_cache, workdir, *args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
