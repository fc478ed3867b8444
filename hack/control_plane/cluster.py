"""Start and stop a local Kubernetes control plane: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (fake GPU nodes that run pods without containers), all on loopback.

Every component runs in its own process group. Processes started for a test session also get a parent-death
signal, so they go away even when the test runner itself is killed.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from . import host_state, network, pki, versions

T = TypeVar("T")

GPUS_PER_NODE = 8
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
STATE_FILE = "state.json"
EGRESS_CONFIG = "egress-selector.json"
EGRESS_SOCKET = "cluster-egress.sock"
STOP_GRACE_SECONDS = 10.0
PR_SET_PDEATHSIG = 1
NOT_READY_TAINT = "node.kubernetes.io/not-ready"

# Metadata level (who, verb, object, user agent; no bodies) for resource requests, nothing for /healthz
# and the like; one event per request, when its response is complete.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [{"level": "None", "nonResourceURLs": ["*"]}, {"level": "Metadata"}],
}

CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "garbage-collector-controller",
    "horizontal-pod-autoscaler-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "endpoints-controller",
    "endpointslice-controller",
    "daemonset-controller",
    "statefulset-controller",
    "job-controller",
    "disruption-controller",
    "pod-garbage-collector-controller",
    "persistentvolume-binder-controller",  # binds the claims of the real node's hostPath volumes
    # Lift the in-use finalizers admission puts on every claim and volume once no pod uses them; without
    # them a claim, and so its namespace, is never deleted.
    "persistentvolumeclaim-protection-controller",
    "persistentvolume-protection-controller",
    # Lifts the node.kubernetes.io/not-ready taint that admission puts on every new node.
    "node-lifecycle-controller",
)


class ControlPlaneError(RuntimeError):
    pass


def aggregation_flags(certificates: pki.Pki) -> list[str]:
    """The aggregation layer, for extension apiservers (KEDA's external metrics): the apiserver proxies to
    them as the front-proxy client, naming the user in headers they trust by the front-proxy CA, and dials
    their pods directly (through the node's gateway, like all its traffic to the node)."""
    return [
        f"--requestheader-client-ca-file={certificates.front_proxy_ca_cert}",
        f"--requestheader-allowed-names={pki.FRONT_PROXY_CLIENT}",
        "--requestheader-username-headers=X-Remote-User",
        "--requestheader-group-headers=X-Remote-Group",
        "--requestheader-extra-headers-prefix=X-Remote-Extra-",
        f"--proxy-client-cert-file={certificates.front_proxy_client_cert}",
        f"--proxy-client-key-file={certificates.front_proxy_client_key}",
        "--enable-aggregator-routing=true",
    ]


def wait_for(
    predicate: Callable[[], T], timeout: float = 60.0, interval: float = 0.2, message: str = "condition"
) -> T:
    """Call `predicate` until it returns something truthy (returned) or `timeout` seconds pass (raises).

    Exceptions from the predicate count as "not yet"; the last one is named in the timeout error.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = predicate()
            if result:
                return result
        except ControlPlaneError:
            raise
        except Exception as error:  # any other failure means "not yet"
            last_error = error
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {message}{detail}")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: kill it when the process that started it exits.

    This is the path where nobody is left to stop the control plane in order, so it is SIGKILL: on
    SIGTERM kube-apiserver waits for an etcd that is going away too, and lingers."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def process_alive(pid: int) -> bool:
    fields = host_state.stat_fields(pid)
    return fields is not None and fields[0] != "Z"  # a zombie is dead for our purposes


def process_runs_binary(pid: int, bin_dir: Path) -> bool:
    """Guards against PID reuse: only signal a PID whose command line still names one of our binaries."""
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return Path(argv0).parent == bin_dir


def stop_process_group(pid: int, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM the process group led by `pid`, then SIGKILL it if it has not exited after `grace` s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if process_alive(pid):
        raise ControlPlaneError(f"process {pid} survived SIGKILL for {grace:.0f}s")


def _join_cgroups(cgroup_dirs: tuple[Path, ...]) -> None:
    for directory in cgroup_dirs:
        (directory / "cgroup.procs").write_text(f"{os.getpid()}\n")


@dataclass
class Component:
    name: str
    argv: list[str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    # Cgroups (one per hierarchy) the process joins before it runs: its children are found there later.
    cgroups: tuple[Path, ...] = ()
    env: dict[str, str] | None = None

    def start(self, die_with_parent: bool) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
                preexec_fn=self._child_setup(die_with_parent),
            )

    def _child_setup(self, die_with_parent: bool) -> Callable[[], None] | None:
        cgroups = self.cgroups
        if not cgroups and not die_with_parent:
            return None

        def setup() -> None:
            _join_cgroups(cgroups)
            if die_with_parent:
                _die_with_parent()

        return setup

    def check_running(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise ControlPlaneError(
                f"{self.name} exited with code {self.process.returncode}; last log lines of {self.log}:\n"
                + self.log_tail()
            )

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is None:
            return
        stop_process_group(self.process.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=1)


class ClusterTools:
    """kubectl, helm and a client for a cluster: what the tests use of the local control plane and of any
    other cluster (`ExternalCluster`). Subclasses give `kubeconfig`, `state_dir` and `binary`."""

    state_dir: Path

    @property
    def kubeconfig(self) -> Path:
        raise NotImplementedError

    def binary(self, name: str) -> Path:
        raise NotImplementedError

    def check_running(self) -> None:
        """Raise if a component of the cluster has died (nothing to check where the cluster is not ours)."""

    def tool_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        for kind in ("CACHE", "CONFIG", "DATA"):
            env[f"HELM_{kind}_HOME"] = str(self.state_dir / "helm" / kind.lower())
        return env

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run_tool("kubectl", args, check, input, timeout)

    def helm(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run_tool("helm", args, check, input, timeout)

    def _run_tool(
        self, name: str, args: Sequence[str], check: bool, input: str | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binary(name)), *args],
            env=self.tool_env(),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise ControlPlaneError(
                f"`{name} {' '.join(args)}` failed (exit {result.returncode}):\n{result.stderr.strip()}"
            )
        return result

    def api_client(self) -> Any:
        """A new `kubernetes.client.ApiClient` authenticated as the kubeconfig's user (the local control
        plane's: cluster admin)."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def wait_default_service_account(self, namespace: str, timeout: float = 60) -> None:
        """Pods are rejected until the namespace's `default` ServiceAccount exists (kube-controller-manager
        creates it a moment after the namespace)."""

        def exists() -> bool:
            self.check_running()
            return (
                self.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0
            )

        wait_for(exists, timeout=timeout, message=f"ServiceAccount default in namespace {namespace}")

    def wait_for(
        self,
        predicate: Callable[[], T],
        timeout: float = 60.0,
        interval: float = 0.2,
        message: str = "condition",
    ) -> T:
        return wait_for(predicate, timeout=timeout, interval=interval, message=message)


@dataclass
class ControlPlane(ClusterTools):
    """A running (or startable) local control plane.

    `state_dir` holds certificates, the kubeconfig, etcd's data and one log per component. `nodes` fake
    kwok nodes are registered, each with `nvidia.com/gpu: 8`.
    """

    state_dir: Path
    bin_dir: Path = field(default_factory=versions.bin_dir)
    crd_dir: Path | None = field(default_factory=versions.crd_dir)
    kwok_stage_dir: Path = field(default_factory=versions.kwok_stage_dir)
    nodes: int = 2
    die_with_parent: bool = True
    components: list[Component] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    apiserver_port: int = 0
    node_addresses: network.NodeAddresses | None = None
    second_node_addresses: network.NodeAddresses | None = None
    # Keep the apiserver's audit log (every resource request at Metadata level, one JSON line each) here.
    audit_log: Path | None = None

    # -- paths and addresses -------------------------------------------------------------------------------

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def addresses(self) -> network.NodeAddresses:
        """The addresses a real node joining this control plane uses (chosen at start)."""
        if self.node_addresses is None:
            raise ControlPlaneError("the control plane has not been started")
        return self.node_addresses

    @property
    def second_addresses(self) -> network.NodeAddresses:
        """The addresses of a second real node (chosen with the first's)."""
        if self.second_node_addresses is None:
            raise ControlPlaneError("the control plane has not been started")
        return self.second_node_addresses

    @property
    def gateway_destinations(self) -> tuple[ipaddress.IPv4Network, ...]:
        """What the apiserver may reach through the nodes' gateway: the networks of both real nodes."""
        first, second = self.addresses, self.second_addresses
        return (first.node_network, first.pod_subnet, second.node_network, second.pod_subnet,
                network.SERVICE_SUBNET)  # fmt: skip

    @property
    def egress_config(self) -> Path:
        return self.state_dir / EGRESS_CONFIG

    @property
    def egress_socket(self) -> Path:
        """Where the apiserver sends its traffic to kubelets, pods and Services (HTTP CONNECT)."""
        return self.state_dir / EGRESS_SOCKET

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver_port}"

    @property
    def startup_seconds(self) -> float:
        return self.timings.get("total", 0.0)

    def binary(self, name: str) -> Path:
        path = self.bin_dir / name
        if not path.is_file():
            raise ControlPlaneError(f"{path} is missing: run `hack/control-plane build` first")
        return path

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every component and return once nodes are Ready and third-party CRDs are established."""
        for name in versions.BINARIES:
            self.binary(name)
        if not any(self.kwok_stage_dir.glob("*.yaml")):
            raise ControlPlaneError(
                f"no kwok stages in {self.kwok_stage_dir}: run `hack/control-plane build`"
            )
        started = time.monotonic()
        try:
            self._start_all(started)
        except BaseException:
            self.stop()
            raise
        self.timings["total"] = time.monotonic() - started

    def _start_all(self, started: float) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.node_addresses, self.second_node_addresses = network.choose(2)
        # A real node and its pods reach the apiserver at the node network's apiserver address.
        certificates = pki.generate(self.state_dir / "pki", extra_ips=(self.node_addresses.api_ip,))
        etcd_port = free_port()
        self.apiserver_port = free_port()
        self.write_kubeconfig(certificates)
        self.write_egress_config()
        self._launch("etcd", self.etcd_argv(etcd_port))
        self._launch("kube-apiserver", self.apiserver_argv(etcd_port, certificates))
        self.wait_ready(timeout=120)
        self.timings["apiserver-ready"] = time.monotonic() - started
        self.save_state()
        self._launch("kube-controller-manager", self.controller_manager_argv(certificates))
        self._launch("kube-scheduler", self.scheduler_argv())
        self._launch("kwok", self.kwok_argv())
        self.save_state()
        self.install_third_party_crds()
        self.timings["crds-established"] = time.monotonic() - started
        self.register_fake_nodes()
        self.wait_nodes_ready()
        self.wait_default_service_account("default")
        self.timings["nodes-ready"] = time.monotonic() - started

    def stop(self) -> None:
        """Stop every component (reverse start order); leaves no process behind."""
        for component in reversed(self.components):
            component.stop()
        self.components.clear()

    def _launch(self, name: str, argv: list[str]) -> None:
        component = Component(name, argv, self.state_dir / "logs" / f"{name}.log")
        self.components.append(component)
        component.start(self.die_with_parent)

    def pids(self) -> dict[str, int]:
        return {c.name: c.process.pid for c in self.components if c.process is not None}

    def check_running(self) -> None:
        for component in self.components:
            component.check_running()

    def save_state(self) -> None:
        state = {
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "bin_dir": str(self.bin_dir),
            "processes": self.pids(),
            "node_addresses": self.addresses.to_json() if self.node_addresses else None,
        }
        (self.state_dir / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    # -- component command lines ---------------------------------------------------------------------------

    def etcd_argv(self, client_port: int) -> list[str]:
        peer = f"http://127.0.0.1:{free_port()}"
        client = f"http://127.0.0.1:{client_port}"
        return [
            str(self.binary("etcd")),
            "--name=default",
            f"--data-dir={self.state_dir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            # Test data is thrown away: skipping fsync makes every write cheap.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]

    def apiserver_argv(self, etcd_port: int, certificates: pki.Pki) -> list[str]:
        return [
            str(self.binary("kube-apiserver")),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            "--bind-address=127.0.0.1",
            # The address pods get for the `kubernetes` Service: a real node's gateway serves it inside the
            # node's namespaces (see network.py). Without a real node nothing uses it.
            f"--advertise-address={self.addresses.api_ip}",
            # Traffic to kubelets, pods and Services goes through that gateway's socket, never out of this
            # machine's own interfaces; with no real node there it fails at once.
            f"--egress-selector-config-file={self.egress_config}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--kubelet-client-certificate={certificates.admin_cert}",
            f"--kubelet-client-key={certificates.admin_key}",
            f"--secure-port={self.apiserver_port}",
            f"--tls-cert-file={certificates.serving_cert}",
            f"--tls-private-key-file={certificates.serving_key}",
            f"--client-ca-file={certificates.ca_cert}",
            f"--service-account-key-file={certificates.service_account_public_key}",
            f"--service-account-signing-key-file={certificates.service_account_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-cluster-ip-range={network.SERVICE_SUBNET}",
            "--authorization-mode=RBAC",
            "--allow-privileged=true",
            f"--cert-dir={self.state_dir / 'apiserver-certs'}",
            "--profiling=false",
            *aggregation_flags(certificates),
            *self.audit_flags(),
        ]

    def audit_flags(self) -> list[str]:
        """Who asked the apiserver for what: one line per resource request, once it was answered."""
        if self.audit_log is None:
            return []
        policy = self.state_dir / "audit-policy.json"
        policy.write_text(json.dumps(AUDIT_POLICY))
        return [
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            "--audit-log-mode=blocking",
            "--audit-log-maxsize=0",  # one file: a reader counts from its start
        ]

    def controller_manager_argv(self, certificates: pki.Pki) -> list[str]:
        return [
            str(self.binary("kube-controller-manager")),
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--secure-port=0",
            f"--controllers={','.join(CONTROLLERS)}",
            f"--service-account-private-key-file={certificates.service_account_key}",
            f"--root-ca-file={certificates.ca_cert}",
            "--horizontal-pod-autoscaler-sync-period=5s",
            # Scale-down waits this long after the last higher recommendation (300s by default): a test's
            # load ends and its replicas come back down within a minute.
            "--horizontal-pod-autoscaler-downscale-stabilization=15s",
        ]

    def scheduler_argv(self) -> list[str]:
        return [
            str(self.binary("kube-scheduler")),
            f"--kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--secure-port=0",
        ]

    def kwok_argv(self) -> list[str]:
        return [
            str(self.binary("kwok")),
            f"--kubeconfig={self.kubeconfig}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
            *(f"--config={stage}" for stage in sorted(self.kwok_stage_dir.glob("*.yaml"))),
            "--node-lease-duration-seconds=40",
            "--cidr=10.244.0.0/16",
            "--node-ip=10.240.0.1",
            f"--server-address=127.0.0.1:{free_port()}",
        ]

    # -- kubeconfig and clients ----------------------------------------------------------------------------

    def write_kubeconfig(self, certificates: pki.Pki) -> None:
        def b64(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "local",
                    "cluster": {
                        "server": self.server,
                        "certificate-authority-data": b64(certificates.ca_cert),
                    },
                }
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {
                        "client-certificate-data": b64(certificates.admin_cert),
                        "client-key-data": b64(certificates.admin_key),
                    },
                }
            ],
            "contexts": [{"name": "local", "context": {"cluster": "local", "user": "admin"}}],
            "current-context": "local",
        }
        # JSON is YAML, and every kubeconfig reader accepts it.
        self.kubeconfig.write_text(json.dumps(config, indent=2) + "\n")
        self.kubeconfig.chmod(0o600)

    def write_egress_config(self) -> None:
        config = {
            "apiVersion": "apiserver.k8s.io/v1beta1",
            "kind": "EgressSelectorConfiguration",
            "egressSelections": [
                {
                    "name": "cluster",
                    "connection": {
                        "proxyProtocol": "HTTPConnect",
                        "transport": {"uds": {"udsName": str(self.egress_socket)}},
                    },
                }
            ],
        }
        self.egress_config.write_text(json.dumps(config, indent=2) + "\n")

    # -- readiness -----------------------------------------------------------------------------------------

    def _ssl_context(self) -> ssl.SSLContext:
        certificates = self.state_dir / "pki"
        context = ssl.create_default_context(cafile=str(certificates / "ca.crt"))
        context.load_cert_chain(str(certificates / "admin.crt"), str(certificates / "admin.key"))
        return context

    def readyz(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"{self.server}/readyz", context=self._ssl_context(), timeout=5
            ) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def wait_ready(self, timeout: float) -> None:
        def ready() -> bool:
            self.check_running()
            return self.readyz()

        try:
            wait_for(ready, timeout=timeout, interval=0.1, message="kube-apiserver /readyz")
        except TimeoutError as error:
            tail = self.components[-1].log_tail() if self.components else ""
            raise ControlPlaneError(f"{error}\n{tail}") from error

    def install_third_party_crds(self) -> None:
        manifests = sorted(self.crd_dir.glob("*.yaml")) if self.crd_dir is not None else []
        if not manifests:
            return
        files = [argument for path in manifests for argument in ("-f", str(path))]
        self.kubectl("apply", "--server-side", "--force-conflicts", *files)
        self.kubectl("wait", "--for=condition=Established", "--timeout=60s", *files)

    def register_fake_nodes(self) -> None:
        items = [fake_gpu_node(f"kwok-gpu-{index}") for index in range(self.nodes)]
        if not items:  # a cluster of real nodes only (the GPU machine's)
            return
        self.kubectl(
            "apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        )

    def wait_nodes_ready(self, timeout: float = 60) -> None:
        def all_ready() -> bool:
            self.check_running()
            listing = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)
            ready = [node for node in listing["items"] if node_is_ready(node)]
            return len(ready) >= self.nodes

        wait_for(all_ready, timeout=timeout, interval=0.2, message=f"{self.nodes} kwok nodes Ready")


def node_is_ready(node: dict[str, Any]) -> bool:
    """Ready, and schedulable: the not-ready taint is gone too."""
    conditions = node.get("status", {}).get("conditions") or []
    taints = node.get("spec", {}).get("taints") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and not any(t.get("key") == NOT_READY_TAINT for t in taints)


def fake_gpu_node(name: str) -> dict[str, Any]:
    resources = {
        "cpu": "64",
        "memory": "512Gi",
        "pods": "110",
        "ephemeral-storage": "1Ti",
        "nvidia.com/gpu": str(GPUS_PER_NODE),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {FAKE_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.product": "NVIDIA-H200",
                "nvidia.com/gpu.count": str(GPUS_PER_NODE),
            },
        },
        "status": {"capacity": resources, "allocatable": resources},
    }


def load_state(state_dir: Path) -> dict[str, Any] | None:
    path = state_dir / STATE_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def stop_recorded(state_dir: Path) -> list[str]:
    """Stop the processes a detached `up` recorded in `state_dir`; returns the names it stopped."""
    state = load_state(state_dir)
    if state is None:
        return []
    bin_dir = Path(state["bin_dir"])
    stopped = []
    for name, pid in reversed(list(state["processes"].items())):
        if process_alive(pid) and process_runs_binary(pid, bin_dir):
            stop_process_group(pid)
            stopped.append(name)
    (state_dir / STATE_FILE).unlink()
    return stopped
