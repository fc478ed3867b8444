"""Fixtures for the node mechanics: a real CRIU 4 (skip with the reason when there is none) and sandboxes."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIM = REPO / "hack" / "criu"


def _criu_command() -> str | None:
    configured = os.environ.get("WARMSTART_CRIU")
    if configured:
        return configured
    probe = subprocess.run([str(REPO / "hack" / "criu-setup"), "--print"], capture_output=True, text=True)
    if probe.returncode == 0:
        return str(SHIM)
    return shutil.which("criu")


@pytest.fixture(scope="session")
def criu_command() -> str:
    """A CRIU >= 4 command line; skips when not root (CRIU and namespaces need it) or none is set up."""
    if os.geteuid() != 0:
        pytest.skip("CRIU and PID/mount namespaces need root")
    command = _criu_command()
    if command is None:
        pytest.skip("no CRIU 4 here: run hack/criu-setup (or set WARMSTART_CRIU)")
    from warmstart.snapshot_agent.criu import Criu, CriuError

    try:
        Criu(command).version()
    except CriuError as exc:
        pytest.skip(f"no usable CRIU 4: {exc}")
    return command
