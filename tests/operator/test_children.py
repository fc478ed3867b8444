from __future__ import annotations

import pytest
from builders import UID, endpoint_body, snapshot_object

from warmstart.api import labels as L
from warmstart.operator import children
from warmstart.operator.children import workers
from warmstart.operator.placement import preferred_node
from warmstart.operator.reconcile import unwanted_children
from warmstart.operator.spec import parse_spec

HASH = "ab" * 32


def owner_and_spec(**overrides):
    body = endpoint_body(**overrides)
    return children.Owner.from_body(body), parse_spec(body["spec"])


def container_of(pod_spec: dict) -> dict:
    (container,) = pod_spec["containers"]
    return container


def test_cold_deployment_shape():
    owner, spec = owner_and_spec(replicas=2)
    dep = children.deployment(owner, spec, L.ROLE_COLD, "", HASH)
    assert dep["metadata"]["ownerReferences"][0]["uid"] == UID
    assert dep["metadata"]["ownerReferences"][0]["controller"] is True
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["selector"]["matchLabels"] == children.worker_selector("qwen")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels[L.ENDPOINT_LABEL] == "qwen" and labels[L.ROLE_LABEL] == "cold"
    assert L.SNAPSHOT_LABEL not in labels
    assert labels["app.kubernetes.io/instance"] == "qwen"
    pod = dep["spec"]["template"]["spec"]
    container = container_of(pod)
    assert container["command"] == ["warmstart"]
    assert container["args"][0] == "worker" and not any(a.startswith("--mode=") for a in container["args"])
    assert container["args"][-1:] == ["--enforce-eager"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["automountServiceAccountToken"] is False  # no service account named: no token in the pod
    # The supervisor's endpoints, on the port after the engine's; no startup probe to hold readiness back.
    readiness, liveness = container["readinessProbe"], container["livenessProbe"]
    assert readiness["httpGet"] == {"path": f"/ready?wait={workers.READY_PROBE_WAIT}", "port": "probe"}
    assert readiness["periodSeconds"] < workers.READY_PROBE_WAIT < readiness["timeoutSeconds"]
    assert liveness["httpGet"] == {"path": "/live", "port": "probe"} and "startupProbe" not in container
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert container["ports"][0]["name"] == "http" and ports["probe"] == ports["http"] + 1
    assert container["args"][1:3] == [
        f"--probe-port={ports['probe']}",
        f"--start-timeout={workers.START_TIMEOUT_SECONDS}",
    ]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["WARMSTART_CONTROL_DIR"] == "/run/warmstart/control"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["control"] == "/run/warmstart/control"
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["control"] == {"name": "control", "emptyDir": {}}
    # The snapshot store is the node agent's alone: a worker never sees other engines' snapshots.
    assert "store" not in volumes and L.STORE_MOUNT_PATH not in mounts.values()
    assert "WARMSTART_STORE" not in env
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_restore_deployment_names_the_snapshot():
    owner, spec = owner_and_spec()
    dep = children.deployment(owner, spec, L.ROLE_RESTORE, "qwen-abababab", HASH)
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels[L.ROLE_LABEL] == "restore" and labels[L.SNAPSHOT_LABEL] == "qwen-abababab"
    assert labels[L.REQUEST_KEY_LABEL] == HASH[: L.REQUEST_KEY_LABEL_LENGTH]
    assert "affinity" not in dep["spec"]["template"]["spec"]  # no node named: the scheduler is free
    container = container_of(dep["spec"]["template"]["spec"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["WARMSTART_SNAPSHOT"] == "qwen-abababab" and "--mode=restore" in container["args"]


def test_restore_pods_prefer_the_node_holding_their_snapshot_beside_the_endpoints_own_scheduling():
    owner, spec = owner_and_spec(template={"nodeSelector": {"pool": "h200"}})
    dep = children.deployment(owner, spec, L.ROLE_RESTORE, "qwen-ab", HASH, node="gpu-3")
    pod = dep["spec"]["template"]["spec"]
    assert preferred_node(pod) == "gpu-3"
    node_affinity = pod["affinity"]["nodeAffinity"]
    assert list(node_affinity) == ["preferredDuringSchedulingIgnoredDuringExecution"]  # never required
    assert pod["nodeSelector"] == {"pool": "h200"}  # the endpoint's own placement still holds
    capture = children.capture_pod(owner, "qwen", spec, 1, HASH)["spec"]
    assert "affinity" not in capture  # a capture may run on any node


@pytest.mark.parametrize(
    ("overrides", "device"),
    [
        ({}, "cuda"),
        (
            {
                "model": {"uri": "qwen3-0.6b"},
                "engine": {"kind": "builtin", "image": "w:1", "args": ["--max-num-seqs", "8", "--compile"]},
                "resources": {"gpus": 0},
            },
            "cpu",
        ),
        (
            {"engine": {"kind": "vllm", "image": "w", "dtype": "bfloat16", "args": ["--engine-arg", "a=1"]}},
            "cuda",
        ),
    ],
)
def test_every_worker_the_operator_starts_parses_with_the_worker_cli(overrides, device):
    """The pods' args are what `warmstart worker` accepts: its own parser reads them, for every role."""
    from warmstart.cli import build_parser

    owner, spec = owner_and_spec(**overrides)
    snapshot = snapshot_object("qwen-ab", HASH, "Pending", "2026-11-30T00:00:00Z")
    snapshot_owner = children.Owner.from_body(snapshot)
    pods = [
        children.deployment(owner, spec, role, "qwen-ab", HASH)["spec"]["template"]["spec"]
        for role in (L.ROLE_COLD, L.ROLE_RESTORE)
    ] + [children.capture_pod(snapshot_owner, owner.name, spec, 1, HASH)["spec"]]
    for pod in pods:
        container = container_of(pod)
        assert container["command"] == ["warmstart"]
        args = build_parser().parse_args(container["args"])
        assert args.host == "0.0.0.0" and args.port == spec.engine.port  # reachable on the pod's IP
        assert args.device == device and args.engine == spec.engine.kind and args.model == spec.model.uri


def test_overrides_reach_the_pod():
    owner, spec = owner_and_spec(
        template={
            "nodeSelector": {"pool": "h200"},
            "env": [{"name": "WARMSTART_ROLE", "value": "x"}],
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "serviceAccountName": "model-reader",
        },
        resources={"gpus": 2, "gpuProduct": "NVIDIA-H200", "memory": "64Gi"},
        snapshot={"enabled": False},
    )
    pod = children.deployment(owner, spec, L.ROLE_COLD, "", HASH)["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "h200", "nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["serviceAccountName"] == "model-reader" and "automountServiceAccountToken" not in pod
    assert {"key": "dedicated", "operator": "Exists"} in pod["tolerations"]
    container = container_of(pod)
    roles = [e["value"] for e in container["env"] if e["name"] == "WARMSTART_ROLE"]
    assert roles == ["x"]  # the override replaces, never duplicates
    assert "store" not in {v["name"] for v in pod["volumes"]}
    assert container["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 2}


def test_extra_volumes_reach_worker_and_capture_pods_beside_the_operators():
    cache = {"name": "cache", "hostPath": {"path": "/srv/models", "type": "Directory"}}
    mount = {"name": "cache", "mountPath": "/models", "readOnly": True}
    owner, spec = owner_and_spec(template={"volumes": [cache], "volumeMounts": [mount]})
    for pod in (
        children.deployment(owner, spec, L.ROLE_COLD, "", HASH)["spec"]["template"]["spec"],
        children.capture_pod(owner, "qwen", spec, 1, HASH)["spec"],
    ):
        assert [v["name"] for v in pod["volumes"]] == ["control", "shm", "cache"]
        assert pod["volumes"][-1] == cache
        assert container_of(pod)["volumeMounts"][-1] == mount


def test_capture_pod_is_owned_by_the_snapshot_and_not_served():
    _, spec = owner_and_spec()
    snap = children.Owner(L.API_VERSION, L.SNAPSHOT_KIND, "qwen-ab", "ml", "snap-uid")
    pod = children.capture_pod(snap, "qwen", spec, 2, HASH)
    assert pod["metadata"]["name"] == "qwen-ab-capture-2"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "snap-uid"
    labels = pod["metadata"]["labels"]
    assert labels[L.ROLE_LABEL] == "capture" and labels[L.SNAPSHOT_LABEL] == "qwen-ab"
    service = children.service(*owner_and_spec())
    assert not set(service["spec"]["selector"].items()) <= set(labels.items())
    assert pod["spec"]["restartPolicy"] == "Never"
    (container,) = pod["spec"]["containers"]  # probes would fail while it is checkpointed, each a Warning
    assert "readinessProbe" not in container and "livenessProbe" not in container


def test_hpa_pods_and_external_metrics():
    scaling = {
        "mode": "hpa",
        "minReplicas": 1,
        "maxReplicas": 6,
        "metric": {"name": "vllm:num_requests_waiting", "target": "4"},
    }
    hpa = children.horizontal_pod_autoscaler(*owner_and_spec(autoscaling=scaling))
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": L.API_VERSION,
        "kind": L.ENDPOINT_KIND,
        "name": "qwen",
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["target"] == {
        "type": "AverageValue",
        "averageValue": "4",
    }
    scaling["metric"]["source"] = "External"
    (metric,) = children.horizontal_pod_autoscaler(*owner_and_spec(autoscaling=scaling))["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"]["selector"] == {"matchLabels": {L.ENDPOINT_LABEL: "qwen"}}


def test_scaled_object_builds_the_default_query_over_the_endpoints_pods():
    scaling = {
        "mode": "keda",
        "minReplicas": 1,
        "maxReplicas": 3,
        "metric": {"name": "vllm:num_requests_waiting", "target": 2},
    }
    so = children.scaled_object(*owner_and_spec(autoscaling=scaling))
    assert so["spec"]["minReplicaCount"] == 1 and so["spec"]["maxReplicaCount"] == 3
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["threshold"] == "2"
    assert trigger["metadata"]["query"] == 'sum(vllm:num_requests_waiting{namespace="ml",service="qwen"})'


def test_scale_to_zero_with_keda_takes_the_query_given_and_cooldown_sets_both_scale_down_windows():
    query = 'sum(rate(gateway_requests_total{route="qwen"}[1m]))'
    scaling = {
        "mode": "keda",
        "minReplicas": 0,
        "cooldownSeconds": 45,
        "metric": {"name": "requests", "target": "5", "query": query},
    }
    so = children.scaled_object(*owner_and_spec(autoscaling=scaling))
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["cooldownPeriod"] == 45
    assert so["spec"]["triggers"][0]["metadata"]["query"] == query
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior == {"scaleDown": {"stabilizationWindowSeconds": 45}}


def test_hpa_removes_replicas_after_the_cooldown():
    scaling = {"mode": "hpa", "cooldownSeconds": 20, "metric": {"name": "m", "target": "1"}}
    hpa = children.horizontal_pod_autoscaler(*owner_and_spec(autoscaling=scaling))
    assert hpa["spec"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": 20}}


def test_http_scaled_object_routes_the_default_host_to_the_service():
    owner, spec = owner_and_spec(service={"port": 8080}, autoscaling={"mode": "http", "minReplicas": 0})
    httpso = children.http_scaled_object(owner, spec)
    service = children.service(owner, spec)
    assert httpso["apiVersion"] == "http.keda.sh/v1alpha1" and httpso["kind"] == "HTTPScaledObject"
    assert httpso["metadata"]["ownerReferences"][0]["uid"] == UID
    assert httpso["metadata"]["labels"][L.ENDPOINT_LABEL] == "qwen"
    assert httpso["spec"] == {
        "hosts": ["qwen.ml"],
        "scaleTargetRef": {
            "apiVersion": L.API_VERSION,
            "kind": L.ENDPOINT_KIND,
            "name": "qwen",
            "service": service["metadata"]["name"],
            "port": service["spec"]["ports"][0]["port"],
        },
        "replicas": {"min": 0, "max": 4},
        "scaledownPeriod": 300,
        "scalingMetric": {"concurrency": {"targetValue": 1}},
        "timeouts": {"conditionWait": "120s", "responseHeader": "600s"},
    }
    assert service["spec"]["ports"][0]["port"] == 8080


def test_http_scaled_object_takes_the_spec_settings():
    scaling = {
        "mode": "http",
        "minReplicas": 1,
        "maxReplicas": 6,
        "cooldownSeconds": 900,
        "http": {
            "hosts": ["qwen.example.com", "*.qwen.example.com"],
            "pathPrefixes": ["/v1/"],
            "targetConcurrency": 16,
            "coldStartTimeoutSeconds": 45,
            "responseTimeoutSeconds": 1200,
        },
    }
    spec = children.http_scaled_object(*owner_and_spec(autoscaling=scaling))["spec"]
    assert spec["hosts"] == ["qwen.example.com", "*.qwen.example.com"] and spec["pathPrefixes"] == ["/v1/"]
    assert spec["replicas"] == {"min": 1, "max": 6} and spec["scaledownPeriod"] == 900
    assert spec["scalingMetric"] == {"concurrency": {"targetValue": 16}}
    assert spec["timeouts"] == {"conditionWait": "45s", "responseHeader": "1200s"}


KEDA = {"mode": "keda", "metric": {"name": "warmstart_worker_requests_waiting", "target": "2"}}


@pytest.mark.parametrize(
    ("autoscaling", "previous", "deleted"),
    [
        ({"mode": "http"}, ["Deployment", "Service", "ScaledObject"], ["ScaledObject"]),  # ours, from keda
        (
            {"mode": "http"},
            None,
            ["HorizontalPodAutoscaler", "ServiceMonitor", "DaemonSet"],
        ),  # its ScaledObject: the add-on's
        ({"mode": "http"}, ["Deployment", "Service", "HTTPScaledObject"], []),
        (KEDA, ["Deployment", "Service", "HTTPScaledObject"], ["HTTPScaledObject"]),
        (KEDA, None, ["HorizontalPodAutoscaler", "HTTPScaledObject", "ServiceMonitor", "DaemonSet"]),
        (
            {"mode": "none"},
            None,
            ["HorizontalPodAutoscaler", "ScaledObject", "HTTPScaledObject", "ServiceMonitor", "DaemonSet"],
        ),
    ],
)
def test_unwanted_autoscalers_are_deleted_but_not_the_add_ons_scaled_object(autoscaling, previous, deleted):
    _, spec = owner_and_spec(autoscaling=autoscaling)
    assert unwanted_children(spec, previous) == deleted


def test_service_and_monitor_select_the_workers():
    owner, spec = owner_and_spec(monitoring={"serviceMonitor": True})
    service = children.service(owner, spec)
    assert service["spec"]["selector"] == children.worker_selector("qwen")
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    monitor = children.service_monitor(owner, spec)
    assert set(monitor["spec"]["selector"]["matchLabels"].items()) <= set(
        service["metadata"]["labels"].items()
    )
    assert (
        children.selector_string("qwen") == "app.kubernetes.io/component=worker,warmstart.dev/endpoint=qwen"
    )


def test_the_service_monitor_carries_the_labels_a_prometheus_selects_beside_the_operators():
    labels = {"release": "kube-prometheus-stack", L.ENDPOINT_LABEL: "other"}
    owner, spec = owner_and_spec(monitoring={"serviceMonitor": True, "labels": labels})
    monitor = children.service_monitor(owner, spec)
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["labels"][L.ENDPOINT_LABEL] == "qwen"


PRESTAGED = {"enabled": True, "prestage": "PageCache"}


def test_the_model_stager_runs_where_the_workers_may_with_their_volumes_and_no_gpu():
    template = {
        "nodeSelector": {"pool": "h200"},
        "volumes": [{"name": "models", "hostPath": {"path": "/models"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models"}],
        "env": [{"name": "HF_HOME", "value": "/models/hf"}],
    }
    owner, spec = owner_and_spec(snapshot=PRESTAGED, template=template)
    daemonset = children.prestage_daemonset(owner, spec)
    assert daemonset["kind"] == "DaemonSet" and daemonset["metadata"]["name"] == "qwen"
    pod = daemonset["spec"]["template"]["spec"]
    container = container_of(pod)
    args = container["args"]
    assert args[0] == "prestage-weights" and not any(arg.startswith("--mode=") for arg in args)
    assert "--model=Qwen/Qwen3-0.6B" in args
    assert "nvidia.com/gpu" not in str(container["resources"]) and "limits" not in container["resources"]
    assert pod["nodeSelector"] == {"pool": "h200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["volumes"] == template["volumes"] and container["volumeMounts"] == template["volumeMounts"]
    assert container["env"] == template["env"]
    labels = daemonset["spec"]["template"]["metadata"]["labels"]
    # Neither a worker (Deployment, Service, scale subresource) nor a pod the node agent acts on.
    assert not set(children.worker_selector("qwen").items()) <= set(labels.items())
    assert daemonset["spec"]["selector"]["matchLabels"][L.COMPONENT_LABEL] == L.PRESTAGE_COMPONENT


@pytest.mark.parametrize(
    ("snapshot", "wanted"),
    [
        (PRESTAGED, True),
        ({"enabled": True}, False),
        ({"enabled": False, "prestage": "PageCache"}, False),
    ],
)
def test_the_model_stager_exists_only_for_prestage_page_cache(snapshot, wanted):
    from warmstart.operator.reconcile import optional_children

    _, spec = owner_and_spec(snapshot=snapshot)
    assert ("DaemonSet" in optional_children(spec)) is wanted
