"""A small stateful process to checkpoint in tests: its answer depends on memory built before the dump.

Usage: target_process.py CONTROL_DIR SEED [chatty] [linger] [hold=MIB]. Builds a random state, signals
ready-for-snapshot with its PID, waits for restore-complete, then writes `answer` (a digest of the state
continued after the restore).
`chatty` keeps printing after ready-for-snapshot, as a worker that does not quiesce would; `linger` keeps
running after the answer until `CONTROL_DIR/exit` exists (at most two minutes), as a serving engine would.
`hold=MIB` also holds that many MiB of seeded random bytes in private memory, part of the answer.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import threading
import time
from pathlib import Path

from warmstart.api.control_dir import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, SNAPSHOT_COMPLETE, ControlDir
from warmstart.api.identity import SnapshotIdentity


def _chatter() -> None:
    while True:
        print("still busy", flush=True)
        time.sleep(0.001)


def _held_mib() -> int:
    return next((int(arg.split("=", 1)[1]) for arg in sys.argv[3:] if arg.startswith("hold=")), 0)


def main() -> int:
    control = ControlDir(sys.argv[1])
    rng = random.Random(int(sys.argv[2]))
    state = bytes(rng.getrandbits(8) for _ in range(1 << 16))
    held = rng.randbytes(_held_mib() << 20)
    print(f"target ready pid={os.getpid()}", flush=True)
    identity = SnapshotIdentity(
        model_digest=f"sha256:{sys.argv[2]:0>64}", engine="target", engine_version="1"
    )
    payload = {"pid": os.getpid(), "identity": identity.to_dict(), "identity_hash": identity.digest()}
    control.send(READY_FOR_SNAPSHOT, payload)
    if "chatty" in sys.argv[3:]:
        threading.Thread(target=_chatter, daemon=True).start()
    signal = control.wait(RESTORE_COMPLETE, SNAPSHOT_COMPLETE)
    if signal.name == SNAPSHOT_COMPLETE:
        return 0
    digest = hashlib.sha256(state + hashlib.sha256(held).digest() + rng.randbytes(32)).hexdigest()
    answer = Path(control.path) / "answer"
    answer.write_text(f"{digest} {os.getpid()} {signal.payload.get('port', '')}\n")
    print(f"target answered {digest}", flush=True)
    deadline = time.monotonic() + 120
    while (
        "linger" in sys.argv[3:]
        and not (Path(control.path) / "exit").exists()
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
