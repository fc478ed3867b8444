"""Every benchmark script starts: its imports (the test helpers it shares with the suite among them) resolve
and it prints its usage. A script that only runs on a GPU host without a usage text is listed apart."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spawns

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
WITHOUT_USAGE = {"cuda_context_probe.py"}  # no options: it probes the GPU as soon as it runs
SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if path.name not in WITHOUT_USAGE)


def test_the_scripts_are_found() -> None:
    assert len(SCRIPTS) >= 10, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_a_benchmark_script_starts(script: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout.lower(), result.stdout[-2000:]
