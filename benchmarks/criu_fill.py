"""How fast CRIU's restorer fills a process's memory, against plain reads of the same image, in one run.

    sudo python benchmarks/criu_fill.py --size-gib 1.77 --dir /var/tmp/fill --touch-gib 96 --contend-readers 8

A hot restore of the builtin engine on the H200 spends most of its CRIU time in the restorer's `preadv`
of the pages image into the restored process's private memory. This takes that part alone: a process holding
`--size-gib` GiB of private anonymous memory (random bytes, as a heap) is dumped once, then restored
`--repeat` times under each transparent huge pages mode, beside these baselines on the same image, hot in
the page cache:

- the copy alone: the image read into one 16 MiB buffer used again and again (the page cache's floor);
- one reader filling one fresh mapping the size of the image: what the restorer does, outside CRIU;
- one reader filling fresh 16 MiB mappings, unmapped after each (the bench's fresh-memory floor up to
  2026-12-01: the kernel hands the freed pages straight back, warm in the caches);
- eight readers each filling one fresh mapping of an eighth: what parallel reads inside CRIU could reach.

CRIU's restorer row is the restorer's own reads, timed from its log. With `--touch-gib`, every row is
measured again after a process has faulted in and freed that much memory: whether memory a virtual machine
never touched costs more to fill (a long-running node has touched all of its memory). With
`--contend-readers N`, every row is measured again while N threads copy the image from the page cache into
reused buffers: the memory traffic a weight stager makes beside a product restore, without the GPU.
CRIU comes from `--criu`, else WARMSTART_CRIU, else `criu` on PATH; it runs as root.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import json
import mmap
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from restore_bench import READ_CHUNK, read_bandwidth

from warmstart.checkpoint import hugepages
from warmstart.checkpoint.criu import RESTORE_READERS, Criu
from warmstart.host.env import default_criu_command
from warmstart.serve.local_node import usable_criu

GIB = 1 << 30
PR_SET_CHILD_SUBREAPER = 36
HOLDER = """
import hashlib, mmap, os, sys, time
size, ready, ask = int(sys.argv[1]), sys.argv[2], sys.argv[3]
memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for offset in range(0, size, 64 << 20):
    block = os.urandom(min(64 << 20, size - offset))
    memory[offset:offset + len(block)] = block


def answer(path):
    with open(path + ".part", "w") as out:
        out.write(hashlib.sha256(memory).hexdigest())
    os.rename(path + ".part", path)


answer(ready)
while True:
    if os.path.exists(ask):
        os.unlink(ask)
        answer(ask + ".digest")
    time.sleep(0.01)
"""
PREADV = re.compile(r"^\((\d+\.\d+)\) pie: \d+: Preadv ")
RETURNED = re.compile(r"^\((\d+\.\d+)\) pie: \d+: `- returned (\d+)")


@dataclass
class Row:
    name: str
    seconds: list[float]
    nbytes: int
    note: str = ""

    def median(self) -> float:
        return statistics.median(self.seconds)


@dataclass
class Held:
    """The memory holder's process, the SHA-256 of its memory, and the file that asks it for the digest."""

    process: subprocess.Popen[bytes]
    digest: str
    ask: Path


def hold_memory(size: int, work: Path) -> Held:
    """A process holding `size` bytes of private anonymous memory, filled; returned once it is."""
    ready, ask = work / "holder.ready", work / "holder.ask"
    ready.unlink(missing_ok=True)
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(size), str(ready), str(ask)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 300
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the memory holder did not start (exit {process.poll()})")
        time.sleep(0.05)
    return Held(process, ready.read_text(), ask)


def restorer_reads(log_file: Path) -> tuple[int, float]:
    """Bytes the restorer read and the seconds those reads took, from a CRIU -v4 restore log (serial
    preadv calls, or one parallel read of all pages by a CRIU built with it)."""
    nbytes, seconds, started = 0, 0.0, None
    for line in log_file.read_text(errors="replace").splitlines():
        if match := PREADV.match(line):
            started = float(match.group(1))
        elif (match := RETURNED.match(line)) and started is not None:
            nbytes, seconds, started = (
                nbytes + int(match.group(2)),
                seconds + float(match.group(1)) - started,
                None,
            )
    return nbytes, seconds


