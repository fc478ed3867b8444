"""The CRIU driver's own logic, against stand-in executables (no CRIU needed)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from warmstart.checkpoint.criu import (
    Criu,
    CriuError,
    CriuVersion,
    cgroup_dirs,
    first_error_line,
    parse_version,
)


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_parse_version_reads_criu_output() -> None:
    assert parse_version("Version: 4.1.1\nGitID: v4.1.1\n") == CriuVersion(4, 1, 1)
    assert parse_version("Version: 4.0\n") == CriuVersion(4, 0, 0)


def test_parse_version_rejects_garbage() -> None:
    with pytest.raises(CriuError, match="cannot read a version"):
        parse_version("criu, probably\n")


@pytest.mark.spawns
def test_old_criu_is_refused_with_the_setup_script_named(tmp_path: Path) -> None:
    old = _script(tmp_path / "criu", 'echo "Version: 3.17.1"\n')
    with pytest.raises(CriuError, match=r"CRIU 3\.17\.1.*hack/criu-setup"):
        Criu(str(old)).version()


@pytest.mark.spawns
def test_missing_criu_names_the_setup_script(tmp_path: Path) -> None:
    with pytest.raises(CriuError, match="not found.*hack/criu-setup"):
        Criu(str(tmp_path / "no-such-criu")).version()


def test_empty_command_is_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        Criu("")


def test_first_error_line_skips_benign_lines(tmp_path: Path) -> None:
    log = tmp_path / "dump.log"
    log.write_text(
        "(00.000100) Version: 4.1.1\n"
        "(00.000200) Error (criu/util.c:1533): rlimit: Can't setup RLIMIT_NOFILE for self: EPERM\n"
        "(00.000250) Error (criu/tun.c:85): tun: Unable to create tun: No such file or directory\n"
        "(00.000300) Error (criu/files-reg.c:10): Can't lookup mount=42 for fd=1 path=/x\n"
        "(00.000400) Error (criu/cr-dump.c:20): Dumping FAILED.\n"
    )
    assert first_error_line(log) == "Error (criu/files-reg.c:10): Can't lookup mount=42 for fd=1 path=/x"


@pytest.mark.spawns
def test_failed_dump_quotes_criu_error_line(tmp_path: Path) -> None:
    # A stand-in that behaves like a failing CRIU: writes its log where told, exits 1.
    fake = _script(
        tmp_path / "criu",
        'while [ $# -gt 0 ]; do [ "$1" = --log-file ] && log=$2; shift; done\n'
        'echo "(00.1) Error (criu/cr-dump.c:1): Can\'t dump nested pid namespace for 42" > "$log"\nexit 1\n',
    )
    with pytest.raises(CriuError, match="Can't dump nested pid namespace for 42") as info:
        Criu(str(fake)).dump(42, tmp_path / "img", logs_dir=tmp_path / "logs")
    assert info.value.log_file == tmp_path / "logs" / "dump.log"


@pytest.mark.spawns
def test_timeout_kills_criu_and_says_so(tmp_path: Path) -> None:
    slow = _script(tmp_path / "criu", "sleep 30\n")
    with pytest.raises(CriuError, match="timed out after 1s"):
        Criu(str(slow), timeout=1).dump(1, tmp_path / "img", logs_dir=tmp_path / "logs")


def test_namespaced_criu_runs_through_nsenter() -> None:
    criu = Criu(["/opt/criu", "-v"]).in_namespaces_of(1234)
    assert criu.describe() == "nsenter --target=1234 --pid --mount -- /opt/criu -v"


@pytest.mark.spawns
def test_criu_in_a_pod_reaches_its_program_and_files_through_descriptors(tmp_path: Path) -> None:
    """Inside a container's mount namespace no host path resolves: the program, its library folder, the
    images and the work directory are passed as descriptors (`/proc/self/fd/N`), the log named relative."""
    folder = tmp_path / "portable"
    folder.mkdir()
    seen = tmp_path / "argv"
    program = _script(
        folder / "criu",
        (f'echo "$@" > {seen}\nwhile [ "$1" != --images-dir ]; do shift; done; ls "$2" > {seen}.images\n'),
    )
    criu = Criu([str(program), "--library-path", str(folder)]).in_pod(os.getpid())
    criu._prefix = []  # run directly: the descriptors are what is checked
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "marker").write_text("")
    criu.dump(7, tmp_path / "img", logs_dir=tmp_path / "logs", leave_running=True)
    argv = seen.read_text().split()
    assert argv[0] == "--library-path" and argv[1].startswith("/proc/self/fd/")
    assert argv[2:5] == ["dump", "--tree", "7"]
    assert argv[argv.index("--images-dir") + 1].startswith("/proc/self/fd/")
    assert argv[argv.index("--work-dir") + 1].startswith("/proc/self/fd/")
    assert argv[argv.index("--log-file") + 1] == "dump.log" and "--leave-running" in argv
    assert (tmp_path / "argv.images").read_text().split() == ["marker"]  # the descriptor led to the folder
    described = Criu([str(program), "--library-path", str(folder)]).in_pod(42).describe()
    assert described.startswith("nsenter --target=42 --pid --mount --net --ipc --uts -- ")


def test_cgroup_dirs_map_every_hierarchy_through_the_mounts(tmp_path: Path) -> None:
    (tmp_path / "self").mkdir()
    (tmp_path / "5").mkdir()
    (tmp_path / "cgroups").write_text(
        "#subsys_name\thierarchy\nmemory\t4\t1\t1\ncpu\t2\t1\t1\ncpuacct\t2\t1\t1\n"
    )
    (tmp_path / "self" / "mountinfo").write_text(
        "30 25 0:26 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n"
        "31 25 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "32 25 0:28 /kubepods /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "33 25 0:29 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd\n"
    )
    (tmp_path / "5" / "cgroup").write_text(
        "4:memory:/kubepods/pod1/c1\n2:cpu,cpuacct:/kubepods/pod1/c1\n1:name=systemd:/kubepods/pod1/c1\n"
        "0::/kubepods/pod1/c1\n"
    )
    assert cgroup_dirs(5, proc=tmp_path) == [
        Path("/sys/fs/cgroup/memory/pod1/c1"),
        Path("/sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/c1"),
        Path("/sys/fs/cgroup/systemd/kubepods/pod1/c1"),
        Path("/sys/fs/cgroup/unified/kubepods/pod1/c1"),
    ]
    (tmp_path / "5" / "cgroup").write_text("4:memory:/elsewhere/c2\n")
    with pytest.raises(CriuError, match="not mounted where the agent can reach it"):
        cgroup_dirs(5, proc=tmp_path)
