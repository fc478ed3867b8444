"""README's Kubernetes section run verbatim on the real node, as a new user runs it: `helm install` with the
release and namespace it names, the chart's NOTES snippet and every example applied, each Ready or saying
why within a minute; then what a user does next to a serving endpoint (its model files changed in place, the
agent killed mid-restore), and README's removal: everything gone within a bound, nothing stuck.

The real node stands alone for it: the kwok nodes are cordoned and the real node's test taint lifted, so the
chart's pods land where they would on a one-node cluster (restored afterwards for the rest of the suite).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from control_plane import network
from control_plane.cluster import ControlPlane, ControlPlaneError, wait_for
from control_plane.node import RealNode
from endpoint_flow import (
    Answer,
    agent_cgroups,
    client_pod,
    events_of,
    get,
    items,
    kill_agent,
    ready,
    restore_claims,
    timed_completion,
)
from operator_process import OperatorProcess

from warmstart.api import labels as L

pytestmark = [pytest.mark.integration, pytest.mark.spawns]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
EXPLAINED_WITHIN = 60.0  # seconds for an example to be Ready or to say why not
REMOVED_WITHIN = 120.0
START_TIMEOUT = 300.0
NAMESPACE = "default"  # where README's `kubectl apply` puts the examples
# What each example shows on a node with 2 CPUs and no GPU: Ready, or the true reason in its Ready condition.
EXPECTED = {
    "builtin-cpu.yaml": ("True", r"ReplicasReady"),
    "builtin-cpu-cold.yaml": ("True", r"ReplicasReady"),
    # No GPU node: the examples select NVIDIA-H200 nodes, which the scheduler names before their GPU.
    "qwen3-8b-hpa.yaml": ("False", r"Unschedulable: .*(nvidia\.com/gpu|node affinity/selector)"),
    "qwen3-8b-vllm-tools.yaml": ("False", r"Unschedulable: .*(nvidia\.com/gpu|node affinity/selector)"),
    "qwen3-0.6b-scale-to-zero.yaml": ("False", r"ScaledToZero|MissingAPI: .*HTTPScaledObject"),
}


def readme_commands(after: str) -> list[str]:
    """The commands of README's first bash block after the line `after` (comments dropped)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(re.escape(after) + r".*?```bash\n(.*?)```", text, re.S)
    assert block is not None, f"README has no bash block after {after!r}"
    lines = [line.split("  #")[0].split(" # ")[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line]


def shell(kube: ControlPlane, command: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`command` as a user types it, from the repository root, with this cluster's kubectl and helm."""
    env = {**kube.tool_env(), "PATH": f"{kube.bin_dir}:{kube.tool_env()['PATH']}"}
    return subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.fixture
def one_node_cluster(kube: ControlPlane, real_node: RealNode) -> Iterator[RealNode]:
    """The real node as a cluster's only schedulable node."""
    kube.kubectl("cordon", "-l", "type=kwok")
    taint = f"{network.REAL_NODE_LABEL}=true:NoSchedule"
    kube.kubectl("taint", "node", real_node.name, f"{taint}-")
    try:
        yield real_node
    finally:
        kube.kubectl("taint", "node", real_node.name, taint, "--overwrite", check=False)
        kube.kubectl("uncordon", "-l", "type=kwok", check=False)


def ready_condition(kube: ControlPlane, name: str) -> tuple[str, str] | None:
    """(status, "reason: message") of an endpoint's Ready condition; None before there is one."""
    endpoint = get(kube, "iep", NAMESPACE, name) or {}
    condition = next((c for c in endpoint.get("status", {}).get("conditions") or [] if c["type"] == "Ready"),
                     None)  # fmt: skip
    return (condition["status"], f"{condition['reason']}: {condition['message']}") if condition else None


def test_readme_install_examples_and_removal_on_a_one_node_cluster(
    kube: ControlPlane, one_node_cluster: RealNode, chart_image: str, tmp_path: Path
) -> None:
    node = one_node_cluster
    install, apply_example, watch = readme_commands("## Kubernetes")
    installed = shell(kube, install)
    assert installed.returncode == 0, installed.stderr
    wait_for(lambda: chart_ready(kube, node), timeout=START_TIMEOUT, interval=1,
             message="the operator and the agent Ready on the node")  # fmt: skip

    snippet = re.search(r"kubectl apply -f - <<YAML\n(.*?)\n\s*YAML", installed.stdout, re.S)
    assert snippet is not None, installed.stdout
    applied = shell(kube, f"kubectl apply -f - <<'YAML'\n{snippet.group(1)}\nYAML")
    assert applied.returncode == 0, applied.stderr
    assert shell(kube, apply_example).returncode == 0
    for example in EXAMPLES:
        assert shell(kube, f"kubectl apply -f examples/{example.name}").returncode == 0, example.name
    for example in EXAMPLES:
        expected_status, expected_reason = EXPECTED[example.name]
        name = yaml.safe_load(example.read_text())["metadata"]["name"]

        def explained(name: str = name, status: str = expected_status, reason: str = expected_reason) -> bool:
            found = ready_condition(kube, name)
            return found is not None and found[0] == status and re.search(reason, found[1]) is not None

        wait_for(explained, timeout=EXPLAINED_WITHIN * 3, interval=1,
                 message=f"{example.name}: Ready {expected_status} with {expected_reason!r}, "
                         f"found {ready_condition(kube, name)}")  # fmt: skip
    watched = shell(kube, watch, timeout=30)
    assert watched.returncode == 0, watched.stderr
    assert "tiny" in watched.stdout and "inferencesnapshot" in watched.stdout, watched.stdout

    agent_killed_mid_restore(kube, node)
    model_changed_under_a_ready_snapshot(kube, node, chart_image, tmp_path)  # last: no restore matches after

    for command in readme_commands("Removing it:"):
        removed = shell(kube, command, timeout=REMOVED_WITHIN)
        assert removed.returncode == 0, (command, removed.stderr)
    left = left_after_removal(kube, REMOVED_WITHIN)
    assert not left, f"{REMOVED_WITHIN:.0f} s after README's removal, left: {left}"
    deleted = shell(kube, "kubectl delete namespace warmstart --timeout=120s", timeout=REMOVED_WITHIN + 10)
    assert deleted.returncode == 0, deleted.stderr
    crds = [name.rpartition("/")[2] for name in kube.kubectl("get", "crd", "-o", "name").stdout.split()]
    assert not [name for name in crds if name.partition(".")[2] == L.GROUP], crds


# Every kind the operator makes for an endpoint, and what those make in turn (all labelled with its name).
ENDPOINT_KINDS = (
    "deployments,replicasets,daemonsets,pods,services,horizontalpodautoscalers,"
    "servicemonitors.monitoring.coreos.com,scaledobjects.keda.sh,httpscaledobjects.http.keda.sh"
)


def lingering(kube: ControlPlane) -> list[str]:
    """What is left of the endpoints (terminating objects included) and of the chart's pods, one
    `kind/namespace/name: state, owners` each; empty when nothing is."""
    result = kube.kubectl("get", ENDPOINT_KINDS, "-A", "-l", L.ENDPOINT_LABEL, "-o", "json")
    return [describe(found) for found in json.loads(result.stdout)["items"] + chart_pods(kube)]


def describe(found: dict[str, Any]) -> str:
    meta, status = found["metadata"], found.get("status") or {}
    if found["kind"] == "Pod":
        state = f"{status.get('phase')} on {found['spec'].get('nodeName') or 'no node'}"
    elif "replicas" in (found.get("spec") or {}):
        state = f"{status.get('readyReplicas', 0)}/{found['spec']['replicas']} ready"
    else:
        state = "present"
    if meta.get("deletionTimestamp"):
        state += f", deleting since {meta['deletionTimestamp']} (finalizers {meta.get('finalizers') or []})"
    owners = [f"{ref['kind']}/{ref['name']}" for ref in meta.get("ownerReferences") or []]
    return f"{found['kind']}/{meta['namespace']}/{meta['name']}: {state}, owned by {owners or 'nothing'}"


def left_after_removal(kube: ControlPlane, within: float) -> list[str]:
    """What still lingers `within` seconds from now (empty as soon as nothing does)."""
    try:
        wait_for(lambda: not lingering(kube), timeout=within, interval=1, message="nothing left")
    except TimeoutError:
        return lingering(kube)
    return []


# Each round's `kubectl delete iep --cascade=foreground` waits for the garbage collector to find the CRDs the
# round's install made again (its discovery runs every 30 s): the rounds land at different points of it.
REMOVAL_ROUNDS = 5
LEFT_WITHIN = 60.0  # seconds for everything to be gone after README's removal on kwok nodes
CRDS = ROOT / "charts" / "warmstart" / "crds"


@pytest.mark.timeout(REMOVAL_ROUNDS * 240)
def test_readme_removal_leaves_nothing_round_after_round(kube: ControlPlane, tmp_path: Path) -> None:
    """README's install, its examples served, then README's removal, verbatim, five times on the kwok nodes
    (where pods run no container, so a round takes seconds): each time nothing of the endpoints is left,
    whatever the garbage collector's timing. The operator runs from this machine (the chart's own pods run
    nothing on kwok nodes) and stops before the removal, as `helm uninstall` stops it."""
    install = readme_commands("## Kubernetes")[0]
    removal = readme_commands("Removing it:")
    names = [yaml.safe_load(example.read_text())["metadata"]["name"] for example in EXAMPLES]
    rounds: list[str] = []
    try:
        for round_number in range(1, REMOVAL_ROUNDS + 1):
            took: list[str] = []
            with timed_step(took, "served"):
                serve_examples(kube, install, names, tmp_path / f"operator-{round_number}.log")
            for command in removal:
                with timed_step(took, " ".join(command.split()[:3])):
                    removed = shell(kube, command, timeout=REMOVED_WITHIN)
                assert removed.returncode == 0, (round_number, command, removed.stderr)
            with timed_step(took, "gone"):
                left = left_after_removal(kube, LEFT_WITHIN)
            outcome = "left " + "; ".join(left) if left else "nothing left"
            rounds.append(f"round {round_number}: {outcome} ({', '.join(took)})")
            if left:  # the next round starts clean
                kube.kubectl("delete", ENDPOINT_KINDS, "-A", "-l", L.ENDPOINT_LABEL, "--wait=false")
                wait_for(lambda: not lingering(kube), timeout=LEFT_WITHIN, interval=1,
                         message="the leftovers deleted by hand gone")  # fmt: skip
    finally:
        print("\n".join(rounds))
        # As the rest of the session expects: the CRDs installed, no release, no examples.
        shell(kube, "helm uninstall warmstart -n warmstart --ignore-not-found")
        kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
        kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRDS))
        kube.kubectl("delete", "iep", "--all", "-A", "--cascade=foreground", "--timeout=60s", check=False)
        kube.kubectl("delete", "namespace", "warmstart", "--ignore-not-found", "--timeout=120s", check=False)
    failed = [line for line in rounds if "nothing left" not in line]
    assert not failed, f"{len(failed)} of {len(rounds)} rounds left something:\n" + "\n".join(failed)


