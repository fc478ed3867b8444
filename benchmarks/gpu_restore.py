#!/usr/bin/env python3
"""GPU restore benchmark: cold start vs naive restore vs optimised restore of the builtin engine, one run.

For each model shape (Qwen3-0.6B, Qwen3-8B; bf16 weights as safetensors) it measures, in the same run:

* cold start to first token (import, weight load, torch.compile where enabled, warm-up, CUDA graph capture for
  the decode batch sizes, KV allocation), page cache hot and dropped;
* naive restore: nothing released, weights and KV cache inside the CUDA checkpoint and the CRIU image; CRIU
  reads its image serially;
* optimised restore: the engine releases its KV cache, weights and CUDA-graph scratch memory (CUDA VMM:
  the virtual addresses stay, so CUDA graphs stay valid) before the checkpoint; at restore the CRIU image and
  the weight files are prefetched by parallel readers while CRIU restores (page cache dropped), and the
  engine refills its weights with parallel pinned reads while it maps the KV cache and scratch again;
* keep-scratch restore (on request): as optimised, but the graphs' scratch memory stays in the checkpoint;

each with the page cache dropped and hot, repeated, against the floor computed from measured disk,
page-cache and pinned host->GPU bandwidth, with the time split by phase and the outputs after every restore
compared with the source's (token for token).

It orchestrates the mechanics directly in the host PID namespace: the engine process is started by this
script, checkpointed (CUDA driver API + CRIU dump; the source exits), then restored from the same image as
many times as asked (the PIDs are free again once the previous copy exited). Needs root, an NVIDIA GPU
with the checkpoint API (driver >= 570) and CRIU >= 4.

    sudo python3 benchmarks/gpu_restore.py --criu "DIR/ld-linux-x86-64.so.2 --library-path DIR DIR/criu" \\
        --work /var/tmp/warmstart-bench --out results/
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import platform
import shlex
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from warmstart.api.control_dir import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, ControlDir  # noqa: E402

GB = 1e9
GiB = 1 << 30
MiB = 1 << 20
STAGING_PLAN = "weight-staging-plan.json"  # in the engine's control directory, for the weight stager
MODELS = ("qwen3-0.6b", "qwen3-8b")
PROMPTS = (
    "The quick brown fox",
    "Checkpoint and restore make inference workers start",
    "In a distant galaxy",
    "def fibonacci(n):",
)
RESULT_TOKENS = 16
PR_SET_CHILD_SUBREAPER = 36


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# =========================================================================================================
# Page cache and parallel reads
# =========================================================================================================


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def files_under(paths: Iterable[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        if path.is_dir():
            found += [p for p in sorted(path.rglob("*")) if p.is_file()]
        elif path.is_file():
            found.append(path)
    return found


def parallel_read(
    files: Sequence[Path], threads: int = 16, chunk: int = 16 << 20, direct: bool = False
) -> tuple[int, float]:
    """Read every byte of `files` with `threads` concurrent preadv calls; returns (bytes, seconds).

    Buffered reads leave the files in the page cache (prefetch); `direct=True` measures the disk alone.
    Biggest files first, so one large file does not end up read by a single thread at the end.
    """
    work = []
    for path in sorted(files, key=lambda p: -p.stat().st_size):
        size = path.stat().st_size
        work += [(path, offset, min(chunk, size - offset)) for offset in range(0, size, chunk)]
    queue = iter(work)
    lock = threading.Lock()
    totals: list[int] = []

    def reader() -> None:
        buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT requires
        fds: dict[Path, int] = {}
        done = 0
        try:
            while True:
                with lock:
                    item = next(queue, None)
                if item is None:
                    break
                path, offset, length = item
                fd = fds.get(path)
                if fd is None:
                    fd = fds[path] = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
                view = memoryview(buffer)[: (length + 4095) // 4096 * 4096 if direct else length]
                done += os.preadv(fd, [view], offset)
                view.release()
        finally:
            for fd in fds.values():
                os.close(fd)
            buffer.close()
            totals.append(done)

    started = time.perf_counter()
    pool = [threading.Thread(target=reader, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return sum(totals), time.perf_counter() - started


def set_cache_state(cache: str, hot_files: Sequence[Path]) -> None:
    if cache == "dropped":
        drop_page_cache()
    else:
        parallel_read(hot_files)


# =========================================================================================================
# Floors: disk, page cache -> pinned, pinned -> GPU, refill variants
# =========================================================================================================


def make_blob(path: Path, nbytes: int) -> None:
    """A safetensors file holding one uint8 tensor `blob` of random bytes (data page-aligned)."""
    if path.exists() and path.stat().st_size > nbytes:
        return
    import torch

    header = json.dumps({"blob": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (4096 - 8 - len(header))
    gen = torch.Generator(device="cuda").manual_seed(0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for offset in range(0, nbytes, GiB):
            n = min(GiB, nbytes - offset)
            f.write(
                torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=gen).cpu().numpy()
            )
        os.fsync(f.fileno())


def pinned_h2d_gbps(nbytes: int = 2 * GiB, repeats: int = 5) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times[1:]) / GB


def pinned_alloc_seconds(count: int, nbytes: int) -> float:
    """Allocating and freeing `count` pinned buffers (what a staged refill pays after a restore)."""
    import torch

    from warmstart.gpu.weights_io import release_pinned_cache

    release_pinned_cache()
    started = time.perf_counter()
    buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    del buffers
    release_pinned_cache()
    return time.perf_counter() - started


def pagecache_to_pinned_gbps(path: Path, threads: int, chunk: int = 32 << 20) -> float:
    """Hot page cache -> per-thread pinned buffers, no GPU copy: the CPU side of a refill."""
    import torch

    size = path.stat().st_size
    offsets = iter(range(0, size, chunk))
    lock = threading.Lock()

    def reader() -> None:
        buffer = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
        view = memoryview(buffer.numpy())
        fd = os.open(path, os.O_RDONLY)
        try:
            while True:
                with lock:
                    offset = next(offsets, None)
                if offset is None:
                    return
                os.preadv(fd, [view], offset)
        finally:
            os.close(fd)

    parallel_read([path])  # hot
    started = time.perf_counter()
    pool = [threading.Thread(target=reader) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return size / (time.perf_counter() - started) / GB


def refill_sweep(path: Path) -> list[dict[str, Any]]:
    """The engine's weight refill (`weights_io.refill`) into a CUDA VMM arena, by threads, chunk and cache."""
    import torch

    from warmstart.gpu import weights_io
    from warmstart.gpu.cuda_arena import CudaVmmArena

    layout, size = weights_io.plan_layout([path])
    arena = CudaVmmArena("cuda")
    arena.allocate(size)
    rows = []
    variants = [(t, c, "hot") for t in (4, 8, 12, 16) for c in (16 << 20, 64 << 20)]
    variants += [(t, 16 << 20, "dropped-direct") for t in (8, 16)]
    variants += [(16, 16 << 20, "dropped-buffered")]
    reference = None
    for threads, chunk, cache in variants:
        set_cache_state("dropped" if cache.startswith("dropped") else "hot", [path])
        arena.tensor.zero_()
        torch.cuda.synchronize()
        direct = cache.endswith("direct")
        started = time.perf_counter()
        weights_io.refill(arena.tensor, layout, [path], threads=threads, chunk_bytes=chunk, direct_io=direct)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        check = int(arena.tensor[:: 1 << 20].sum().item())
        reference = check if reference is None else reference
        rows.append(
            {
                "threads": threads,
                "chunk_mib": chunk >> 20,
                "cache": cache,
                "seconds": round(seconds, 3),
                "gb_per_s": round(size / seconds / GB, 2),
                "bytes_ok": check == reference,
            }
        )
        log(f"refill threads={threads} chunk={chunk >> 20}MiB {cache}: {size / seconds / GB:.1f} GB/s")
    arena.close()
    weights_io.release_pinned_cache()
    return rows


