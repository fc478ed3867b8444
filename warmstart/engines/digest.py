"""Digests of model files, shared by the engines.

A model digest is `sha256:<hex>` over `<file sha256>  <file name>` lines in name order, so it follows the
files' bytes, not the model's name. Per-file hashes are cached in a sidecar file keyed by size and mtime, so
later starts do not re-read gigabytes; changed files are hashed again, several at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from warmstart.host.fileio import write_atomic

log = logging.getLogger(__name__)

DIGEST_SIDECAR = ".warmstart-digest.json"


def weight_files(model_dir: str | Path) -> list[Path]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors weight files")
    return files


def model_digest(model_dir: str | Path) -> str:
    return files_digest(model_dir, weight_files(model_dir))


def files_digest(model_dir: str | Path, files: Iterable[Path]) -> str:
    """The digest over `files` (inside `model_dir`), hashing only those the sidecar does not know."""
    model_dir = Path(model_dir)
    cached = read_sidecar(model_dir)
    hashes: dict[str, str] = {}
    stats: dict[str, os.stat_result] = {}
    unknown: list[Path] = []
    for path in files:
        stat = stats[path.name] = path.stat()
        entry = cached.get(path.name)
        if entry and entry.get("size") == stat.st_size and entry.get("mtime_ns") == stat.st_mtime_ns:
            hashes[path.name] = entry["sha256"]
        else:
            unknown.append(path)
    if unknown:
        # The store's hashing, several shards at once, without its prefix. Imported here: a start whose files
        # the sidecar already knows never loads the store's modules.
        from warmstart.snapshot.hashing import hash_files

        for path, found in hash_files(unknown).items():
            hashes[path.name] = found.digest.removeprefix("sha256:")
        write_sidecar(model_dir, hashes, stats)
    return combine_digests(hashes)


def combine_digests(file_hashes: dict[str, str]) -> str:
    lines = "".join(f"{file_hashes[name]}  {name}\n" for name in sorted(file_hashes))
    return "sha256:" + hashlib.sha256(lines.encode()).hexdigest()


def read_sidecar(model_dir: Path) -> dict[str, dict[str, Any]]:
    """The hashes cached beside the weights; a sidecar missing, unreadable or not as written caches none."""
    try:
        data = json.loads((model_dir / DIGEST_SIDECAR).read_text())
    except (OSError, ValueError):  # ValueError: not UTF-8, not JSON
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return {}
    return {name: entry for name, entry in files.items() if isinstance(entry, dict) and _a_sha256(entry)}


def _a_sha256(entry: dict[str, Any]) -> bool:
    return isinstance(entry.get("sha256"), str) and re.fullmatch("[0-9a-f]{64}", entry["sha256"]) is not None


def write_sidecar(
    model_dir: Path, file_hashes: dict[str, str], stats: dict[str, os.stat_result] | None = None
) -> None:
    """Record the hashes with each file's size and mtime; `stats` taken before hashing (a file changed
    while it was hashed then misses the cache next time instead of keeping a stale hash)."""
    files = {}
    for name, sha in file_hashes.items():
        stat = stats[name] if stats else (model_dir / name).stat()
        files[name] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha}
    body = json.dumps({"files": files, "digest": combine_digests(file_hashes)}, indent=2, sort_keys=True)
    try:
        write_atomic(model_dir / DIGEST_SIDECAR, (body + "\n").encode())
    except OSError as exc:  # a read-only model directory: the digest is simply not cached
        log.warning("cannot cache the weights digest in %s: %s", model_dir, exc)


# A file's sampled digest reads its first MiB (a safetensors header and the first tensors), its last window
# and evenly spaced windows between: a few MiB whatever the file's size (restore_facts.py says the rule).
SAMPLE_HEAD_BYTES = 1 << 20
SAMPLE_WINDOW_BYTES = 64 << 10
SAMPLE_WINDOWS = 16


def sampled_digest(path: Path) -> tuple[int, str]:
    """(size, hex SHA-256 over the size and the sampled regions) of one file."""
    hasher = hashlib.sha256()
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        hasher.update(size.to_bytes(8, "little"))
        for offset, length in _sample_regions(size):
            hasher.update(os.pread(file.fileno(), length, offset))
    return size, hasher.hexdigest()


def _sample_regions(size: int) -> list[tuple[int, int]]:
    if size <= SAMPLE_HEAD_BYTES + SAMPLE_WINDOWS * SAMPLE_WINDOW_BYTES:
        return [(0, size)]
    span = size - SAMPLE_HEAD_BYTES - SAMPLE_WINDOW_BYTES
    windows = [SAMPLE_HEAD_BYTES + span * index // (SAMPLE_WINDOWS - 1) for index in range(SAMPLE_WINDOWS)]
    return [(0, SAMPLE_HEAD_BYTES)] + [(offset, SAMPLE_WINDOW_BYTES) for offset in windows]


def sampled_digests(files: Iterable[Path]) -> dict[str, tuple[int, str]]:
    return {path.name: sampled_digest(path) for path in files}
