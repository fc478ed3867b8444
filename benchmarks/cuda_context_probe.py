"""What a CUDA checkpoint copies out of a process that holds no tensors worth keeping.

Each variant runs in its own child process, which sets up CUDA state and waits. The parent measures the
child's device memory (nvidia-smi) and its anonymous host memory, takes a CUDA checkpoint (the driver copies
device memory into the process's host memory), measures again, restores and lets the child go. The host
growth is what CRIU would then have to store and restore: the part of an image no engine can shed.

    python3 benchmarks/cuda_context_probe.py [SUBSTRING...]   # as root, on a GPU host; a markdown table
                                                               # of every variant (or those named)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gpu_restore import GiB, gpu_memory_of  # noqa: E402

VARIANTS = {
    "context only (torch.zeros on cuda)": "x = torch.zeros(1, device='cuda')",
    "+ cuBLAS bf16 matmul": (
        "x = torch.zeros(1, device='cuda'); a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16);"
        " b = a @ a; del a, b; torch.cuda.empty_cache()"
    ),
    "+ SDPA and a Triton kernel (torch.compile)": (
        "x = torch.zeros(1, device='cuda'); a = torch.randn(4096, 4096, device='cuda', dtype=torch.bfloat16);"
        " b = a @ a; q = torch.randn(8, 32, 128, 128, device='cuda', dtype=torch.bfloat16);"
        " o = torch.nn.functional.scaled_dot_product_attention(q, q, q);"
        " f = torch.compile(lambda t: torch.nn.functional.silu(t) * t); f(a);"
        " del a, b, q, o; torch.cuda.empty_cache();"
        " from torch._inductor import async_compile as ac; getattr(ac, 'shutdown_compile_workers', int)()"
    ),
}
# What the CUDA restore's time grows with: bytes of device memory, or objects (vLLM's engine holds about
# 1,900 CUDA graphs at its default capture sizes, each a few kernels, all in one shared memory pool).
GRAPHS = """
x = torch.zeros(4096, device='cuda'); graphs = []; pool = None
for _ in range({count}):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        y = x
        for _ in range(16):
            y = y * 1.0001 + 1
    pool = pool or g.pool()
    graphs.append(g)
"""
VARIANTS.update(
    {
        "+ 2 GiB of tensors": (
            "x = torch.zeros(1, device='cuda'); m = torch.ones(2 << 30, dtype=torch.uint8, device='cuda')"
        ),
        **{
            f"+ {count} CUDA graphs of 32 kernels": f"exec({GRAPHS.format(count=count)!r})"
            for count in (500, 2000)
        },
    }
)
# The driver's local-memory reserve (stack bytes x every thread the GPU holds) is device memory a checkpoint
# copies: the same states with the stack limit lowered just before it, as the builtin engine's release does.
LOWER_STACK = (
    "; from cuda.bindings import driver as cu"
    "; assert int(cu.cuCtxSetLimit(cu.CUlimit.CU_LIMIT_STACK_SIZE, 16)[0]) == 0"
)
VARIANTS.update(
    {f"{name}, stack limit lowered": setup + LOWER_STACK for name, setup in list(VARIANTS.items())}
)

CHILD = "import sys, torch; {setup}; torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()"


def rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def start_child(setup: str) -> subprocess.Popen[str]:
    """A child process that runs `setup` (torch imported), says it is ready and waits for its stdin to
    close."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(setup=setup)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    if child.stdout is None or child.stdout.readline().strip() != "ready":
        child.kill()
        child.wait()
        raise RuntimeError("the probe child failed to set up CUDA")
    return child


def stop_child(child: subprocess.Popen[str]) -> None:
    """Close the child's stdin, so it exits; killed if it has not within a minute."""
    if child.stdin is not None:
        child.stdin.close()
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def probe(setup: str) -> dict[str, float]:
    from warmstart.checkpoint import cuda

    child = start_child(setup)
    try:
        gpu = gpu_memory_of(child.pid) or 0
        host_before = rss_anon(child.pid)
        started = time.perf_counter()
        cuda.suspend(child.pid)  # lock + checkpoint; unlocked again if the checkpoint fails
        checkpoint_s = time.perf_counter() - started
        host_after = rss_anon(child.pid)
        started = time.perf_counter()
        cuda.resume(child.pid)
        restore_s = time.perf_counter() - started
    finally:
        stop_child(child)
    return {
        "gpu_gib": gpu / GiB,
        "host_gib": host_before / GiB,
        "copied_gib": (host_after - host_before) / GiB,
        "checkpoint_s": checkpoint_s,
        "restore_s": restore_s,
    }


def main() -> int:
    only = sys.argv[1:]  # substrings of the variants to run (all by default)
    rows = [
        "| process state | GPU memory (nvidia-smi) | host anon before | host growth at checkpoint | "
        "checkpoint s | restore s |",
        "|---|---|---|---|---|---|",
    ]
    for name, setup in VARIANTS.items():
        if only and not any(part in name for part in only):
            continue
        r = probe(setup)
        rows.append(
            f"| {name} | {r['gpu_gib']:.2f} GiB | {r['host_gib']:.2f} GiB | {r['copied_gib']:.2f} GiB | "
            f"{r['checkpoint_s']:.2f} | {r['restore_s']:.2f} |"
        )
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
