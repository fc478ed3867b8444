"""A worker's engine checkpointed out of one real pod's container and restored into another's, with real
CRIU: the capture and restore code the agent runs, here run from the host (the test process is root)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from control_plane.cluster import ControlPlane, wait_for
from control_plane.node import RealNode
from endpoint_flow import COMPLETE
from node_plugin import HostPython

from warmstart.agent.pods import PodSandbox, pod_processes
from warmstart.api import labels as L
from warmstart.api.control_dir import READY_FOR_SNAPSHOT, ControlDir
from warmstart.checkpoint.capture import CaptureOptions, capture, identity_from_payload
from warmstart.checkpoint.criu import Criu, cgroup_dirs
from warmstart.checkpoint.restore import restore
from warmstart.snapshot.signing import generate_hmac_key, load_signer, load_verifier
from warmstart.snapshot.store import SnapshotStore

pytestmark = pytest.mark.spawns

PORT = 8000
START_TIMEOUT = 240.0
REPO = Path(__file__).resolve().parents[2]


def portable_criu() -> list[str]:
    """CRIU as a folder of its own (loader, libraries, program): what can run inside a container's mount
    namespace through descriptors of that folder."""
    try:
        printed = subprocess.run(
            [str(REPO / "hack" / "criu-setup"), "--print"], capture_output=True, text=True, timeout=120
        )
    except OSError as exc:
        pytest.skip(f"no CRIU: {exc}")
    command = printed.stdout.split()
    if printed.returncode != 0 or not command or not command[0].endswith("ld-linux-x86-64.so.2"):
        pytest.skip(f"no portable CRIU folder (hack/criu-setup --print: {printed.stdout.strip()!r})")
    return command


def worker_pod(
    name: str, mode: str, image: str, node: RealNode, host_python: HostPython, model_dir: Path
) -> dict[str, Any]:
    command = [
        host_python.python, "-m", "warmstart", "worker", "--mode", mode, "--engine", "builtin",
        "--model", "tiny", "--model-dir", str(model_dir), "--device", "cpu", "--host", "0.0.0.0",
        "--port", str(PORT), "--control-dir", L.CONTROL_DIR_PATH,
    ]  # fmt: skip
    container = {
        "name": "worker",
        "image": image,
        "imagePullPolicy": "Never",
        "command": command,
        "env": [
            {"name": "WARMSTART_RESTORE_TIMEOUT", "value": "600"},
            {"name": "OMP_NUM_THREADS", "value": "1"},
        ],
        "volumeMounts": [
            *host_python.volume_mounts,
            {"name": "control", "mountPath": L.CONTROL_DIR_PATH},
            {"name": "model", "mountPath": str(model_dir)},
        ],
    }
    volumes = [
        *host_python.volumes,
        {"name": "control", "emptyDir": {}},
        {"name": "model", "hostPath": {"path": str(model_dir), "type": "Directory"}},
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            **node.pod_placement(),
            "terminationGracePeriodSeconds": 1,
            "restartPolicy": "Never",
            "containers": [container],
            "volumes": volumes,
        },
    }


def running(kube: ControlPlane, namespace: str, name: str) -> dict[str, Any] | None:
    pod = json.loads(kube.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)
    statuses = pod["status"].get("containerStatuses") or []
    if pod["status"].get("podIP") and statuses and "running" in statuses[0]["state"]:
        return pod
    assert pod["status"].get("phase") not in ("Failed", "Succeeded"), pod["status"]
    return None


def complete(node: RealNode, pod_ip: str, prompt: str) -> dict[str, Any]:
    assert node.record is not None
    inside = ["nsenter", f"--target={node.record.holder_pid}", "--net", "--"]
    url = f"http://{pod_ip}:{PORT}/v1/completions"

    def answer() -> str | None:
        result = subprocess.run(
            [*inside, sys.executable, "-c", COMPLETE, url, prompt, "", "30"], capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        return result.stdout if result.returncode == 0 else None

    reply = wait_for(answer, timeout=120, interval=1.0, message=f"a completion from {url}")
    return json.loads(reply)["answer"]


@pytest.mark.integration
def test_engine_moves_from_one_real_pod_into_another(
    kube: ControlPlane,
    real_node: RealNode,
    chart_image: str,
    host_python: HostPython,
    namespace: str,
    tmp_path: Path,
) -> None:
    criu = Criu(portable_criu(), timeout=300)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    kubelet_root = real_node.shadow("/var/lib/kubelet")
    source_spec = worker_pod("source", "capture", chart_image, real_node, host_python, model_dir)
    target_spec = worker_pod("placeholder", "restore", chart_image, real_node, host_python, model_dir)
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(source_spec))
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(target_spec))
    source = wait_for(lambda: running(kube, namespace, "source"), timeout=START_TIMEOUT, interval=0.5,
                      message="the source pod running")  # fmt: skip
    target = wait_for(lambda: running(kube, namespace, "placeholder"), timeout=START_TIMEOUT, interval=0.5,
                      message="the placeholder pod running")  # fmt: skip

    # Pod -> container -> processes by cgroup: the container id the runtime reports.
    source_cid = source["status"]["containerStatuses"][0]["containerID"]
    source_pod = PodSandbox.find(source["metadata"]["uid"], kubelet_root, timeout=60, container=source_cid)
    assert source_pod.whole_container
    assert source_pod.init_pid in pod_processes(source["metadata"]["uid"], container=source_cid)

    control = ControlDir(source_pod.host_dir)
    try:
        ready = wait_for(lambda: control.read(READY_FOR_SNAPSHOT), timeout=150, interval=0.5,
                         message="the source worker's ready-for-snapshot")  # fmt: skip
    except TimeoutError:
        supervisor = kube.kubectl("logs", "-n", namespace, "source", check=False).stdout[-3000:]
        engine_log = control.path / "logs" / "engine.log"
        engine = engine_log.read_text(errors="replace")[-3000:] if engine_log.exists() else "(no engine.log)"
        raise AssertionError(f"no ready-for-snapshot\nsupervisor:\n{supervisor}\nengine:\n{engine}") from None
    identity = identity_from_payload(ready.payload)
    key = generate_hmac_key(tmp_path / "hmac.key")
    store = SnapshotStore(tmp_path / "store")
    captured = capture(
        store=store, signer=load_signer(key), sandbox=source_pod, control=control, criu=criu,
        options=CaptureOptions(keep_serving=True, resume_payload={"port": PORT}, ready_timeout=60),
    )  # fmt: skip
    source_answer = complete(real_node, source["status"]["podIP"], "the quick brown fox")

    target_cid = target["status"]["containerStatuses"][0]["containerID"]
    target_pod = PodSandbox.find(target["metadata"]["uid"], kubelet_root, timeout=60, container=target_cid)
    target_pod.reserve_low_pids()
    restored = restore(
        store=store, verifier=load_verifier(key), snapshot_id=captured.snapshot.id,
        expected_identity=identity, sandbox=target_pod, control=ControlDir(target_pod.host_dir),
        criu=criu, work_dir=tmp_path / "restore-work", resume_payload={"port": PORT},
    )  # fmt: skip
    # The restored engine lives in the placeholder's container: its namespaces and its cgroups.
    for kind in ("pid", "mnt", "net", "ipc", "uts"):
        engine_ns = Path(f"/proc/{restored.host_pid}/ns/{kind}").readlink()
        assert engine_ns == Path(f"/proc/{target_pod.init_pid}/ns/{kind}").readlink(), kind
    assert cgroup_dirs(restored.host_pid) == cgroup_dirs(target_pod.init_pid)

    target_answer = complete(real_node, target["status"]["podIP"], "the quick brown fox")
    assert target_answer["choices"][0]["text"] == source_answer["choices"][0]["text"]
    assert target_answer["choices"][0]["text"]