def measure_floors(work: Path, gib: int) -> dict[str, Any]:
    blob = work / "floor.bin"
    make_blob(blob, gib * GiB)
    floors: dict[str, Any] = {"file_gib": gib}
    drop_page_cache()
    n, s = parallel_read([blob], threads=16, direct=True)
    floors["disk_direct_gbps"] = round(n / s / GB, 2)
    drop_page_cache()
    n, s = parallel_read([blob], threads=16)
    floors["disk_buffered_gbps"] = round(n / s / GB, 2)
    n, s = parallel_read([blob], threads=16)
    floors["pagecache_read_gbps"] = round(n / s / GB, 2)
    for threads in (1, 8, 16):
        floors[f"pagecache_to_pinned_{threads}t_gbps"] = round(pagecache_to_pinned_gbps(blob, threads), 2)
    floors["pinned_h2d_gbps"] = round(pinned_h2d_gbps(), 2)
    floors["pinned_alloc_16x16mib_s"] = round(pinned_alloc_seconds(16, 16 << 20), 3)
    log(f"floors: {json.dumps(floors)}")
    floors["refill"] = refill_sweep(blob)
    blob.unlink()
    return floors


# =========================================================================================================
# The engine process (the worker under test)
# =========================================================================================================


# Modes whose engine releases its memory before the checkpoint: "keep-scratch" keeps the CUDA graphs' scratch
# memory (so it rides in the checkpoint), to measure what releasing it is worth.
RELEASING_MODES = ("optimised", "keep-scratch")


def releases(mode: str) -> bool:
    return mode in RELEASING_MODES


def vllm_like_graph_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's default capture sizes (1, 2, 4, every 8 below 256, every 16 from 256 to 512), up to
    `max_num_seqs`: the builtin engine's graphs are decode batches, one row per sequence."""
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    return [size for size in sizes if size <= max_num_seqs]


