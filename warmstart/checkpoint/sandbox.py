"""A "pod" on one machine: a new PID and mount namespace with a private directory at a fixed path.

Every sandbox sees its own host directory at `MOUNTPOINT` (a bind mount private to its mount namespace),
so a process restored from a snapshot finds the same paths it had at dump time (control directory, stdio
log files) while two restores of one snapshot run side by side with their own files. PID 1 of a sandbox is
a small supervisor: the worker supervisor for captures, `python -m warmstart.checkpoint.sandbox` (a
waiting init that reaps orphans) for restores. Restore sandboxes move the PID counter past `RESERVED_PIDS`
before anything runs in them, so the low PIDs and thread IDs a restored engine needs stay free even
while CRIU itself runs inside the namespace.

Needs root (namespaces, mounts) and util-linux `unshare`/`nsenter`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.host.fileio import directory_fd, write_atomic

if TYPE_CHECKING:
    from warmstart.checkpoint.criu import Criu

MOUNTPOINT = Path("/run/warmstart/pod")
PR_SET_PDEATHSIG = 1
# Process and thread ids a restored engine may need (torch.compile's worker pool alone can use hundreds
# before a capture); a capture whose ids reach this is refused, since no restore could bring it back.
RESERVED_PIDS = 10000
READY_MARK = ".sandbox-ready"
MAIN_PID_FILE = ".sandbox-main-pid"  # in-namespace PID whose exit ends a waiting init


class SandboxError(RuntimeError):
    """The sandbox could not be created or entered."""


def _setup_script(mountpoint: Path, reserve_pids: bool) -> str:
    steps = [
        f"mkdir -p {shlex.quote(str(mountpoint))}",
        f'mount --bind "$WARMSTART_SANDBOX_HOST_DIR" {shlex.quote(str(mountpoint))}',
    ]
    if reserve_pids:
        steps.append(f"echo {RESERVED_PIDS} > /proc/sys/kernel/ns_last_pid")
    steps.append(f"touch {shlex.quote(str(mountpoint / READY_MARK))}")
    return " && ".join(steps) + ' && exec "$@"'


# Resolved here, not in the forked child: a child of a process with other threads (one may be loading a
# library: the CUDA driver's warm-up) must not call the dynamic loader before exec.
_prctl = ctypes.CDLL(None, use_errno=True).prctl


def _die_with_parent() -> None:
    """In the forked child: SIGKILL when the process that started the sandbox dies.

    With `unshare --kill-child` the namespace's PID 1 dies with `unshare`, and the kernel then kills every
    process of the namespace: a sandbox never outlives its owner, even one killed with SIGKILL.
    """
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def pid_namespace_of(pid: int) -> str:
    """The PID namespace of host process `pid`, e.g. 'pid:[4026532123]'."""
    return os.readlink(f"/proc/{pid}/ns/pid")


def namespace_pids(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """NSpid of host process `pid`: its PID in every namespace from the host's down to its own."""
    with open(proc / str(pid) / "status") as status:
        for line in status:
            if line.startswith("NSpid:"):
                return [int(value) for value in line.split()[1:]]
    return [pid]