def restored_digest(ask: Path, timeout: float = 120.0) -> str:
    """The SHA-256 of the restored holder's memory, which it computes when `ask` appears."""
    answer = ask.with_name(ask.name + ".digest")
    answer.unlink(missing_ok=True)
    ask.touch()
    deadline = time.monotonic() + timeout
    while not answer.exists():
        if time.monotonic() > deadline:
            raise SystemExit("the restored holder did not answer with the digest of its memory")
        time.sleep(0.02)
    return answer.read_text()


def restore_once(criu: Criu, images: Path, logs: Path, held: Held) -> tuple[float, int, float]:
    """One restore: its wall seconds, and the restorer's bytes and seconds of reads. The restored memory
    must hash as it did before the dump. The restored process is killed and reaped (this process is its
    subreaper), so its PID is free for the next."""
    started = time.monotonic()
    pid = criu.restore(images, logs_dir=logs)
    wall = time.monotonic() - started
    try:
        if (digest := restored_digest(held.ask)) != held.digest:
            raise SystemExit(f"the restored memory differs: SHA-256 {digest}, {held.digest} before the dump")
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return (wall, *restorer_reads(logs / "restore.log"))


def fresh_chunks(paths: list[Path]) -> tuple[int, float]:
    """One reader filling fresh READ_CHUNK mappings, each unmapped before the next."""
    total, started = 0, time.monotonic()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            for offset in range(0, path.stat().st_size, READ_CHUNK):
                with mmap.mmap(-1, READ_CHUNK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as fresh:
                    total += os.preadv(fd, [fresh], offset)
        finally:
            os.close(fd)
    return total, time.monotonic() - started


def pages_images(images: Path) -> list[Path]:
    return sorted(images.glob("pages-*.img"))


def measure(
    criu: Criu, images: Path, logs: Path, held: Held, args: argparse.Namespace, label: str
) -> list[Row]:
    pages = pages_images(images)
    image_bytes = sum(p.stat().st_size for p in pages)
    read_bandwidth(pages)  # the image hot in the page cache

    def fresh(readers: int) -> Callable[[], tuple[int, float]]:
        return lambda: read_bandwidth(pages, readers, fresh_memory=True)

    baselines: list[tuple[str, Callable[[], tuple[int, float]], str]] = [
        (
            "the copy alone: 16 MiB buffer reused, 1 reader",
            lambda: read_bandwidth(pages, 1),
            "page cache floor",
        ),
        ("1 reader, one fresh mapping", fresh(1), "the restorer's work"),
        ("1 reader, fresh 16 MiB mappings", lambda: fresh_chunks(pages), "warm recycled pages"),
        ("8 readers, one fresh mapping each", fresh(8), "parallel"),
    ]
    rows = [Row(f"{label}{name}", [], image_bytes, note) for name, _, note in baselines]
    restores = {
        readers: (
            Row(f"{label}CRIU restorer's reads, {readers} readers", [], image_bytes, "from CRIU's log"),
            Row(f"{label}CRIU restore, whole, {readers} readers", [], image_bytes, "wall"),
        )
        for readers in args.readers
    }
    for _ in range(args.repeat):
        for row, (_, run, _) in zip(rows, baselines, strict=True):
            nbytes, seconds = run()
            assert nbytes == image_bytes, (row.name, nbytes, image_bytes)
            row.seconds.append(seconds)
        for readers, (restorer, whole) in restores.items():
            os.environ[RESTORE_READERS] = str(readers)
            wall, nbytes, seconds = restore_once(criu, images, logs, held)
            whole.seconds.append(wall)
            restorer.seconds.append(seconds)
            restorer.nbytes = nbytes
    return [*rows, *(row for pair in restores.values() for row in pair)]


def run(args: argparse.Namespace) -> list[Row]:
    criu, why_not = usable_criu(args.criu or default_criu_command())
    if criu is None:
        raise SystemExit(f"needs CRIU 4 as root: {why_not}")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="criu-fill-", dir=args.dir))
    images, logs = work / "images", work / "logs"
    held = hold_memory(int(args.size_gib * GIB), work)
    try:
        criu.dump(held.process.pid, images, logs_dir=logs)
    finally:
        held.process.kill()
        held.process.wait()
    rows: list[Row] = []
    try:
        for label, condition in passes(args, images):
            with condition():
                for mode in args.thp:
                    with hugepages.selected(mode):
                        rows += measure(criu, images, logs, held, args, f"THP {mode}{label}: ")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return rows


