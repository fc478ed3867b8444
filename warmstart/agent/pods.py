"""From a pod to what the node agent acts on: the pod's host processes and its control directory.

The agent runs with the host's PID namespace. A pod's processes are found by their cgroup path, which the
kubelet and the container runtime choose and the tenant cannot: a path component names the pod uid
(`pod<uid>`, or `kubepods-...-pod<uid with _>.slice` with the systemd driver) and, given the container id
the runtime reports (`status.containerStatuses[].containerID`), the next one names the container
(`<id>`, or `cri-containerd-<id>.scope` / `crio-<id>.scope` / `docker-<id>.scope`). Nothing a tenant sets
(its environment, its command line) ever decides which processes are a pod's. The container's PID 1,
the worker supervisor, is the process whose NSpid ends in 1; before the kubelet reports the container
(it does only at its next relist, up to a second after the start) the worker container is the one among
the pod's cgroups whose PID 1, in a PID namespace one below the host's, has the pod's control volume
mounted where the operator mounts it (the pause container mounts nothing), when exactly one does. PIDs
the worker reports (e.g. in `ready-for-snapshot`) are in-namespace PIDs and are translated to host PIDs
through NSpid. The control directory is the pod's `control` emptyDir as the kubelet lays it out on the host.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from warmstart.api import labels as L
from warmstart.checkpoint.criu import Criu, unescape_mountinfo
from warmstart.checkpoint.sandbox import RESERVED_PIDS, Sandbox, namespace_pids, pid_namespace_of
from warmstart.host import procinfo

CONTROL_VOLUME = "control"
PROC = Path("/proc")
ProcessLookup = Callable[..., list[int]]  # (pod uid, container=id or None) -> the pod's host PIDs


class PodProcessError(RuntimeError):
    """The pod's processes could not be found or prepared on this node."""


def control_dir_on_host(kubelet_root: str | Path, pod_uid: str) -> Path:
    """Where the kubelet keeps the pod's `control` emptyDir on the host."""
    if not pod_uid or "/" in pod_uid or pod_uid.startswith("."):
        raise ValueError(f"{pod_uid!r} is not a pod uid")
    return Path(kubelet_root) / "pods" / pod_uid / "volumes" / "kubernetes.io~empty-dir" / CONTROL_VOLUME


def host_process_ids(proc: Path = PROC) -> list[int]:
    return [int(entry.name) for entry in os.scandir(proc) if entry.name.isdigit()]


def read_environ(pid: int, proc: Path = PROC) -> dict[str, str]:
    """The environment host process `pid` was started with (empty when it is gone or unreadable)."""
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0"))
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, sep, v in pairs if sep}


_CONTAINER_ID = re.compile(r"^(?:[a-z0-9-]+://)?([0-9a-f]{12,128})$")
_SCOPE = re.compile(r"^(?:cri-containerd|crio|docker)-([0-9a-f]{12,128})\.scope$")


def container_id(reported: str) -> str:
    """The bare id of a runtime's container id (`containerd://<hex>` as the pod status reports it)."""
    match = _CONTAINER_ID.match(reported.strip())
    if not match:
        raise ValueError(f"{reported!r} is not a container id")
    return match[1]


def _is_pod_component(component: str, pod_uid: str) -> bool:
    systemd = f"-pod{pod_uid.replace('-', '_')}.slice"  # systemd driver: kubepods[-<qos>]-pod<uid_>.slice
    return component == f"pod{pod_uid}" or component.endswith(systemd)  # or the cgroupfs driver's


def _is_container_component(component: str, wanted: str) -> bool:
    if component == wanted:
        return True
    scope = _SCOPE.match(component)
    return scope is not None and scope[1] == wanted