def engine_options(model: str, model_dir: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """Keyword options for `create_engine("builtin", ...)`: a realistic, vLLM-like cold start.

    The releasing modes (optimised, keep-scratch) keep weights and KV cache in the CUDA VMM arena (released
    before the checkpoint, re-mapped at the same addresses after); naive uses torch's allocator, as an
    unmodified engine would.
    """
    if args.device == "cpu":  # a dry run of the orchestration, without a GPU
        return {
            "model": model,
            "model_dir": str(model_dir),
            "device": "cpu",
            "release_weights": releases(mode),
        }
    return {
        "model": model,
        "model_dir": str(model_dir),
        "device": "cuda",
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "cuda_graph_sizes": vllm_like_graph_sizes(args.max_num_seqs),
        "compile": model in args.compile_models.split(","),
        "release_weights": releases(mode),
        "arena": "cuda-vmm" if releases(mode) else "torch",
        "release_graph_scratch": mode != "keep-scratch",
        "refill_threads": args.refill_threads,
    }


def outputs_of(engine: Any, requests: list[Any]) -> list[list[int]]:
    """Greedy tokens per prompt, one request at a time: batch composition then cannot change the numerics."""
    return [list(engine.generate([request])[0].token_ids) for request in requests]


def trim_host_heap() -> None:
    """Give freed malloc memory back to the kernel, so CRIU does not dump it (glibc keeps it otherwise)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def host_memory() -> dict[str, int]:
    """This process's resident memory by kind, in bytes (what a CRIU image mostly holds: RssAnon)."""
    wanted = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
    found: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in wanted:
            found[key] = int(value.split()[0]) * 1024
        elif key == "Threads":
            found[key] = int(value)
    # CRIU restores mapping by mapping: with 51 CUDA graphs instead of 35 its time grew far more than bytes
    found["Mappings"] = len(Path("/proc/self/maps").read_text().splitlines())
    return found


def anonymous_memory_by_mapping(top: int = 15) -> dict[str, Any]:
    """Where this process's anonymous memory is (what CRIU copies): by mapping name, and the largest."""
    by_name: dict[str, int] = {}
    largest: list[tuple[int, str]] = []
    name, span = "", ""
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            span = fields[0]
            name = fields[5] if len(fields) > 5 else "[anon]"
        elif fields[0] == "Anonymous:":
            anon = int(fields[1]) * 1024
            if anon:
                by_name[name] = by_name.get(name, 0) + anon
                begin, end = (int(x, 16) for x in span.split("-"))
                largest.append((anon, f"{name} {(end - begin) >> 20} MiB mapping"))
    ranked = sorted(by_name.items(), key=lambda item: -item[1])
    return {
        "by_name_mib": {k: round(v / MiB, 1) for k, v in ranked[:top]},
        "largest_mib": [(round(a / MiB, 1), what) for a, what in sorted(largest, reverse=True)[:top]],
        "mappings_with_anon": len(largest),
    }


def _count_host_memory_per_graph() -> list[float]:
    """RssAnon (MiB) after each CUDA graph capture (the first includes torch.compile): what graphs cost."""
    from warmstart.engines.builtin.graphs import DecodeGraphs

    after: list[float] = []
    capture_one = DecodeGraphs._capture_one

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not after:
            after.append(round(host_memory()["RssAnon"] / MiB, 1))  # before the first
        captured = capture_one(self, *args, **kwargs)
        after.append(round(host_memory()["RssAnon"] / MiB, 1))
        return captured

    DecodeGraphs._capture_one = counted  # type: ignore[method-assign]
    return after


def engine_process(args: argparse.Namespace) -> int:
    """Cold start, then either exit (mode cold) or release, signal, wait for the restore and report."""
    spawned_at = float(args.spawned_at)
    marks: dict[str, float] = {"spawned": spawned_at}
    import torch

    marks["torch_imported"] = time.time()
    from warmstart.engines import create_engine
    from warmstart.engines.base import GenerationRequest, SamplingParams

    options = json.loads(args.options)
    anon_per_graph = _count_host_memory_per_graph()
    engine = create_engine("builtin", **options)
    engine.load()
    marks["loaded"] = time.time()
    host_at = {"loaded": host_memory()}
    engine.warm_up()
    marks["warm"] = time.time()
    host_at["warm"] = host_memory()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    first = engine.generate([GenerationRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=1))])
    marks["first_token"] = time.time()
    requests = [
        GenerationRequest(prompt=p, sampling=SamplingParams(max_tokens=RESULT_TOKENS, ignore_eos=True))
        for p in PROMPTS
    ]
    reference = outputs_of(engine, requests)
    marks["reference_done"] = time.time()
    control = ControlDir(args.control)
    report: dict[str, Any] = {
        "pid": os.getpid(),
        "marks": marks,
        "outputs": reference,
        "first": list(first[0].token_ids),
        "gpu_bytes_before_release": torch.cuda.memory_allocated(),
        "describe": engine.describe(),
    }
    if args.mode == "cold":
        Path(args.control, "cold.json").write_text(json.dumps(report))
        return 0
    released_weights = engine.release() if releases(args.mode) else False
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        report["torch_reserved_before_empty_cache"] = torch.cuda.memory_reserved()
        if releases(args.mode):
            # The engine's release() empties the cache already; again here so the figures below do not
            # depend on it: cached blocks nothing uses would ride in the CUDA checkpoint and the image.
            torch.cuda.empty_cache()
        report["torch_reserved_at_checkpoint"] = torch.cuda.memory_reserved()
        report["torch_allocated_at_checkpoint"] = torch.cuda.memory_allocated()
        with contextlib.suppress(AttributeError):
            torch._C._host_emptyCache()  # pinned staging buffers would otherwise ride along in the image
        free, total = torch.cuda.mem_get_info()
        report["gpu_used_at_checkpoint"] = total - free
    if releases(args.mode):
        trim_host_heap()
    report["released_weights"] = released_weights
    plan = engine.weight_staging_plan() if released_weights else None
    if plan is not None:
        Path(args.control, STAGING_PLAN).write_text(plan.to_json())
    report["host_memory_at_checkpoint"] = host_memory()
    report["host_memory_at"] = host_at
    report["anonymous_memory"] = anonymous_memory_by_mapping()
    report["anonymous_memory"]["after_each_graph_mib"] = anon_per_graph
    marks["released"] = time.time()
    control.send(READY_FOR_SNAPSHOT, report)
    # --- checkpointed here; everything below runs in a restored copy ---
    resume = control.wait(RESTORE_COMPLETE, timeout=None, interval=0.002).payload
    after: dict[str, float] = {"resumed": time.time()}
    if releases(args.mode):
        engine.expect_staged_weights(resume.get("weight_stager_socket"))
        engine.reacquire()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        after["reacquired"] = time.time()
    first_after = engine.generate(
        [GenerationRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_tokens=1))]
    )
    after["first_token"] = time.time()
    outputs = outputs_of(engine, requests)
    result = {
        "marks": after,
        "outputs": outputs,
        "first": list(first_after[0].token_ids),
        "weights_refill": getattr(engine, "last_refill_stats", None),
        "reacquire": getattr(engine, "last_reacquire_stats", None),
    }
    Path(resume["result"]).write_text(json.dumps(result, default=str))
    return 0


