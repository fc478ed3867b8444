"""The `demo` preset (what `make demo` serves): trained once on the packaged text, it answers in words, and a
trained model is reused rather than trained again. Training takes about half a minute on 2 cores, once per
module."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from support import share_of_word_characters

torch = pytest.importorskip("torch", reason="needs torch (the `engine` extra)")

from warmstart.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from warmstart.engines.builtin.engine import BuiltinEngine  # noqa: E402
from warmstart.engines.builtin.model_dir import ensure_model  # noqa: E402
from warmstart.engines.builtin.shapes import TRAINED_PRESETS, preset  # noqa: E402
from warmstart.engines.builtin.train import TEXT_FILE  # noqa: E402
from warmstart.engines.digest import DIGEST_SIDECAR, model_digest  # noqa: E402

PROMPT = "The snapshot"


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """(a freshly trained demo model, seconds ensure_model took to train and write it)."""
    started = time.monotonic()
    model_dir = ensure_model(tmp_path_factory.mktemp("models") / "demo-0", "demo", seed=0)
    return model_dir, time.monotonic() - started


@pytest.fixture(scope="module")
def demo_engine(demo_model: tuple[Path, float]):
    engine = BuiltinEngine(model="demo", model_dir=demo_model[0], device="cpu")
    engine.load()
    engine.warm_up()
    yield engine
    engine.close()


def greedy(engine: BuiltinEngine, prompt: str = PROMPT, max_tokens: int = 64) -> str:
    request = GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, temperature=0))
    return engine.generate([request])[0].text


def test_the_demo_preset_is_trained_on_plain_text() -> None:
    assert "demo" in TRAINED_PRESETS and "tiny" not in TRAINED_PRESETS
    assert preset("demo").vocab_size == 260  # the byte tokenizer's
    text = TEXT_FILE.read_text(encoding="utf-8")
    assert share_of_word_characters(text) == 1.0 and text.count(PROMPT) >= 3


@pytest.mark.spawns
def test_the_demo_model_answers_in_words(demo_model, demo_engine) -> None:
    model_dir, seconds = demo_model
    text = greedy(demo_engine)
    print(f"trained and written in {seconds:.1f} s; {PROMPT!r} -> {text!r}")
    assert text.strip(), "an empty completion"
    assert share_of_word_characters(text) > 0.9, text
    assert len(text.split()) >= 5, text  # words, not one long run of letters
    assert greedy(demo_engine) == text  # greedy decoding is deterministic
    assert {path.name for path in model_dir.iterdir()} == {"config.json", "model.safetensors", DIGEST_SIDECAR}


@pytest.mark.spawns
def test_a_trained_model_is_reused_untouched(demo_model, monkeypatch) -> None:
    model_dir, _ = demo_model
    before = {path.name: path.stat().st_mtime_ns for path in model_dir.iterdir()}
    digest = model_digest(model_dir)

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a reused model started a process: {args}")

    monkeypatch.setattr(subprocess, "run", no_training)
    started = time.monotonic()
    assert ensure_model(model_dir, "demo", seed=0) == model_dir
    assert time.monotonic() - started < 1.0
    assert {path.name: path.stat().st_mtime_ns for path in model_dir.iterdir()} == before
    assert model_digest(model_dir) == digest


@pytest.mark.spawns
def test_the_digest_and_identity_come_from_the_written_files(demo_model, demo_engine) -> None:
    model_dir, _ = demo_model
    identity = demo_engine.identity()
    assert identity.model_digest == model_digest(model_dir)
    assert identity.engine_args["model"] == "demo"
