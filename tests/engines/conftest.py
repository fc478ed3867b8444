"""Fixtures for engine tests: one tiny model generated per session, engines on CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the builtin engine needs torch (the `engine` extra)")

from warmstart.engines.builtin.engine import BuiltinEngine  # noqa: E402
from warmstart.engines.builtin.model_dir import ensure_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(tmp_path_factory.mktemp("models") / "tiny-0", "tiny", seed=0)


@pytest.fixture
def make_engine(tiny_model_dir: Path) -> Iterator:
    engines: list[BuiltinEngine] = []

    def make(**options: object) -> BuiltinEngine:
        options.setdefault("model_dir", tiny_model_dir)
        engine = BuiltinEngine(model="tiny", device="cpu", **options)
        engine.load()
        engine.warm_up()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
