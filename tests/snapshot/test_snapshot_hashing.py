"""Parallel hashing: whole-file and chunk digests equal hashlib's (and blake3's) over the same bytes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import blake3
import pytest

from warmstart.snapshot.hashing import chunk_ranges, hash_files, hash_range


@pytest.mark.parametrize(
    ("size", "chunk_size"), [(0, 1 << 20), (1, 1 << 20), (5 << 20, 1 << 20), ((3 << 20) + 7, 1 << 20)]
)
def test_chunk_ranges_cover_the_file_exactly(size: int, chunk_size: int) -> None:
    ranges = chunk_ranges(size, chunk_size)
    assert sum(length for _, length in ranges) == size
    assert all(offset == index * chunk_size for index, (offset, _) in enumerate(ranges))


@pytest.mark.parametrize(("chunk_hash", "reference"), [("blake3", blake3.blake3), ("sha256", hashlib.sha256)])
def test_hash_files_matches_the_reference_hashes(tmp_path: Path, chunk_hash: str, reference: Any) -> None:
    contents = {
        "big": os.urandom((3 << 20) + 123),
        "small": b"small",
        "empty": b"",
        "exact": os.urandom(2 << 20),
    }
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
    hashes = hash_files(
        [tmp_path / name for name in contents], workers=3, chunk_size=1 << 20, chunk_hash=chunk_hash
    )
    for name, data in contents.items():
        result = hashes[tmp_path / name]
        assert result.digest == "sha256:" + hashlib.sha256(data).hexdigest()
        assert result.size == len(data)
        if len(data) > 1 << 20:
            expected = [
                reference(data[o : o + length]).hexdigest() for o, length in chunk_ranges(len(data), 1 << 20)
            ]
            assert list(result.chunks) == expected and result.chunk_size == 1 << 20
            assert result.chunk_hash == chunk_hash
        else:
            assert result.chunks == () and result.chunk_size == 0


def test_hash_range_hashes_exactly_the_range(tmp_path: Path) -> None:
    data = os.urandom(10 << 20)
    path = tmp_path / "data"
    path.write_bytes(data)
    for offset, length in [(0, 1), (123, 5 << 20), ((10 << 20) - 9, 9)]:
        piece = data[offset : offset + length]
        assert hash_range(path, offset, length) == hashlib.sha256(piece).hexdigest()
        assert hash_range(path, offset, length, "blake3") == blake3.blake3(piece).hexdigest()
