"""Model directories: `config.json` plus safetensors weight files, and a digest of the weights.

`ensure_model()` generates a preset's weights deterministically from a seed (no download needed) and writes
them once; the `demo` preset's are trained instead (`train.py`), once, on text shipped with the package.
The weights' digest is `warmstart.engines.digest`'s (shared with the other engines).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

from warmstart.engines.builtin.shapes import PRESETS, TRAINED_PRESETS, ModelConfig, preset, tensor_shapes
from warmstart.engines.digest import write_sidecar
from warmstart.gpu.weights_io import dtype_code, write_safetensors
from warmstart.host.env import cache_dir

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
INIT_STD = 0.02


def default_model_dir(preset_name: str, seed: int, overrides: dict[str, Any] | None = None) -> Path:
    """`$WARMSTART_CACHE/models/<preset>-<seed>`, with a suffix when fields are overridden."""
    name = f"{preset_name}-{seed}"
    if overrides:
        suffix = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:10]
        name = f"{name}-{suffix}"
    return cache_dir() / "models" / name


def model_directory(
    model: str, model_dir: str | os.PathLike[str] | None, seed: int, overrides: dict[str, Any]
) -> Path:
    """Where the builtin engine finds `model`: `model_dir` when given, else a preset's default directory,
    else `model` itself (a directory)."""
    if model_dir:
        return Path(model_dir)
    return default_model_dir(model, seed, overrides) if model in PRESETS else Path(model)


def ensure_model(
    model_dir: str | Path,
    preset_name: str = "tiny",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
) -> Path:
    """Make sure `model_dir` holds the preset's weights for `seed`; generate and write them if not.

    Writing goes to a staging directory inside `model_dir` whose files are renamed into place, `config.json`
    last, so a crash never leaves a model that looks whole. Staging inside (not beside) the directory lets
    `model_dir` be a mount point, as a volume in a pod is. `device` is where random numbers are drawn (a GPU
    draws 8B weights much faster); the files, not the device, define the model, and the digest follows the
    files. A trained preset (`TRAINED_PRESETS`) is trained on the CPU whatever `device` says.
    """
    model_dir = Path(model_dir)
    if (model_dir / WEIGHTS_FILE).exists() and (model_dir / "config.json").exists():
        return model_dir
    config = preset(preset_name, **(overrides or {}))
    # Pods sharing the directory can run their engines under the same PID: a random part keeps them apart.
    staging = model_dir / f".partial-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        trained = preset_name in TRAINED_PRESETS
        log.info(
            "%s %s weights (seed %d, %.1f M parameters) in %s",
            "training" if trained else "generating",
            preset_name,
            seed,
            config.parameter_count / 1e6,
            model_dir,
        )
        config.save(staging)
        if trained:
            digest = _write_trained_weights(staging, seed)
        else:
            digest = _write_random_weights(staging / WEIGHTS_FILE, config, seed, device)
        write_sidecar(staging, {WEIGHTS_FILE: digest})
        # A concurrent writer's identical files are replaced atomically; config.json marks completion.
        for name in sorted(os.listdir(staging), key=lambda entry: entry == "config.json"):
            os.rename(staging / name, model_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model_dir


def initial_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: Any, device: str = "cpu") -> Any:
    """A weight as generated for `seed`: norms are ones, every other tensor N(0, INIT_STD) from its own
    generator (a tensor's values depend on the seed and its name only)."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)
    tensor_seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)
    generator = torch.Generator(device=device).manual_seed(tensor_seed)
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return (values * INIT_STD).to(dtype)


def _write_random_weights(path: Path, config: ModelConfig, seed: int, device: str) -> str:
    import torch

    dtype = getattr(torch, config.torch_dtype)
    sources = [
        (name, dtype_code(dtype), shape, functools.partial(initial_tensor, name, shape, seed, dtype, device))
        for name, shape in tensor_shapes(config)
    ]
    hasher = hashlib.sha256()
    write_safetensors(path, sources, metadata={"format": "pt", "seed": str(seed)}, on_bytes=hasher.update)
    return hasher.hexdigest()


def _write_trained_weights(model_dir: Path, seed: int) -> str:
    """Train the weights for `model_dir`'s config.json in a child process, which writes them there: its
    threads, memory and autograd state stay out of this process (a worker, checkpointed later). Returns the
    weights file's SHA-256."""
    started = time.monotonic()
    command = [sys.executable, "-m", "warmstart.engines.builtin.train", str(model_dir), str(seed)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"training the model in {model_dir} failed:\n{result.stderr[-4000:]}")
    with open(model_dir / WEIGHTS_FILE, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    summary = result.stdout.strip().splitlines()
    log.info("trained in %.1f s (%s)", time.monotonic() - started, summary[-1] if summary else "no summary")
    return digest
