"""Start a weight stager next to a restore, for snapshots whose engine left its weights out of the image.

The engine's staging plan travels in the signed snapshot (`meta.worker.weight_staging`, written by the
engine process at capture). Once the snapshot is verified, and before CRIU starts, the restoring side starts
`warmstart.engines.weight_stager` with that plan, its file paths seen through the sandbox's root
(`/proc/<init>/root`), listening on a socket in the sandbox's control directory. The resume payload names
the socket; the restored engine maps the staged weights instead of reading them itself (see the stager's
docstring). A stager nobody connects to gives up after two minutes; one whose restore failed is stopped.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
from typing import Any

from warmstart.engines.weight_stager import StagingPlan
from warmstart.protocol import ControlDir
from warmstart.snapshot.store import Snapshot

log = logging.getLogger(__name__)

STAGER_SOCKET = "weight-stager.sock"  # in the control directory; the resume payload names it


def staging_plan(snapshot: Snapshot) -> StagingPlan | None:
    """The engine's plan, when the snapshot has one and runs on CUDA; None otherwise (or when unreadable)."""
    planned = (snapshot.meta.get("worker") or {}).get("weight_staging")
    if not planned or not snapshot.meta.get("uses_cuda"):
        return None
    try:
        return StagingPlan.from_dict(planned)
    except (ValueError, KeyError, TypeError) as exc:
        log.warning(
            "snapshot %s: unusable weight staging plan (%s); the engine refills itself", snapshot.id, exc
        )
        return None


class StagerProcess:
    """A running stager: `payload()` for the resume signal, `stop()` when the restore failed."""

    def __init__(self, process: subprocess.Popen[bytes], control: ControlDir) -> None:
        self.process = process
        self._socket = control.path / STAGER_SOCKET
        # reaped in the background: the agent does not wait for the engine to connect
        threading.Thread(target=self._reap, name="weight-stager-reaper", daemon=True).start()

    def payload(self) -> dict[str, Any]:
        return {"weight_stager_socket": STAGER_SOCKET}

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        self._socket.unlink(missing_ok=True)

    def _reap(self) -> None:
        code = self.process.wait()
        if code:
            log.warning("the weight stager exited with %d (the engine refilled its weights itself)", code)


def start_stager(snapshot: Snapshot, sandbox_init_pid: int, control: ControlDir) -> StagerProcess | None:
    """Start the stager for `snapshot` (files read through the sandbox's root); None when it has no plan."""
    plan = staging_plan(snapshot)
    if plan is None:
        return None
    socket_path = control.path / STAGER_SOCKET
    socket_path.unlink(missing_ok=True)
    command = [sys.executable, "-m", "warmstart.engines.weight_stager", "--plan", "-"]
    process = subprocess.Popen([*command, "--socket", str(socket_path)], stdin=subprocess.PIPE)
    assert process.stdin is not None
    with process.stdin:
        process.stdin.write(plan.under_root(f"/proc/{sandbox_init_pid}/root").to_json().encode())
    return StagerProcess(process, control)