@contextlib.contextmanager
def timed_step(took: list[str], step: str) -> Iterator[None]:
    started = time.monotonic()
    yield
    took.append(f"{step} {time.monotonic() - started:.1f}s")


def serve_examples(kube: ControlPlane, install: str, names: list[str], log: Path) -> None:
    """README's `helm install`, every example applied and the operator's Deployments and workers made."""
    installed = shell(kube, install)
    assert installed.returncode == 0, installed.stderr
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRDS))
    operator = OperatorProcess(kube.kubeconfig, log, env={"WARMSTART_OPERATOR_RESYNC_SECONDS": "2"})
    operator.start()
    try:
        for example in EXAMPLES:
            assert shell(kube, f"kubectl apply -f examples/{example.name}").returncode == 0, example.name

        def made() -> bool:
            deployed = {d["metadata"]["name"] for d in items(kube, "deployment", NAMESPACE, L.ENDPOINT_LABEL)}
            pods = items(kube, "pod", NAMESPACE, L.ENDPOINT_LABEL)
            serving = {p["metadata"]["labels"][L.ENDPOINT_LABEL] for p in pods}
            return deployed >= set(names) and len(serving) >= len(names) - 1  # one example scales to zero

        wait_for(made, timeout=START_TIMEOUT, interval=1, message=f"Deployments and workers of {names}")
    finally:
        operator.stop()


