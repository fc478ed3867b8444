"""benchmarks/criu_fill.py on a small process with real CRIU: the restorer's reads (with one reader and, on
the CRIU hack/criu-setup builds, two) are found in CRIU's log, account for every byte of the pages image, and
the restored memory hashes as it did before the dump."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from warmstart.checkpoint import hugepages

pytestmark = pytest.mark.spawns

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_the_restorers_fill_is_read_from_a_real_restore(criu_command: str, tmp_path: Path) -> None:
    try:
        mode = hugepages.current_mode()
    except (OSError, ValueError) as exc:
        pytest.skip(f"no transparent huge pages setting to run under: {exc}")
    rows_file = tmp_path / "rows.json"
    command = [
        sys.executable, "benchmarks/criu_fill.py", "--size-gib", "0.0625", "--dir", str(tmp_path / "work"),
        "--repeat", "1", "--thp", mode, "--criu", criu_command, "--json", str(rows_file),
        "--contend-readers", "1", "--readers", "1", "2",
    ]  # fmt: skip
    finished = subprocess.run(command, cwd=REPO, timeout=300, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stdout[-4000:] + finished.stderr[-4000:]
    rows = {row["name"]: row for row in json.loads(rows_file.read_text())}
    image_bytes = rows[f"THP {mode}: the copy alone: 16 MiB buffer reused, 1 reader"]["nbytes"]
    assert image_bytes >= 64 << 20
    for label in (f"THP {mode}", f"THP {mode}, 1 readers copying beside it"):
        for readers in (1, 2):
            restorer = rows[f"{label}: CRIU restorer's reads, {readers} readers"]
            assert restorer["nbytes"] == image_bytes and restorer["seconds"][0] > 0, restorer
    assert not list((tmp_path / "work").iterdir()), "the image was left behind"
