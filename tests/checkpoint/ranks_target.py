"""Two ranks of a tensor-parallel computation, checkpointed as one process tree: a test program.

Usage: ranks_target.py CONTROL_DIR SEED. Rank 0 (this process, the engine) starts rank 1 as its child with a
pipe each way. Each rank holds half of a seeded weight matrix (rows of W, the matching columns of x) and a
row-parallel product sums the halves with gloo's all_reduce over loopback. Before `ready-for-snapshot` both
ranks destroy their process group, so nothing but the pipes joins them at the dump (no socket); after
`restore-complete` rank 0 tells rank 1 where to meet again (a new file store: a world of two needs no
network rendezvous) and both compute again. `answer` holds the digests before and after and whether the
sum matches the product computed by one process.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from warmstart.api.control_dir import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, SNAPSHOT_COMPLETE, ControlDir
from warmstart.api.identity import SnapshotIdentity

WORLD = 2
SIZE = 256
TIMEOUT = timedelta(seconds=60)


def shards(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x's columns, W's rows) of `rank`, and the whole product as one process computes it."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(8, SIZE, generator=generator, dtype=torch.float64)
    w = torch.randn(SIZE, SIZE, generator=generator, dtype=torch.float64)
    part = slice(rank * SIZE // WORLD, (rank + 1) * SIZE // WORLD)
    return x[:, part].clone(), w[part].clone(), x @ w


def product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    partial = x @ w
    dist.all_reduce(partial)
    return partial


def join(store_path: str, rank: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD,
                            timeout=TIMEOUT)  # fmt: skip


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.numpy().tobytes()).hexdigest()


def follower(seed: int, commands: int, answers: int) -> int:
    """Rank 1: compute whenever rank 0 says where to meet; stop when told."""
    x, w, _ = shards(seed, 1)
    with os.fdopen(commands) as inbox, os.fdopen(answers, "w") as outbox:
        for line in inbox:
            word, _, store_path = line.strip().partition(" ")
            if word == "stop":
                return 0
            join(store_path, 1)
            product(x, w)
            dist.destroy_process_group()
            outbox.write("done\n")
            outbox.flush()
    return 1


def main() -> int:
    if sys.argv[1] == "--follower":
        return follower(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    control, seed = ControlDir(sys.argv[1]), int(sys.argv[2])
    to_follower, from_leader = os.pipe()
    to_leader, from_follower = os.pipe()
    rank1 = subprocess.Popen(
        [sys.executable, __file__, "--follower", str(seed), str(to_follower), str(from_follower)],
        pass_fds=(to_follower, from_follower), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(to_follower)
    os.close(from_follower)
    inbox, outbox = os.fdopen(to_leader), os.fdopen(from_leader, "w")
    x, w, whole = shards(seed, 0)

    def compute(round_name: str) -> torch.Tensor:
        store_path = Path(control.path) / f"rendezvous-{round_name}"
        store_path.unlink(missing_ok=True)  # a file store must start empty
        outbox.write(f"join {store_path}\n")
        outbox.flush()
        join(str(store_path), 0)
        result = product(x, w)
        dist.destroy_process_group()  # nothing of gloo's stays open between rounds
        if inbox.readline().strip() != "done":
            raise RuntimeError("rank 1 did not finish its part")
        return result

    before = compute("before")
    identity = SnapshotIdentity(model_digest=f"sha256:{seed:0>64}", engine="ranks", engine_version="1",
                                parallelism=WORLD)  # fmt: skip
    payload = {"pid": os.getpid(), "identity": identity.to_dict(), "identity_hash": identity.digest(),
               "ranks": [os.getpid(), rank1.pid]}  # fmt: skip
    control.send(READY_FOR_SNAPSHOT, payload)
    signal = control.wait(RESTORE_COMPLETE, SNAPSHOT_COMPLETE)
    if signal.name != SNAPSHOT_COMPLETE:
        after = compute("after")
        answer = {"before": digest(before), "after": digest(after), "pids": [os.getpid(), rank1.pid],
                  "matches_one_process": bool(torch.allclose(after, whole))}  # fmt: skip
        (Path(control.path) / "answer").write_text(json.dumps(answer) + "\n")
    outbox.write("stop\n")
    outbox.flush()
    return rank1.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
