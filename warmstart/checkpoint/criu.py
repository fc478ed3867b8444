"""CRIU (>= 4.0) driven as a subprocess: dump and restore process trees, with logs kept and timeouts.

CRIU is configuration: a command line (`criu`, the repository's `hack/criu` shim, or the portable folder's
`DIR/ld-linux-x86-64.so.2 --library-path DIR DIR/criu`). Tasks inside a nested PID namespace cannot be dumped
from the host, so `in_namespaces_of(pid)` runs CRIU inside the target's PID and mount namespaces with
`nsenter`; PIDs given to and returned by CRIU are then the ones seen inside that namespace.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MIN_MAJOR = 4
SETUP_HINT = "run hack/criu-setup (it provides CRIU 4) and pass its command with --criu or WARMSTART_CRIU"
_VERSION_LINE = re.compile(r"^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)
_ERROR_LINE = re.compile(r"\bError\b")
# CRIU logs these as "Error" and carries on (e.g. it could not raise its own descriptor limit).
_BENIGN_ERRORS = (re.compile(r"rlimit: Can't setup RLIMIT_NOFILE"),)


class CriuError(RuntimeError):
    """CRIU failed, timed out or is missing; the message quotes CRIU's own first error line."""

    def __init__(self, message: str, *, log_file: Path | None = None) -> None:
        super().__init__(message)
        self.log_file = log_file


@dataclass(frozen=True)
class CriuVersion:
    major: int
    minor: int
    patch: int

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def parse_version(output: str) -> CriuVersion:
    match = _VERSION_LINE.search(output)
    if not match:
        raise CriuError(f"cannot read a version from `criu --version` output {output.strip()[:200]!r}")
    return CriuVersion(int(match[1]), int(match[2]), int(match[3] or 0))


def first_error_line(log_file: Path) -> str | None:
    """CRIU's first line mentioning "Error" in its log, without the timestamp prefix."""
    try:
        with open(log_file, errors="replace") as log:
            for line in log:
                if _ERROR_LINE.search(line) and not any(b.search(line) for b in _BENIGN_ERRORS):
                    return re.sub(r"^\(\s*[\d.]+\)\s*", "", line.strip())
    except OSError:
        return None
    return None


def _split(command: Sequence[str] | str) -> list[str]:
    parts = shlex.split(command) if isinstance(command, str) else list(command)
    if not parts:
        raise ValueError("the CRIU command is empty; " + SETUP_HINT)
    if "/" in parts[0]:  # a relative path would not survive nsenter's change of namespaces
        parts[0] = os.path.abspath(parts[0])
    return parts


class Criu:
    """One CRIU command line plus the namespaces it runs in."""

    def __init__(self, command: Sequence[str] | str, timeout: float = 600.0) -> None:
        self.command = _split(command)
        self.timeout = timeout
        self._prefix: list[str] = []

    def in_namespaces_of(self, pid: int) -> Criu:
        """The same CRIU, run inside the PID and mount namespaces of host process `pid`."""
        clone = Criu(self.command, self.timeout)
        clone._prefix = ["nsenter", f"--target={pid}", "--pid", "--mount", "--"]
        return clone

    def describe(self) -> str:
        return shlex.join(self._prefix + self.command)

    def version(self) -> CriuVersion:
        """CRIU's version; a clear error naming the setup script when CRIU is missing or older than 4.0."""
        result = self._run(["--version"], timeout=min(self.timeout, 30.0))
        if result.returncode != 0:
            raise CriuError(
                f"`{self.describe()} --version` failed: {result.stderr.strip()[:300]}; {SETUP_HINT}"
            )
        version = parse_version(result.stdout)
        if version.major < MIN_MAJOR:
            raise CriuError(
                f"{self.describe()} is CRIU {version}; warmstart needs CRIU >= {MIN_MAJOR}.0 "
                f"(older CRIU fails on 6.x kernels); {SETUP_HINT}"
            )
        return version

    def dump(
        self,
        pid: int,
        images_dir: Path,
        *,
        logs_dir: Path,
        leave_running: bool = False,
        extra: Sequence[str] = (),
    ) -> Path:
        """Dump the process tree rooted at `pid` into `images_dir`; returns the log file."""
        images_dir.mkdir(parents=True, exist_ok=True)
        log_file = self._log_file(logs_dir, "dump.log")
        args = ["dump", "--tree", str(pid), "--images-dir", str(images_dir)]
        args += self._log_args(log_file)
        if leave_running:
            args.append("--leave-running")
        args += list(extra)
        self._run_logged(args, log_file, what=f"dump of pid {pid}")
        return log_file

    def restore(
        self,
        images_dir: Path,
        *,
        logs_dir: Path,
        detach: bool = True,
        extra: Sequence[str] = (),
    ) -> int:
        """Restore the tree in `images_dir`; returns the restored root's PID (as seen where CRIU ran)."""
        log_file = self._log_file(logs_dir, "restore.log")
        pidfile = logs_dir / "restore.pid"
        pidfile.unlink(missing_ok=True)
        args = ["restore", "--images-dir", str(images_dir), "--pidfile", str(pidfile)]
        args += self._log_args(log_file)
        if detach:
            args.append("--restore-detached")
        args += list(extra)
        self._run_logged(args, log_file, what="restore")
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError) as exc:
            raise CriuError(f"CRIU restore succeeded but wrote no PID to {pidfile}: {exc}") from exc

    @staticmethod
    def _log_file(logs_dir: Path, name: str) -> Path:
        logs_dir.mkdir(parents=True, exist_ok=True)
        log_file = logs_dir / name
        log_file.unlink(missing_ok=True)
        return log_file

    @staticmethod
    def _log_args(log_file: Path) -> list[str]:
        return ["--log-file", str(log_file.resolve()), "-v4"]

    def _run_logged(self, args: list[str], log_file: Path, *, what: str) -> None:
        result = self._run(args, timeout=self.timeout)
        if result.returncode == 0:
            return
        if result.returncode == -signal.SIGKILL and result.stderr == "timeout":
            reason = f"timed out after {self.timeout:.0f}s"
        else:
            reason = first_error_line(log_file) or (
                result.stderr.strip()[-300:] or f"exit {result.returncode}"
            )
        raise CriuError(f"CRIU {what} failed: {reason} (log: {log_file})", log_file=log_file)

    def _run(self, args: list[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        argv = self._prefix + self.command + args
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,  # a timeout kills nsenter and CRIU together
            )
        except FileNotFoundError as exc:
            raise CriuError(f"cannot run {argv[0]!r}: not found; {SETUP_HINT}") from exc
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            return subprocess.CompletedProcess(argv, -signal.SIGKILL, "", "timeout")
        except BaseException:  # Ctrl-C while CRIU runs: do not leave it behind
            _kill_group(process)
            raise
        return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def _kill_group(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
