"""The real node runs the project's images as real containers: a privileged hostPID DaemonSet and a
Deployment behind a ClusterIP Service, from the chart's image built from the Dockerfile; and stopping the node
leaves nothing on the machine."""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from control_plane import host_state, images, network, node_config, versions
from control_plane.cluster import ControlPlane, wait_for
from control_plane.node import NodeImage, RealNode
from node_plugin import HostPython

WEB_PORT = 8080
SERVICE_PORT = 80
READY_TIMEOUT = 180.0
# Run by the images' python3: a tiny HTTP server that names the pod it runs in.
WEB_SERVER = """
import http.server, os
class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = os.environ["HOSTNAME"].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), Hello).serve_forever()
"""
FETCH = """
import ssl, sys, urllib.request
url = sys.argv[1]
context = None
if url.startswith("https://"):
    account = "/var/run/secrets/kubernetes.io/serviceaccount"
    context = ssl.create_default_context(cafile=f"{account}/ca.crt")
with urllib.request.urlopen(url, timeout=10, context=context) as response:
    print(response.status, response.read().decode()[:200])
"""
FIND_KUBELET = """
import os
names = set()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        names.add(open(f"/proc/{pid}/comm").read().strip())
    except OSError:
        pass
print("kubelet" in names, "containerd" in names)
"""


def on_the_real_node(node: RealNode) -> dict[str, Any]:
    return {**node.pod_placement(), "terminationGracePeriodSeconds": 1}


def agent_like_daemonset(image: str, node: RealNode) -> dict[str, Any]:
    container = {
        "name": "agent",
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["python3", "-c", "import time\nwhile True: time.sleep(3600)"],
        "securityContext": {"privileged": True},
        "readinessProbe": {"exec": {"command": ["criu", "--version"]}, "periodSeconds": 2},
        # The chart's agent mounts these two with these propagations.
        "volumeMounts": [
            {"name": "run", "mountPath": "/run/warmstart", "mountPropagation": "Bidirectional"},
            {"name": "pods", "mountPath": "/var/lib/kubelet/pods", "mountPropagation": "HostToContainer"},
        ],
    }
    volumes = [
        {"name": "run", "hostPath": {"path": "/run/warmstart", "type": "DirectoryOrCreate"}},
        {"name": "pods", "hostPath": {"path": "/var/lib/kubelet/pods", "type": "Directory"}},
    ]
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "agent"},
        "spec": {
            "selector": {"matchLabels": {"app": "agent"}},
            "template": {
                "metadata": {"labels": {"app": "agent"}},
                "spec": {
                    **on_the_real_node(node),
                    "hostPID": True,
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def web_deployment(image: str, node: RealNode) -> dict[str, Any]:
    container = {
        "name": "web",
        "image": image,
        "imagePullPolicy": "Never",
        "command": ["python3", "-c", WEB_SERVER],
        "env": [{"name": "PORT", "value": str(WEB_PORT)}],
        "ports": [{"containerPort": WEB_PORT}],
        "readinessProbe": {"httpGet": {"path": "/", "port": WEB_PORT}, "periodSeconds": 1},
        "resources": {"limits": {"memory": "128Mi", "cpu": "500m"}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {**on_the_real_node(node), "containers": [container]},
            },
        },
    }


def web_service() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {
            "type": "ClusterIP",
            "selector": {"app": "web"},
            "ports": [{"port": SERVICE_PORT, "targetPort": WEB_PORT}],
        },
    }


def get_json(kube: ControlPlane, *args: str) -> dict[str, Any]:
    return json.loads(kube.kubectl("get", *args, "-o", "json").stdout)


def ready_pods(kube: ControlPlane, namespace: str, app: str) -> list[dict[str, Any]]:
    pods = get_json(kube, "pods", "-n", namespace, "-l", f"app={app}")["items"]
    return [
        pod
        for pod in pods
        if pod["status"].get("phase") == "Running"
        and any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))
    ]


