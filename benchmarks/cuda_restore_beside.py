"""The CUDA restore of one process, alone and beside the loads a restore runs next to it.

    python3 benchmarks/cuda_restore_beside.py [--device-gib 1.0] [--weights-gib 12] [--dir /dev/shm]
                                              [--repeat 2] [--out FILE]     # as root, on a GPU host

A vLLM restore's CUDA step (1.45 GiB of device memory at Qwen3-8B shapes) took 0.43 s after a dropped page
cache and 0.57-0.62 s hot, when the weight stager copies 16.4 GB from the page cache to the GPU beside it
(BENCHMARKS.md, 2026-12-05 evening). Which shared resource slows it: the host-to-GPU link, or the host's
memory bandwidth? And what would fewer stager threads cost the stager?

A child process holds `--device-gib` of tensors besides its context and cuBLAS's state (about 1.5 GiB in
all, as vLLM's engine asleep). Each round checkpoints it through the driver (lock + checkpoint), starts a
load in this process, and times the restore (`warmstart.checkpoint.cuda.resume`: restore + unlock) while
the load runs:

- none;
- the weight stager's fill (`warmstart.gpu.weight_stager.stage.fill`, buffered: page cache -> pinned buffers
  -> GPU) of `--weights-gib` of scratch files, with 8 (the stager's default), 4 and 2 threads;
- pinned host -> GPU copies only (the link, no page-cache reads);
- page-cache reads only, 8 threads (host memory, no GPU).

A load repeats its unit (one whole fill, one 1 GiB pinned copy, one read of every file) until the restore
is done; the restore starts `--lead` seconds after the load. Each load's rate alone is measured first, and
beside the restore the unit that overlapped it. The last fill is checked (first and last MiB of each file
read back from the GPU). Scratch files are written to `--dir` (memory, as hot weights are in the page cache)
and removed afterwards.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cuda_context_probe import start_child, stop_child  # noqa: E402
from gpu_restore import gpu_memory_of  # noqa: E402
from restore_bench import read_bandwidth  # noqa: E402
from stager_copy import check_filled, copies_of, write_random  # noqa: E402

from warmstart.checkpoint import cuda  # noqa: E402
from warmstart.gpu.weight_stager.plan import Copy  # noqa: E402
from warmstart.gpu.weight_stager.stage import SharedDeviceMemory, fill  # noqa: E402

GIB = 1 << 30
SCRATCH_FILES = 4
SETUP = (
    "x = torch.zeros(1, device='cuda'); a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16);"
    " b = a @ a; del a, b; torch.cuda.empty_cache();"
    " m = torch.ones({nbytes}, dtype=torch.uint8, device='cuda')"
)


@dataclass
class Load:
    """A unit of work repeated on a thread until stopped; each unit's bytes and seconds."""

    name: str
    unit: Callable[[], int]
    units: list[tuple[int, float]] = field(default_factory=list)

    def timed_unit(self) -> None:
        started = time.perf_counter()
        nbytes = self.unit()
        self.units.append((nbytes, time.perf_counter() - started))

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.timed_unit()


@dataclass
class Round:
    restore_s: float
    unit_gib_s: float | None  # the load's first unit, which overlapped the restore


def rate(unit: tuple[int, float]) -> float:
    return unit[0] / unit[1] / GIB


def one_round(child: int, load: Load | None, lead: float) -> Round:
    cuda.suspend(child)
    stop, thread = threading.Event(), None
    if load is not None:
        load.units.clear()
        thread = threading.Thread(target=load.run, args=(stop,), name=load.name)
        thread.start()
        time.sleep(lead)
    started = time.perf_counter()
    cuda.resume(child)
    restore_s = time.perf_counter() - started
    stop.set()
    if thread is not None:
        thread.join()
    first = load.units[0] if load is not None and load.units else None
    return Round(restore_s, rate(first) if first else None)


def alone(load: Load, units: int = 2) -> float:
    """The load's median rate with nothing beside it (GiB/s)."""
    load.units.clear()
    for _ in range(units):
        load.timed_unit()
    return statistics.median(rate(unit) for unit in load.units)


