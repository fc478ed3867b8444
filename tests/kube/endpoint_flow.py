"""An InferenceEndpoint on the real node, as a user runs one: the chart's values for the real node, the
snapshot volume, endpoints of the builtin engine on CPU, a client pod that sends completions from inside the
cluster, and what to print when the flow stalls. Used by the end-to-end test and the pod start benchmark."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from control_plane import gpu_node, host_state
from control_plane.cluster import ControlPlane, ControlPlaneError, wait_for
from control_plane.node import RealNode
from node_plugin import HostPython, warmstart_source

from warmstart.api import labels as L
from warmstart.api.control_dir import RESTORE_CLAIM as CLAIM
from warmstart.snapshot.store import SnapshotStore

CHART = Path(__file__).resolve().parents[2] / "charts" / "warmstart"
RELEASE = "ws"
ENDPOINT = "tiny"
COLD_ENDPOINT = "tiny-cold"
PROMPT = "the quick brown fox"
MODELS_MOUNT = "/cache/models"  # under WARMSTART_CACHE: where the builtin engine keeps generated models
WORKER_PORT = 8000  # the engine's default port, which the operator gives the worker
START_TIMEOUT = 300.0  # a loaded 2-core machine starts several Python processes at once
# Run with the image's python3 in the client pod: one greedy completion with its token ids (Host header
# optional); on stdout the response body and the seconds from sending the request to the whole answer.
COMPLETE = """
import json, sys, time, urllib.error, urllib.request
url, prompt, host, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
body = json.dumps(body).encode()
headers = {"Content-Type": "application/json", **({"Host": host} if host else {})}
request = urllib.request.Request(url, data=body, headers=headers)
started = time.monotonic()
try:
    response = urllib.request.urlopen(request, timeout=timeout)
except urllib.error.HTTPError:
    raise
except urllib.error.URLError as error:  # raised before the request was sent: connecting failed
    sys.exit(f"UNREACHABLE: {error.reason}")
with response:
    answer = json.loads(response.read())
print(json.dumps({"answer": answer, "seconds": time.monotonic() - started}))
"""
REQUEST_TIMEOUT = 30.0
# How long the interceptor holds a request at zero replicas: a restore or a cold start on a loaded machine.
HOLD_SECONDS = 180
LOAD_SECONDS = 60
LOAD_CONCURRENCY = 4
# Run in the client pod: LOAD_CONCURRENCY threads sending completions until the deadline or until LOAD_STOP
# exists (bounded in count too); prints how many were answered and how many failed.
LOAD_STOP = "/tmp/load-stop"
LOAD = f"""
import json, os, sys, threading, time, urllib.request
url, host, seconds, workers = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
deadline, answered, failed, lock = time.monotonic() + seconds, [0], [0], threading.Lock()
body = json.dumps({{"model": "tiny", "prompt": "load", "max_tokens": 64, "temperature": 0}}).encode()
if os.path.exists("{LOAD_STOP}"):
    os.remove("{LOAD_STOP}")