def both_ready(kube: ControlPlane, namespace: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    agents, webs = ready_pods(kube, namespace, "agent"), ready_pods(kube, namespace, "web")
    return (agents[0], webs[0]) if agents and webs else None


def exec_python(kube: ControlPlane, namespace: str, pod: str, code: str, *args: str) -> str:
    return kube.kubectl("exec", "-n", namespace, pod, "--", "python3", "-c", code, *args, timeout=60).stdout


def fetch_once_served(kube: ControlPlane, namespace: str, pod: str, url: str) -> str:
    """kube-proxy programs a Service's endpoints a moment after the pod turns Ready; until then its rules
    refuse the connection. Retry, bounded, and return the first answer."""

    def fetch() -> str | None:
        command = ("exec", "-n", namespace, pod, "--", "python3", "-c", FETCH, url)
        result = kube.kubectl(*command, check=False, timeout=60)
        return result.stdout if result.returncode == 0 else None

    return wait_for(fetch, timeout=60.0, interval=1.0, message=f"{url} answering from pod {pod}")


@pytest.mark.spawns
@pytest.mark.integration
def test_daemonset_and_deployment_from_the_project_image_run_and_serve(
    kube: ControlPlane, real_node: RealNode, chart_image: str, namespace: str
) -> None:
    manifests = [
        agent_like_daemonset(chart_image, real_node),
        web_deployment(chart_image, real_node),
        web_service(),
    ]
    listing = {"apiVersion": "v1", "kind": "List", "items": manifests}
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(listing))

    agent_pod, web_pod = wait_for(
        lambda: both_ready(kube, namespace),
        timeout=READY_TIMEOUT,
        interval=0.5,
        message="the DaemonSet's and the Deployment's pods Running and Ready on the real node",
    )
    for pod in (agent_pod, web_pod):
        assert pod["spec"]["nodeName"] == real_node.name
        statuses = pod["status"]["containerStatuses"]
        assert all(status["ready"] and "running" in status["state"] for status in statuses)
        assert all(status["imageID"] for status in statuses), "a real container reports the image it runs"
    agent_name, web_name = agent_pod["metadata"]["name"], web_pod["metadata"]["name"]
    web_ip = web_pod["status"]["podIP"]
    assert web_ip and web_ip != agent_pod["status"]["podIP"]

    # The image is the project's: warmstart and a CRIU >= 4 inside.
    installed = exec_python(kube, namespace, web_name, "import warmstart; print(warmstart.__name__)")
    assert installed.strip() == "warmstart"
    criu = kube.kubectl("exec", "-n", namespace, agent_name, "--", "criu", "--version").stdout
    assert "Version: 4" in criu

    # hostPID: the agent sees the node's own processes.
    assert exec_python(kube, namespace, agent_name, FIND_KUBELET).split() == ["True", "True"]

    # A ClusterIP Service answers from another pod (kube-proxy's nftables rules, inside the node).
    cluster_ip = get_json(kube, "service", "web", "-n", namespace)["spec"]["clusterIP"]
    answer = fetch_once_served(kube, namespace, agent_name, f"http://{cluster_ip}:{SERVICE_PORT}/")
    assert answer.split() == ["200", web_name]

    # The `kubernetes` Service reaches the apiserver through the node's gateway, with a verified certificate.
    kubernetes_ip = get_json(kube, "service", "kubernetes", "-n", "default")["spec"]["clusterIP"]
    version = fetch_once_served(kube, namespace, web_name, f"https://{kubernetes_ip}/version")
    assert version.startswith("200 ")

    logs = kube.kubectl("logs", "-n", namespace, web_name).stdout
    assert logs == ""


