"""A worker that, like a JIT compiler loading the shared object it just built, writes a shared object under
its control directory and loads it (the loader maps it and closes its descriptor: only the mappings hold the
file). After a restore it calls into it and writes `answer` (CRIU restores the mappings only if the file is
there again, as it was).

Usage: mapping_target.py CONTROL_DIR. Signals ready-for-snapshot with its PID, then waits for
restore-complete or snapshot-complete.
"""

from __future__ import annotations

import _ctypes
import ctypes
import os
import shutil
import sys
from pathlib import Path

from warmstart.api.control_dir import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, SNAPSHOT_COMPLETE, ControlDir
from warmstart.api.identity import SnapshotIdentity


def main() -> int:
    control = ControlDir(sys.argv[1])
    built = Path(sys.argv[1]) / "cache" / "launcher.so"
    built.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_ctypes.__file__, built)  # any shared object will do: this one is at hand
    loaded = ctypes.CDLL(str(built))
    identity = SnapshotIdentity(model_digest=f"sha256:{9:0>64}", engine="target", engine_version="1")
    payload = {"pid": os.getpid(), "identity": identity.to_dict(), "identity_hash": identity.digest()}
    control.send(READY_FOR_SNAPSHOT, payload)
    if control.wait(RESTORE_COMPLETE, SNAPSHOT_COMPLETE).name == RESTORE_COMPLETE:
        found = loaded.PyInit__ctypes is not None  # a symbol looked up in the restored mapping
        (Path(sys.argv[1]) / "answer").write_text(f"loaded {found}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
