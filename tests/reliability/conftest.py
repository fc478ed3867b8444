"""Fixtures for the reliability tests: a real worker process, and the worker's app served in this process
by uvicorn with the same connection settings, both with the tiny builtin model on CPU, on loopback only."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the reliability tests run the builtin engine, which needs torch")
pytest.importorskip("httpx", reason="the reliability tests talk HTTP through httpx (the `dev` extra)")

from reliability_helpers import InProcessWorker, load_tiny_engine
from support import free_port
from worker_helpers import Worker

from warmstart.engines.base import Engine


@pytest.fixture(scope="session")
def worker_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache dir with the tiny model already generated, so each worker start only loads it."""
    from warmstart.engines.builtin.model_dir import ensure_model

    cache = tmp_path_factory.mktemp("cache")
    ensure_model(cache / "models" / "tiny-0", "tiny", seed=0)
    return cache


@pytest.fixture(scope="module")
def worker(worker_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Worker, int]]:
    """A real `warmstart worker --mode cold` process and its port."""
    port = free_port()
    process = Worker(worker_cache, tmp_path_factory.mktemp("worker"), "--mode", "cold", "--port", str(port))
    process.wait_ready(port)
    yield process, port
    assert process.stop() == 0, process.logs()


@pytest.fixture(scope="session")
def tiny_engine(worker_cache: Path) -> Iterator[Engine]:
    """The tiny builtin engine, loaded in this process (shared: in-process servers come and go)."""
    engine = load_tiny_engine(worker_cache / "models" / "tiny-0")
    yield engine
    engine.close()


@pytest.fixture
def serve_in_process(tiny_engine: Engine) -> Iterator[Callable[..., InProcessWorker]]:
    started: list[InProcessWorker] = []

    def start(**kwargs: object) -> InProcessWorker:
        server = InProcessWorker(kwargs.pop("engine", tiny_engine), **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
