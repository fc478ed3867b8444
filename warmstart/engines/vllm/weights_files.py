"""The weights back from the model's own safetensors files after a level-2 wake, without vLLM's loader.

Most of a model's loaded parameters hold exactly the bytes of one checkpoint tensor, or of several laid end
to end (vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj` along their first dimension, as its
model's `packed_modules_mapping` names). `plan` finds, for every parameter, the file ranges whose bytes it
holds, and proves each by comparing the bytes, before the sleep; the plan stays in the process's memory, so a
restored process has it. `refill` reads those ranges back with the weights image's parallel pinned reads:
the weights image's speed without writing an image anywhere, and from files a restored pod already mounts
(the restore compared their sizes and sampled digests with the capture's, and each header is checked again
before a byte is copied). A parameter that matches no file range (quantized, transformed, sharded) leaves no
plan, and the engine reloads through vLLM instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmstart.engines.vllm.weights_image import Chunk, copy_chunks, parameters
from warmstart.gpu.weights_io import pread_exact

SAFETENSORS_DTYPES = {
    "BF16": "torch.bfloat16", "F16": "torch.float16", "F32": "torch.float32", "F64": "torch.float64",
    "I64": "torch.int64", "I32": "torch.int32", "I16": "torch.int16", "I8": "torch.int8",
    "U8": "torch.uint8", "BOOL": "torch.bool",
    "F8_E4M3": "torch.float8_e4m3fn", "F8_E5M2": "torch.float8_e5m2",
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
PROVE_CHUNK = 64 << 20


class NoPlan(ValueError):
    """The parameters are not the files' bytes; the reason names the first that is not."""


@dataclass(frozen=True)
class Stored:
    """One tensor in a safetensors file: its dtype and its bytes' place."""

    file: str
    dtype: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Piece:
    file: int  # index into Plan.files
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Plan:
    """Where each parameter's bytes are: `files` (names in the model directory, with each header's digest as
    read, rechecked before a refill), then one list of pieces per parameter, in `parameters()` order."""

    files: tuple[tuple[str, str], ...]
    names: tuple[str, ...]
    pieces: tuple[tuple[Piece, ...], ...]

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for pieces in self.pieces for piece in pieces)


def read_header(path: Path) -> tuple[str, dict[str, Stored]]:
    """A safetensors file's header digest and tensors (the `__metadata__` entry left out)."""
    with open(path, "rb") as file:
        raw = file.read(8)
        if len(raw) != 8:
            raise NoPlan(f"{path.name} is not a safetensors file")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER_BYTES:
            raise NoPlan(f"{path.name}: a header of {size} bytes")
        raw = file.read(size)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise NoPlan(f"{path.name}: its header does not parse ({exc})") from exc
    tensors: dict[str, Stored] = {}
    try:
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = (int(value) for value in entry["data_offsets"])
            tensors[name] = Stored(path.name, str(entry["dtype"]), 8 + size + begin, end - begin)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise NoPlan(f"{path.name}: an entry of its header is not a tensor's ({exc!r})") from exc
    return hashlib.sha256(raw).hexdigest(), tensors


def plan(model: Any, model_dir: Path) -> Plan:
    """The file ranges of every parameter, each checked byte for byte; NoPlan says why there is none."""
    headers = {path.name: read_header(path) for path in sorted(model_dir.glob("*.safetensors"))}
    if not headers:
        raise NoPlan(f"no safetensors files in {model_dir}")
    stored = {name: tensor for _digest, tensors in headers.values() for name, tensor in tensors.items()}
    files = tuple((name, digest) for name, (digest, _tensors) in headers.items())
    index = {name: i for i, (name, _digest) in enumerate(files)}
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    names, pieces = [], []
    for name, tensor in parameters(model):
        sources = _sources(name, tensor, stored, packed)
        names.append(name)
        pieces.append(tuple(Piece(index[s.file], s.offset, s.nbytes) for s in sources))
    result = Plan(files, tuple(names), tuple(pieces))
    _prove(model, model_dir, result)
    return result


