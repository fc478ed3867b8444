"""CRIU (>= 4.0) driven as a subprocess: dump and restore process trees, with logs kept and timeouts.

CRIU is configuration: a command line (`criu`, the repository's `hack/criu` shim, or the portable folder's
`DIR/ld-linux-x86-64.so.2 --library-path DIR DIR/criu`). Tasks inside a nested PID namespace cannot be dumped
from the host, so `in_namespaces_of(pid)` runs CRIU inside the target's PID and mount namespaces with
`nsenter`; PIDs given to and returned by CRIU are then the ones seen inside that namespace.

A real pod's container is handled whole by `in_pod(pid)`: CRIU runs inside all five namespaces of the
container (pid, mnt, net, ipc, uts), so it dumps none of them and needs no `--root` or `--external`: the
engine's mounts, network and hostname are the ones the restoring container already has. Inside the
container's mount namespace no host path resolves (the container has no CRIU and sees none of the agent's
directories), so everything CRIU reads or writes on the host is reached through descriptors opened before
entering: its program and library folders, the images directory and the work directory (where CRIU writes
its log and pid file: relative names are CRIU's work directory's) become `/proc/self/fd/N` paths, passed
with `pass_fds`. A restore first moves the restoring process into the target container's cgroups (every
hierarchy: restored tasks inherit them) and runs CRIU with `--manage-cgroups=ignore`.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

MIN_MAJOR = 4
LAZY_PAGES_SOCKET = "lazy-pages.socket"  # where `criu lazy-pages` and `criu restore --lazy-pages` meet
# How many tasks fill a restored task's memory from its pages image. Read by the CRIU that
# hack/criu-setup builds (parallel page reads in the restorer); any other CRIU ignores it.
RESTORE_READERS = "CRIU_RESTORE_READERS"
MAX_RESTORE_READERS = 8
PARALLEL_READS_BUILD = "warmstart-parallel-page-reads"  # the GitID `criu --version` prints for that build
SETUP_HINT = "run hack/criu-setup (it provides CRIU 4) and pass its command with --criu or WARMSTART_CRIU"
_VERSION_LINE = re.compile(r"^Version:\s*(\d+)\.(\d+)(?:\.(\d+))?", re.MULTILINE)
_ERROR_LINE = re.compile(r"\bError\b")
# CRIU logs these as "Error" and carries on: it could not raise its own descriptor limit; its probe of the
# kernel's features found no /dev/net/tun (none in the agent's container, nor in a pod's mount namespace).
_BENIGN_ERRORS = (re.compile(r"rlimit: Can't setup RLIMIT_NOFILE"), re.compile(r"tun: Unable to create tun"))


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
    with contextlib.suppress(OSError), open(log_file, errors="replace") as log:
        for line in log:
            if _ERROR_LINE.search(line) and not any(b.search(line) for b in _BENIGN_ERRORS):
                return re.sub(r"^\(\s*[\d.]+\)\s*", "", line.strip())
    return None


# CRIU restoring a process whose PID is in use in the target namespace (clone3 with set_tid: EEXIST).
_PID_TAKEN = re.compile(r"Can't fork for (\d+): File exists")


def taken_pid(error: CriuError) -> int | None:
    """The PID a failed restore could not have because a process of the target namespace holds it."""
    match = _PID_TAKEN.search(str(error))
    return int(match.group(1)) if match else None


def _split(command: Sequence[str] | str) -> list[str]:
    parts = shlex.split(command) if isinstance(command, str) else list(command)
    if not parts:
        raise ValueError("the CRIU command is empty; " + SETUP_HINT)
    if "/" in parts[0]:  # a relative path would not survive nsenter's change of namespaces
        parts[0] = os.path.abspath(parts[0])
    return parts


@dataclass
class _Entered:
    """What one CRIU run inside a pod needs opened on the host: descriptors and the paths naming them."""

    fds: dict[str, int] = field(default_factory=dict)  # by host directory

    def directory(self, path: Path) -> str:
        """`/proc/self/fd/N` for host directory `path` (opened once, without following a final link)."""
        key = os.path.abspath(path)
        if key not in self.fds:
            self.fds[key] = os.open(key, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return f"/proc/self/fd/{self.fds[key]}"

    def path(self, path: str) -> str:
        """A host file or directory as a path through a descriptor of itself or of its folder."""
        if os.path.isdir(path):
            return self.directory(Path(path))
        folder, name = os.path.split(os.path.abspath(path))
        return f"{self.directory(Path(folder))}/{name}"

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)


def _program_args(command: list[str], entered: _Entered) -> list[str]:
    """The CRIU command with every absolute host path in it (the program, `--library-path` folders)
    replaced by a descriptor path, so it runs inside a mount namespace where those paths do not exist."""
    out = []
    for arg in command:
        if arg.startswith("/") and ":" in arg and all(os.path.isdir(p) for p in arg.split(":")):
            out.append(":".join(entered.path(p) for p in arg.split(":")))
        elif arg.startswith("/") and os.path.exists(arg):
            out.append(entered.path(arg))
        else:
            out.append(arg)
    return out


def cgroup_dirs(pid: int, proc: Path = Path("/proc")) -> list[Path]:
    """The directory of each cgroup of host process `pid`, every hierarchy (v1 and unified), as mounted
    where this process runs; CriuError when one of them is not reachable from here."""
    mounts = _cgroup_mounts(proc / "self" / "mountinfo", _controller_names(proc))
    found = []
    for line in (proc / str(pid) / "cgroup").read_text().splitlines():
        number, controllers, path = line.split(":", 2)
        key = frozenset() if number == "0" and not controllers else frozenset(controllers.split(","))
        for names, root, mountpoint in mounts:
            if names == key and (path == root or path.startswith(root.rstrip("/") + "/")):
                found.append(Path(os.path.normpath(os.path.join(mountpoint, os.path.relpath(path, root)))))
                break
        else:
            raise CriuError(f"cgroup {line!r} of pid {pid} is not mounted where the agent can reach it")
    return found


def _controller_names(proc: Path) -> set[str]:
    try:
        lines = (proc / "cgroups").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[0] for line in lines if line and not line.startswith("#")}


def _cgroup_mounts(mountinfo: Path, controllers: set[str]) -> list[tuple[frozenset[str], str, str]]:
    """(controllers, root, mountpoint) of every cgroup mount; no controllers: the unified hierarchy."""
    mounts = []
    for line in mountinfo.read_text(errors="surrogateescape").splitlines():
        fields = line.split()
        separator = fields.index("-")
        fstype, options = fields[separator + 1], fields[separator + 3].split(",")
        root, mountpoint = unescape_mountinfo(fields[3]), unescape_mountinfo(fields[4])
        if fstype == "cgroup2":
            mounts.append((frozenset(), root, mountpoint))
        elif fstype == "cgroup":
            names = frozenset(o for o in options if o in controllers or o.startswith("name="))
            mounts.append((names, root, mountpoint))
    return mounts


def unescape_mountinfo(field: str) -> str:
    """Undo mountinfo's octal escapes (a space is written as \\040)."""
    return re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), field)


