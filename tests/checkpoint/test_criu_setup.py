"""hack/criu-setup and the hack/criu shim: CRIU >= 4 from the cache, runnable through the shim."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from warmstart.checkpoint.criu import Criu

pytestmark = pytest.mark.spawns

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_shim_runs_criu_4(criu_command: str) -> None:
    printed = subprocess.run([REPO / "hack" / "criu-setup", "--print"], capture_output=True, text=True)
    if printed.returncode != 0:
        pytest.skip(f"hack/criu-setup has not run here: {printed.stderr.strip()}")
    assert "criu" in printed.stdout
    assert Criu(str(REPO / "hack" / "criu")).version().major >= 4
    assert Criu(printed.stdout.strip()).version().major >= 4


def test_setup_rejects_unknown_arguments() -> None:
    result = subprocess.run([REPO / "hack" / "criu-setup", "--frobnicate"], capture_output=True, text=True)
    assert result.returncode != 0
    assert "unknown argument --frobnicate" in result.stderr