@pytest.mark.spawns
@pytest.mark.integration
def test_a_pod_runs_the_engine_from_the_host_python_environment(
    kube: ControlPlane, real_node: RealNode, chart_image: str, host_python: HostPython, namespace: str
) -> None:
    """The chart's image has no torch; a test worker takes this run's environment read-only from the host."""
    container = {
        "name": "worker",
        "image": chart_image,
        "imagePullPolicy": "Never",
        "command": [host_python.python, "-c", "import torch, warmstart.engines; print(torch.__version__)"],
        "volumeMounts": host_python.volume_mounts,
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "host-python"},
        "spec": {
            **on_the_real_node(real_node),
            "restartPolicy": "Never",
            "containers": [container],
            "volumes": host_python.volumes,
        },
    }
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    def finished() -> str | None:
        phase = get_json(kube, "pod", "host-python", "-n", namespace)["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for(finished, timeout=READY_TIMEOUT, interval=0.5, message="the host-python pod to finish")
    logs = kube.kubectl("logs", "-n", namespace, "host-python").stdout
    assert phase == "Succeeded", logs
    assert logs.strip().startswith(importlib.metadata.version("torch"))


# Prints a digest of the warmstart package's Python files, wherever it is installed.
PACKAGE_DIGEST = """
import hashlib, pathlib, warmstart
root = pathlib.Path(warmstart.__file__).parent
digest = hashlib.sha256()
for path in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
    digest.update(str(path.relative_to(root)).encode() + b"\\0" + path.read_bytes())
print(digest.hexdigest())
"""


@pytest.mark.spawns
@pytest.mark.integration
@pytest.mark.parametrize("image", ["chart", "worker-cpu"])
def test_the_projects_images_carry_the_working_trees_code(
    kube: ControlPlane, real_node: RealNode, namespace: str, image: str
) -> None:
    """What the image build installs is this tree's code, every file (a build step once left an empty
    `warmstart/__init__.py` from the dependency layer's placeholder in the image)."""
    specs = images.chart_images() if image == "chart" else images.worker_images()
    reference = specs[0].reference
    if reference not in images.current_images():
        pytest.skip(f"{reference} is not built from this tree: run `hack/control-plane images`")
    container = {"name": "digest", "image": reference, "imagePullPolicy": "Never",
                 "command": ["python3", "-c", PACKAGE_DIGEST]}  # fmt: skip
    spec = {**on_the_real_node(real_node), "restartPolicy": "Never", "containers": [container]}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "digest"}, "spec": spec}
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    def finished() -> str | None:
        phase = get_json(kube, "pod", "digest", "-n", namespace)["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_for(finished, timeout=READY_TIMEOUT, interval=0.5, message="the digest pod to finish")
    logs = kube.kubectl("logs", "-n", namespace, "digest").stdout
    here = subprocess.run([sys.executable, "-c", PACKAGE_DIGEST], capture_output=True, text=True, check=True)
    assert phase == "Succeeded", logs
    assert logs.strip() == here.stdout.strip()


def run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30).stdout


@pytest.mark.spawns
@pytest.mark.integration
def test_the_node_network_lives_only_in_its_namespaces(real_node: RealNode) -> None:
    """Runs after the workloads above: the pods' bridge and kube-proxy's rules exist, inside the node."""
    record = real_node.record
    assert record is not None
    addresses = real_node.addresses
    inside = ["nsenter", f"--target={record.holder_pid}", "--net", "--"]
    node_addresses = run(*inside, "ip", "-o", "addr")
    assert addresses.node_ip in node_addresses and f" {network.POD_BRIDGE} " in node_addresses
    assert "table ip kube-proxy" in run(*inside, "nft", "list", "tables")

    # None of the node's networks is one the machine's own interfaces or routes use.
    for ours in (addresses.node_network, addresses.pod_subnet):
        assert not any(ours.overlaps(theirs) for theirs in network.machine_networks())
    assert host_state.host_links() == record.host.links
    assert host_state.host_nft_tables() == record.host.nft_tables
    # kubelet found its sysctls already set (files bound over them in its mount namespace).
    assert host_state.read_sysctls() == record.host.sysctls


