"""The weight stager's two copy paths, against the PCIe floor and beside a CRIU-like reader, in one run.

    python benchmarks/stager_copy.py --size-gib 16 --dir /var/tmp/stage [--image-gib 1.8] [--dropped]

A product restore runs the weight stager (16 GB of Qwen3-8B weights from the page cache to the GPU) while
CRIU's restorer fills the restored process's memory from its pages image with one reader. The stager can
copy two ways (`warmstart.gpu.weight_stager --copy`):

- buffered: page cache -> a pinned buffer (a CPU copy) -> GPU: every byte crosses host memory three times;
- mapped: the page cache itself, mapped and pinned piece by piece, -> GPU by DMA: once.

`--variants` picks paths and piece sizes (`buffered:2`: 2 MiB pieces, small enough for the pinned buffers to
stay in the CPU's last-level cache).

For each path this prints the fill's time and rate with the page cache hot (and, with `--dropped`, after
the files were evicted), the stager's CPU seconds, and the rate of one reader filling one fresh mapping from
an `--image-gib` file (what CRIU's restorer does) alone and while that fill runs. The floor is one large
pinned-host-to-GPU copy (torch) over the same bytes. The weights are `--files`, else scratch files written
in `--dir` (removed afterwards). Every fill is checked: the first and last MiB of each file read back from
the GPU must equal the file.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from restore_bench import pinned_to_gpu_bandwidth, read_bandwidth

from warmstart.checkpoint import hugepages
from warmstart.gpu.weight_stager.plan import Copy
from warmstart.gpu.weight_stager.stage import COPY_PATHS, STAGING_THREADS, SharedDeviceMemory, fill
from warmstart.snapshot.residency import evict

GIB = 1 << 30
MIB = 1 << 20
CHECK_BYTES = 1 << 20
SCRATCH_FILES = 4


@dataclass(frozen=True)
class Variant:
    copy: str
    piece_bytes: int | None = None  # None: the copy path's own
    threads: int | None = None  # None: --threads

    @classmethod
    def parse(cls, text: str) -> Variant:
        """`mapped`, `buffered:2` (pieces of 2 MiB), `mapped::16` (16 threads), `mapped:256:16`."""
        copy, mib, threads = (text.split(":") + ["", ""])[:3]
        if copy not in COPY_PATHS:
            raise argparse.ArgumentTypeError(f"{copy!r} is not one of {', '.join(COPY_PATHS)}")
        return cls(copy, int(float(mib) * MIB) if mib else None, int(threads) if threads else None)

    def __str__(self) -> str:
        pieces = f", {self.piece_bytes // MIB} MiB pieces" if self.piece_bytes else ""
        return f"{self.copy}{pieces}" + (f", {self.threads} threads" if self.threads else "")


@dataclass
class Fill:
    seconds: float
    cpu_seconds: float
    paths: list[str]
    reader_gib_s: float | None = None


def write_random(path: Path, size: int) -> Path:
    """`size` bytes at `path`: one random 64 MiB block repeated (speed is measured here, not content)."""
    block = memoryview(os.urandom(64 * MIB))
    with path.open("wb") as handle:
        left = size
        while left:
            left -= handle.write(block[: min(len(block), left)])
    return path


def copies_of(files: list[Path]) -> tuple[Copy, ...]:
    copies, offset = [], 0
    for path in files:
        size = path.stat().st_size
        copies.append((str(path), 0, offset, size))
        offset += -(-size // (2 * MIB)) * 2 * MIB
    return tuple(copies)


def fill_once(memory: SharedDeviceMemory, copies: tuple[Copy, ...], fds: dict[str, int], threads: int,
              variant: Variant, image: Path | None) -> Fill:  # fmt: skip
    """One fill; with `image`, one fresh-memory reader of it runs beside the fill (its rate recorded)."""
    reader: list[float] = []

    def read_image() -> None:
        nbytes, seconds = read_bandwidth([image], 1, fresh_memory=True)
        reader.append(nbytes / seconds / GIB)

    thread = threading.Thread(target=read_image) if image is not None else None
    cpu, started = time.process_time(), time.perf_counter()
    if thread is not None:
        thread.start()
    paths = fill(memory, copies, fds, variant.threads or threads, variant.copy, variant.piece_bytes)
    seconds = time.perf_counter() - started
    cpu_seconds = time.process_time() - cpu
    if thread is not None:
        thread.join()
    check_filled(memory, copies, fds)
    return Fill(seconds, cpu_seconds, paths, reader[0] if reader else None)


def check_filled(memory: SharedDeviceMemory, copies: tuple[Copy, ...], fds: dict[str, int]) -> None:
    cu, check = memory._cu, memory._check
    for path, file_offset, offset, nbytes in copies:
        for start in (0, max(0, nbytes - CHECK_BYTES)):
            length = min(CHECK_BYTES, nbytes - start)
            host = ctypes.create_string_buffer(length)
            check(cu.cuMemcpyDtoH(host, memory.address + offset + start, length), "cuMemcpyDtoH")
            if host.raw != os.pread(fds[path], length, file_offset + start):
                raise SystemExit(f"FAILED: the GPU does not hold {path} at {start} after the fill")


def run(args: argparse.Namespace, files: list[Path], image: Path) -> None:
    copies = copies_of(files)
    total = sum(c[3] for c in copies)
    fds = {c[0]: os.open(c[0], os.O_RDONLY) for c in copies}
    range_bytes = -(-(copies[-1][2] + copies[-1][3]) // GIB) * GIB
    memory = SharedDeviceMemory(0, range_bytes)
    try:
        floor = pinned_to_gpu_bandwidth()
        read_bandwidth(files + [image], 8)  # everything hot in the page cache
        alone = [read_bandwidth([image], 1, fresh_memory=True) for _ in range(args.repeat)]
        alone_rate = statistics.median(n / s / GIB for n, s in alone)
        print(f"{total / GIB:.2f} GiB of weights in {len(files)} files, {args.threads} threads; "
              f"image {image.stat().st_size / GIB:.2f} GiB")  # fmt: skip
        if floor:
            print(f"floor: pinned host -> GPU {floor / GIB:.1f} GiB/s: {total / floor:.3f} s for these bytes")
        print(f"one reader filling fresh memory from the image, alone: {alone_rate:.2f} GiB/s (median of "
              f"{args.repeat})\n")  # fmt: skip
        print("| copy | page cache | fill (median) | min-max | GiB/s | vs floor | stager CPU s "
              "| reader beside it GiB/s | reader vs alone | n |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for variant in args.variants:
            fill_once(memory, copies, fds, args.threads, variant, None)  # warm: the driver's first pins
            hot = [fill_once(memory, copies, fds, args.threads, variant, image) for _ in range(args.repeat)]
            print_row(variant, "hot", hot, total, floor, alone_rate)
            if args.dropped:
                dropped = []
                for _ in range(args.repeat):
                    for path in files:
                        evict(path)
                    dropped.append(fill_once(memory, copies, fds, args.threads, variant, None))
                print_row(variant, "dropped", dropped, total, floor, alone_rate)
                read_bandwidth(files, 8)
    finally:
        memory.close()
        for fd in fds.values():
            os.close(fd)


def print_row(
    variant: Variant, cache: str, fills: list[Fill], total: int, floor: float | None, alone: float
) -> None:
    seconds = [f.seconds for f in fills]
    median = statistics.median(seconds)
    readers = [f.reader_gib_s for f in fills if f.reader_gib_s is not None]
    reader = statistics.median(readers) if readers else None
    ended = sorted({p for f in fills for p in f.paths})
    cells = [
        str(variant) if ended == [variant.copy] else f"{variant} (ended as {', '.join(ended)})",
        cache,
        f"{median:.3f} s",
        f"{min(seconds):.3f}-{max(seconds):.3f} s",
        f"{total / median / GIB:.1f}",
        f"{median * floor / total:.2f}x" if floor else "",
        f"{statistics.median(f.cpu_seconds for f in fills):.2f}",
        f"{reader:.2f}" if reader else "",
        f"{reader / alone:.2f}x" if reader else "",
        str(len(fills)),
    ]
    print("| " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", nargs="*", type=Path, help="weight files (default: scratch files)")
    parser.add_argument("--size-gib", type=float, default=16.0, help="scratch weights to write (default 16)")
    parser.add_argument("--image-gib", type=float, default=1.8, help="the CRIU-like reader's image (1.8)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="scratch directory")
    parser.add_argument("--threads", type=int, default=STAGING_THREADS)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dropped", action="store_true", help="also fill after evicting the weight files")
    parser.add_argument(
        "--variants", nargs="+", type=Variant.parse, default=[Variant(copy) for copy in COPY_PATHS],
        help="copy paths to measure, each with its piece size in MiB if not its own: mapped buffered:2 ...",
    )  # fmt: skip
    parser.add_argument("--transparent-hugepages", choices=hugepages.MODES, help="the node's mode meanwhile")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="stager-copy-", dir=args.dir))
    try:
        share = int(args.size_gib * GIB) // SCRATCH_FILES
        files = args.files or [
            write_random(scratch / f"weights-{n}.bin", share) for n in range(SCRATCH_FILES)
        ]
        image = write_random(scratch / "pages.img", int(args.image_gib * GIB))
        with hugepages.selected(args.transparent_hugepages):
            run(args, files, image)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