def children_of(pid: int) -> list[int]:
    try:
        return [int(value) for value in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Sandbox:
    """One pod: `unshare --pid --fork --mount-proc --mount` around an init command."""

    def __init__(
        self, host_dir: Path, process: subprocess.Popen[bytes], init_pid: int, mountpoint: Path
    ) -> None:
        self.host_dir = host_dir
        self.process = process
        self.init_pid = init_pid
        self.mountpoint = mountpoint
        self.pid_namespace = pid_namespace_of(init_pid)

    @classmethod
    def start(
        cls,
        host_dir: Path,
        init_command: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        reserve_pids: bool = False,
        mountpoint: Path = MOUNTPOINT,
    ) -> Sandbox:
        """Make the namespaces, bind `host_dir` at `mountpoint` inside, exec `init_command` as PID 1."""
        host_dir.mkdir(parents=True, exist_ok=True)
        if host_dir.is_symlink():  # root would write and bind-mount wherever it points
            raise SandboxError(f"the sandbox directory {host_dir} is a symbolic link; refusing to use it")
        (host_dir / READY_MARK).unlink(missing_ok=True)
        argv = [
            "unshare", "--pid", "--fork", "--mount-proc", "--mount", "--propagation", "private",
            "--kill-child=SIGKILL", "--",
            "/bin/sh", "-c", _setup_script(mountpoint, reserve_pids), "sandbox-init", *init_command,
        ]  # fmt: skip
        full_env = dict(os.environ if env is None else env)
        full_env["WARMSTART_SANDBOX_HOST_DIR"] = str(host_dir.resolve())
        with open(host_dir / "init.log", "ab") as init_log:
            try:
                process = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=init_log, stderr=init_log, env=full_env,
                    start_new_session=True, preexec_fn=_die_with_parent,
                )  # fmt: skip
            except FileNotFoundError as exc:
                raise SandboxError("`unshare` (util-linux) is missing: install util-linux") from exc
        return cls(host_dir, process, cls._wait_ready(process, host_dir), mountpoint)

    @staticmethod
    def _wait_ready(process: subprocess.Popen[bytes], host_dir: Path, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log = (host_dir / "init.log").read_text(errors="replace")[-500:]
                raise SandboxError(
                    f"the sandbox exited during setup (exit {process.returncode}): {log.strip()}"
                )
            children = children_of(process.pid)
            if children and (host_dir / READY_MARK).exists():
                return children[0]
            time.sleep(0.005)
        process.kill()
        raise SandboxError(f"the sandbox in {host_dir} was not ready within {timeout}s (needs root)")

    def criu(self, criu: Criu) -> Criu:
        """`criu` as it must run to dump from or restore into this sandbox: in its PID and mount namespace."""
        return criu.in_namespaces_of(self.init_pid)

    def alive(self) -> bool:
        return self.process.poll() is None

    def host_pid(self, namespace_pid: int) -> int | None:
        """The host PID of the sandbox's process `namespace_pid`, None when there is none."""
        for pid in self.host_pids():
            with contextlib.suppress(OSError):
                if namespace_pids(pid)[-1] == namespace_pid:
                    return pid
        return None

    def task_holding(self, namespace_tid: int) -> str:
        """What holds `namespace_tid` in the sandbox's PID namespace (a process, or a thread of one), in
        words; "" when nothing does."""
        for pid in self.host_pids():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                try:
                    if namespace_pids(int(tid), Path(f"/proc/{pid}/task"))[-1] != namespace_tid:
                        continue
                    name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                except OSError:
                    continue
                owner = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()[:120]
                what = "process" if int(tid) == pid else f"a thread of pid {namespace_pids(pid)[-1]}"
                return f"{what} named {name!r} ({owner})"
        return ""

    def host_pids(self) -> list[int]:
        """Host PIDs of every process in the sandbox's PID namespace (init included)."""
        found = []
        for entry in os.scandir("/proc"):
            with contextlib.suppress(OSError):  # gone meanwhile
                if entry.name.isdigit() and pid_namespace_of(int(entry.name)) == self.pid_namespace:
                    found.append(int(entry.name))
        return found

    def set_main_pid(self, namespace_pid: int) -> None:
        """Tell the waiting init which process's exit ends the sandbox."""
        with directory_fd(self.host_dir.parent, self.host_dir.name) as fd:  # never through a planted link
            write_atomic(Path(MAIN_PID_FILE), f"{namespace_pid}\n".encode(), dir_fd=fd)

    def kill_all_but_init(self) -> None:
        """SIGKILL every process of the sandbox except PID 1 (e.g. what a failed restore left)."""
        for pid in self.host_pids():
            if pid != self.init_pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM PID 1, then SIGKILL it (which the kernel extends to every process in the namespace)."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.init_pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.init_pid, signal.SIGKILL)
            self.process.wait()


def waiting_init_command() -> list[str]:
    """PID 1 for restore sandboxes: this module's `init_main`."""
    return [sys.executable, "-m", "warmstart.checkpoint.sandbox"]


def init_main() -> int:
    """Reap orphans until the main process (named in `MAIN_PID_FILE`) exits; exit with its status.

    The restored engine becomes an orphan of PID 1 when CRIU detaches; the restorer writes its PID to
    `MAIN_PID_FILE` in the sandbox directory. Other orphans (e.g. of a failed restore) are reaped without
    ending the sandbox. SIGTERM/SIGINT are forwarded to every process of the namespace.
    """
    stopping = False

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGTERM)  # from PID 1: every other process of the namespace

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    main_pid_file = MOUNTPOINT / MAIN_PID_FILE
    while True:
        try:
            pid, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            if stopping:
                return 0
            time.sleep(0.05)
            continue
        if pid == _read_pid(main_pid_file) or stopping and not children_of(os.getpid()):
            status = os.waitstatus_to_exitcode(raw)
            return status if status >= 0 else 128 - status


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    sys.exit(init_main())
