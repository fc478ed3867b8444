"""Snapshot store throughput: publish and verify against raw disk and hashing baselines, in one run.

    python benchmarks/store_throughput.py --size-gib 2 --dir /var/tmp/bench

Writes a synthetic snapshot of `--size-gib` GiB in `--files` files (random bytes, as CRIU leaves them: in
the page cache, not yet synced), publishes it into a fresh store (hash + fsync + hardlink into blobs), and
verifies it with the page cache dropped and hot. Baselines measured on the same bytes in the same run:
sequential O_DIRECT read, sequential and parallel buffered reads after dropping the cache, the chunk digests
alone with each chunk hash (BLAKE3, SHA-256 of older manifests), and single-thread SHA-256 (from memory and
from hot files). The page cache of the benchmark's files is dropped with
posix_fadvise(DONTNEED); as root, /proc/sys/vm/drop_caches is written too (disable with --no-global-drop).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import mmap
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from warmstart.api.identity import SnapshotIdentity
from warmstart.host.parallel import default_workers, parallel_map, run_heaviest_first
from warmstart.snapshot import SnapshotStore
from warmstart.snapshot.hashing import CHUNK_HASHES, DEFAULT_CHUNK_HASH, chunk_ranges, hash_file, hash_range
from warmstart.snapshot.residency import evict
from warmstart.snapshot.signing import HmacKey

GIB = 1 << 30
CHUNK = 4 << 20
ALIGN = 4096


@dataclass(frozen=True)
class Result:
    name: str
    bytes: int
    seconds: float
    note: str

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9


def timed(
    function: Callable[[], object], *, repeat: int = 1, before: Callable[[], object] | None = None
) -> float:
    """Best of `repeat` runs (the least disturbed by other load); `before` runs untimed ahead of each."""
    best = float("inf")
    for _ in range(repeat):
        if before is not None:
            before()
        started = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - started)
    return best


# --- page cache ------------------------------------------------------------------------------------------


def drop_cache(paths: list[Path], *, global_drop: bool) -> str:
    """Evict `paths` from the page cache; returns how it was done."""
    for path in paths:
        evict(path)
    if global_drop and os.geteuid() == 0:
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            return "fadvise DONTNEED + drop_caches"
        except OSError:
            pass
    return "fadvise DONTNEED"


# --- baselines -------------------------------------------------------------------------------------------


def read_direct(path: Path) -> int:
    """Sequential O_DIRECT read (bypasses the page cache): the disk's own speed."""
    buffer = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT requires
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    total = 0
    try:
        while count := os.preadv(fd, [buffer], total):
            total += count
            if count < CHUNK:
                break
    finally:
        os.close(fd)
        buffer.close()
    return total


def read_buffered(path: Path) -> int:
    buffer = bytearray(CHUNK)
    total = 0
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            total += count
    return total


