"""A worker that tries to make the capturing side read a file it must not: it holds a descriptor of a
symbolic link in its sandbox (opened O_PATH | O_NOFOLLOW, which needs no permission on the link's target).

Usage: hostile_target.py CONTROL_DIR LINK. Opens LINK, signals ready-for-snapshot with its PID and waits for
restore-complete or snapshot-complete.
"""

from __future__ import annotations

import os
import sys

from warmstart.api.control_dir import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, SNAPSHOT_COMPLETE, ControlDir
from warmstart.api.identity import SnapshotIdentity


def main() -> int:
    control, link = ControlDir(sys.argv[1]), sys.argv[2]
    held = os.open(link, os.O_PATH | os.O_NOFOLLOW)
    identity = SnapshotIdentity(model_digest=f"sha256:{0:0>64}", engine="target", engine_version="1")
    payload = {"pid": os.getpid(), "identity": identity.to_dict(), "identity_hash": identity.digest()}
    control.send(READY_FOR_SNAPSHOT, payload)
    control.wait(RESTORE_COMPLETE, SNAPSHOT_COMPLETE)
    os.close(held)
    return 0


if __name__ == "__main__":
    sys.exit(main())
