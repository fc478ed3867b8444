"""The restore claim, seen from a real `warmstart worker` in restore mode: one engine per pod, whoever wins.

The restorer's side is played by the test (it takes the claim as the agent does before CRIU, and answers
as the agent does); tests/checkpoint/test_restore_claim.py runs the real restore against a real supervisor.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import free_port

from warmstart.api.control_dir import CLAIM_COLD, CLAIM_RESTORE, RESTORE_CLAIM, RESTORE_FAILED, ControlDir
from warmstart.worker.supervisor import EXIT_RESTORE_UNANSWERED, RESTORE_ANSWER_TIMEOUT_ENV

pytestmark = pytest.mark.spawns


def _restore_mode(start_worker, control: Path, port: int):
    return start_worker(
        "--mode", "restore", "--port", str(port), "--control-dir", str(control), "--restore-timeout", "1"
    )  # fmt: skip


def test_a_supervisor_whose_timeout_passes_while_a_restore_holds_the_claim_does_not_cold_start(
    start_worker, tmp_path: Path
) -> None:
    control, port = ControlDir(tmp_path / "control"), free_port()
    assert control.claim(CLAIM_RESTORE).ours  # the restorer, about to start CRIU
    worker = _restore_mode(start_worker, control.path, port)
    worker.wait_for_log("a restore holds the claim")
    assert not (worker.log_dir / "engine.log").exists(), "an engine started next to the restore"
    assert control.read(RESTORE_CLAIM).payload["holder"] == CLAIM_RESTORE
    control.send(RESTORE_FAILED, {"reason": "CRIU restore failed (test)"})  # the restorer always answers
    worker.wait_ready(port)
    assert "CRIU restore failed (test)" in worker.logs()


def test_a_supervisor_claims_the_pod_before_its_cold_start(start_worker, tmp_path: Path) -> None:
    control, port = ControlDir(tmp_path / "control"), free_port()
    worker = _restore_mode(start_worker, control.path, port)
    worker.wait_ready(port)
    assert control.read(RESTORE_CLAIM).payload["holder"] == CLAIM_COLD
    assert not control.claim(CLAIM_RESTORE).ours  # a restore arriving now gives way


def test_a_restore_that_never_answers_ends_the_supervisor_with_an_error_not_a_second_engine(
    start_worker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RESTORE_ANSWER_TIMEOUT_ENV, "1")
    control = ControlDir(tmp_path / "control")
    assert control.claim(CLAIM_RESTORE).ours  # a restorer that then died
    worker = _restore_mode(start_worker, control.path, free_port())
    assert worker.process.wait(timeout=120) == EXIT_RESTORE_UNANSWERED
    assert "never answered" in worker.logs()
    assert not (worker.log_dir / "engine.log").exists()


@pytest.mark.spawns
def test_the_supervisor_starts_without_the_servers_imports() -> None:
    """A restore waits for the supervisor's restore facts, written right after its imports: `warmstart
    worker` imports neither the HTTP server nor pydantic nor an engine (the engine process does), nor the
    other commands' modules (the agent's and operator's settings models)."""
    heavy = ("uvicorn", "fastapi", "pydantic", "torch", "vllm", "warmstart.worker.engine_process",
             "warmstart.agent.cli", "warmstart.operator.cli")  # fmt: skip
    code = (
        "import sys; import warmstart.worker.supervisor;"
        "from warmstart.cli import build_parser, named_command;"
        "build_parser(named_command(['--log-level', 'INFO', 'worker', '--mode', 'restore']));"
        "print(' '.join(sys.modules))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert [name for name in heavy if name in run.stdout.split()] == []