def chart_pods(kube: ControlPlane) -> list[dict[str, Any]]:
    return [p for p in items(kube, "pod", "warmstart", "app.kubernetes.io/name=warmstart")
            if "deletionTimestamp" not in p["metadata"]]  # fmt: skip


def chart_ready(kube: ControlPlane, node: RealNode) -> bool:
    """The operator and the real node's agent Ready (the agent DaemonSet also covers the cordoned kwok nodes,
    whose pods run nothing)."""
    on_node = [p for p in chart_pods(kube) if p["spec"].get("nodeName") == node.name]
    components = {p["metadata"]["labels"].get("app.kubernetes.io/component") for p in on_node if ready(p)}
    return components == {"operator", "agent"}


def tiny_replicas(kube: ControlPlane, role: str) -> list[dict[str, Any]]:
    return [p for p in items(kube, "pod", NAMESPACE, f"{L.ENDPOINT_LABEL}=tiny,{L.ROLE_LABEL}={role}")
            if "deletionTimestamp" not in p["metadata"]]  # fmt: skip


def model_changed_under_a_ready_snapshot(
    kube: ControlPlane, node: RealNode, chart_image: str, tmp_path: Path
) -> None:
    """The model's weights overwritten in place under a Ready snapshot: the next replica is refused before
    CRIU (the Event names the model), starts cold and answers as a cold replica of the new weights does.
    (Two CPUs hold four of the examples' replicas: tiny-cold steps aside while tiny grows.)"""
    from warmstart.engines.builtin.model_dir import WEIGHTS_FILE, ensure_model

    kube.kubectl("apply", "-f", "-", input=client_pod(NAMESPACE, chart_image, node))
    scale_and_wait_gone(kube, "tiny-cold")
    models = node.shadow("/var/cache/warmstart") / "models" / "tiny-0"
    other = ensure_model(tmp_path / "tiny-1", "tiny", seed=1)
    shutil.copyfile(other / WEIGHTS_FILE, models / WEIGHTS_FILE)
    before = {p["metadata"]["name"] for p in tiny_replicas(kube, L.ROLE_RESTORE)}
    kube.kubectl("scale", "iep/tiny", "-n", NAMESPACE, f"--replicas={len(before) + 1}")

    def new_replica() -> dict[str, Any] | None:
        fresh = [p for p in tiny_replicas(kube, L.ROLE_RESTORE) if p["metadata"]["name"] not in before]
        return fresh[0] if fresh and ready(fresh[0]) else None

    pod = wait_for(new_replica, timeout=START_TIMEOUT, interval=1, message="tiny's new replica Ready")
    refused = [e["message"] for e in events_of(kube, NAMESPACE, pod["metadata"]["name"])
               if e["reason"] == "RestoreRefused"]  # fmt: skip
    assert refused and "model" in refused[0] and WEIGHTS_FILE in refused[0], refused
    answer = timed_completion(kube, NAMESPACE, f"http://{pod['status']['podIP']}:8000/v1/completions")[0]
    # The reference: a cold replica of the changed files (tiny-cold maps the same model directory).
    kube.kubectl("scale", "iep/tiny", "-n", NAMESPACE, "--replicas=1")
    kube.kubectl("scale", "iep/tiny-cold", "-n", NAMESPACE, "--replicas=1")
    url = f"http://{get(kube, 'service', NAMESPACE, 'tiny-cold')['spec']['clusterIP']}/v1/completions"
    expected = wait_for(lambda: completion_or_none(kube, url), timeout=START_TIMEOUT, interval=1,
                        message="a cold replica of the changed model answering")  # fmt: skip
    assert answer == expected and answer