def passes(
    args: argparse.Namespace, images: Path
) -> list[tuple[str, Callable[[], AbstractContextManager[None]]]]:
    """Each pass of measurements: its label and the condition it runs under."""
    chosen: list[tuple[str, Callable[[], AbstractContextManager[None]]]] = [("", contextlib.nullcontext)]
    if args.touch_gib:
        chosen.append((", memory touched", lambda: touched(int(args.touch_gib * GIB))))
    if args.contend_readers:
        name = f", {args.contend_readers} readers copying beside it"
        chosen.append((name, lambda: contending(pages_images(images), args.contend_readers)))
    return chosen


@contextlib.contextmanager
def touched(nbytes: int) -> Iterator[None]:
    """First fault in and free `nbytes` of anonymous memory, one share per core."""
    threads = os.cpu_count() or 1
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE

    def touch(_index: int) -> None:
        mmap.mmap(-1, nbytes // threads, flags=flags).close()

    started = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(touch, range(threads)))
    print(f"touched {nbytes / GIB:g} GiB of memory in {time.monotonic() - started:.1f} s")
    yield


@contextlib.contextmanager
def contending(paths: list[Path], readers: int) -> Iterator[None]:
    """`readers` threads copying `paths` (hot) from the page cache into reused buffers, over and over, for
    the duration: the memory traffic of a weight stager beside a restore, without the GPU."""
    pieces = [(path, offset) for path in paths for offset in range(0, path.stat().st_size, READ_CHUNK)]
    stop, copied = threading.Event(), [0] * readers

    def copy(index: int) -> None:
        buffer = bytearray(READ_CHUNK)
        descriptors = {path: os.open(path, os.O_RDONLY) for path in paths}
        try:
            while not stop.is_set():
                for path, offset in pieces[index::readers]:
                    copied[index] += os.preadv(descriptors[path], [buffer], offset)
        finally:
            for fd in descriptors.values():
                os.close(fd)

    threads = [threading.Thread(target=copy, args=(index,), daemon=True) for index in range(readers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        rate = sum(copied) / (time.monotonic() - started) / GIB
        print(f"{readers} readers copied from the page cache at {rate:.1f} GiB/s beside the measurements")


def print_table(rows: list[Row], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"CRIU's memory fill: {rows[0].nbytes / GIB:.2f} GiB image, {os.cpu_count()} cores, "
        f"median of {args.repeat}"
    )
    for column, justify in (("measurement", "left"), ("GiB", "right"), ("seconds", "right"),
                            ("GiB/s", "right"), ("range (s)", "right"), ("note", "left")):  # fmt: skip
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    for row in rows:
        median = row.median()
        rate = f"{row.nbytes / median / GIB:.2f}" if median else "-"
        spread = f"{min(row.seconds):.3f}-{max(row.seconds):.3f}"
        table.add_row(row.name, f"{row.nbytes / GIB:.2f}", f"{median:.3f}", rate, spread, row.note)
    console = Console()
    (console if console.is_terminal else Console(width=150)).print(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size-gib", type=float, default=1.77, help="memory the process holds (default 1.77)"
    )
    parser.add_argument("--dir", required=True, help="where to work (in a folder of its own, removed after)")
    parser.add_argument("--repeat", type=int, default=3, help="restores per mode (default 3)")
    parser.add_argument("--thp", nargs="+", choices=hugepages.MODES, default=["always", "madvise"])
    parser.add_argument(
        "--touch-gib",
        type=float,
        default=0.0,
        help="measure again after faulting in and freeing this much memory",
    )
    parser.add_argument(
        "--contend-readers", type=int, default=0,
        help="measure again with this many threads copying the image beside (a weight stager's traffic)",
    )  # fmt: skip
    parser.add_argument(
        "--readers", type=int, nargs="+", default=[1],
        help=f"restore with each of these {RESTORE_READERS} (CRIU built with parallel page reads; default 1)",
    )  # fmt: skip
    parser.add_argument("--criu", default="", help="CRIU command (default WARMSTART_CRIU, else criu)")
    parser.add_argument("--keep", action="store_true", help="keep the image")
    parser.add_argument("--json", default="", help="also write the rows to this JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(row) for row in rows], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