@pytest.mark.spawns
@pytest.mark.integration
def test_stopping_the_node_leaves_nothing_behind(real_node: RealNode) -> None:
    """Runs after the workloads above; the node is started again for any later test."""
    record = real_node.record
    assert record is not None
    assert record.host.sysctls, "the machine's sysctls were saved before the node started"
    real_node.stop()
    left = real_node.leftovers(record)
    real_node.start()
    assert left == []


@pytest.mark.spawns
@pytest.mark.integration
def test_a_stopped_second_node_leaves_no_link_while_its_namespace_lingers(
    real_node: RealNode, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The kernel may free a stopped node's network namespace a while later (held open here); the second
    node's veth end in the apiserver's namespace goes at the stop all the same, so the next start can add
    it."""
    chart = [NodeImage(reference, path) for reference, path in images.built_images().items()]
    second = RealNode(plane=real_node.plane, state_dir=tmp_path_factory.mktemp("node-b"), images=chart,
                      name=network.SECOND_NODE_NAME, first=real_node)  # fmt: skip
    second.start()
    record = second.record
    assert record is not None
    lingering = os.open(f"/proc/{record.holder_pid}/ns/net", os.O_RDONLY)
    try:
        second.stop()
        assert second.leftovers(record) == []
    finally:
        os.close(lingering)


# -- without a node ------------------------------------------------------------------------------------------


def test_node_addresses_avoid_every_network_of_the_machine() -> None:
    taken = [ipaddress.ip_network("198.51.100.0/24"), ipaddress.ip_network("10.245.0.0/16")]
    node_network = network.first_free(network.NODE_NETWORK_CANDIDATES, taken)
    pod_subnet = network.first_free(network.POD_SUBNET_CANDIDATES, [*taken, node_network])
    addresses = network.NodeAddresses(node_network, pod_subnet)
    assert str(node_network) == "203.0.113.0/24" and not pod_subnet.overlaps(taken[1])
    assert (addresses.api_ip, addresses.node_ip) == ("203.0.113.1", "203.0.113.2")
    assert network.NodeAddresses.from_json(addresses.to_json()) == addresses


@pytest.mark.spawns
def test_two_nodes_get_link_networks_and_pod_subnets_of_their_own(tmp_path) -> None:
    first, second = network.choose(2)
    ranges = [first.node_network, first.pod_subnet, second.node_network, second.pod_subnet]
    assert not any(a.overlaps(b) for i, a in enumerate(ranges) for b in ranges[i + 1 :]), ranges
    taints = (network.REAL_NODE_LABEL, network.SECOND_NODE_LABEL)
    name = network.SECOND_NODE_NAME
    text = node_config.kubelet_config(second, tmp_path / "ca", tmp_path / "resolv", name, taints)
    kubelet = json.loads(text)
    assert kubelet["cgroupRoot"] == f"/{name}" and kubelet["address"] == second.node_ip
    assert {taint["key"] for taint in kubelet["registerWithTaints"]} == set(taints)


TWO_TICKS = 2 / os.sysconf("SC_CLK_TCK")


def own_namespace(pid: int) -> int | None:
    """The mount namespace of `pid` once it is no longer this process's."""
    inode = host_state.namespace_inode(pid, "mnt")
    return inode if inode not in (None, host_state.namespace_inode(os.getpid(), "mnt")) else None


@pytest.mark.spawns
def test_a_process_started_after_a_namespace_was_let_go_is_not_counted_in_it() -> None:
    """The kernel gives a freed namespace's number to the next one made, so a check after a node stopped
    counts only processes started while the node still pinned its namespaces. Here one namespace stands for
    both: the process joining it later is what a newer namespace of the same number would show."""
    sleeper = ["sleep", "30"]
    first = subprocess.Popen(["unshare", "--mount", "--propagation", "private", *sleeper])
    joined = None
    try:
        inode = wait_for(lambda: own_namespace(first.pid), timeout=10, interval=0.02, message="unshare")
        time.sleep(TWO_TICKS)
        let_go = host_state.boottime()
        time.sleep(TWO_TICKS)
        joined = subprocess.Popen(["nsenter", f"--target={first.pid}", "--mount", "--", *sleeper])
        wait_for(lambda: host_state.namespace_inode(joined.pid, "mnt") == inode, timeout=10, interval=0.02,
                 message="nsenter")  # fmt: skip
        assert host_state.pids_in_namespace("mnt", inode) == {first.pid, joined.pid}
        assert host_state.pids_in_namespace("mnt", inode, started_before=let_go) == {first.pid}
    finally:
        for process in (first, joined):
            if process is not None:
                process.kill()
                process.wait()


def test_the_node_has_a_stamp_of_its_own() -> None:
    """Adding the node must not make a cached control plane look stale."""
    control_plane = json.dumps(versions.wanted_stamp())
    assert "kubelet" not in control_plane and "kube-proxy" not in control_plane
    assert versions.node_stamp_path() != versions.stamp_path()


def test_kube_proxy_syncs_at_its_default_interval_unless_the_testbed_lowers_it(tmp_path, monkeypatch) -> None:
    addresses = network.NodeAddresses(
        ipaddress.ip_network("203.0.113.0/24"), ipaddress.ip_network("10.245.0.0/24")
    )
    monkeypatch.delenv(node_config.MIN_SYNC_ENV, raising=False)
    proxy = json.loads(node_config.kube_proxy_config(addresses, tmp_path / "kubeconfig"))
    assert "minSyncPeriod" not in proxy["nftables"] and proxy["nftables"]["masqueradeAll"] is True
    monkeypatch.setenv(node_config.MIN_SYNC_ENV, "100ms")
    proxy = json.loads(node_config.kube_proxy_config(addresses, tmp_path / "kubeconfig"))
    assert proxy["nftables"]["minSyncPeriod"] == "100ms"
    for zero in ("0s", "0", "0.0ms", "0h0m0s"):  # kube-proxy would run at its 1 s default
        monkeypatch.setenv(node_config.MIN_SYNC_ENV, zero)
        with pytest.raises(ValueError, match=r"zero minSyncPeriod as its default, 1s.*1ms"):
            node_config.kube_proxy_config(addresses, tmp_path / "kubeconfig")


def test_kubelet_and_containerd_carry_the_settings_this_kind_of_machine_needs(tmp_path) -> None:
    addresses = network.NodeAddresses(
        ipaddress.ip_network("203.0.113.0/24"), ipaddress.ip_network("10.245.0.0/24")
    )
    kubelet = json.loads(node_config.kubelet_config(addresses, tmp_path / "ca", tmp_path / "resolv"))
    assert kubelet["failCgroupV1"] is False and kubelet["oomScoreAdj"] == 0
    assert (kubelet["imageGCHighThresholdPercent"], kubelet["imageGCLowThresholdPercent"]) == (100, 99)
    assert kubelet["cgroupRoot"] == f"/{node_config.CGROUP_ROOT}" and kubelet["address"] == "203.0.113.2"
    assert "localStorageCapacityIsolation" not in kubelet
    containerd = node_config.containerd_toml()
    assert "restrict_oom_score_adj = true" in containerd and "SystemdCgroup = false" in containerd
    proxy = json.loads(node_config.kube_proxy_config(addresses, tmp_path / "kubeconfig"))
    assert proxy["mode"] == "nftables" and proxy["conntrack"]["maxPerCore"] == 0


def test_the_image_hash_covers_what_the_dockerfile_copies() -> None:
    sources = images.copied_sources(images.REPO / "Dockerfile")
    assert {"pyproject.toml", "README.md", "warmstart"} <= set(sources)
    files = images.context_files(sources)
    assert files and not any(images.ignored(path) for path in files)