class Criu:
    """One CRIU command line plus the namespaces it runs in."""

    def __init__(self, command: Sequence[str] | str, timeout: float = 600.0) -> None:
        self.command = _split(command)
        self.timeout = timeout
        self._prefix: list[str] = []
        self._pod_pid: int | None = None
        self._cgroups_of: int | None = None

    def in_namespaces_of(self, pid: int) -> Criu:
        """The same CRIU, run inside the PID and mount namespaces of host process `pid`."""
        clone = Criu(self.command, self.timeout)
        clone._prefix = ["nsenter", f"--target={pid}", "--pid", "--mount", "--"]
        return clone

    def in_pod(self, pid: int, *, join_cgroups: bool = False) -> Criu:
        """The same CRIU run inside all five namespaces of host process `pid` (a container's PID 1), with
        its program and files reached through descriptors; with `join_cgroups`, CRIU (and so what it
        restores) runs in that process's cgroups, and restores leave cgroups alone."""
        clone = Criu(self.command, self.timeout)
        clone._prefix = ["nsenter", f"--target={pid}", "--pid", "--mount", "--net", "--ipc", "--uts", "--"]
        clone._pod_pid = pid
        clone._cgroups_of = pid if join_cgroups else None
        return clone

    def describe(self) -> str:
        return shlex.join(self._prefix + self.command)

    def version(self) -> CriuVersion:
        """CRIU's version; a clear error naming the setup script when CRIU is missing or older than 4.0."""
        result = self._version_output()
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

    def reads_pages_in_parallel(self) -> bool:
        """Whether this is the CRIU built with the restorer's parallel page reads (hack/criu-setup)."""
        result = self._version_output()
        return result.returncode == 0 and PARALLEL_READS_BUILD in result.stdout

    def _version_output(self) -> subprocess.CompletedProcess[str]:
        with contextlib.closing(_Entered()) as entered:
            return self._run(["--version"], timeout=min(self.timeout, 30.0), entered=entered)

    def dump(
        self,
        pid: int,
        images_dir: Path,
        *,
        logs_dir: Path,
        leave_running: bool = False,
        extra: Sequence[str] = (),
    ) -> Path:
        """Dump the process tree rooted at `pid` into `images_dir`; returns the log file. `extra`: more of
        CRIU's options (the GPU benchmark lowers its log level)."""
        images_dir.mkdir(parents=True, exist_ok=True)
        log_file = self._fresh_file(logs_dir, "dump.log")
        with contextlib.closing(_Entered()) as entered:
            args = ["dump", "--tree", str(pid), *self._dirs_args(entered, images_dir, log_file)]
            if leave_running:
                args.append("--leave-running")
            self._run_logged([*args, *extra], log_file, what=f"dump of pid {pid}", entered=entered)
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
        log_file = self._fresh_file(logs_dir, "restore.log")
        pidfile = self._fresh_file(logs_dir, "restore.pid")
        with contextlib.closing(_Entered()) as entered:
            args = ["restore", *self._dirs_args(entered, images_dir, log_file)]
            args += ["--pidfile", pidfile.name if self._pod_pid is not None else str(pidfile)]
            if detach:
                args.append("--restore-detached")
            if self._cgroups_of is not None:
                args.append("--manage-cgroups=ignore")
            self._run_logged([*args, *extra], log_file, what="restore", entered=entered)
        try:
            return int(pidfile.read_text().strip())
        except (OSError, ValueError) as exc:
            raise CriuError(f"CRIU restore succeeded but wrote no PID to {pidfile}: {exc}") from exc

    def lazy_pages(self, images_dir: Path, *, logs_dir: Path) -> subprocess.Popen[str]:
        """Start CRIU's lazy-pages daemon for a `restore(..., extra=["--lazy-pages"])` of `images_dir`.

        The restore then maps private memory empty and hands it to the daemon (userfaultfd), which fills
        pages as the restored tasks touch them and the rest in the background, and exits once all are in.
        It meets the restore at a socket in `images_dir` (CRIU's default work directory); not in a pod.
        """
        if self._pod_pid is not None:
            raise CriuError("lazy pages are not supported for restores into a pod")
        log_file = self._fresh_file(logs_dir, "lazy-pages.log")
        (images_dir / LAZY_PAGES_SOCKET).unlink(missing_ok=True)
        dirs = self._dirs_args(_Entered(), images_dir, log_file)  # not in a pod: no descriptors
        process = subprocess.Popen(
            [*self._prefix, *self.command, "lazy-pages", *dirs], stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not (images_dir / LAZY_PAGES_SOCKET).exists():  # the restore must find it listening
            if process.poll() is not None or time.monotonic() > deadline:
                kill_group(process)
                reason = first_error_line(log_file) or "it did not open its socket"
                raise CriuError(
                    f"CRIU lazy-pages did not start: {reason} (log: {log_file})", log_file=log_file
                )
            time.sleep(0.002)
        return process

    @staticmethod
    def _fresh_file(logs_dir: Path, name: str) -> Path:
        logs_dir.mkdir(parents=True, exist_ok=True)
        log_file = logs_dir / name
        log_file.unlink(missing_ok=True)
        return log_file

    def _dirs_args(self, entered: _Entered, images_dir: Path, log_file: Path) -> list[str]:
        """--images-dir and the log; in a pod through descriptors, the log (and pid file) named relative
        to CRIU's work directory, the logs folder."""
        if self._pod_pid is None:
            return ["--images-dir", str(images_dir), "--log-file", str(log_file.resolve()), "-v4"]
        images = entered.directory(images_dir)
        work = entered.directory(log_file.parent)
        return ["--images-dir", images, "--work-dir", work, "--log-file", log_file.name, "-v4"]

    def _run_logged(self, args: list[str], log_file: Path, *, what: str, entered: _Entered) -> None:
        result = self._run(args, timeout=self.timeout, entered=entered)
        if result.returncode == 0:
            return
        if result.returncode == -signal.SIGKILL and result.stderr == "timeout":
            reason = f"timed out after {self.timeout:.0f}s"
        else:
            reason = first_error_line(log_file) or result.stderr.strip()[-300:] or f"exit {result.returncode}"
        raise CriuError(f"CRIU {what} failed: {reason} (log: {log_file})", log_file=log_file)

    def _run(self, args: list[str], *, timeout: float, entered: _Entered) -> subprocess.CompletedProcess[str]:
        program = self.command if self._pod_pid is None else _program_args(self.command, entered)
        argv = self._prefix + program + args
        readers = str(min(MAX_RESTORE_READERS, len(os.sched_getaffinity(0))))  # one per CPU we may use
        join_fds = _open_cgroup_procs(self._cgroups_of) if self._cgroups_of is not None else []
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={RESTORE_READERS: readers, **os.environ},  # unless set
                pass_fds=entered.fds.values(),
                start_new_session=True,  # a timeout kills nsenter and CRIU together
                preexec_fn=(lambda: _join(join_fds)) if join_fds else None,
            )
        except FileNotFoundError as exc:
            raise CriuError(f"cannot run {argv[0]!r}: not found; {SETUP_HINT}") from exc
        except subprocess.SubprocessError as exc:  # the cgroup move failed in the child
            raise CriuError(f"could not move CRIU into the cgroups of pid {self._cgroups_of}: {exc}") from exc
        finally:
            for fd in join_fds:
                os.close(fd)
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(process)
            return subprocess.CompletedProcess(argv, -signal.SIGKILL, "", "timeout")
        except BaseException:  # Ctrl-C while CRIU runs: do not leave it behind
            kill_group(process)
            raise
        return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def _open_cgroup_procs(pid: int) -> list[int]:
    """Write descriptors of `cgroup.procs` in every cgroup of `pid` (opened here, written by the child)."""
    fds: list[int] = []
    try:
        for directory in cgroup_dirs(pid):
            fds.append(os.open(directory / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW))
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise CriuError(f"cannot open the cgroups of pid {pid}: {exc}") from exc
    return fds


def _join(fds: list[int]) -> None:
    """In the forked child, before exec: move itself ("0": the writing task) into each cgroup."""
    for fd in fds:
        os.write(fd, b"0")


def kill_group(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
