"""An engine's model files and version, found from its flags without loading the engine (no torch, no vLLM):
what a restore pod's worker measures before an engine exists (`warmstart.api.restore_facts`)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import warmstart
from warmstart.engines.base import EngineError


def model_files(
    engine: str, model: str, model_dir: str | None, seed: int, dtype: str | None, revision: str | None
) -> tuple[Path, list[Path]]:
    """(the model directory, the files that define the model) as the engine would find them."""
    if engine == "builtin":
        from warmstart.engines.builtin.model_dir import model_directory
        from warmstart.engines.digest import weight_files

        directory = model_directory(model, model_dir, seed, {"torch_dtype": dtype} if dtype else {})
        try:
            return directory, [*weight_files(directory), directory / "config.json"]
        except (ValueError, OSError) as exc:
            raise EngineError(f"no model files in {directory}: {exc}") from exc
    if engine == "vllm":
        from warmstart.engines.vllm.identity import model_files as vllm_files
        from warmstart.engines.vllm.identity import resolve_model_dir

        directory = resolve_model_dir(model_dir or model, revision)
        return directory, vllm_files(directory)
    raise EngineError(f"unknown engine {engine!r}")


def engine_version(engine: str) -> str:
    """The engine's version as installed (metadata only): what a snapshot's restore facts record."""
    if engine == "vllm":
        return _distribution("vllm")
    return f"warmstart-{warmstart.__version__}/torch-{_distribution('torch')}"


def _distribution(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""