def send():
    for _ in range(5000):
        if time.monotonic() > deadline or os.path.exists("{LOAD_STOP}"):
            return
        headers = {{"Content-Type": "application/json", **({{"Host": host}} if host else {{}})}}
        request = urllib.request.Request(url, data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                response.read()
            outcome = answered
        except Exception:
            outcome = failed
            time.sleep(0.5)
        with lock:
            outcome[0] += 1
threads = [threading.Thread(target=send) for _ in range(workers)]
[t.start() for t in threads]
[t.join() for t in threads]
print(json.dumps({{"answered": answered[0], "failed": failed[0]}}))
"""


def load_argv(namespace: str, url: str, host: str = "", seconds: float = LOAD_SECONDS) -> list[str]:
    """kubectl's arguments that run LOAD in the client pod against `url` (with `host` as the Host header)."""
    return ["exec", "-n", namespace, "client", "--", "python3", "-c", LOAD, url, host, str(seconds),
            str(LOAD_CONCURRENCY)]  # fmt: skip


def stop_load(kube: ControlPlane, namespace: str) -> None:
    """Tell a LOAD running in the client pod to send nothing more."""
    kube.kubectl("exec", "-n", namespace, "client", "--", "touch", LOAD_STOP)


def get(kube: ControlPlane, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
    result = kube.kubectl("get", kind, name, "-n", namespace, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def items(kube: ControlPlane, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
    result = kube.kubectl("get", kind, "-n", namespace, "-l", selector, "-o", "json")
    return json.loads(result.stdout)["items"]


def ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def split_image(reference: str) -> tuple[str, str]:
    repository, _, tag = reference.rpartition(":")
    return repository, tag


# Set by the GPU testbed's script: the chart's pods run this tree's warmstart package over the image's, so a
# fix made while a GPU machine is lent needs no new image carried there (the CPU suite runs the image's own,
# which test_real_node checks is this tree's).
SOURCE_OVERLAY_ENV = "WARMSTART_CHART_SOURCE_OVERLAY"


def source_overlay() -> dict[str, Any]:
    """extraEnv/extraVolumes/extraVolumeMounts that put this tree's package first on the pods' path."""
    source = str(warmstart_source())
    return {
        "extraEnv": [{"name": "PYTHONPATH", "value": "/opt/warmstart-source"}],
        "extraVolumes": [{"name": "source", "hostPath": {"path": source, "type": "Directory"}}],
        "extraVolumeMounts": [{"name": "source", "mountPath": "/opt/warmstart-source", "readOnly": True}],
    }


def chart_values(chart_image: str, node: RealNode, namespace: str, store: str) -> dict[str, Any]:
    """Operator and agent on the real node, watching `namespace`, the store at `store` on the node."""
    repository, tag = split_image(chart_image)
    placement = node.pod_placement()
    overlay = source_overlay() if os.environ.get(SOURCE_OVERLAY_ENV) == "1" else {}
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "operator": {
            "watchNamespaces": [namespace],
            "nodeSelector": placement["nodeSelector"],
            "tolerations": placement["tolerations"],
            "resyncSeconds": 5,
            "captureBackoffSeconds": 5,
            **overlay,
        },
        "agent": {
            # null drops the chart's default selector of GPU nodes (Helm merges maps)
            "nodeSelector": placement["nodeSelector"],
            "tolerations": placement["tolerations"],
            "store": {"hostPath": store},
            "prestage": {"intervalSeconds": 5},
            # On a GPU node the agent takes the driver's libraries from the node (no NVIDIA runtime here).
            **({"cuda": {"driverLibraryHostPath": str(gpu_node.driver_library_dir())}} if node.gpu else {}),
            **overlay,
        },
    }


def store_on_node(namespace: str) -> str:
    """The agent's store directory as the node sees it (one per test namespace)."""
    return f"/var/lib/warmstart/{namespace}/store"


def agent_store(node: RealNode, namespace: str) -> SnapshotStore:
    """The agent's store, read from the machine (the node's /var/lib/warmstart is a directory of its own)."""
    return SnapshotStore(node.shadow("/var/lib/warmstart") / namespace / "store")


def install(
    kube: ControlPlane,
    chart_image: str,
    node: RealNode,
    namespace: str,
    more: dict[str, Any] | None = None,
    agent: dict[str, Any] | None = None,
) -> str:
    """`helm install` into `namespace` (with `more` values at the top level and `agent` among the agent's);
    returns the agent's store directory as the node sees it."""
    store = store_on_node(namespace)
    values = {**chart_values(chart_image, node, namespace, store), **(more or {})}
    values["agent"].update(agent or {})
    kube.helm(
        "install", RELEASE, str(CHART), "-n", namespace, "-f", "-", input=json.dumps(values), timeout=120
    )
    return store


def uninstall(kube: ControlPlane, namespace: str) -> None:
    kube.helm("uninstall", RELEASE, "-n", namespace, "--wait", "--timeout=60s", check=False, timeout=90)


def endpoint(
    name: str, namespace: str, chart_image: str, node: RealNode, host_python: HostPython, snapshots: bool
) -> dict[str, Any]:
    """The builtin engine's tiny model on CPU; without `snapshots` every replica starts cold."""
    placement = node.pod_placement()
    models = f"/var/lib/warmstart/{namespace}/models"
    return {
        "apiVersion": L.API_VERSION,
        "kind": L.ENDPOINT_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "model": {"uri": "tiny"},
            "engine": {"kind": "builtin", "image": chart_image, "imagePullPolicy": "Never"},
            "resources": {"gpus": 0},
            "snapshot": {"enabled": snapshots},
            "template": {
                **placement,
                "env": [
                    # `warmstart` from the mounted environment (the image's own has no torch).
                    *host_python.env,
                    {"name": "WARMSTART_CACHE", "value": "/cache"},
                    {"name": "OMP_NUM_THREADS", "value": "1"},
                ],
                # The model files at the same path in every pod: the restored engine maps them again.
                "volumes": [
                    *host_python.volumes,
                    {"name": "models", "hostPath": {"path": models, "type": "DirectoryOrCreate"}},
                ],
                "volumeMounts": [
                    *host_python.volume_mounts,
                    {"name": "models", "mountPath": "/cache/models"},
                ],
            },
        },
    }


def apply_endpoint(
    kube: ControlPlane,
    namespace: str,
    chart_image: str,
    node: RealNode,
    host_python: HostPython,
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> None:
    """The endpoint with snapshots; `edit` changes its spec before it is applied."""
    body = endpoint(ENDPOINT, namespace, chart_image, node, host_python, snapshots=True)
    if edit is not None:
        edit(body["spec"])
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))


def autoscaled(body: dict[str, Any], min_replicas: int, max_replicas: int) -> dict[str, Any]:
    """The endpoint fronted by the HTTP add-on, starting at `min_replicas`."""
    body["spec"]["replicas"] = min_replicas
    body["spec"]["autoscaling"] = {
        "mode": "http",
        "minReplicas": min_replicas,
        "maxReplicas": max_replicas,
        "cooldownSeconds": 10,
        "http": {"targetConcurrency": 1, "coldStartTimeoutSeconds": HOLD_SECONDS},
    }
    return body


def routed_host(kube: ControlPlane, namespace: str, name: str) -> str:
    """The Host header the interceptor routes to the endpoint, as the operator wrote it."""
    scaled = wait_for(lambda: get(kube, "httpscaledobject", namespace, name), timeout=60,
                      message=f"HTTPScaledObject {name}")  # fmt: skip
    return scaled["spec"]["hosts"][0]


def at_zero(kube: ControlPlane, namespace: str, name: str) -> bool:
    deployment = get(kube, "deployment", namespace, name)
    return (
        deployment is not None
        and deployment["spec"].get("replicas") == 0
        and not any(worker_pods(kube, namespace, role, name) for role in (L.ROLE_COLD, L.ROLE_RESTORE))
    )


def client_pod(namespace: str, chart_image: str, node: RealNode) -> str:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "client", "namespace": namespace},
        "spec": {
            **node.pod_placement(),
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "client",
                    "image": chart_image,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "3600"],
                }
            ],
        },
    }
    return json.dumps(pod)