# =========================================================================================================
# Orchestration: cold starts, captures, restores
# =========================================================================================================


@dataclass
class Capture:
    mode: str
    pid: int
    images: Path
    control: Path
    ready: dict[str, Any]
    timings: dict[str, float]
    image_bytes: int


@dataclass
class RestoreRun:
    mode: str
    cache: str
    rep: int
    phases: dict[str, float]
    total_s: float
    outputs_identical: bool
    first_token_identical: bool
    variant: str  # the mode, and whether a weight stager ran, where both were measured
    engine_detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelResult:
    model: str
    weight_bytes: int
    cold: list[dict[str, Any]] = field(default_factory=list)
    captures: dict[str, dict[str, Any]] = field(default_factory=dict)
    restores: list[RestoreRun] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from warmstart.checkpoint import cuda
        from warmstart.checkpoint.criu import Criu

        self.args = args
        self.work = Path(args.work)
        self.out = Path(args.out)
        self.criu = Criu(args.criu, timeout=300)
        self.cuda = cuda if args.device == "cuda" else None
        self.deadline = time.monotonic() + args.budget_s
        self.caches = [c for c in ("hot", "dropped") if c in args.caches.split(",")]
        # stager threads per variant; 0: no stager (the engine refills its weights itself)
        self.stage_weights = [_stager_threads(v) for v in args.stage_weights.split(",") if v]
        self.compile_cache = self.work / "compile-cache"
        libc = ctypes.CDLL(None, use_errno=True)
        # Restored engines get re-parented to us: we reap them, freeing their PIDs for the next restore.
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    # -- engine processes --------------------------------------------------------------------------------
    def spawn_engine(self, mode: str, model: str, model_dir: Path, control: Path) -> subprocess.Popen[bytes]:
        shutil.rmtree(control, ignore_errors=True)
        control.mkdir(parents=True)
        options = engine_options(model, model_dir, mode, self.args)
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(REPO),
            # torch.compile's caches, as a serving node keeps them between starts (vLLM's default too)
            "TORCHINDUCTOR_CACHE_DIR": str(self.compile_cache / "inductor"),
            "TRITON_CACHE_DIR": str(self.compile_cache / "triton"),
        }
        argv = [
            sys.executable,
            str(Path(__file__).resolve()),
            "engine-process",
            "--mode",
            mode,
            "--control",
            str(control),
            "--options",
            json.dumps(options),
            "--spawned-at",
            repr(time.time()),
        ]
        out = open(control.parent / f"{control.name}.log", "wb")  # noqa: SIM115 - owned by the child
        # Own session, stdio on a file: CRIU must not find pipes shared with this script.
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=str(self.work),
        )

    def start_stager(self, cap: Capture, socket_path: Path, threads: int) -> subprocess.Popen[bytes]:
        """The weight stager, started with the restore (as the node agent does)."""
        plan = cap.control / STAGING_PLAN
        log_file = open(self.work / "weight-stager.log", "wb")  # noqa: SIM115 - owned by the child
        argv = [sys.executable, "-m", "warmstart.gpu.weight_stager", "--plan", str(plan)]
        return subprocess.Popen(
            [*argv, "--socket", str(socket_path), "--threads", str(threads)],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            start_new_session=True,
        )

    def wait_for(
        self,
        child: subprocess.Popen[bytes] | None,
        check: Callable[[], Any],
        what: str,
        log_file: Path,
        timeout: float = 600,
    ) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value is not None:
                return value
            if child is not None and child.poll() is not None:
                raise RuntimeError(f"engine exited {child.returncode} before {what}:\n{_tail(log_file)}")
            time.sleep(0.002)
        raise RuntimeError(f"timed out waiting for {what}:\n{_tail(log_file)}")

    def cold_start(self, model: str, model_dir: Path, cache: str) -> dict[str, Any]:
        set_cache_state(cache, weight_files(model_dir))
        control = self.work / "cold-control"
        child = self.spawn_engine("cold", model, model_dir, control)
        result_file = control / "cold.json"
        report = self.wait_for(
            child,
            lambda: _json_if_exists(result_file),
            "cold start result",
            control.parent / "cold-control.log",
        )
        child.wait(timeout=120)
        marks = report["marks"]
        phases = _phases(marks, ["spawned", "torch_imported", "loaded", "warm", "first_token"])
        return {
            "cache": cache,
            "total_s": round(marks["first_token"] - marks["spawned"], 3),
            "phases": phases,
            "outputs": report["outputs"],
            "describe": report.get("describe"),
        }

    def capture(self, mode: str, model: str, model_dir: Path) -> tuple[Capture, dict[str, Any]]:
        control = self.work / f"{mode}-control"
        images = self.work / f"{mode}-images"
        shutil.rmtree(images, ignore_errors=True)
        child = self.spawn_engine(mode, model, model_dir, control)
        ctl = ControlDir(control)
        log_file = control.parent / f"{control.name}.log"
        ready = self.wait_for(
            child, lambda: _payload(ctl.read(READY_FOR_SNAPSHOT)), "ready-for-snapshot", log_file
        )
        pid = ready["pid"]
        ready["gpu_used_by_engine"] = gpu_memory_of(pid) if self.cuda else None
        t0 = time.time()
        if self.cuda:
            self.cuda.lock(pid)
        t1 = time.time()
        if self.cuda:
            self.cuda.checkpoint(pid)
        t2 = time.time()
        self.criu.dump(pid, images, logs_dir=self.work / f"{mode}-logs", extra=["-v1"])
        t3 = time.time()
        child.wait(timeout=60)  # CRIU killed the source; reap it so its PID is free
        ctl.clear(READY_FOR_SNAPSHOT)
        marks = ready["marks"]
        cold = {
            "cache": "hot",
            "total_s": round(marks["first_token"] - marks["spawned"], 3),
            "phases": _phases(marks, ["spawned", "torch_imported", "loaded", "warm", "first_token"]),
            "outputs": ready["outputs"],
            "describe": ready.get("describe"),
            "source": f"{mode} capture",
        }
        timings = {"cuda_lock_s": t1 - t0, "cuda_checkpoint_s": t2 - t1, "criu_dump_s": t3 - t2}
        size = sum(p.stat().st_size for p in files_under([images]))
        return Capture(mode, pid, images, control, ready, timings, size), cold

    def restore(
        self, cap: Capture, model_dir: Path, cache: str, rep: int, stager_threads: int = 0
    ) -> RestoreRun:
        weights = weight_files(model_dir)
        image_files = files_under([cap.images])
        set_cache_state(cache, image_files + (weights if releases(cap.mode) else []))
        result_file = self.work / f"result-{cap.mode}-{cache}-{rep}.json"
        result_file.unlink(missing_ok=True)
        ctl = ControlDir(cap.control)
        ctl.clear()
        prefetchers: list[threading.Thread] = []
        stager_socket = self.work / "weight-stager.sock"
        stager_socket.unlink(missing_ok=True)
        t0 = time.time()
        stager = self.start_stager(cap, stager_socket, stager_threads) if stager_threads else None
        if releases(cap.mode) and cache == "dropped":
            # the stager reads the weights itself: prefetching them too would only compete with it
            prefetchers = _start_prefetch(image_files, [] if stager else weights)
        pid = self.criu.restore(cap.images, logs_dir=self.work / f"{cap.mode}-logs", extra=["-v1"])
        t1 = time.time()
        if pid != cap.pid:
            raise RuntimeError(f"CRIU restored pid {pid}, expected {cap.pid}")
        if self.cuda:
            self.cuda.restore(pid)
        t2 = time.time()
        if self.cuda:
            self.cuda.unlock(pid)
        t3 = time.time()
        socket_path = str(stager_socket) if stager else None
        ctl.send(RESTORE_COMPLETE, {"result": str(result_file), "weight_stager_socket": socket_path})
        log_file = cap.control.parent / f"{cap.control.name}.log"
        result = self.wait_for(
            None, lambda: _json_if_exists(result_file), "restored engine's result", log_file
        )
        for thread in prefetchers:
            thread.join()
        if stager is not None and stager.wait(timeout=60) != 0:
            raise RuntimeError(f"the weight stager failed:\n{_tail(self.work / 'weight-stager.log')}")
        _reap(pid)
        marks = result["marks"]
        phases = {
            "criu_restore": t1 - t0,
            "cuda_restore": t2 - t1,
            "cuda_unlock": t3 - t2,
            "signal_to_resume": marks["resumed"] - t3,
        }
        if "reacquired" in marks:
            phases["reacquire_refill"] = marks["reacquired"] - marks["resumed"]
            phases["first_token"] = marks["first_token"] - marks["reacquired"]
        else:
            phases["first_token"] = marks["first_token"] - marks["resumed"]
        total = marks["first_token"] - t0
        several = releases(cap.mode) and len(self.stage_weights) > 1
        return RestoreRun(
            cap.mode,
            cache,
            rep,
            {k: round(v, 3) for k, v in phases.items()},
            round(total, 3),
            result["outputs"] == cap.ready["outputs"],
            result["first"] == cap.ready["first"],
            _variant(cap.mode, stager_threads) if several else cap.mode,
            engine_detail={
                "weights_refill": result.get("weights_refill"),
                "reacquire": result.get("reacquire"),
            },
        )

    # -- one model -----------------------------------------------------------------------------------------
    def run_model(self, model: str) -> ModelResult:
        model_dir = self.prepare_model(model)
        weights = weight_files(model_dir)
        result = ModelResult(model, sum(p.stat().st_size for p in weights))
        result.engine = engine_options(model, model_dir, "naive", self.args)
        reps = self.args.reps
        if result.engine.get("compile"):
            # The very first start compiles from nothing; every later one finds torch.compile's cache warm.
            shutil.rmtree(self.compile_cache, ignore_errors=True)
            first = self.cold_start(model, model_dir, "hot")
            first["compile_cache"] = "empty"
            result.cold.append(first)
            log(f"{model} cold start (compile cache empty): {first['total_s']} s {first['phases']}")
        for cache in self.caches[::-1]:
            for _ in range(self.args.cold_reps):
                if self.time_left() < 60:
                    result.notes.append(f"cold start ({cache}) repetitions cut short by the time budget")
                    break
                cold = self.cold_start(model, model_dir, cache)
                result.cold.append(cold)
                log(f"{model} cold start ({cache}): {cold['total_s']} s {cold['phases']}")
        for mode in self.args.modes.split(","):
            if self.time_left() < 90:
                result.notes.append(f"{mode} skipped: time budget spent")
                continue
            cap, cold = self.capture(mode, model, model_dir)
            result.cold.append(cold)
            result.captures[mode] = {
                "image_bytes": cap.image_bytes,
                **{k: round(v, 3) for k, v in cap.timings.items()},
                "gpu_used_at_checkpoint": cap.ready.get("gpu_used_at_checkpoint"),
                "gpu_used_by_engine": cap.ready.get("gpu_used_by_engine"),
                "host_memory_at_checkpoint": cap.ready.get("host_memory_at_checkpoint"),
                "host_memory_at": cap.ready.get("host_memory_at"),
                "anonymous_memory": cap.ready.get("anonymous_memory"),
                "released_weights": cap.ready.get("released_weights"),
                "graph_scratch_bytes": (cap.ready.get("describe") or {}).get("graph_scratch_bytes", 0),
                **{
                    k: cap.ready.get(k)
                    for k in (
                        "torch_reserved_before_empty_cache",
                        "torch_reserved_at_checkpoint",
                        "torch_allocated_at_checkpoint",
                    )
                },
            }
            log(f"{model} {mode} capture: {result.captures[mode]}")
            mode_reps = self.args.naive_reps if mode == "naive" and self.args.naive_reps else reps
            for cache in self.caches:
                # a stager needs the engine's plan: weights released from a CUDA VMM arena
                stageable = (cap.control / STAGING_PLAN).exists()
                stage_variants = self.stage_weights if stageable else [0]
                for rep, stager_threads in ((r, v) for r in range(mode_reps) for v in stage_variants):
                    if self.time_left() < 45:
                        result.notes.append(f"{mode} {cache} restores cut at {rep} by the time budget")
                        break
                    run = self.restore(cap, model_dir, cache, rep, stager_threads)
                    result.restores.append(run)
                    log(
                        f"{model} {run.variant} restore ({cache}) #{rep}: {run.total_s} s {run.phases} "
                        f"{run.engine_detail} identical={run.outputs_identical}"
                    )
            shutil.rmtree(cap.images, ignore_errors=True)
        self.write_partial(result)
        return result

    def prepare_model(self, model: str) -> Path:
        from warmstart.engines.builtin.model_dir import ensure_model

        model_dir = self.work / "models" / model
        started = time.perf_counter()
        ensure_model(model_dir, preset_name=model, seed=0, device=self.args.device)
        if self.args.device == "cuda":
            import torch

            torch.cuda.empty_cache()  # our own generator's blocks must not count as the engine's memory
        log(f"{model}: weights ready in {model_dir} ({time.perf_counter() - started:.1f} s)")
        return model_dir

    def write_partial(self, result: ModelResult) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"gpu_restore_{result.model}.json").write_text(
            json.dumps(asdict(result), indent=1, default=str)
        )


