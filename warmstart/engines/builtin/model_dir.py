"""Model directories: `config.json` plus safetensors weight files, and a digest of the weights.

`ensure_model()` generates a preset's weights deterministically from a seed (no download needed) and writes
them once; `model_digest()` is SHA-256 over the weight files' bytes, cached in a sidecar file so later starts
do not re-read gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

from warmstart.config import cache_dir
from warmstart.engines.builtin.config import ModelConfig, preset, tensor_shapes
from warmstart.engines.weights_io import dtype_code, torch_dtype, write_safetensors

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
DIGEST_SIDECAR = ".warmstart-digest.json"
INIT_STD = 0.02
HASH_BLOCK = 8 << 20


def default_model_dir(preset_name: str, seed: int, overrides: dict[str, Any] | None = None) -> Path:
    """`$WARMSTART_CACHE/models/<preset>-<seed>`, with a suffix when fields are overridden."""
    name = f"{preset_name}-{seed}"
    if overrides:
        suffix = hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:10]
        name = f"{name}-{suffix}"
    return cache_dir() / "models" / name


def weight_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors weight files")
    return files


def ensure_model(
    model_dir: str | Path,
    preset_name: str = "tiny",
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
) -> Path:
    """Make sure `model_dir` holds the preset's weights for `seed`; generate and write them if not.

    Writing goes to a sibling staging directory that is renamed into place, so a crash never leaves a
    half-written model. `device` is where random numbers are drawn (a GPU draws 8B weights much faster);
    the files, not the device, define the model, and the digest follows the files.
    """
    model_dir = Path(model_dir)
    if (model_dir / WEIGHTS_FILE).exists() and (model_dir / "config.json").exists():
        return model_dir
    config = preset(preset_name, **(overrides or {}))
    staging = model_dir.parent / f".{model_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        log.info(
            "generating %s weights (seed %d, %.1f M parameters) in %s",
            preset_name,
            seed,
            config.parameter_count / 1e6,
            model_dir,
        )
        config.save(staging)
        digest = _write_random_weights(staging / WEIGHTS_FILE, config, seed, device)
        _write_sidecar(staging, {WEIGHTS_FILE: digest})
        try:
            os.rename(staging, model_dir)
        except OSError:
            if not (model_dir / WEIGHTS_FILE).exists():  # not a concurrent writer that won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model_dir


def _write_random_weights(path: Path, config: ModelConfig, seed: int, device: str) -> str:
    import torch

    dtype = torch_dtype(_code_for(config.torch_dtype))

    def producer(name: str, shape: tuple[int, ...]) -> Any:
        def produce() -> torch.Tensor:
            if name.endswith("norm.weight"):
                return torch.ones(shape, dtype=dtype)
            generator = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
            values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
            return (values * INIT_STD).to(dtype)

        return produce

    code = dtype_code(dtype)
    sources = [(name, code, shape, producer(name, shape)) for name, shape in tensor_shapes(config)]
    hasher = hashlib.sha256()
    write_safetensors(path, sources, metadata={"format": "pt", "seed": str(seed)}, on_bytes=hasher.update)
    return hasher.hexdigest()


def _tensor_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 62)


def _code_for(torch_dtype_name: str) -> str:
    return {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[torch_dtype_name]


# --- digest -----------------------------------------------------------------------------------------------


def model_digest(model_dir: str | Path) -> str:
    """`sha256:<hex>` over the weight files (each file's SHA-256 and name, in name order).

    Per-file hashes are cached in a sidecar keyed by size and mtime; a changed file is hashed again.
    """
    model_dir = Path(model_dir)
    cached = _read_sidecar(model_dir)
    hashes: dict[str, str] = {}
    changed = False
    for path in weight_files(model_dir):
        stat = path.stat()
        entry = cached.get(path.name)
        if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
            hashes[path.name] = entry["sha256"]
        else:
            hashes[path.name] = _hash_file(path)
            changed = True
    if changed:
        _write_sidecar(model_dir, hashes)
    return combine_digests(hashes)


def combine_digests(file_hashes: dict[str, str]) -> str:
    lines = "".join(f"{file_hashes[name]}  {name}\n" for name in sorted(file_hashes))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def _hash_file(path: Path) -> str:
    hasher = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        while block := os.read(fd, HASH_BLOCK):
            hasher.update(block)
    finally:
        os.close(fd)
    return hasher.hexdigest()


def _read_sidecar(model_dir: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads((model_dir / DIGEST_SIDECAR).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _write_sidecar(model_dir: Path, file_hashes: dict[str, str]) -> None:
    files = {}
    for name, sha in file_hashes.items():
        stat = (model_dir / name).stat()
        files[name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha}
    body = json.dumps({"files": files, "digest": combine_digests(file_hashes)}, indent=2, sort_keys=True)
    tmp = model_dir / f"{DIGEST_SIDECAR}.{os.getpid()}.tmp"
    try:
        tmp.write_text(body + "\n")
        os.replace(tmp, model_dir / DIGEST_SIDECAR)
    except OSError as exc:  # a read-only model directory: the digest is simply not cached
        log.warning("cannot cache the weights digest in %s: %s", model_dir, exc)
        tmp.unlink(missing_ok=True)
