"""One real Kubernetes node beside the kwok ones: containerd + runc + CNI, kubelet and kube-proxy.

Layout (everything the node touches is its own):
- a holder process (`unshare --net --mount`) owns the node's network and mount namespaces; containerd,
  kubelet and kube-proxy join both with nsenter. A second one owns the "apiserver" network namespace. A veth
  pair joins the two (the node's address on one end, the apiserver's on the other, network.py); CNI's bridge
  and the pods' veths hang off the node's. Nothing links either namespace to the machine: the netns gateway
  (netns_gateway.py) listens at the apiserver's address and carries traffic to the apiserver on loopback.
- in the mount namespace, the paths kubelet and containerd hard-code (/var/lib/kubelet, /run/containerd,
  /var/log/pods, ...) are bind mounts of the node's own directories, and the global sysctls kubelet would
  rewrite are bind mounts of files already holding its values, so the machine's sysctls are never written.
- every process (daemons, shims, containers) lives under one cgroup root, `warmstart-node`, in every
  hierarchy: teardown kills what is in it and removes it.
- containerd's image store is kept in the cache between runs, so images are imported once.

A record of the running node (`run.json` in the node cache) lets `down`, or the next start after a crash,
clean up whatever a node left.

A second node (`first=` the running one) has the same layout under names of its own (its cgroup root, record
and containerd store are named after it) and joins the first's apiserver namespace with a link of its own; the
apiserver's namespace forwards between the two nodes, so pods on either reach pods and Services on both.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import gpu_node, host_state, network, node_build, node_config, versions
from .cluster import Component, ControlPlane, ControlPlaneError, node_is_ready, process_alive, wait_for

HACK_DIR = Path(__file__).resolve().parent.parent
SECOND_API_LINK = "api1"
CRI_STATE_DIRS = ("io.containerd.grpc.v1.cri/sandboxes", "io.containerd.grpc.v1.cri/containers")
IMPORTED_INDEX = "warmstart-imported.json"
NODE_READY_TIMEOUT = 120.0
DAEMON_STOP_GRACE = 5.0

# Paths kubelet, containerd, CNI and the chart's agent use on a node -> the node directory bound over them.
SHADOWED_DIRS = {
    "/var/lib/kubelet": "kubelet",
    "/run/containerd": "run-containerd",
    "/var/lib/cni": "cni-state",
    "/etc/cni/net.d": "cni-config",
    "/var/log/pods": "pod-logs",
    "/var/log/containers": "container-logs",
    "/var/lib/warmstart": "warmstart",
    "/run/warmstart": "run-warmstart",
    "/var/cache/warmstart": "cache-warmstart",  # the examples' node model cache
}
CONTAINERD_ROOT = "/var/lib/containerd"


class NodeError(RuntimeError):
    pass


class NodeBusyError(NodeError):
    """Another real node runs on this machine (one at a time: the cgroup root and paths are shared)."""


@dataclass
class NodeImage:
    reference: str
    archive: Path


@dataclass
class NodeRecord:
    """What a started node changed, enough to undo it without the process that started it."""

    holder_pid: int
    # "node-net", "node-mnt", "api-net" -> inode of that namespace (the kind follows the last "-").
    namespaces: dict[str, int]
    created_dirs: list[str]
    host: host_state.HostSnapshot
    state_dir: str
    pids: dict[str, int] = field(default_factory=dict)
    name: str = network.NODE_NAME
    # `host_state.boottime()` when stop let go of the namespaces: their numbers may be reused after it.
    namespaces_pinned_until: float | None = None

    def save(self) -> None:
        data = {**self.__dict__, "host": self.host.to_json()}
        path = record_path(self.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(data, indent=2) + "\n")
        partial.replace(path)

    @classmethod
    def load(cls, name: str = network.NODE_NAME) -> NodeRecord | None:
        try:
            data = json.loads(record_path(name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        data["host"] = host_state.HostSnapshot.from_json(data["host"])
        return cls(**data)

    def holder_alive(self) -> bool:
        return process_alive(self.holder_pid) and host_state.namespace_inode(
            self.holder_pid, "net"
        ) == self.namespaces.get("node-net")


def _own_name(stem: str, node: str) -> str:
    """The first node's files keep their plain names; a second node's carry its name."""
    return stem if node == network.NODE_NAME else f"{stem}-{node}"


def record_path(node: str = network.NODE_NAME) -> Path:
    return versions.node_cache_dir() / f"{_own_name('run', node)}.json"


def containerd_root(node: str = network.NODE_NAME) -> Path:
    return versions.node_cache_dir() / _own_name("containerd", node)


@contextlib.contextmanager
def node_lock() -> Iterator[None]:
    """One node start or teardown at a time on this machine."""
    path = versions.node_cache_dir() / "lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def missing_parts(gpu: bool = False) -> list[str]:
    """Why a real node (a GPU node when `gpu`) cannot start here, one reason each; empty when it can."""
    reasons = []
    if os.geteuid() != 0:
        reasons.append("a real node needs root (namespaces, cgroups, mounts)")
    if not node_build.is_cached():
        reasons.append(f"kubelet/kube-proxy/coredns/pause are not built in {versions.cache_root()}")
    if missing := node_build.missing_debian_packages(runtime_only=True):
        reasons.append(f"Debian packages missing: {', '.join(missing)}")
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            reasons.append(f"{tool} is not installed")
    if gpu:
        reasons += gpu_node.missing_parts()
    return reasons


@dataclass
class RealNode:
    plane: ControlPlane
    state_dir: Path
    images: list[NodeImage] = field(default_factory=list)
    die_with_parent: bool = True
    # A GPU node: NVIDIA's device plugin advertises the machine's GPUs, labelled as GPU Feature Discovery
    # does.
    gpu: bool = False
    name: str = network.NODE_NAME
    # The running node a second node joins (its apiserver namespace and gateway); None for the first.
    first: RealNode | None = None
    components: dict[str, Component] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    record: NodeRecord | None = None

    @property
    def own_labels(self) -> tuple[str, ...]:
        """The labels this node carries as NoSchedule taints too: a pod lands here only tolerating all."""
        second = () if self.first is None else (network.SECOND_NODE_LABEL,)
        return (network.REAL_NODE_LABEL, *second)

    def pod_placement(self) -> dict[str, Any]:
        """Pod spec fields that put a pod on this node (its labels, a toleration of each of its taints)."""
        return {
            "nodeSelector": {label: "true" for label in self.own_labels},
            "tolerations": [
                {"key": label, "operator": "Exists", "effect": "NoSchedule"} for label in self.own_labels
            ],
        }

    # -- paths ---------------------------------------------------------------------------------------------

    def shadow(self, target: str) -> Path:
        """The node's directory that is bound over `target` inside its mount namespace."""
        return self.state_dir / "node-fs" / SHADOWED_DIRS[target]

    @property
    def containerd_socket(self) -> Path:
        """containerd's socket as the machine sees it (the node sees it at /run/containerd/...)."""
        return self.shadow("/run/containerd") / "containerd.sock"

    @property
    def config_dir(self) -> Path:
        return self.state_dir / "config"

    @property
    def kubeconfig(self) -> Path:
        """kubelet's and kube-proxy's kubeconfig: the apiserver through the gateway, inside the node."""
        return self.config_dir / "kubeconfig"

    @property
    def startup_seconds(self) -> float:
        return self.timings.get("total", 0.0)

    @property
    def cgroup_root(self) -> str:
        """Every process of the node (daemons, shims, containers) lives under this cgroup, named after it."""
        return self.name

    @property
    def daemons_cgroup(self) -> str:
        return f"{self.cgroup_root}/daemons"

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        if reasons := missing_parts(self.gpu):
            raise NodeError("; ".join(reasons))
        started = time.monotonic()
        try:
            with node_lock():
                clean_up_stale_node(self.name)
                self._make_namespaces()
            self.timings["namespaces"] = time.monotonic() - started
            if self.first is None:  # a second node reaches the apiserver through the first's gateway
                self._start_gateway()
            self._start_containerd()
            self.timings["containerd"] = time.monotonic() - started
            self._import_images()
            self.timings["images"] = time.monotonic() - started
            self._start_node_daemons()
            self.wait_ready()
            self.timings["node-ready"] = time.monotonic() - started
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - started

    def stop(self) -> None:
        """Stop the node and undo everything it changed on the machine (also after a failed start)."""
        with node_lock():
            self._stop_daemons_in_order()
            if self.record is not None:
                self._api_link("del")
                undo(self.record)
                self.record = None
        with contextlib.suppress(ControlPlaneError, OSError, subprocess.SubprocessError):
            self.plane.kubectl("delete", "node", self.name, "--ignore-not-found", "--wait=false", timeout=20)

    def _api_link(self, action: str) -> bool:
        """`ip link ACTION` of a second node's veth end in the (running) first node's API namespace; whether
        it succeeded. That end goes with the second node's own namespace only when the kernel gets round to
        freeing it, which can be after the next start has tried to add the same name ("File exists"), so
        stop deletes it. A first node's API namespace goes with it: False."""
        if self.first is None or self.first.record is None:
            return False
        command = [*api_nsenter(self.api_holder), "ip", "link", action, self.api_link]
        return subprocess.run(command, capture_output=True, timeout=30, check=False).returncode == 0

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every component's log, for a start that failed."""
        tails = []
        for log in sorted((self.state_dir / "logs").glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {log.name}:\n" + "\n".join(tail))
        return "\n".join(tails)

    def leftovers(self, record: NodeRecord) -> list[str]:
        left = host_state.leftovers(
            record.host,
            self.cgroup_root,
            record.namespaces,
            record.created_dirs,
            [Path(record.state_dir), containerd_root(self.name)],
            record.namespaces_pinned_until,
        )
        if self._api_link("show"):
            left.append(f"link {self.api_link} in the apiserver's network namespace")
        return left

    # -- namespaces, mounts, cgroups -----------------------------------------------------------------------

    def _make_namespaces(self) -> None:
        before = host_state.HostSnapshot.take()
        self._write_files()
        daemon_cgroups = tuple(host_state.make_cgroup(self.daemons_cgroup))
        created = ensure_mount_points(list(SHADOWED_DIRS) + [CONTAINERD_ROOT])
        holder = self._launch(
            "holder",
            # A slave of the machine's mounts: nothing mounted in here ever shows on the machine.
            ["unshare", "--net", "--mount", "--propagation", "slave", "sleep", "infinity"],
            daemon_cgroups,
        )
        namespaces = {f"node-{k}": v for k, v in wait_for_own_namespaces(holder, ("net", "mnt")).items()}
        if self.first is None:
            api_holder = self._launch("api-holder", ["unshare", "--net", "sleep", "infinity"], daemon_cgroups)
            namespaces["api-net"] = wait_for_own_namespaces(api_holder, ("net",))["net"]
        else:
            api_holder = self.first.api_holder
        self.record = NodeRecord(holder, namespaces, created, before, str(self.state_dir), self.pids(),
                                 self.name)  # fmt: skip
        self.record.save()
        self._nsenter_script(self._nsenter(), self._node_setup_script(api_holder), timeout=30)
        self._nsenter_script(api_nsenter(api_holder), self._api_setup_script(), timeout=30)

    @property
    def api_holder(self) -> int:
        """The process holding the apiserver's network namespace (the first node's)."""
        if self.first is not None:
            return self.first.api_holder
        assert self.record is not None
        return self.record.pids["api-holder"]

    @property
    def api_netns(self) -> str:
        return f"/proc/{self.api_holder}/ns/net"

    @property
    def addresses(self) -> network.NodeAddresses:
        """This node's link network (the node at .2, the apiserver's side at .1) and its pods' subnet."""
        return self.plane.addresses if self.first is None else self.plane.second_addresses

    @property
    def api_link(self) -> str:
        return network.API_LINK if self.first is None else SECOND_API_LINK

    def _api_setup_script(self) -> list[str]:
        addresses = self.addresses
        prefix = addresses.node_network.prefixlen
        lines = [
            "ip link set lo up",
            f"ip addr add {addresses.api_ip}/{prefix} dev {self.api_link}",
            f"ip link set {self.api_link} up",
            # The apiserver's side reaches pods and Services through the node, as on a real cluster.
            f"ip route add {addresses.pod_subnet} via {addresses.node_ip}",
        ]
        if self.first is None:
            return [*lines, f"ip route add {network.SERVICE_SUBNET} via {addresses.node_ip}"]
        # Between the two nodes (a pod on one reaching a pod on the other) through the apiserver's namespace:
        # this namespace's own setting, not the machine's.
        return [*lines, "echo 1 > /proc/sys/net/ipv4/ip_forward"]

    def _node_setup_script(self, api_holder: int) -> list[str]:
        addresses = self.addresses
        prefix = addresses.node_network.prefixlen
        link = network.NODE_LINK
        lines = [
            "ip link set lo up",
            f"ip link add {link} type veth peer name {self.api_link} netns {api_holder}",
            f"ip addr add {addresses.node_ip}/{prefix} dev {link}",
            f"ip link set {link} up",
            # The apiserver's namespace routes nothing further: whatever is not for the node's networks
            # ends there.
            f"ip route add default via {addresses.api_ip}",
        ]
        binds = {target: self.shadow(target) for target in SHADOWED_DIRS}
        binds[CONTAINERD_ROOT] = containerd_root(self.name)
        for name in host_state.KUBELET_SYSCTLS:
            binds[str(host_state.PROC_SYS / name)] = self.state_dir / "sysctl" / name.replace("/", ".")
        lines += [
            f"mount --bind {shlex.quote(str(source))} {shlex.quote(target)}"
            for target, source in binds.items()
        ]
        # Shared within the node (still a slave of the machine), as on a real node: pods' HostToContainer
        # and Bidirectional volume mounts (the chart's agent has both) need it.
        lines.append("mount --make-rshared /")
        return lines

    def _write_files(self) -> None:
        for target in SHADOWED_DIRS:
            self.shadow(target).mkdir(parents=True, exist_ok=True)
        containerd_root(self.name).mkdir(parents=True, exist_ok=True)
        remove_cri_state(self.name)
        sysctl_dir = self.state_dir / "sysctl"
        sysctl_dir.mkdir(parents=True, exist_ok=True)
        for name, value in host_state.KUBELET_SYSCTLS.items():
            (sysctl_dir / name.replace("/", ".")).write_text(f"{value}\n")
        self.config_dir.mkdir(parents=True, exist_ok=True)
        certificates = self.plane.state_dir / "pki"
        files = {
            "containerd.toml": node_config.containerd_toml(),
            "kubelet.json": node_config.kubelet_config(
                self.addresses,
                certificates / "ca.crt",
                self.config_dir / "resolv.conf",
                self.cgroup_root,
                self.own_labels,
            ),  # fmt: skip
            "kube-proxy.json": node_config.kube_proxy_config(self.addresses, self.kubeconfig, self.name),
            "resolv.conf": node_config.resolv_conf(),
            "kubeconfig": self._kubeconfig_text(),
            "Corefile": node_config.corefile(self.addresses, self.kubeconfig),
        }
        for name, text in files.items():
            (self.config_dir / name).write_text(text)
        conflist = self.shadow("/etc/cni/net.d") / "10-warmstart.conflist"
        conflist.write_text(node_config.cni_conflist(self.addresses))

    def _kubeconfig_text(self) -> str:
        config = json.loads(self.plane.kubeconfig.read_text())
        # Both nodes reach the apiserver at the first node's link address, where the gateway listens.
        config["clusters"][0]["cluster"]["server"] = (
            f"https://{self.plane.addresses.api_ip}:{self.plane.apiserver_port}"
        )
        return json.dumps(config, indent=2) + "\n"

    def _nsenter(self) -> list[str]:
        assert self.record is not None
        return ["nsenter", f"--target={self.record.holder_pid}", "--net", "--mount", "--"]

    @staticmethod
    def _nsenter_script(nsenter: list[str], lines: list[str], timeout: float) -> None:
        script = "set -e\n" + "\n".join(lines) + "\n"
        argv = [*nsenter, "sh", "-c", script]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise NodeError(f"setting up the node's namespaces failed:\n{result.stderr.strip()}")

    # -- daemons -------------------------------------------------------------------------------------------

    def _launch(
        self,
        name: str,
        argv: list[str],
        cgroups: tuple[Path, ...] | None = None,
        env: dict[str, str] | None = None,
    ) -> int:
        if cgroups is None:
            cgroups = tuple(host_state.make_cgroup(self.daemons_cgroup))
        log = self.state_dir / "logs" / f"{name}.log"
        component = Component(name, argv, log, cgroups=cgroups, env=env)
        self.components[name] = component
        component.start(self.die_with_parent)
        assert component.process is not None
        if self.record is not None:
            self.record.pids[name] = component.process.pid
            self.record.save()
        return component.process.pid

    def pids(self) -> dict[str, int]:
        return {name: c.process.pid for name, c in self.components.items() if c.process is not None}

    def check_running(self) -> None:
        for component in self.components.values():
            component.check_running()

    def _start_gateway(self) -> None:
        assert self.record is not None
        self.plane.egress_socket.unlink(missing_ok=True)
        port = self.plane.apiserver_port
        argv = [
            sys.executable,
            "-m",
            "control_plane.netns_gateway",
            f"--netns={self.api_netns}",
            f"--listen={self.addresses.api_ip}:{port}",
            *(f"--allow={subnet}" for subnet in self.plane.gateway_destinations),
            f"--upstream=127.0.0.1:{port}",
            f"--egress-socket={self.plane.egress_socket}",
        ]
        python_path = os.pathsep.join(filter(None, [str(HACK_DIR), os.environ.get("PYTHONPATH")]))
        self._launch("gateway", argv, env={**os.environ, "PYTHONPATH": python_path})

        def listening() -> bool:
            self.check_running()
            return self.plane.egress_socket.exists()

        wait_for(listening, timeout=30, interval=0.05, message="the node's gateway")

    def _start_containerd(self) -> None:
        self._launch(
            "containerd", [*self._nsenter(), "containerd", f"--config={self.config_dir / 'containerd.toml'}"]
        )
        self._wait_containerd()
        stale = self.ctr("containers", "ls", "-q").split()
        if stale:
            # Left by a node that was killed: remove them, then restart containerd so its CRI plugin
            # forgets them too.
            self.ctr("containers", "rm", *stale, check=False)
            self.components.pop("containerd").stop()
            remove_cri_state(self.name)
            self._launch(
                "containerd",
                [*self._nsenter(), "containerd", f"--config={self.config_dir / 'containerd.toml'}"],
            )
            self._wait_containerd()

    def _wait_containerd(self) -> None:
        def answers() -> bool:
            self.check_running()
            return self.ctr("version", check=False, timeout=5) != ""

        wait_for(answers, timeout=60, interval=0.05, message="containerd's socket")

    def ctr(self, *args: str, check: bool = True, timeout: float = 120) -> str:
        argv = ["ctr", f"--address={self.containerd_socket}", "--namespace=k8s.io", *args]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            if check:
                raise NodeError(f"`{' '.join(argv)}` failed: {result.stderr.strip()}")
            return ""
        return result.stdout

    def _import_images(self) -> None:
        """Import each image archive once; containerd's store is kept in the cache between runs."""
        index_path = containerd_root(self.name) / IMPORTED_INDEX
        try:
            imported: dict[str, str] = json.loads(index_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            imported = {}
        present = set(self.ctr("images", "ls", "-q").split())
        pause = NodeImage(versions.PAUSE_IMAGE, node_build.pause_archive())
        for image in [pause, *self.images]:
            marker = archive_marker(image.archive)
            if imported.get(image.reference) == marker and image.reference in present:
                continue
            self._import_image(image)
            imported[image.reference] = marker
            index_path.write_text(json.dumps(imported, indent=2) + "\n")

    def _import_image(self, image: NodeImage) -> None:
        try:
            self.ctr("images", "import", str(image.archive), timeout=600)
        except NodeError as error:
            if "does not exist" not in str(error):
                raise
            # Moving a tag to a new image lets containerd collect the old one's snapshots, and one the import
            # had found present can go before its child is unpacked ("parent snapshot ... does not exist").
            # A second import unpacks what is missing.
            print(f"node: importing {image.archive.name} again: {error}", file=sys.stderr)
            self.ctr("images", "import", str(image.archive), timeout=600)

    def _start_node_daemons(self) -> None:
        bin_dir = self.plane.bin_dir
        self._launch(
            "coredns",
            [*self._nsenter(), str(bin_dir / "coredns"), "-conf", str(self.config_dir / "Corefile")],
        )
        self._launch(
            "kubelet",
            [
                *self._nsenter(),
                str(bin_dir / "kubelet"),
                f"--config={self.config_dir / 'kubelet.json'}",
                f"--kubeconfig={self.kubeconfig}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.addresses.node_ip}",
                f"--node-labels={self._labels()}",
                "--v=1",
            ],
        )
        self._launch(
            "kube-proxy",
            [
                *self._nsenter(),
                str(bin_dir / "kube-proxy"),
                f"--config={self.config_dir / 'kube-proxy.json'}",
                "--v=2",  # each rules sync and how long it took: a Service's share of a replica's start
            ],
        )
        if self.gpu:
            # The plugin watches the kubelet's device-plugin directory for its socket: it must exist first.
            (self.shadow("/var/lib/kubelet") / "device-plugins").mkdir(parents=True, exist_ok=True)
            argv = [*self._nsenter(), *gpu_node.plugin_argv()]
            self._launch("nvidia-device-plugin", argv, env=gpu_node.plugin_env())

    def _labels(self) -> str:
        labels = {**dict.fromkeys(self.own_labels, "true"), **(gpu_node.node_labels() if self.gpu else {})}
        return ",".join(f"{key}={value}" for key, value in labels.items())

    def wait_ready(self, timeout: float = NODE_READY_TIMEOUT) -> None:
        """Ready (and, on a GPU node, with its GPUs allocatable)."""

        def ready() -> bool:
            self.check_running()
            result = self.plane.kubectl("get", "node", self.name, "-o", "json", check=False)
            if result.returncode != 0:
                return False
            node = json.loads(result.stdout)
            gpus = (node.get("status", {}).get("allocatable") or {}).get(gpu_node.RESOURCE, "0")
            return node_is_ready(node) and (not self.gpu or int(gpus) > 0)

        try:
            wait_for(ready, timeout=timeout, interval=0.1, message=f"node {self.name} Ready")
        except TimeoutError as error:
            kubelet = self.components.get("kubelet")
            raise NodeError(f"{error}\n{kubelet.log_tail() if kubelet else ''}") from error

    def _stop_daemons_in_order(self) -> None:
        """kube-proxy and kubelet first, then the pods, their containers in containerd, containerd itself."""
        for name in ("nvidia-device-plugin", "kube-proxy", "kubelet", "coredns"):
            if component := self.components.pop(name, None):
                component_stop(component)
        host_state.kill_cgroup_tree(host_state.process_hierarchy() / self.cgroup_root / "kubepods")
        if "containerd" in self.components:
            self._remove_all_containers()
        if self.record is not None:
            self.record.namespaces_pinned_until = host_state.boottime()
        for name in ("containerd", "gateway", "holder", "api-holder"):
            if component := self.components.pop(name, None):
                component_stop(component)
        for component in self.components.values():
            component_stop(component)
        self.components.clear()

    def _remove_all_containers(self) -> None:
        with contextlib.suppress(NodeError, subprocess.SubprocessError, OSError):
            tasks = self.ctr("tasks", "ls", "-q", timeout=20).split()
            for task in tasks:
                self.ctr("tasks", "rm", "-f", task, check=False, timeout=20)
            if containers := self.ctr("containers", "ls", "-q", timeout=20).split():
                self.ctr("containers", "rm", *containers, check=False, timeout=60)


def component_stop(component: Component) -> None:
    with contextlib.suppress(ControlPlaneError):
        component.stop()


def archive_marker(path: Path) -> str:
    stat = path.stat()
    return f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}"


def wait_for_own_namespaces(holder_pid: int, kinds: tuple[str, ...]) -> dict[str, int]:
    """Wait until the holder has made its namespaces and runs `sleep`; returns their inodes."""
    mine = {kind: host_state.namespace_inode(os.getpid(), kind) for kind in kinds}

    def made() -> dict[str, int] | None:
        if not process_alive(holder_pid):
            raise NodeError("the node's namespace holder (unshare) exited")
        theirs = {kind: host_state.namespace_inode(holder_pid, kind) for kind in mine}
        comm = Path(f"/proc/{holder_pid}/comm").read_text().strip()
        if comm == "sleep" and all(theirs[k] not in (None, mine[k]) for k in mine):
            return {kind: inode for kind, inode in theirs.items() if inode is not None}
        return None

    return wait_for(made, timeout=20, interval=0.01, message="the node's namespaces")


def ensure_mount_points(paths: list[str]) -> list[str]:
    """Create the directories bind mounts need; returns the topmost of those it created (to remove later)."""
    created = []
    for path in paths:
        missing = [p for p in [Path(path), *Path(path).parents] if not p.exists()]
        if missing:
            top = missing[-1]
            Path(path).mkdir(parents=True)
            created.append(str(top))
    return created


def remove_cri_state(node: str) -> None:
    for relative in CRI_STATE_DIRS:
        shutil.rmtree(containerd_root(node) / relative, ignore_errors=True)


def api_nsenter(api_holder: int) -> list[str]:
    """The command prefix that runs in the apiserver's network namespace."""
    return ["nsenter", f"--target={api_holder}", "--net", "--"]


def undo(record: NodeRecord) -> list[str]:
    """Kill what is left of a node and undo its changes to the machine; returns problems it could not fix."""
    problems = []
    hierarchy = host_state.process_hierarchy()
    # Members of the node's namespaces that escaped its cgroups; only while the holder still pins them, since
    # the inode of a namespace that is gone may be another one's by now.
    holders_alive = record.holder_alive()
    survivors = host_state.kill_cgroup_tree(hierarchy / record.name)
    for name, inode in record.namespaces.items() if holders_alive else ():
        for pid in host_state.pids_in_namespace(host_state.namespace_kind(name), inode):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    if survivors:
        problems.append(f"processes that would not die: {sorted(survivors)}")
    with contextlib.suppress(TimeoutError):
        wait_for(
            lambda: (
                not any(
                    host_state.pids_in_namespace(
                        host_state.namespace_kind(name), inode, record.namespaces_pinned_until
                    )
                    for name, inode in record.namespaces.items()
                )
            ),
            timeout=10,
            interval=0.05,
            message="the node's namespaces to empty",
        )
    if remaining := host_state.remove_cgroup_tree(record.name):
        problems.append(f"cgroups that would not go: {remaining}")
    remove_cri_state(record.name)
    for path in sorted(record.created_dirs, key=len, reverse=True):
        remove_empty_tree(Path(path))
    host_state.restore_sysctls(record.host.sysctls)
    record_path(record.name).unlink(missing_ok=True)
    return problems


def remove_empty_tree(top: Path) -> None:
    """rmdir `top` and the empty directories under it; anything holding files stays."""
    if not top.is_dir():
        return
    for directory, _subdirectories, _files in os.walk(top, topdown=False):
        with contextlib.suppress(OSError):
            Path(directory).rmdir()


def clean_up_stale_node(name: str) -> None:
    """Undo a node whose starter died without stopping it; refuse if one is still running."""
    record = NodeRecord.load(name)
    if record is None:
        return
    if record.holder_alive() and record.pids:
        owner_alive = any(process_alive(pid) for name, pid in record.pids.items() if name != "holder")
        if owner_alive:
            raise NodeBusyError(
                f"a real node is already running (holder pid {record.holder_pid}): "
                "stop it with `hack/control-plane down`"
            )
    undo(record)


def stop_recorded_node() -> bool:
    """Stop the nodes recorded (started by a detached `up`, or left by a crash), the second first; returns
    whether there was one."""
    stopped = False
    with node_lock():
        for node in (network.SECOND_NODE_NAME, network.NODE_NAME):
            record = NodeRecord.load(node)
            if record is None:
                continue
            # Only PIDs still in the node's cgroups: a recorded PID may belong to another process by now.
            ours = host_state.cgroup_pids(host_state.process_hierarchy() / record.name)
            for name in ("kube-proxy", "kubelet", "containerd", "gateway", "holder", "api-holder"):
                pid = record.pids.get(name)
                if pid in ours:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, 15)
            time.sleep(0.5)
            undo(record)
            stopped = True
    return stopped


def node_summary(node: RealNode) -> str:
    phases = ", ".join(
        f"{phase} {seconds:.1f}s" for phase, seconds in node.timings.items() if phase != "total"
    )
    return (
        f"real node {node.name} (kubelet {versions.KUBERNETES}) up in {node.startup_seconds:.1f}s: {phases}"
    )