def gpu_memory_of(pid: int) -> int | None:
    """Device memory `pid` holds, per nvidia-smi (bytes), or None when it cannot tell."""
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0] == str(pid) and fields[1].isdigit():
            return int(fields[1]) << 20
    return None


def _start_prefetch(image_files: list[Path], weights: list[Path]) -> list[threading.Thread]:
    """Image first (CRIU needs it now), then the weights (the engine's refill needs them next)."""

    def run() -> None:
        parallel_read(image_files, threads=16)
        parallel_read(weights, threads=16)

    thread = threading.Thread(target=run, name="prefetch", daemon=True)
    thread.start()
    return [thread]


def _reap(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (no subreaper): wait until the PID is gone
            if not Path(f"/proc/{pid}").exists():
                return
            time.sleep(0.01)
            continue
        if done:
            return
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _phases(marks: dict[str, float], order: list[str]) -> dict[str, float]:
    return {
        f"{a}->{b}": round(marks[b] - marks[a], 3)
        for a, b in zip(order, order[1:], strict=False)
        if b in marks
    }


def _json_if_exists(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _payload(signal_: Any) -> Any:
    return None if signal_ is None else signal_.payload


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


# =========================================================================================================
# Report
# =========================================================================================================


def _median_spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f}, n={len(values)})"