def start_client(kube: ControlPlane, namespace: str, chart_image: str, node: RealNode) -> None:
    """The client pod, Ready to exec into."""
    kube.kubectl("apply", "-f", "-", input=client_pod(namespace, chart_image, node))
    ready = ("wait", "--for=condition=Ready", "pod/client", "-n", namespace, "--timeout=180s")
    kube.kubectl(*ready, timeout=190)


class Answer(NamedTuple):
    """A completion as the oracle compares it: two answers are the same when their token ids are."""

    token_ids: tuple[int, ...]
    text: str


def timed_completion(
    kube: ControlPlane, namespace: str, url: str, host: str = "", timeout: float = REQUEST_TIMEOUT
) -> tuple[Answer, float]:
    """A greedy completion from the client pod, and the seconds from request to answer measured there; an
    answer without token ids or with a blank text fails (an empty answer would make every comparison pass).

    A connection that could not be made (refused, or timed out) raises ConnectionError, which waits retry: a
    Service whose first replica just turned Ready is refused until kube-proxy has programmed its endpoint, and
    one whose replica is being replaced can still route to the old pod's address for a moment.
    """
    script = ["python3", "-c", COMPLETE, url, PROMPT, host, str(timeout)]
    try:
        result = kube.kubectl("exec", "-n", namespace, "client", "--", *script, timeout=timeout + 30)
    except ControlPlaneError as error:
        if "UNREACHABLE: " in str(error):
            reason = str(error).rpartition("UNREACHABLE: ")[2].splitlines()[0]
            raise ConnectionError(f"{url}: {reason}") from error
        raise
    reply = json.loads(result.stdout)
    choice = reply["answer"]["choices"][0]
    answer = Answer(tuple(choice.get("token_ids") or ()), choice["text"])
    assert answer.token_ids and answer.text.strip(), f"{url} answered no tokens: {reply['answer']}"
    return answer, reply["seconds"]


def completion(kube: ControlPlane, namespace: str, url: str) -> Answer:
    return timed_completion(kube, namespace, url)[0]


def service_url(kube: ControlPlane, namespace: str, name: str) -> str:
    """The completions URL of an endpoint's Service (its cluster IP)."""
    service = get(kube, "service", namespace, name)
    assert service is not None, f"no Service {namespace}/{name}"
    return f"http://{service['spec']['clusterIP']}/v1/completions"


