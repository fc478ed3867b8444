"""The pods that run workers: the Deployment's pod template, the capture pod, the weight stagers.

The weight stagers run as a DaemonSet of the worker's image."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from warmstart.api import labels as L
from warmstart.api import worker_options as W
from warmstart.api.control_dir import CONTROL_DIR_ENV
from warmstart.api.endpoint import EndpointSpec
from warmstart.operator.children.owner import Owner, common_labels, object_metadata, worker_selector
from warmstart.operator.placement import prefer_node
from warmstart.operator.rollout import SURGE

START_TIMEOUT_SECONDS = int(W.DEFAULT_START_TIMEOUT)  # past it, a worker never ready is restarted
PROBE_PORT_NAME = "probe"  # the supervisor's probe endpoints
READY_PROBE_WAIT = 1.5  # seconds a readiness probe waits for the engine: over its 1 s period, so one probe
# follows another with no gap; under the probes' 2 s timeout


def _engine_args(spec: EndpointSpec, mode: str = L.ROLE_COLD) -> list[str]:
    """The worker's flags for the engine and the model, shared by the model stager; the snapshot to restore
    reaches the agent through pod labels and env."""
    return W.WorkerOptions(
        engine=spec.engine.kind,
        model=spec.model.uri,
        served_model_name=spec.model.name_on_api,
        dtype=spec.engine.dtype,
        device="cuda" if spec.resources.gpus else "cpu",
        tensor_parallel_size=spec.engine.tensor_parallel_size,
        revision=spec.model.revision or None,
        mode=mode,
        host="0.0.0.0",  # the kubelet's probes and the Service reach the pod's IP
        port=spec.engine.port,
    ).argv() + list(spec.engine.args)


def _env(endpoint: str, spec: EndpointSpec, role: str, snapshot: str, request_hash: str) -> list[dict]:
    def field_ref(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[dict[str, Any]] = [
        {"name": CONTROL_DIR_ENV, "value": L.CONTROL_DIR_PATH},
        {"name": "WARMSTART_ENDPOINT", "value": endpoint},
        {"name": "WARMSTART_ROLE", "value": role},
        {"name": "WARMSTART_REQUEST_KEY", "value": request_hash},
        {"name": "WARMSTART_POD_NAME", **field_ref("metadata.name")},
        {"name": "WARMSTART_POD_NAMESPACE", **field_ref("metadata.namespace")},
        {"name": L.POD_UID_ENV, **field_ref("metadata.uid")},  # how the node agent finds its processes
        {"name": "WARMSTART_NODE_NAME", **field_ref("spec.nodeName")},
    ]
    if snapshot:
        env.append({"name": "WARMSTART_SNAPSHOT", "value": snapshot})
    overridden = {item["name"] for item in spec.template.env}
    return [item for item in env if item["name"] not in overridden] + [dict(e) for e in spec.template.env]


def _resources(spec: EndpointSpec) -> dict[str, Any]:
    requests: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    if spec.resources.cpu:
        requests["cpu"] = spec.resources.cpu
    if spec.resources.memory:
        requests["memory"] = limits["memory"] = spec.resources.memory
    if spec.resources.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = spec.resources.gpus
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": PROBE_PORT_NAME},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def _container(endpoint: str, spec: EndpointSpec, role: str, snapshot: str, request_hash: str) -> dict:
    # No snapshot store: the node agent alone reads it. Mounted in a worker it would show every snapshot in
    # it (other engines' memory) to whatever runs there.
    mounts = [{"name": "control", "mountPath": L.CONTROL_DIR_PATH}, {"name": "shm", "mountPath": "/dev/shm"}]
    mounts += [dict(mount) for mount in spec.template.volume_mounts]
    container: dict[str, Any] = {
        "name": L.WORKER_CONTAINER,
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["warmstart"],
        "args": [
            "worker",
            f"--probe-port={W.probe_port(spec.engine.port)}",
            f"--start-timeout={START_TIMEOUT_SECONDS}",
            *_engine_args(spec, role),
        ],
        "env": _env(endpoint, spec, role, snapshot, request_hash),
        "ports": [
            {"name": "http", "containerPort": spec.engine.port, "protocol": "TCP"},
            {"name": PROBE_PORT_NAME, "containerPort": W.probe_port(spec.engine.port), "protocol": "TCP"},
        ],
        # The probes ask the supervisor, which listens from the container's start and answers readiness the
        # moment the engine's /ready does (`?wait=`): a restored engine opens its server only once restored,
        # and a probe it refused would leave the replica waiting up to a period for the next. No startup
        # probe: readiness is not probed before one passes, which can cost another period; /live passes
        # while the engine starts, up to --start-timeout.
        "readinessProbe": _probe(f"{W.PROBE_READY_PATH}?wait={READY_PROBE_WAIT}", 1, 3),
        "livenessProbe": _probe(W.PROBE_LIVE_PATH, 10, 6),
        "volumeMounts": mounts,
    }
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    return container


def _scheduling(spec: EndpointSpec) -> dict[str, Any]:
    node_selector = dict(spec.template.node_selector)
    if spec.resources.gpu_product:
        node_selector.setdefault("nvidia.com/gpu.product", spec.resources.gpu_product)
    tolerations = [dict(t) for t in spec.template.tolerations]
    if spec.resources.gpus:
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    scheduling: dict[str, Any] = {}
    if node_selector:
        scheduling["nodeSelector"] = node_selector
    if tolerations:
        scheduling["tolerations"] = tolerations
    if spec.template.service_account_name:
        scheduling["serviceAccountName"] = spec.template.service_account_name
    else:  # a worker never calls the API: no token of the namespace's default account in it (or to mount)
        scheduling["automountServiceAccountToken"] = False
    if spec.template.priority_class_name:
        scheduling["priorityClassName"] = spec.template.priority_class_name
    return scheduling


def pod_labels(
    spec: EndpointSpec, endpoint: str, component: str, role: str, snapshot: str, request_hash: str
) -> dict[str, str]:
    """The template's labels, then the operator's (which win)."""
    pod = {**spec.template.labels, **common_labels(endpoint, component)}
    pod[L.ROLE_LABEL] = role
    pod[L.REQUEST_KEY_LABEL] = L.request_key_label(request_hash)
    if snapshot:
        pod[L.SNAPSHOT_LABEL] = snapshot
    return pod


def pod_spec(endpoint: str, spec: EndpointSpec, role: str, snapshot: str, request_hash: str) -> dict:
    return {
        "containers": [_container(endpoint, spec, role, snapshot, request_hash)],
        "volumes": [
            {"name": "control", "emptyDir": {}},
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
            *(dict(volume) for volume in spec.template.volumes),
        ],
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        **_scheduling(spec),
    }


def deployment(
    owner: Owner,
    spec: EndpointSpec,
    role: str,
    snapshot: str,
    request_hash: str,
    node: str = "",
    rolling_update: Mapping[str, int] = SURGE,
) -> dict[str, Any]:
    """The serving workers: role `cold` until a snapshot is Ready, then `restore` from it, preferring `node`
    (the one holding the snapshot, when only it does; "" for no preference), replaced as `rolling_update`
    says (`rollout`)."""
    labels = pod_labels(spec, owner.name, L.WORKER_COMPONENT, role, snapshot, request_hash)
    pod = pod_spec(owner.name, spec, role, snapshot, request_hash)
    if node:
        prefer_node(pod, node)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_metadata(owner, owner.name, L.WORKER_COMPONENT),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": worker_selector(owner.name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": dict(rolling_update)},
            "template": {
                "metadata": {"labels": labels, "annotations": dict(spec.template.annotations)},
                "spec": pod,
            },
        },
    }


def prestage_daemonset(owner: Owner, spec: EndpointSpec) -> dict[str, Any]:
    """`snapshot.prestage: PageCache`: on every node the endpoint's pods may run on (the worker's scheduling),
    an unprivileged pod of the worker's image and volumes keeps the model files in the page cache (the node
    agent keeps the snapshot there)."""
    labels = common_labels(owner.name, L.PRESTAGE_COMPONENT)
    container = {
        "name": L.PRESTAGE_COMPONENT,
        "image": spec.engine.image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["warmstart"],
        "args": ["prestage-weights", *_engine_args(spec)],
        "env": [dict(e) for e in spec.template.env],
        "volumeMounts": [dict(mount) for mount in spec.template.volume_mounts],
        # The stager only reads files: a sliver of CPU and a little memory of its own; the page cache it
        # fills is charged to it but reclaimable, so it gets no memory limit that would evict its own pages.
        "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": object_metadata(owner, owner.name, L.PRESTAGE_COMPONENT),
        "spec": {
            "selector": {"matchLabels": {key: labels[key] for key in (L.ENDPOINT_LABEL, L.COMPONENT_LABEL)}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [container],
                    "volumes": [dict(volume) for volume in spec.template.volumes],
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 5,
                    **_scheduling(spec),
                },
            },
        },
    }


def capture_pod(
    snapshot_owner: Owner, endpoint: str, spec: EndpointSpec, attempt: int, request_hash: str
) -> dict[str, Any]:
    """One worker that cold-starts, signals ready-for-snapshot and is captured by the node agent."""
    snapshot = snapshot_owner.name
    labels = pod_labels(spec, endpoint, L.CAPTURE_COMPONENT, L.ROLE_CAPTURE, snapshot, request_hash)
    body = pod_spec(endpoint, spec, L.ROLE_CAPTURE, snapshot, request_hash)
    for container in body["containers"]:  # no Service routes to it, and its deadline ends a stuck capture:
        container.pop("readinessProbe")  # probes would only fail while the agent checkpoints it, each
        container.pop("livenessProbe")  # failure a Warning Event on a capture that goes as planned
    body["restartPolicy"] = "Never"
    body["activeDeadlineSeconds"] = spec.snapshot.capture_timeout_seconds  # a stuck capture ends
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": capture_pod_name(snapshot_owner.name, attempt),
            "namespace": snapshot_owner.namespace,
            "labels": labels,
            "annotations": dict(spec.template.annotations),
            "ownerReferences": [snapshot_owner.reference()],
        },
        "spec": body,
    }


def capture_pod_name(snapshot: str, attempt: int) -> str:
    return f"{snapshot}-capture-{attempt}"