def floor_seconds(
    result: ModelResult, capture: dict[str, Any], floors: dict[str, Any], cache: str, mode: str
) -> float:
    """Bytes that must be read / storage bandwidth + bytes to the GPU / pinned bandwidth (no fixed cost)."""
    image = capture["image_bytes"]
    to_gpu = result.weight_bytes + (_engine_gpu_bytes(capture) or 0) if releases(mode) else image
    read = image + (result.weight_bytes if releases(mode) else 0)
    disk = max(floors["disk_direct_gbps"], floors.get("disk_buffered_gbps", 0))
    storage = disk if cache == "dropped" else floors["pagecache_read_gbps"]
    return read / (storage * GB) + to_gpu / (floors["pinned_h2d_gbps"] * GB)


def _engine_gpu_bytes(capture: dict[str, Any]) -> int | None:
    """The engine's own device memory at checkpoint: nvidia-smi's per-process figure when it had one."""
    return capture.get("gpu_used_by_engine") or capture.get("gpu_used_at_checkpoint")


def markdown(results: list[ModelResult], floors: dict[str, Any] | None, env: dict[str, Any]) -> str:
    lines = [
        "# GPU restore benchmark",
        "",
        "Environment: " + ", ".join(f"{k} {v}" for k, v in env.items()),
        "",
    ]
    if floors:
        lines += ["## Measured ceilings", "", "| what | GB/s |", "|---|---|"]
        lines += [f"| {k} | {v} |" for k, v in floors.items() if k.endswith("gbps")]
        if "pinned_alloc_16x16mib_s" in floors:
            seconds = floors["pinned_alloc_16x16mib_s"]
            lines += ["", f"Allocating and freeing 16 pinned 16 MiB buffers: {seconds} s."]
        lines += [
            "",
            "| weight refill threads | chunk MiB | cache | GB/s |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {r['threads']} | {r['chunk_mib']} | {r['cache']} | {r['gb_per_s']} |"
            for r in floors.get("refill", [])
            if r.get("impl", "weights_io") == "weights_io"  # floors from older runs also timed other readers
        ]
        lines.append("")
    for res in results:
        lines += [f"## {res.model} (weights {res.weight_bytes / GiB:.2f} GiB)", ""]
        described = next((c.get("describe") for c in res.cold if c.get("describe")), None) or {}
        eng = res.engine
        kv_gib, weights_gib = described.get("kv_bytes", 0) / GiB, described.get("weights_bytes", 0) / GiB
        lines += [
            f"Engine: torch.compile {'on' if eng.get('compile') else 'off'}, CUDA graphs for decode batches "
            f"{eng.get('cuda_graph_sizes')}, max_model_len {eng.get('max_model_len')}, "
            f"KV cache {kv_gib:.2f} GiB, weights {weights_gib:.2f} GiB.",
            "",
        ]
        lines += [
            "| start | page cache | to first token, s: median (min-max, n) | floor s | vs floor | "
            "vs cold (same cache) | outputs identical |",
            "|---|---|---|---|---|---|---|",
        ]
        warm_compile = [r for r in res.cold if r.get("compile_cache") != "empty"]
        colds = {c: [r["total_s"] for r in warm_compile if r["cache"] == c] for c in ("hot", "dropped")}
        for cache in ("hot", "dropped"):
            lines.append(f"| cold start | {cache} | {_median_spread(colds[cache])} | | | 1x | |")
        for first in (r for r in res.cold if r.get("compile_cache") == "empty"):
            lines.append(f"| cold start, torch.compile cache empty | hot | {first['total_s']:.2f} | | | | |")
        for variant, mode in _variants(res):
            capture = res.captures[mode]
            for cache in ("hot", "dropped"):
                runs = [r for r in res.restores if r.variant == variant and r.cache == cache]
                if not runs:
                    continue
                totals = [r.total_s for r in runs]
                med = statistics.median(totals)
                floor = floor_seconds(res, capture, floors, cache, mode) if floors else None
                vs_floor = f"{med / floor:.2f}x" if floor else "-"
                cold = statistics.median(colds[cache]) if colds[cache] else None
                speedup = f"{cold / med:.1f}x faster" if cold else "-"
                same = all(r.outputs_identical and r.first_token_identical for r in runs)
                lines.append(
                    f"| {variant} restore | {cache} | {_median_spread(totals)} | "
                    f"{floor:.2f} | {vs_floor} | {speedup} | {'yes' if same else 'NO'} |"
                    if floor
                    else f"| {variant} restore | {cache} | {_median_spread(totals)} | - | - | "
                    f"{speedup} | {'yes' if same else 'NO'} |"
                )
        lines += ["", "Capture:", ""]
        for mode, capture in res.captures.items():
            host = capture.get("host_memory_at_checkpoint") or {}
            lines.append(
                f"- {mode}: image {capture['image_bytes'] / GiB:.2f} GiB, engine's GPU memory at checkpoint "
                f"{(_engine_gpu_bytes(capture) or 0) / GiB:.2f} GiB (torch reserved "
                f"{(capture.get('torch_reserved_at_checkpoint') or 0) / GiB:.2f} GiB; graph scratch released "
                f"{(capture.get('graph_scratch_bytes') or 0) / GiB:.2f} GiB), host anonymous memory "
                f"{host.get('RssAnon', 0) / GiB:.2f} GiB in {host.get('Mappings', '?')} mappings, "
                f"{host.get('Threads', '?')} threads; cuda lock "
                f"{capture['cuda_lock_s']} s, cuda checkpoint {capture['cuda_checkpoint_s']} s, "
                f"criu dump {capture['criu_dump_s']} s"
            )
        lines += ["", "Phases (median seconds):", ""]
        keys = sorted({k for r in res.restores for k in r.phases}, key=_phase_order)
        header = [*keys, *(f"({k})" for k in DETAIL_KEYS)]
        lines += ["| restore | cache | " + " | ".join(header) + " |", "|---|---|" + "---|" * len(header)]
        for variant, _mode in _variants(res):
            for cache in ("hot", "dropped"):
                runs = [r for r in res.restores if r.variant == variant and r.cache == cache]
                if runs:
                    cells = [_median_or_dash([r.phases.get(k) for r in runs]) for k in keys]
                    cells += [_median_or_dash([_detail(r, k) for r in runs]) for k in DETAIL_KEYS]
                    lines.append(f"| {variant} | {cache} | " + " | ".join(cells) + " |")
        cold_keys = sorted({k for c in res.cold for k in c["phases"]}, key=_phase_order)
        lines += [
            "",
            "| cold start | cache | " + " | ".join(cold_keys) + " |",
            "|---|---|" + "---|" * len(cold_keys),
        ]
        for cache in ("hot", "dropped"):
            runs = [c for c in res.cold if c["cache"] == cache]
            if runs:
                cells = [_median_or_dash([c["phases"].get(k) for c in runs]) for k in cold_keys]
                lines.append(f"| cold | {cache} | " + " | ".join(cells) + " |")
        lines += [""] + [f"Note: {n}" for n in res.notes] + [""]
    return "\n".join(lines)


