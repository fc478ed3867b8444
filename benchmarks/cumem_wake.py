"""How long backing a sleeping vLLM KV cache with fresh device memory takes, one range at a time (what vLLM's
allocator does at wake: `cuMemCreate` + `cuMemMap` + `cuMemSetAccess` per range) against several threads.

vLLM's KV cache at Qwen3-8B shapes on an H200 is 37 ranges, 102 GiB, and its wake took 0.29 s after every
restore: the largest step of the engine's wake. Whether the driver maps ranges side by side decides whether
a wake in threads is worth building. The ranges are reserved once; each pass maps all of them, touches one
byte of each (so a lazy driver cannot hide the cost), and unmaps them again. The first pass is the baseline:
memory this process never freed; each later pass is printed against it, and one more pass, one range at a
time, times each driver call.

    python benchmarks/cumem_wake.py [--ranges 37] [--gib 102] [--threads 1,2,4,8] [--passes 3] [--rest S]
        [--json F]
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from warmstart.gpu.cuda_arena import VmmRange, allocation_granularity, primary_context
from warmstart.host.cuda_driver import check, driver


def map_all(ranges: list[VmmRange], threads: int, device_index: int) -> float:
    """Seconds to back every range with fresh memory, `threads` ranges at a time."""

    def back(span: VmmRange) -> None:
        primary_context(device_index).make_current()
        span.map()

    started = time.perf_counter()
    if threads == 1:
        for span in ranges:
            back(span)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(back, ranges))
    return time.perf_counter() - started


def phases(ranges: list[VmmRange], device_index: int) -> dict[str, float]:
    """One range at a time, each driver call timed on its own; the ranges are left unmapped again."""
    cu = driver()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    took = {"cuMemCreate": 0.0, "cuMemMap": 0.0, "cuMemSetAccess": 0.0, "cuMemUnmap+Release": 0.0}
    handles = []
    for span in ranges:
        mark = time.perf_counter()
        handle = check(cu.cuMemCreate(span.size, prop, 0), "cuMemCreate")
        took["cuMemCreate"] += time.perf_counter() - mark
        mark = time.perf_counter()
        check(cu.cuMemMap(span.address, span.size, 0, handle, 0), "cuMemMap")
        took["cuMemMap"] += time.perf_counter() - mark
        mark = time.perf_counter()
        check(cu.cuMemSetAccess(span.address, span.size, [access], 1), "cuMemSetAccess")
        took["cuMemSetAccess"] += time.perf_counter() - mark
        handles.append(handle)
    mark = time.perf_counter()
    for span, handle in zip(ranges, handles, strict=True):
        check(cu.cuMemUnmap(span.address, span.size), "cuMemUnmap")
        check(cu.cuMemRelease(handle), "cuMemRelease")
    took["cuMemUnmap+Release"] = time.perf_counter() - mark
    return {call: round(seconds, 4) for call, seconds in took.items()}


def touch_all(ranges: list[VmmRange]) -> None:
    cu = driver()
    for span in ranges:
        check(cu.cuMemsetD8(span.address, 1, 1), "cuMemsetD8")
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--ranges", type=int, default=37)
    parser.add_argument("--gib", type=float, default=102.0)
    parser.add_argument("--threads", default="1,2,4,8")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument(
        "--rest", type=float, default=0.0, help="seconds between a pass's unmap and the next map"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    primary_context(args.device).make_current()
    granularity = allocation_granularity(args.device)
    each = max(granularity, int(args.gib * (1 << 30) / args.ranges) // granularity * granularity)
    ranges = [VmmRange(args.device, each, backed=False) for _ in range(args.ranges)]
    total = each * len(ranges)
    rows: list[dict[str, float]] = []
    try:
        for threads in [int(t) for t in args.threads.split(",")] * args.passes:
            seconds = map_all(ranges, threads, args.device)
            touch_all(ranges)
            for span in ranges:
                span.unmap()
            time.sleep(args.rest)
            rows.append(
                {"threads": threads, "seconds": round(seconds, 4), "gib_per_s": total / seconds / 2**30}
            )
        calls = phases(ranges, args.device)
    finally:
        for span in ranges:
            span.free()
    print(
        f"{len(ranges)} ranges of {each / 2**30:.2f} GiB ({total / 2**30:.1f} GiB), granularity {granularity}"
    )
    # The first pass backs the ranges with memory this process never freed: the baseline (the driver's
    # floor); every later one re-allocates what the pass before it freed.
    print(f"{'pass':>5} {'threads':>8} {'seconds':>9} {'GiB/s':>8} {'vs pass 1':>10}")
    for index, row in enumerate(rows, 1):
        ratio = row["seconds"] / rows[0]["seconds"]
        print(
            f"{index:>5} {row['threads']:>8} {row['seconds']:>9.4f} {row['gib_per_s']:>8.1f} {ratio:>9.1f}x"
        )
    print(
        "one range at a time, by call: " + ", ".join(f"{call} {took:.4f} s" for call, took in calls.items())
    )
    if args.json:
        record = {"ranges": len(ranges), "bytes_each": each, "rows": rows, "calls": calls}
        args.json.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