def _in_cgroup_of(pid: int, pod_uid: str, container: str | None, proc: Path) -> bool:
    """True when some hierarchy's path in the process's `/proc/<pid>/cgroup` has the pod's component
    (followed by the container's, when `container` is given)."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        components = [c for c in parts[2].split("/") if c]
        for component, following in zip(components, [*components[1:], ""], strict=False):
            if _is_pod_component(component, pod_uid) and (
                container is None or _is_container_component(following, container)
            ):
                return True
    return False


def pod_processes(pod_uid: str, proc: Path = PROC, container: str | None = None) -> list[int]:
    """Host PIDs of the pod's processes (of its container `container`, a bare or runtime-prefixed id, when
    given) by cgroup path."""
    wanted = container_id(container) if container else None
    return sorted(pid for pid in host_process_ids(proc) if _in_cgroup_of(pid, pod_uid, wanted, proc))


def mount_points(pid: int, proc: Path = PROC) -> set[str]:
    """Where host process `pid` sees mounts (its mount namespace's, unescaped); empty when unreadable."""
    try:
        lines = (proc / str(pid) / "mountinfo").read_text().splitlines()
    except OSError:
        return set()
    rows = (line.split(" ") for line in lines)
    return {unescape_mountinfo(row[4]) for row in rows if len(row) > 4}


def control_volume_holders(pod_uid: str, proc: Path = PROC, container: str | None = None) -> list[int]:
    """A `ProcessLookup` for a pod whose container the kubelet has not reported yet: the PID 1 of the one
    container of the pod that mounts the control volume (none when no container, or more than one, does)."""
    firsts = []
    for pid in pod_processes(pod_uid, proc, container):
        try:
            nspid = namespace_pids(pid, proc)
        except OSError:
            continue
        if len(nspid) == 2 and nspid[-1] == 1 and L.CONTROL_DIR_PATH in mount_points(pid, proc):
            firsts.append(pid)
    return firsts if len(firsts) == 1 else []


def supervisor_of(host_pids: Iterable[int]) -> int | None:
    """The container's PID 1 among `host_pids` (its NSpid ends in 1), None when there is none."""
    for pid in host_pids:
        try:
            nspid = namespace_pids(pid)
        except OSError:
            continue
        if len(nspid) > 1 and nspid[-1] == 1:
            return pid
    return None


class PodSandbox(Sandbox):
    """A running pod seen from the host, shaped like `Sandbox` so the capture and restore paths serve both.

    `host_dir` is the control emptyDir on the host and `mountpoint` where the container mounts it: the
    files the engine holds open there (its logs) travel with the snapshot, like a sandbox's files.
    """

    def __init__(self, host_dir: Path, init_pid: int, *, whole_container: bool = False) -> None:
        self.whole_container = whole_container
        self.host_dir = host_dir
        self.init_pid = init_pid
        self.mountpoint = Path(L.CONTROL_DIR_PATH)
        self.pid_namespace = pid_namespace_of(init_pid)
        self._init_identity = procinfo.start_ticks(init_pid)

    @classmethod
    def find(
        cls,
        pod_uid: str,
        kubelet_root: str | Path,
        timeout: float = 0.0,
        cancelled: Callable[[], bool] = lambda: False,
        *,
        container: str | None = None,
        in_pod: bool | None = None,
        lookup: ProcessLookup = pod_processes,
    ) -> PodSandbox:
        """The pod's supervisor (PID 1 of `container`, an id as the pod status reports it) and control
        directory, waited for while the container starts. `in_pod` (default: when a container id is given):
        CRIU runs in all of the container's namespaces and restores join its cgroups (`Criu.in_pod`)."""
        host_dir = control_dir_on_host(kubelet_root, pod_uid)
        deadline = time.monotonic() + timeout
        whole = container is not None if in_pod is None else in_pod
        while True:
            found = lookup(pod_uid, container=container)
            init_pid = supervisor_of(found)
            if init_pid is not None and host_dir.is_dir():
                return cls(host_dir, init_pid, whole_container=whole)
            if time.monotonic() >= deadline or cancelled():
                where = "no process" if init_pid is None else f"no control directory at {host_dir}"
                of = f"container {container} of pod {pod_uid}" if container else f"pod {pod_uid}"
                raise PodProcessError(
                    f"{of}: {where} on this node (no process in its cgroups; is the kubelet root right?)"
                )
            time.sleep(0.1)

    def criu(self, criu: Criu) -> Criu:
        if self.whole_container:
            return criu.in_pod(self.init_pid, join_cgroups=True)
        return super().criu(criu)

    def alive(self) -> bool:
        started = procinfo.start_ticks(self.init_pid)
        return started is not None and started == self._init_identity

    def reserve_low_pids(self, timeout: float = 10.0) -> None:
        """Move the namespace's PID counter past the PIDs a restored engine needs (fresh namespaces only).

        CRIU runs inside the namespace and would otherwise take the low PIDs the engine had at dump time.
        """
        script = (
            f"last=$(cat /proc/sys/kernel/ns_last_pid); "
            f'[ "$last" -ge {RESERVED_PIDS} ] || echo {RESERVED_PIDS} > /proc/sys/kernel/ns_last_pid'
        )
        command = ["nsenter", f"--target={self.init_pid}", "--pid", "--", "/bin/sh", "-c", script]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            message = f"could not reserve PIDs in the pod of pid {self.init_pid}: {detail}"
            raise PodProcessError(message) from exc

    def stop(self, grace: float = 5.0) -> None:  # the kubelet owns the pod's lifetime, never the agent
        return None