# Inside reacquire_refill, as the engine timed it (in parentheses in the phase table)
DETAIL_KEYS = ("weights_refill", "staged_weights_wait", "map_kv_and_scratch")


def _detail(run: RestoreRun, key: str) -> float | None:
    refill = run.engine_detail.get("weights_refill") or {}
    reacquire = run.engine_detail.get("reacquire") or {}
    found = {
        "weights_refill": refill.get("seconds"),
        "staged_weights_wait": refill.get("waited_s"),
        "map_kv_and_scratch": reacquire.get("map_kv_and_scratch_s"),
    }
    return found[key]


def _stager_threads(value: str) -> int:
    """off: 0; on: the stager's default thread count; a number: that many threads."""
    from warmstart.gpu.weight_stager.stage import STAGING_THREADS

    if value == "off":
        return 0
    return STAGING_THREADS if value == "on" else int(value)


def _variant(mode: str, stager_threads: int) -> str:
    return (
        f"{mode}, weights staged ({stager_threads} threads)"
        if stager_threads
        else f"{mode}, weights refilled"
    )


def _variants(res: ModelResult) -> list[tuple[str, str]]:
    """(variant, mode) of the restores, in the order they ran."""
    return list(dict.fromkeys((run.variant, run.mode) for run in res.restores))


