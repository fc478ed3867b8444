"""Remote store throughput: push and pull of one synthetic snapshot through a local S3 server, one run.

    python benchmarks/object_store.py --size-mib 400 --dir /var/tmp/bench

Starts the tests' S3 gateway (`hack/control-plane build` builds it) on loopback with its data under
`--dir`, publishes a snapshot of `--size-mib` MiB of random bytes into a local store (one large file with
64 MiB chunk digests, the rest in 16 MiB and 64 KiB files, as a CRIU image directory looks), then measures:
push into the empty bucket, push again (every blob skipped), pull into an empty second store (every byte
verified), and the second store's full verification as the floor a pull cannot beat on this machine.
Prints a table with bytes moved, seconds, MiB/s and this process's CPU seconds; `--json` writes the rows.
On loopback the server shares the machine's cores with the client: the figures bound the client's cost,
not a network's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from warmstart.api.identity import SnapshotIdentity
from warmstart.snapshot import SnapshotStore
from warmstart.snapshot.remote import Credentials, RemoteConfig, RemoteStore
from warmstart.snapshot.signing import HmacKey

HACK = Path(__file__).resolve().parent.parent / "hack"
MIB = 1 << 20
BUCKET = "bench"


@dataclass(frozen=True)
class Row:
    step: str
    bytes_moved: int
    seconds: float
    cpu_seconds: float

    @property
    def mib_per_s(self) -> float:
        return self.bytes_moved / self.seconds / MIB if self.seconds else 0.0


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured(step: str, action: Callable[[], int]) -> Row:
    cpu, started = cpu_seconds(), time.perf_counter()
    moved = action()
    return Row(step, moved, time.perf_counter() - started, cpu_seconds() - cpu)


def file_sizes(total_mib: int) -> list[int]:
    """One large file of half the total, 16 MiB files for most of the rest, 64 KiB files for the tail."""
    large = total_mib // 2 * MIB
    medium = [16 * MIB] * ((total_mib * MIB - large) // (16 * MIB) - 1)
    rest = total_mib * MIB - large - sum(medium)
    return [large, *medium, *[64 << 10] * (rest // (64 << 10))]


def publish_synthetic(store: SnapshotStore, key: HmacKey, total_mib: int) -> str:
    identity = SnapshotIdentity(model_digest="sha256:" + "0" * 64, engine="bench", engine_version="1")
    with store.stage(identity) as staging:
        for index, size in enumerate(file_sizes(total_mib)):
            (staging.dir / f"pages-{index}.img").write_bytes(os.urandom(size))
        return staging.publish(key).id


def run(size_mib: int, work: Path, concurrency: int) -> list[Row]:
    sys.path.insert(0, str(HACK))
    from control_plane import s3

    server = s3.start_s3_server(work / "s3", buckets=[BUCKET], log=work / "versitygw.log")
    try:
        config = RemoteConfig(
            bucket=BUCKET, endpoint=server.endpoint, concurrency=concurrency,
            credentials=Credentials(server.access_key_id, server.secret_access_key),
        )  # fmt: skip
        key = HmacKey(os.urandom(32))
        source = RemoteStore(SnapshotStore(work / "node-a"), config)
        target = RemoteStore(SnapshotStore(work / "node-b"), config)
        snapshot_id = publish_synthetic(source.local, key, size_mib)
        size = source.local.get(snapshot_id).size
        return [
            measured("push (empty bucket)", lambda: source.push(snapshot_id).stats.bytes_transferred),
            measured("push again (all skipped)", lambda: source.push(snapshot_id).stats.bytes_skipped),
            measured(
                "pull (empty cache, verified)", lambda: target.pull(snapshot_id, key).stats.bytes_transferred
            ),
            measured(
                "verify the pulled snapshot (floor)", lambda: (target.local.verify(snapshot_id, key), size)[1]
            ),
        ]
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mib", type=int, default=400)
    parser.add_argument("--dir", type=Path, required=True, help="scratch directory (emptied first)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    rows = run(args.size_mib, args.dir, args.concurrency)
    print(f"{'step':38s} {'MiB':>8s} {'s':>7s} {'MiB/s':>8s} {'cpu s':>7s}")
    for row in rows:
        moved = row.bytes_moved / MIB
        print(f"{row.step:38s} {moved:8.1f} {row.seconds:7.2f} {row.mib_per_s:8.0f} {row.cpu_seconds:7.2f}")
    if args.json:
        args.json.write_text(
            json.dumps([asdict(row) | {"mib_per_s": row.mib_per_s} for row in rows], indent=2)
        )
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