def scale_and_wait_gone(kube: ControlPlane, name: str) -> None:
    """Scale an endpoint to zero and wait until none of its pods is left, terminating ones included."""
    kube.kubectl("scale", f"iep/{name}", "-n", NAMESPACE, "--replicas=0")
    wait_for(lambda: not items(kube, "pod", NAMESPACE, f"{L.ENDPOINT_LABEL}={name}"), timeout=START_TIMEOUT,
             interval=1, message=f"{name}'s pods gone")  # fmt: skip


def completion_or_none(kube: ControlPlane, url: str) -> Answer | None:
    """A completion, None while the replica behind `url` cannot answer yet."""
    try:
        return timed_completion(kube, NAMESPACE, url)[0]
    except (ConnectionError, ControlPlaneError):
        return None


def wait_restored(kube: ControlPlane) -> None:
    """tiny's snapshot is Ready and its replicas are restore pods, all serving."""

    def restored() -> bool:
        replicas = tiny_replicas(kube, L.ROLE_RESTORE)
        return bool(replicas) and all(ready(p) for p in replicas)

    wait_for(restored, timeout=START_TIMEOUT, interval=1, message="tiny's replica restored")


def agent_killed_mid_restore(kube: ControlPlane, node: RealNode) -> None:
    """The agent SIGKILLed while it restores a replica: after it starts again, its work directory is gone
    from the store and the replica serves (started cold)."""
    wait_restored(kube)
    cgroups = agent_cgroups(kube, "warmstart", node)
    earlier = restore_claims(node)
    kube.kubectl("scale", "iep/tiny", "-n", NAMESPACE, "--replicas=2")
    wait_for(lambda: restore_claims(node) - earlier, timeout=START_TIMEOUT, interval=0.002,
             message="a new restore holding its pod's claim")  # fmt: skip
    kill_agent(cgroups)
    work = node.shadow("/var/lib/warmstart") / "store" / "agent-work" / node.name
    assert any(work.glob("*")), f"the killed restore left its work directory in {work}"
    wait_for(lambda: chart_ready(kube, node) and not any(work.glob("*")),
             timeout=START_TIMEOUT, interval=0.5, message=f"the agent back and {work} empty")  # fmt: skip
    wait_for(lambda: len([p for p in tiny_replicas(kube, L.ROLE_RESTORE) if ready(p)]) == 2,
             timeout=START_TIMEOUT, interval=1, message="two tiny replicas Ready")  # fmt: skip
    agents = [p for p in items(kube, "pod", "warmstart", "app.kubernetes.io/component=agent")
              if p["spec"].get("nodeName") == node.name]  # fmt: skip
    assert agents[0]["status"]["containerStatuses"][0]["restartCount"] >= 1, json.dumps(agents[0]["status"])