def _phase_order(key: str) -> int:
    order = [
        "spawned->torch_imported",
        "torch_imported->loaded",
        "loaded->warm",
        "warm->first_token",
        "criu_restore",
        "cuda_restore",
        "cuda_unlock",
        "signal_to_resume",
        "reacquire_refill",
        "first_token",
    ]
    return order.index(key) if key in order else len(order)


def _median_or_dash(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{statistics.median(present):.3f}" if present else "-"


def environment(criu_command: str) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    with contextlib.suppress(Exception):
        env["gpu"] = torch.cuda.get_device_name(0)
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        env["driver"] = smi.stdout.strip()
    with contextlib.suppress(Exception):
        out = subprocess.run(
            [*shlex.split(criu_command), "--version"], capture_output=True, text=True, timeout=30
        )
        env["criu"] = out.stdout.split()[1]
    return env


# =========================================================================================================
# Entry point
# =========================================================================================================


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("run", help="the whole benchmark (default)")
    run.add_argument(
        "--criu", default=os.environ.get("WARMSTART_CRIU", "criu"), help="CRIU >= 4 command line"
    )
    run.add_argument("--work", default="/var/tmp/warmstart-gpu-bench", help="scratch directory on local disk")
    run.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"), help="where results go")
    run.add_argument("--models", default=",".join(MODELS))
    run.add_argument(
        "--modes", default="optimised,naive", help="restore kinds to measure (also: keep-scratch)"
    )
    run.add_argument("--reps", type=int, default=3, help="restores per mode and cache state")
    run.add_argument(
        "--naive-reps", type=int, default=0, help="restores per cache state for naive (0: --reps)"
    )
    run.add_argument("--floors-json", default="", help="reuse floors measured earlier (a floors JSON file)")
    run.add_argument("--cold-reps", type=int, default=1, help="extra cold starts per cache state")
    run.add_argument("--floors-gib", type=int, default=8, help="file size for the bandwidth floors (0: skip)")
    run.add_argument("--budget-s", type=float, default=540, help="stop starting new steps after this")
    run.add_argument(
        "--max-num-seqs", type=int, default=64, help="decode batch limit (graphs: 1,2,4,8,16,..)"
    )
    run.add_argument("--max-model-len", type=int, default=1024, help="KV cache length per sequence")
    run.add_argument(
        "--compile-models", default="", help="models whose engine uses torch.compile (default: none)"
    )
    run.add_argument("--caches", default="hot,dropped", help="page cache states to measure")
    run.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: dry run, tiny model")
    run.add_argument("--refill-threads", type=int, default=8, help="the engine's weight refill threads")
    run.add_argument(
        "--stage-weights",
        default="on",
        help="comma-separated variants, each measured: off (the engine refills), on, or a thread count for "
        "the weight stager (it fills the GPU while CRIU restores)",
    )
    proc = sub.add_parser("engine-process", help="internal: the engine process under test")
    proc.add_argument("--mode", choices=("cold", "naive", *RELEASING_MODES), required=True)
    proc.add_argument("--control", required=True)
    proc.add_argument("--options", required=True)
    proc.add_argument("--spawned-at", required=True)
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["run", *(argv or sys.argv[1:])])
    return args


def run(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise SystemExit("the benchmark needs root (CRIU, dropping the page cache)")
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.criu)
    log(f"environment: {env}")
    bench = Bench(args)
    floors = None
    if args.floors_json:
        floors = json.loads(Path(args.floors_json).read_text())
    elif args.floors_gib and args.device == "cuda":
        floors = measure_floors(work, args.floors_gib)
    if floors:
        (out / "gpu_restore_floors.json").write_text(json.dumps(floors, indent=1))
    results = []
    for model in [m for m in args.models.split(",") if m]:
        if bench.time_left() < 120:
            log(f"{model}: skipped, time budget spent")
            continue
        try:
            results.append(bench.run_model(model))
        except Exception as exc:  # report what was measured, then the failure
            log(f"{model}: FAILED: {exc}")
            (out / f"gpu_restore_{model}.error.txt").write_text(str(exc))
        finally:
            shutil.rmtree(work / "models" / model, ignore_errors=True)
        table = markdown(results, floors, env)
        (out / "gpu_restore.md").write_text(table)
    print(markdown(results, floors, env), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "engine-process":
        return engine_process(args)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