def sha256_memory(size: int) -> float:
    """Seconds for single-thread SHA-256 over `size` bytes already in memory: the CPU's ceiling."""
    block = os.urandom(64 << 20)
    digest = hashlib.sha256()
    rounds = max(1, size // len(block))
    started = time.perf_counter()
    for _ in range(rounds):
        digest.update(block)
    return (time.perf_counter() - started) * size / (rounds * len(block))


def chunk_digests(paths: list[Path], chunk_size: int, algorithm: str, workers: int) -> list[str]:
    """Every `chunk_size` piece of `paths` hashed with `algorithm`, in parallel, as verification does."""
    jobs = [
        (length, functools.partial(hash_range, path, offset, length, algorithm))
        for path in paths
        for offset, length in chunk_ranges(path.stat().st_size, chunk_size)
    ]
    return run_heaviest_first(jobs, workers=workers)


# --- the run ---------------------------------------------------------------------------------------------


def write_synthetic(directory: Path, total: int, files: int) -> list[Path]:
    """`files` files of random bytes summing to `total`, under a CRIU-like layout."""
    (directory / "criu").mkdir(parents=True, exist_ok=True)
    per_file = total // files
    paths = []
    for index in range(files):
        path = directory / "criu" / f"pages-{index + 1}.img"
        with open(path, "wb") as handle:
            remaining = per_file if index < files - 1 else total - per_file * (files - 1)
            while remaining:
                chunk = os.urandom(min(64 << 20, remaining))
                handle.write(chunk)
                remaining -= len(chunk)
        paths.append(path)
    return paths


def run(args: argparse.Namespace) -> list[Result]:
    total = int(args.size_gib * GIB)
    workers = args.workers or default_workers()
    root = Path(args.dir) / f"store-throughput-{os.getpid()}"
    store = SnapshotStore(root / "store", hash_workers=workers, chunk_size=int(args.chunk_mib * (1 << 20)))
    signer = HmacKey(os.urandom(32))
    identity = SnapshotIdentity(model_digest="sha256:" + "0" * 64, engine="benchmark", engine_version="1")
    results: list[Result] = []
    try:
        with store.stage(identity) as staging:
            write_synthetic(staging.dir, total, args.files)
            started = time.perf_counter()
            snapshot = staging.publish(signer)
            seconds = time.perf_counter() - started
        results.append(
            Result("publish (hash + fsync + link)", total, seconds, f"{workers} threads, files hot")
        )
        blobs = [store.blob_path(entry.digest) for entry in snapshot.files.values()]

        how = drop_cache(blobs, global_drop=args.global_drop)
        drop = functools.partial(drop_cache, blobs, global_drop=args.global_drop)

        def add(name: str, function: Callable[[], object], note: str, *, cold: bool) -> None:
            seconds = timed(function, repeat=args.repeat, before=drop if cold else None)
            results.append(Result(name, total, seconds, note))

        add("verify, page cache dropped", lambda: store.verify(snapshot.id, signer), how, cold=True)
        add("verify, page cache hot", lambda: store.verify(snapshot.id, signer), "", cold=False)
        add("raw read, O_DIRECT, 1 thread", lambda: [read_direct(p) for p in blobs], "4 MiB reads", cold=True)
        add(
            "raw read, cache dropped, 1 thread",
            lambda: [read_buffered(p) for p in blobs],
            "4 MiB reads",
            cold=True,
        )
        add(
            f"raw read, cache dropped, {workers} threads",
            lambda: parallel_map(read_buffered, blobs, workers=workers),
            "no hashing",
            cold=True,
        )
        chunk = store.chunk_size or (64 << 20)
        for algorithm in CHUNK_HASHES:  # the verification's hashing work, with each chunk hash
            add(
                f"chunk digests, {algorithm}, {workers} threads, files hot",
                functools.partial(chunk_digests, blobs, chunk, algorithm, workers),
                "the verify lever" if algorithm == DEFAULT_CHUNK_HASH else "manifests before v2",
                cold=False,
            )
        results.append(Result("sha256, 1 thread, from memory", total, sha256_memory(total), "CPU ceiling"))
        add("sha256, 1 thread, files hot", lambda: [hash_file(p) for p in blobs], "", cold=False)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return results


def print_table(results: list[Result], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"store throughput: {args.size_gib:g} GiB in {args.files} files, {os.cpu_count()} cores, "
        f"chunks {args.chunk_mib:g} MiB, best of {args.repeat}"
    )
    table.add_column("measurement")
    table.add_column("GiB", justify="right")
    table.add_column("seconds", justify="right")
    table.add_column("GB/s", justify="right")
    table.add_column("note")
    for result in results:
        table.add_row(
            result.name,
            f"{result.bytes / GIB:.2f}",
            f"{result.seconds:.2f}",
            f"{result.gb_per_s:.2f}",
            result.note,
        )
    console = Console()
    (console if console.is_terminal else Console(width=140)).print(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-gib", type=float, default=2.0, help="snapshot size in GiB (default 2)")
    parser.add_argument("--dir", required=True, help="directory to work in (on the disk to measure)")
    parser.add_argument("--files", type=int, default=8, help="number of files (default 8)")
    parser.add_argument("--workers", type=int, help="hashing threads (default: the store's default)")
    parser.add_argument("--no-global-drop", dest="global_drop", action="store_false", help="fadvise only")
    parser.add_argument(
        "--chunk-mib", type=float, default=64, help="chunk digest size in MiB, 0 for none (default 64)"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="best of N for each read and verify (default 3)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the store afterwards")
    args = parser.parse_args(argv)
    if args.size_gib <= 0 or args.files < 1 or args.repeat < 1:
        parser.error("--size-gib must be positive, --files and --repeat at least 1")
    if not Path(args.dir).is_dir():
        parser.error(f"--dir {args.dir} is not a directory")
    free = shutil.disk_usage(args.dir).free
    if free < args.size_gib * GIB * 1.2:
        parser.error(
            f"--dir {args.dir} has {free / GIB:.1f} GiB free; need about {args.size_gib * 1.2:.1f} GiB"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print_table(run(args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
