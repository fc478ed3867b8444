"""`warmstart worker`: a small supervisor (PID 1 in a container) around the engine process.

The engine runs as a child in its own session with stdio on files, so its subtree can be checkpointed by
CRIU on its own. The supervisor forwards SIGTERM/SIGINT, reaps every child (also processes re-parented to
it, as a restored engine is: it is a child subreaper) and exits with the engine's status.

With `--probe-port` it serves the kubelet's probes there from its start (`probe`): readiness held until
the engine's `/ready` answers 200, liveness.

restore mode: no engine is started at first; the agent restores one into this namespace and writes
`restore-complete`. On `restore-failed` the supervisor cold-starts one. When nothing arrives within
`--restore-timeout` it first takes the pod's restore claim for a cold start (`protocol.RESTORE_CLAIM`): if a
restore holds it already, the supervisor keeps waiting for that restore's answer (up to
`WARMSTART_RESTORE_ANSWER_TIMEOUT` more seconds, then it exits with an error) and never starts a second
engine next to the one being restored.

Both timeouts are resolved and checked by `options.check_worker_args` before the supervisor runs: a bad
setting stops the worker before it writes its restore facts, so no restore is tried into its pod.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from warmstart.api.control_dir import (
    CLAIM_COLD,
    RESTORE_CLAIM,
    RESTORE_COMPLETE,
    RESTORE_FACTS,
    RESTORE_FAILED,
    SIGNALS,
    ControlDir,
    Signal,
)
from warmstart.api.worker_options import WorkerOptions
from warmstart.host import procinfo
from warmstart.worker.facts import measure_restore_facts
from warmstart.worker.options import RESTORE_ANSWER_TIMEOUT_ENV, log_dir
from warmstart.worker.probe import EngineWatch, ProbeServer

log = logging.getLogger("warmstart.worker")

PR_SET_CHILD_SUBREAPER = 36
EXIT_RESTORE_UNANSWERED = 75  # EX_TEMPFAIL: the pod may be restarted, it was not given an engine
POLL_SECONDS = 0.05
# A restore gives the engine back the PIDs it had when it was captured, in a pod whose supervisor holds the
# lowest PIDs of its namespace with threads of its own (one once held the PID a captured engine had). So a
# capture's engine starts past this PID, which no supervisor's thread reaches.
ENGINE_PID_FLOOR = 1000
ENGINE_LOG = "engine.log"


class Supervisor:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.engine_pid: int | None = None
        self.engine = EngineWatch(args.port, args.start_timeout)  # a restore's answer may move its port
        self.stop_signal: int | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def run(self) -> int:
        _become_subreaper()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        started = procinfo.process_start_time()
        if self.args.probe_port is not None:
            ProbeServer(self.args.probe_port, self.engine).start()
        if self.args.mode == "restore":
            return self._restore(started)
        if self.args.mode == "capture":
            ControlDir(self.args.control_dir).clear(*SIGNALS)  # leftovers of an earlier run mean nothing
        return self._run_engine(self.args.mode, started)

    # --- modes ---------------------------------------------------------------------------------------

    def _restore(self, started: float) -> int:
        control = ControlDir(self.args.control_dir)
        _show_restore_facts(self.args, control, started)
        # Both resolved and checked by check_worker_args.
        timeout, answer_timeout = self.args.restore_timeout, self.args.restore_answer_timeout
        waiting_since = time.monotonic()
        restorer_since: float | None = None  # when the restorer was found holding the claim
        log.info("restore mode: waiting up to %.0f s for the agent in %s", timeout, control.path)
        while self.stop_signal is None:
            self._reap_strays()
            answer = control.read(RESTORE_COMPLETE) or control.read(RESTORE_FAILED)  # complete first
            if answer is not None:
                return self._on_answer(answer, started)
            now = time.monotonic()
            if restorer_since is None and now - waiting_since >= timeout:
                claim = control.claim(CLAIM_COLD)
                if claim.holder == CLAIM_COLD:
                    log.warning("no restore within %.0f s; starting the engine cold", timeout)
                    return self._run_engine("cold", started)
                restorer_since = now
                log.warning(
                    "no restore within %.0f s, but a restore holds the claim (%s): waiting up to %.0f s "
                    "more (%s) for its answer instead of starting a second engine",
                    timeout, claim.payload, answer_timeout, RESTORE_ANSWER_TIMEOUT_ENV,
                )  # fmt: skip
            if restorer_since is not None and now - restorer_since >= answer_timeout:
                log.error(
                    "the restore that holds %s never answered within %.0f s; exiting without starting an "
                    "engine (two engines must never share the GPU)",
                    control.path / RESTORE_CLAIM, answer_timeout,
                )  # fmt: skip
                return EXIT_RESTORE_UNANSWERED
            time.sleep(POLL_SECONDS)
        log.info("signal %d while waiting for a restore; exiting", self.stop_signal)
        return 0

    def _on_answer(self, answer: Signal, started: float) -> int:
        if answer.name == RESTORE_FAILED:
            reason = answer.payload.get("reason", "no reason given")
            log.warning("restore failed (%s); starting the engine cold", reason)
            return self._run_engine("cold", started)
        pid = answer.payload.get("pid")  # restore-complete: adopt the restored engine
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            children = _children()
            pid = children[0] if children else None
        if pid is None or not procinfo.is_running(pid):
            log.error("restore-complete arrived but no restored engine process is running; starting cold")
            return self._run_engine("cold", started)
        self.engine_pid = pid
        port = answer.payload.get("port")
        if isinstance(port, int) and not isinstance(port, bool):
            self.engine.port = port
        log.info("restored engine is pid %d", pid)
        return self._wait_for_engine()

    def _run_engine(self, mode: str, started_at: float) -> int:
        if mode == "capture":
            pids_past(ENGINE_PID_FLOOR)
        self.engine_pid = self._spawn(mode, started_at)
        log.info("engine process %d started (%s); logs in %s", self.engine_pid, mode, log_dir(self.args))
        if self.stop_signal is not None:
            self._forward(self.stop_signal)
        return self._wait_for_engine()

    # --- processes -----------------------------------------------------------------------------------

    def _spawn(self, mode: str, started_at: float) -> int:
        directory = log_dir(self.args)
        directory.mkdir(parents=True, exist_ok=True)
        engine_argv = WorkerOptions.of(self.args).engine_argv(mode)
        argv = [sys.executable, "-m", "warmstart.worker.engine_process", *engine_argv]
        argv += ["--started-at", repr(started_at)]
        with open(directory / ENGINE_LOG, "ab") as log_file:
            # A new session: the engine leads its own session, as CRIU wants of a dumped tree's root. Every
            # other descriptor is closed in the child, also ones this process inherited: an outside pipe
            # shared with the engine would make it impossible to checkpoint.
            self._process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                close_fds=True,
                start_new_session=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
            )
        return self._process.pid

    def _wait_for_engine(self) -> int:
        assert self.engine_pid is not None
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return self._watch_foreign(self.engine_pid)
            if pid == self.engine_pid:
                code = _exit_code(status)
                if self._process is not None and self._process.pid == pid:
                    self._process.returncode = code  # reaped here, not by subprocess
                log.info("engine process %d exited with %d", pid, code)
                return code

    def _watch_foreign(self, pid: int) -> int:
        """The engine is not our child (restored outside our namespace): wait until it is gone."""
        while procinfo.is_running(pid):
            time.sleep(POLL_SECONDS)
        log.info("engine process %d is gone (not our child: exit status unknown)", pid)
        return 0

    def _reap_strays(self) -> None:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stop_signal = signum
        if self.engine_pid is not None:
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        try:
            os.killpg(self.engine_pid, signum)  # the engine leads its own process group
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.engine_pid, signum)


def _show_restore_facts(args: argparse.Namespace, control: ControlDir, started: float) -> None:
    """What the restorer checks before it gives this pod a snapshot (`warmstart.api.restore_facts`); a restore
    waits for them, so the log says how long after the process's start they came."""
    measured = time.monotonic()
    facts = measure_restore_facts(args)
    control.send(RESTORE_FACTS, facts.to_dict())
    if facts.error:
        log.warning("restore facts: %s (a restore will be refused; the engine starts cold)", facts.error)
    log.info("restore facts written in %.3f s, %.3f s after the worker started",
             time.monotonic() - measured, time.time() - started)  # fmt: skip


def pids_past(floor: int) -> None:
    """Take and give back PIDs of this namespace, a short thread each, until the next one is past `floor`
    (at once where the namespace's PIDs are past it already)."""
    seen: list[int] = []
    for _ in range(floor):
        thread = threading.Thread(target=lambda: seen.append(threading.get_native_id()), name="pid-floor")
        thread.start()
        thread.join()
        if seen[-1] >= floor:
            return


def _become_subreaper() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("could not become a child subreaper (errno %d)", ctypes.get_errno())
    except OSError as exc:
        log.warning("could not become a child subreaper: %s", exc)


def _children() -> list[int]:
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code