def _sources(name: str, tensor: Any, stored: dict[str, Stored], packed: dict[str, list[str]]) -> list[Stored]:
    """The stored tensors whose bytes, end to end, are this parameter's: itself, or its packed parts."""
    candidates = [[name]]
    for fused, parts in packed.items():
        if f".{fused}." in f".{name}":
            candidates.append([f".{name}".replace(f".{fused}.", f".{part}.", 1)[1:] for part in parts])
    nbytes = int(tensor.numel() * tensor.element_size())
    for names in candidates:
        found = [stored.get(part) for part in names]
        if any(entry is None for entry in found):
            continue
        sources = [entry for entry in found if entry is not None]
        if (
            all(SAFETENSORS_DTYPES.get(s.dtype) == str(tensor.dtype) for s in sources)
            and sum(s.nbytes for s in sources) == nbytes
        ):
            return sources
    raise NoPlan(f"parameter {name} ({tuple(tensor.shape)} {tensor.dtype}) is no stored tensor's bytes")


def _prove(model: Any, model_dir: Path, result: Plan, threads: int = 8) -> None:
    """Compare every parameter with its planned bytes (on its device), a chunk at a time; NoPlan names the
    first parameter that differs."""
    import torch

    targets = [tensor.reshape(-1).view(torch.uint8) for _, tensor in parameters(model)]
    chunks = list(file_chunks(result, PROVE_CHUNK))
    with _opened(model_dir, result) as fds:

        def differs(chunk: Chunk) -> bool:
            expected = torch.empty(chunk.length, dtype=torch.uint8)
            pread_exact(fds[chunk.fd_index], memoryview(expected.numpy()), chunk.file_offset)
            target = targets[chunk.target][chunk.start : chunk.start + chunk.length]
            return not torch.equal(target, expected.to(target.device))

        with ThreadPoolExecutor(threads) as pool:
            bad = list(pool.map(differs, chunks))
        differing = sorted({chunk.target for chunk, wrong in zip(chunks, bad, strict=True) if wrong})
    if differing:
        first = result.names[differing[0]]
        raise NoPlan(f"{len(differing)} parameters differ from their stored bytes, {first} first")


@contextlib.contextmanager
def _opened(model_dir: Path, planned: Plan) -> Iterator[list[int]]:
    fds: list[int] = []
    try:
        for name, _digest in planned.files:
            fds.append(os.open(model_dir / name, os.O_RDONLY))
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def refill(model: Any, model_dir: Path, planned: Plan, threads: int, chunk_bytes: int) -> dict[str, float]:
    """Read every parameter's bytes back from the model's files; NoPlan (nothing copied) when the files'
    headers or the parameters changed since the plan."""
    import torch

    started = time.perf_counter()
    tensors = parameters(model)
    if tuple(name for name, _ in tensors) != planned.names:
        raise NoPlan("the model's parameters are not the planned ones")
    for name, digest in planned.files:
        if read_header(model_dir / name)[0] != digest:
            raise NoPlan(f"{name} changed since the plan")
    targets = [tensor.reshape(-1).view(torch.uint8) for _, tensor in tensors]
    with _opened(model_dir, planned) as fds:
        copy_chunks(targets, fds, list(file_chunks(planned, chunk_bytes)), threads, chunk_bytes)
    seconds = time.perf_counter() - started
    total = planned.nbytes
    return {"bytes": float(total), "seconds": seconds, "gb_per_s": total / seconds / 1e9 if seconds else 0.0}


def file_chunks(planned: Plan, chunk_bytes: int) -> Iterator[Chunk]:
    for target, pieces in enumerate(planned.pieces):
        start = 0
        for piece in pieces:
            for at in range(0, piece.nbytes, chunk_bytes):
                length = min(chunk_bytes, piece.nbytes - at)
                yield Chunk(target, piece.file, piece.offset + at, start + at, length)
            start += piece.nbytes
