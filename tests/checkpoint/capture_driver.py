"""Runs one capture of the target process and stops (sleeps) at a named phase, so a test can kill it there.

Usage: capture_driver.py STORE KEY WORK_DIR CRIU_COMMAND STOP_PHASE. Writes WORK_DIR/sandbox.json (the
sandbox's PIDs) once the sandbox exists and WORK_DIR/phase (the phase reached) at each phase.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

from warmstart.api.control_dir import ControlDir
from warmstart.checkpoint.capture import CaptureOptions, capture
from warmstart.checkpoint.criu import Criu
from warmstart.checkpoint.sandbox import MOUNTPOINT, Sandbox
from warmstart.snapshot.signing import load_signer
from warmstart.snapshot.store import SnapshotStore

TARGET = Path(__file__).with_name("target_process.py")


def main() -> int:
    store, key, work, criu_command, stop_phase = sys.argv[1:6]
    work_dir = Path(work)
    host_dir = work_dir / "sandbox"
    (host_dir / "control" / "logs").mkdir(parents=True)
    control = MOUNTPOINT / "control"
    script = f"setsid {shlex.quote(sys.executable)} {TARGET} {control} 4 </dev/null >{control}/logs/out 2>&1"
    sandbox = Sandbox.start(host_dir, ["/bin/sh", "-c", script + " & wait"])
    (work_dir / "sandbox.json").write_text(
        json.dumps({"init_pid": sandbox.init_pid, "pid_namespace": sandbox.pid_namespace})
    )

    def reached(phase: str) -> None:
        (work_dir / "phase").write_text(phase)
        while phase == stop_phase:
            time.sleep(1)

    capture(
        store=SnapshotStore(store), signer=load_signer(key), sandbox=sandbox,
        control=ControlDir(host_dir / "control"), criu=Criu(criu_command), options=CaptureOptions(),
        on_phase=reached,
    )  # fmt: skip
    reached("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