def stager_load(
    copies: tuple[Copy, ...], threads: int, memory: SharedDeviceMemory, fds: dict[str, int]
) -> Load:
    def unit() -> int:
        fill(memory, copies, fds, threads, "buffered")
        return sum(copy[3] for copy in copies)

    return Load(f"the stager's fill, {threads} threads", unit)


def pinned_load() -> Load:
    import torch

    host = torch.empty(GIB, dtype=torch.uint8).pin_memory()
    device = torch.empty(GIB, dtype=torch.uint8, device="cuda")

    def unit() -> int:
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        return GIB

    return Load("pinned host -> GPU copies", unit)


def reads_load(files: list[Path]) -> Load:
    def unit() -> int:
        return read_bandwidth(files, 8)[0]

    return Load("page-cache reads, 8 threads", unit)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device-gib", type=float, default=1.0, help="tensors of the restored process")
    parser.add_argument("--weights-gib", type=float, default=12.0, help="scratch weights the stager fills")
    parser.add_argument("--dir", type=Path, default=Path("/dev/shm"), help="scratch files (default /dev/shm)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--lead", type=float, default=0.05, help="seconds the load runs before the restore")
    parser.add_argument("--threads", default="8,4,2", help="stager threads to try")
    parser.add_argument("--out", type=Path, help="also write the table here, row by row")
    args = parser.parse_args()

    def emit(line: str) -> None:
        print(line, flush=True)
        if args.out:
            with args.out.open("a") as sink:
                sink.write(line + "\n")

    scratch = Path(tempfile.mkdtemp(prefix="beside-", dir=args.dir))
    child = None
    try:
        size = int(args.weights_gib * GIB) // SCRATCH_FILES
        files = [write_random(scratch / f"w{index}", size) for index in range(SCRATCH_FILES)]
        os.sync()  # nothing written back to disk while the rounds run
        read_bandwidth(files, 8)  # in memory before the first round
        fds = {str(path): os.open(path, os.O_RDONLY) for path in files}
        copies = copies_of(files)
        memory = SharedDeviceMemory(0, (-(-(copies[-1][2] + copies[-1][3]) // GIB) * GIB,))
        child = start_child(SETUP.format(nbytes=int(args.device_gib * GIB)))
        emit(f"child: {(gpu_memory_of(child.pid) or 0) / GIB:.2f} GiB of device memory (nvidia-smi); "
             f"loads: {args.weights_gib:.1f} GiB of weights in {SCRATCH_FILES} files in {args.dir}; "
             f"the load starts {args.lead:.2f} s before each restore")  # fmt: skip
        loads: list[Load | None] = [None]
        loads += [stager_load(copies, int(threads), memory, fds) for threads in args.threads.split(",")]
        loads += [pinned_load(), reads_load(files)]
        one_round(child.pid, None, args.lead)  # the first checkpoint and restore of a process, not counted
        emit("| beside the CUDA restore | restore s (each) | median | vs alone | load alone GiB/s | "
             "load's unit beside it GiB/s |")  # fmt: skip
        emit("|---|---|---|---|---|---|")
        baseline = None
        for load in loads:
            load_alone = alone(load) if load is not None else None
            rounds = [one_round(child.pid, load, args.lead) for _ in range(args.repeat)]
            median = statistics.median(r.restore_s for r in rounds)
            baseline = baseline or median
            beside = [r.unit_gib_s for r in rounds if r.unit_gib_s is not None]
            each = " / ".join(f"{r.restore_s:.3f}" for r in rounds)
            rate_alone = f"{load_alone:.1f}" if load_alone else ""
            emit(
                f"| {load.name if load else 'nothing'} | {each} | {median:.3f} | {median / baseline:.2f}x | "
                f"{rate_alone} | {' / '.join(f'{b:.1f}' for b in beside)} |"
            )
        check_filled(memory, copies, fds)  # the last fill (here: the main thread holds the context)
        memory.close()
        for fd in fds.values():
            os.close(fd)
    finally:
        if child is not None:
            stop_child(child)
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