def pod_url(pod: dict[str, Any]) -> str:
    """The completions URL of one worker pod (its IP and the worker's port)."""
    return f"http://{pod['status']['podIP']}:{WORKER_PORT}/v1/completions"


def ready_workers(kube: ControlPlane, namespace: str, role: str) -> list[dict[str, Any]]:
    return [pod for pod in worker_pods(kube, namespace, role) if ready(pod)]


def worker_pods(kube: ControlPlane, namespace: str, role: str, name: str = ENDPOINT) -> list[dict[str, Any]]:
    selector = f"{L.ENDPOINT_LABEL}={name},{L.ROLE_LABEL}={role}"
    return [
        pod for pod in items(kube, "pod", namespace, selector) if "deletionTimestamp" not in pod["metadata"]
    ]


def all_events(kube: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    return json.loads(kube.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]


def events_of(kube: ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    result = kube.kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                          "-o", "json")  # fmt: skip
    return json.loads(result.stdout)["items"]


def ready_snapshot(kube: ControlPlane, namespace: str, name: str = ENDPOINT) -> dict[str, Any] | None:
    """The endpoint's Ready InferenceSnapshot, None while it has none."""
    snapshots = items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}={name}")
    return next((s for s in snapshots if s.get("status", {}).get("phase") == "Ready"), None)


def waiter(kube: ControlPlane, namespace: str) -> Any:
    """`wait(predicate, message, timeout=START_TIMEOUT)`: its truthy result, or an AssertionError with the
    namespace's diagnostics."""

    def wait(predicate: Any, message: str, timeout: float = START_TIMEOUT) -> Any:
        try:
            return wait_for(predicate, timeout=timeout, interval=1.0, message=message)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{diagnostics(kube, namespace)}") from None

    return wait


def diagnostics(kube: ControlPlane, namespace: str) -> str:
    """What a person would look at when the flow stalls: pods, snapshots, events, the agent's log."""
    parts = []
    for args in (
        ("get", "pods,isnap,iep,deploy", "-n", namespace, "-o", "wide"),
        ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp"),
        ("logs", "-n", namespace, "-l", "app.kubernetes.io/component=agent", "--tail=60"),
        ("logs", "-n", namespace, "-l", "app.kubernetes.io/component=operator", "--tail=40"),
    ):
        result = kube.kubectl(*args, check=False)
        parts.append(f"$ kubectl {' '.join(args)}\n{result.stdout[-4000:]}{result.stderr[-500:]}")
    return "\n".join(parts)


def tamper(store: SnapshotStore, snapshot_id: str) -> Path:
    """Flip one byte in the middle of the snapshot's largest blob, as a disk or a person could."""
    snapshot = store.get(snapshot_id)
    path = max((store.blob_path(d) for d in snapshot.manifest.digests()), key=lambda p: p.stat().st_size)
    path.chmod(0o600)
    with path.open("r+b") as blob:
        blob.seek(path.stat().st_size // 2)
        byte = blob.read(1)
        blob.seek(-1, 1)
        blob.write(bytes([byte[0] ^ 0xFF]))
    return path


def restore_claims(node: RealNode) -> set[Path]:
    """The pods' restore claims on the node: a restore takes its pod's before it touches the pod, and the
    claim stays (protocol.RESTORE_CLAIM)."""
    pods = node.shadow("/var/lib/kubelet") / "pods"
    return set(pods.glob(f"*/volumes/kubernetes.io~empty-dir/control/{CLAIM}"))


def agent_cgroups(kube: ControlPlane, namespace: str, node: RealNode) -> list[Path]:
    """The cgroups of the node's agent container (found ahead, so a kill needs no API call)."""
    agents = items(kube, "pod", namespace, "app.kubernetes.io/component=agent")
    pod = next(p for p in agents if p["spec"].get("nodeName") == node.name)
    container = pod["status"]["containerStatuses"][0]["containerID"].rpartition("//")[2]
    root = host_state.process_hierarchy() / node.cgroup_root
    found = [path for path in host_state.cgroup_tree(root) if path.name == container]
    assert found, f"no cgroup of the agent's container {container} under {root}"
    return found


def kill_agent(cgroups: list[Path]) -> None:
    """SIGKILL every process of the agent's container at once (as the kernel's OOM killer would); the
    kubelet starts it again."""
    for directory in cgroups:
        host_state.kill_cgroup_tree(directory)
