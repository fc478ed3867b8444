"""A capture's engine starts past ENGINE_PID_FLOOR of its PID namespace, where no restoring pod's supervisor
thread reaches: checked in a PID namespace of its own, as a pod's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from warmstart.worker.supervisor import ENGINE_PID_FLOOR

pytestmark = [
    pytest.mark.spawns,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and util-linux unshare"
    ),
]

CHILD_PID_AFTER_FLOOR = f"""
import os
from warmstart.worker.supervisor import pids_past
assert os.getpid() == 1, os.getpid()
pids_past({ENGINE_PID_FLOOR})
child = os.fork()
if child == 0:
    os._exit(0)
os.waitpid(child, 0)
print(child)
"""


def test_a_capture_engine_is_started_past_the_floor_in_a_fresh_pid_namespace() -> None:
    result = subprocess.run(
        ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", CHILD_PID_AFTER_FLOOR],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert ENGINE_PID_FLOOR <= int(result.stdout) < ENGINE_PID_FLOOR + 10, result.stdout
