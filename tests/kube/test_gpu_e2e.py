"""GPU replicas on Kubernetes: the chart on a GPU node (NVIDIA's device plugin hands pods their GPU, the agent
reaches the driver for the CUDA checkpoint API), endpoints at Qwen3-8B shapes of both engines captured by the
agent and restored into new pods, answering through their Service with the token ids of a cold pod of the
same spec, from `kubectl scale` and from a request held at zero by KEDA's HTTP add-on (one capture per
engine serves both); and on the GPU node, a tampered blob, a snapshot signed for another GPU and the agent
killed mid-restore, each ending in a Ready replica and no GPU memory held by a dead restore.

It runs where the real node is a GPU node: `hack/device-kube-gpu.sh run` on a GPU machine. Elsewhere it skips,
saying why, unless WARMSTART_GPU_E2E_DRY_RUN=1 rehearses the builtin engine's flow on CPU (the tiny model, no
GPU facts checked): what the GPU machine's few minutes should not be spent finding. What the tests do before
they need the GPU (this module's imports, the endpoints' bodies, the model written for vLLM, the GPU a forged
snapshot names) runs everywhere, in `test_gpu_e2e_setup.py`. Each endpoint's figures (scale request -> first
token through the Service, restored and cold, the agent's phases, each test's own wall time) go to
$WARMSTART_GPU_RESULTS (`kube-gpu.json` and `kube-gpu.md`). `WARMSTART_GPU_E2E_SHAPE=qwen3-0.6b` runs the
round at Qwen3-0.6B's shapes instead of 8B's, for iterating.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from control_plane import gpu_node
from control_plane.cluster import ControlPlane, wait_for
from control_plane.node import RealNode
from endpoint_flow import (
    HOLD_SECONDS,
    RELEASE,
    agent_cgroups,
    agent_store,
    at_zero,
    autoscaled,
    client_pod,
    diagnostics,
    endpoint,
    events_of,
    get,
    install,
    items,
    kill_agent,
    ready,
    ready_snapshot,
    restore_claims,
    routed_host,
    tamper,
    uninstall,
    waiter,
    worker_pods,
)
from node_plugin import HostPython
from pod_timeline import ENDPOINT, PodTimeline

from warmstart.api import labels as L
from warmstart.api.identity import SnapshotIdentity
from warmstart.checkpoint import hugepages
from warmstart.engines.vllm.engine import STAGED_WEIGHTS_ENV
from warmstart.snapshot.signing import load_signer, signature_document

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
RESULTS_ENV = "WARMSTART_GPU_RESULTS"
DRY_RUN = os.environ.get("WARMSTART_GPU_E2E_DRY_RUN") == "1"
SHAPE = os.environ.get("WARMSTART_GPU_E2E_SHAPE", "qwen3-8b")  # qwen3-0.6b: the quick round
RESTORES = 3  # restored replicas in a row, each from zero, then one cold start of the same spec
# Real products for a snapshot forged as taken on another GPU: the first that is not the node's own card.
OTHER_GPUS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200")
PROMPT = "The first snapshot of a warm worker"
ANSWER_TOKENS = 16
# The agent's values for a GPU node as docs/operations.md describes them: the node's memory in 2 MiB pages,
# which shortens CRIU's restore of the engine's host memory (benchmarks-history.md, THP `always`).
GPU_AGENT_VALUES = {"transparentHugepages": "always"}
CAPTURE_TIMEOUT = 900.0  # the capture pod writes 16 GiB of weights (first start), loads and warms them
START_TIMEOUT = 600.0  # a cold vLLM at 8B shapes compiles and captures graphs
# Run by the client pod's python3: POST the completion until one succeeds (the replica is starting), then once
# more for the answer; prints the wall-clock time of the first token, how long that successful request took,
# the failed attempts by reason, and the answer's JSON. Optional: the Host header (KEDA's interceptor routes
# by it) and how long an attempt may wait for its answer (the interceptor holds it until a replica is Ready).
# While the Service has no ready endpoint kube-proxy rejects each connection with an ICMP error, which the
# node's kernel rate-limits per client (icmp_ratelimit: a burst of 6, then one a second): past the burst a
# rejected SYN is dropped instead, and TCP would resend it only after its 1 s initial timeout. A connection
# is given 50 ms, then tried afresh, so the first token comes when the Service first routes to the replica,
# not up to a second later.
FIRST_TOKEN = """
import http.client, json, sys, time, urllib.parse
url, model, prompt = sys.argv[1], sys.argv[2], sys.argv[3]
tokens, deadline = int(sys.argv[4]), float(sys.argv[5])
host, hold = (sys.argv[6], float(sys.argv[7])) if len(sys.argv) > 7 else ("", 5.0)
address = urllib.parse.urlsplit(url)
def complete(max_tokens, timeout):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    headers = {"Content-Type": "application/json", **({"Host": host} if host else {})}
    connection = http.client.HTTPConnection(address.hostname, address.port or 80, timeout=0.05)
    try:
        connection.connect()
        connection.sock.settimeout(timeout)
        connection.request("POST", address.path, json.dumps(body), headers)
        response = connection.getresponse()
        if response.status != 200:
            raise ConnectionError(f"HTTP {response.status}")
        return json.loads(response.read())
    finally:
        connection.close()
refused = {}
while True:
    sent = time.time()
    try:
        complete(1, hold)
        first = time.time()
        break
    except (ConnectionError, TimeoutError, OSError) as error:
        reason = type(error).__name__
        refused[reason] = refused.get(reason, 0) + 1
        if time.time() > deadline:
            sys.exit("no answer before the deadline")
        time.sleep(0.02)
print(json.dumps({"first_token_at": first, "answered_in": first - sent, "refused": refused,
                  "answer": complete(tokens, 120)}))
"""


@dataclasses.dataclass
class Start:
    """One replica's start: from the scale request to its first token through the Service."""

    endpoint: str
    kind: str  # restore | cold
    seconds: float
    token_ids: list[int]
    text: str
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    refused: dict[str, int] = dataclasses.field(default_factory=dict)  # failed requests before it, by reason


@pytest.fixture(scope="module")
def gpu(real_node: RealNode) -> RealNode:
    if not real_node.gpu and not DRY_RUN:
        pytest.skip("the real node is no GPU node: " + "; ".join(gpu_node.missing_parts()))
    return real_node


def results_dir() -> Path:
    return Path(os.environ.get(RESULTS_ENV) or ROOT / "benchmarks" / "results" / "local")


STEPS: list[dict[str, Any]] = []  # each test's wall time, fixtures included


@pytest.fixture(scope="module")
def report() -> Iterator[list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    yield rows
    write_report(rows + STEPS)


@pytest.fixture(autouse=True)
def step_time(request: pytest.FixtureRequest) -> Iterator[None]:
    """On the GPU machine, the GPU time each step cost: the test's wall time, its fixtures' too."""
    started = time.time()
    yield
    STEPS.append({"engine": "-", "kind": "step", "step": request.node.name, "seconds": time.time() - started})


def write_report(rows: list[dict[str, Any]]) -> None:
    directory = results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kube-gpu.json").write_text(json.dumps(rows, indent=2) + "\n")
    (directory / "kube-gpu.md").write_text(markdown(rows))
    pack_worker_logs(directory)
    print("\n" + markdown(rows))


ENGINE_LOGS = f'for f in {L.CONTROL_DIR_PATH}/logs/*; do echo "== $f"; tail -n 400 "$f"; done'


def keep_worker_log(kube: ControlPlane, namespace: str, pod: str, kind: str) -> str:
    """The worker's logs of a timed start, the supervisor's and the engine's (its resume or load, its
    server's start), kept with the results (the pod goes with the scale to zero) and returned."""
    directory = results_dir() / "worker-logs"
    directory.mkdir(parents=True, exist_ok=True)
    supervisor = kube.kubectl("logs", "-n", namespace, pod, check=False)
    engine = kube.kubectl("exec", "-n", namespace, pod, "--", "sh", "-c", ENGINE_LOGS, check=False)
    text = "\n".join([supervisor.stdout, supervisor.stderr, engine.stdout, engine.stderr])
    (directory / f"{kind}-{pod}.log").write_text(text)
    return text


CAPTURE_TIMINGS = ("weights_plan_s", "weights_image_write_s")  # in the same line, from before the capture


def engine_wake_phases(log: str) -> dict[str, float]:
    """The vLLM engine's own timings of its wake after resume, from the `awake: name seconds, ...` line of
    its log: how its weights came back (`weights_staged_s`, `weights_files_s`, ...) and the KV cache."""
    line = next((line for line in reversed(log.splitlines()) if "awake: " in line), "")
    phases = {}
    for item in line.partition("awake: ")[2].split(", "):
        name, _, seconds = item.partition(" ")
        resumed = name.startswith(("wake_", "weights_", "reacquire")) and name not in CAPTURE_TIMINGS
        if resumed and seconds.replace(".", "", 1).isdigit():
            phases[f"engine_{name.removesuffix('_s')}"] = float(seconds)
    return phases


def pack_worker_logs(directory: Path) -> None:
    logs = directory / "worker-logs"
    if logs.is_dir():
        with tarfile.open(directory / "worker-logs.tgz", "w:gz") as tar:
            tar.add(logs, arcname="worker-logs")
        shutil.rmtree(logs)


def markdown(rows: list[dict[str, Any]]) -> str:
    head = "| engine | start | scale -> first token (s) | token ids vs the first cold | agent's phases (s) |"
    lines = [head, "|---|---|---|---|---|"]
    for row in rows:
        if row["kind"] == "step":
            lines.append(f"| - | step: {row['step']} | {row['seconds']:.1f} | | |")
            continue
        if row["kind"] == "node":
            lines.append(f"| - | node: {row['step']} | | | |")
            continue
        phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in row.get("phases", {}).items())
        if "differs_from_cold_at" not in row:
            versus = ""
        elif row["differs_from_cold_at"] is None:
            versus = "same"
        else:
            versus = f"differ from token {row['differs_from_cold_at']}"
        if row["kind"] == "captured":
            captured = row["captured_answer"].get("token_ids")
            versus = f"the captured process answered {captured}, the restored ones {row['restored_answers']}"
        if refused := row.get("refused"):
            phases += "; refused before: " + ", ".join(f"{n}x {why}" for why, n in refused.items())
        lines.append(f"| {row['engine']} | {row['kind']} | {row['seconds']:.2f} | {versus} | {phases} |")
    return "\n".join(lines) + "\n"


@pytest.fixture
def release(
    kube: ControlPlane, gpu: RealNode, chart_image: str, namespace: str, report: list[dict[str, Any]]
) -> Iterator[str]:
    before = hugepages.current_mode()
    node_row = {"engine": "-", "kind": "node", "step": f"transparent huge pages {before} before the agent's",
                "seconds": 0}  # fmt: skip
    if node_row not in report:
        report.append(node_row)
    store = install(kube, chart_image, gpu, namespace, agent=GPU_AGENT_VALUES)
    try:
        yield store
    finally:
        with contextlib.suppress(OSError, ValueError):
            hugepages.set_mode(before)  # the agent leaves its mode to the node: put back what the node had
        keep_agent_logs(kube, namespace)
        uninstall(kube, namespace)
        keep_criu_logs(gpu.shadow("/var/lib/warmstart") / namespace, results_dir() / "criu-logs.tgz")
        shutil.rmtree(gpu.shadow("/var/lib/warmstart") / namespace, ignore_errors=True)  # 16 GiB of weights


def keep_agent_logs(kube: ControlPlane, namespace: str) -> None:
    """The agents' logs (their restores, weight stagers and refusals), which the release's removal ends."""
    directory = results_dir() / "worker-logs"
    directory.mkdir(parents=True, exist_ok=True)
    for pod in items(kube, "pod", namespace, "app.kubernetes.io/component=agent"):
        name = pod["metadata"]["name"]
        logs = kube.kubectl("logs", "-n", namespace, name, "--all-containers", check=False)
        (directory / f"agent-{name}.log").write_text(logs.stdout + logs.stderr)


def keep_criu_logs(root: Path, archive: Path) -> None:
    """CRIU's logs of the agents' dumps and restores, which the store's removal would take with it."""
    logs = [path for path in root.glob("**/agent-work/**/*.log") if path.is_file()]
    if logs:
        archive.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive, "w:gz") as tar:
            for path in logs:
                tar.add(path, arcname=str(path.relative_to(root)))


def gpu_endpoint(
    name: str, namespace: str, chart_image: str, node: RealNode, host_python: HostPython, snapshots: bool,
    engine: str, model: str, args: list[str],
) -> dict[str, Any]:  # fmt: skip
    """An endpoint of `engine` on one GPU of the node, at zero replicas."""
    body = endpoint(name, namespace, chart_image, node, host_python, snapshots)
    spec = body["spec"]
    spec["replicas"] = 0
    spec["model"] = {"uri": model, "servedName": "model"}
    spec["engine"].update(kind=engine, args=args)
    spec["resources"] = {"gpus": 1 if node.gpu else 0}
    spec["template"]["env"] += [
        {"name": "VLLM_CACHE_ROOT", "value": "/cache/models/vllm-cache"},  # compiled graphs, shared by pods
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        {"name": "VLLM_USE_FLASHINFER_SAMPLER", "value": "0"},  # FlashInfer is not carried to the machine
    ]
    if node.gpu:
        library = str(gpu_node.driver_library_dir())
        spec["template"]["env"].append({"name": "LD_LIBRARY_PATH", "value": library})
    if staged := os.environ.get(STAGED_WEIGHTS_ENV):  # the workers' switch, passed on from the run's
        spec["template"]["env"].append({"name": STAGED_WEIGHTS_ENV, "value": staged})
    return body


def scale(kube: ControlPlane, namespace: str, name: str, replicas: int) -> None:
    kube.kubectl("scale", f"iep/{name}", "-n", namespace, f"--replicas={replicas}")


def timed_start(kube: ControlPlane, namespace: str, name: str, kind: str, interceptor: str = "") -> Start:
    """Scale `name` from zero to one and time the first token through its Service from the client pod, with
    the steps of the replica's start on the way (`PodTimeline.start_phases`, the agent's own phases, and
    Ready -> first token). With `interceptor` (KEDA's HTTP add-on, at that address) the request is sent
    there and is what scales the endpoint: the interceptor holds it at zero replicas."""
    wait = waiter(kube, namespace)
    wait(lambda: not serving_pods(kube, namespace, name) or None, f"{name} at zero", START_TIMEOUT)
    if interceptor:
        url, route = (
            f"http://{interceptor}/v1/completions",
            [routed_host(kube, namespace, name), str(HOLD_SECONDS)],
        )
    else:
        service = get(kube, "service", namespace, name)
        url, route = f"http://{service['spec']['clusterIP']}/v1/completions", []
    with PodTimeline(kube, namespace) as timeline:
        requested = time.time()
        deadline = requested + START_TIMEOUT
        argv = [str(kube.binary("kubectl")), "exec", "-n", namespace, "client", "--", "python3", "-c",
                FIRST_TOKEN, url, "model", PROMPT, str(ANSWER_TOKENS), str(deadline), *route]  # fmt: skip
        client = subprocess.Popen(argv, env=kube.tool_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)  # fmt: skip
        if not interceptor:
            scale(kube, namespace, name, 1)
        out, err = client.communicate(timeout=START_TIMEOUT + 60)
        assert client.returncode == 0, f"{err}\n{out}"
        reply = json.loads(out.strip().splitlines()[-1])
        choice = reply["answer"]["choices"][0]
        pods = [pod for pod in worker_pods(kube, namespace, kind, name) if ready(pod)]
        assert len(pods) == 1, f"one {kind} replica of {name}, Ready: {pods}\n{diagnostics(kube, namespace)}"
        pod_name = pods[0]["metadata"]["name"]
        became_ready = timeline.wait_ready(pod_name, 30.0)  # Ready already: it answered
        phases = timeline.start_phases(pods[0], since=requested)
    log = keep_worker_log(kube, namespace, pod_name, kind)
    status = json.loads((pods[0]["metadata"].get("annotations") or {}).get(L.STATUS_ANNOTATION) or "{}")
    if kind == L.ROLE_RESTORE:  # a restore pod the agent refused starts cold: no figure of a restore
        events = events_of(kube, namespace, pod_name)
        reasons = {event["reason"]: event["message"] for event in events}
        assert "Restored" in reasons and "restoreSeconds" in status, f"{name} was not restored: {reasons}"
    phases.update(status.get("restorePhases", {}))
    phases.update(engine_wake_phases(log) if kind == L.ROLE_RESTORE else {})
    phases["ready_to_first_token"] = reply["first_token_at"] - became_ready
    phases["first_request"] = reply["answered_in"]
    if (endpoint := timeline.at[ENDPOINT].get(pod_name)) is not None:  # the Service's part, split
        phases["ready_to_endpoint"] = endpoint - became_ready
        phases["endpoint_to_first_token"] = reply["first_token_at"] - endpoint
    seconds = reply["first_token_at"] - requested
    return Start(name, kind, seconds, choice["token_ids"], choice["text"], phases, reply["refused"])


def serving_pods(kube: ControlPlane, namespace: str, name: str) -> list[dict[str, Any]]:
    """The endpoint's worker pods, terminating ones included (they can still answer through the Service)."""
    selector = f"{L.ENDPOINT_LABEL}={name},{L.COMPONENT_LABEL}={L.WORKER_COMPONENT}"
    return items(kube, "pod", namespace, selector)


def stop(kube: ControlPlane, namespace: str, name: str) -> None:
    scale(kube, namespace, name, 0)
    gone = waiter(kube, namespace)
    gone(lambda: not serving_pods(kube, namespace, name) or None, f"{name}'s replicas gone", START_TIMEOUT)


def gpu_processes() -> list[tuple[int, int]]:
    """(pid, MiB) of every process holding GPU memory, as nvidia-smi sees them."""
    result = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    rows = [line.split(",") for line in result.stdout.splitlines() if line.strip()]
    return [(int(pid), int(mib)) for pid, mib in rows]


def capture(
    kube: ControlPlane, gpu: RealNode, namespace: str, body: dict[str, Any], report: list[dict[str, Any]]
) -> dict[str, Any]:
    """Apply the endpoint; its capture pod is checkpointed by the agent: the InferenceSnapshot, once Ready."""
    name = body["metadata"]["name"]
    kube.kubectl("apply", "-f", "-", input=json.dumps(body))

    def captured() -> dict[str, Any] | None:
        for found in items(kube, "isnap", namespace, f"{L.ENDPOINT_LABEL}={name}"):
            status = found.get("status") or {}
            assert status.get("phase") != "Failed", f"capture failed: {status.get('captureMessage')}"
        return ready_snapshot(kube, namespace, name)

    snap = waiter(kube, namespace)(captured, f"{name}'s snapshot Ready", CAPTURE_TIMEOUT)
    identity = snap["status"]["identity"]
    if gpu.gpu:
        facts = gpu_node.node_labels()
        assert identity["device"] == "cuda", identity
        assert identity["gpu_product"].replace(" ", "-") == facts["nvidia.com/gpu.product"], identity
        assert str(identity["driver_major"]) == facts["nvidia.com/cuda.driver.major"], identity
    timings = snap["status"].get("timings") or {}
    report.append({"engine": body["spec"]["engine"]["kind"], "kind": "capture",
                   "seconds": timings.get("total", 0), "phases": timings,
                   "snapshot_bytes": snap["status"].get("sizeBytes")})  # fmt: skip
    return snap


def ask(kube: ControlPlane, namespace: str, name: str, prompt: str, tokens: int) -> dict[str, Any]:
    """One greedy completion (`ignore_eos`, token ids returned) through `name`'s Service from the client pod:
    its first choice."""
    service = get(kube, "service", namespace, name)
    url = f"http://{service['spec']['clusterIP']}/v1/completions"
    argv = ["exec", "-n", namespace, "client", "--", "python3", "-c", FIRST_TOKEN, url, "model", prompt,
            str(tokens), str(time.time() + 60)]  # fmt: skip
    return json.loads(kube.kubectl(*argv).stdout.strip().splitlines()[-1])["answer"]["choices"][0]


def captured_answer(gpu: RealNode, namespace: str, snap: dict[str, Any]) -> dict[str, Any]:
    """What the captured process answered to its warm-up completion, as its snapshot records it (vLLM's
    server records one; {} otherwise)."""
    snapshot = agent_store(gpu, namespace).get(snap["status"]["snapshotId"])
    return snapshot.record.worker.engine.get("warm_up") or {}


def first_difference(ids: list[int], other: list[int]) -> int | None:
    """The index of the first token where two answers differ; None when they are identical."""
    for index, (one, two) in enumerate(zip(ids, other, strict=False)):
        if one != two:
            return index
    return None if len(ids) == len(other) else min(len(ids), len(other))


def compare(restored: list[Start], cold: Start) -> None:
    """Every restored replica answers with the cold replica's token ids, with text that is not empty."""
    for start in [*restored, cold]:
        assert start.text.strip() and start.token_ids, start
    for start in restored:
        assert start.token_ids == cold.token_ids, (start, cold)


def turned_to_restores(kube: ControlPlane, namespace: str, name: str) -> None:
    """Wait until the endpoint's Deployment makes restore pods (the operator turns it once the snapshot is
    Ready)."""

    def restore_pods() -> bool:
        template = get(kube, "deployment", namespace, name)["spec"]["template"]
        return template["metadata"]["labels"][L.ROLE_LABEL] == L.ROLE_RESTORE

    waiter(kube, namespace)(lambda: restore_pods() or None, f"{name}'s Deployment turned to restores")


def engine_flow(
    kube: ControlPlane, gpu: RealNode, chart_image: str, host_python: HostPython, namespace: str,
    engine: str, model: str, args: list[str], report: list[dict[str, Any]],
) -> tuple[dict[str, Any], list[Start]]:  # fmt: skip
    """Capture, RESTORES restores from zero in a row, one cold start of the same spec; token ids compared with
    what the captured process answered (when its snapshot records it) and with the cold start's."""
    kube.kubectl("apply", "-f", "-", input=client_pod(namespace, chart_image, gpu))
    body = gpu_endpoint(engine, namespace, chart_image, gpu, host_python, True, engine, model, args)
    snap = capture(kube, gpu, namespace, body, report)
    oracle = captured_answer(gpu, namespace, snap)
    turned_to_restores(kube, namespace, engine)
    starts, same_as_captured = [], []
    for _ in range(RESTORES):  # `kubectl scale` to 1 from zero
        starts.append(timed_start(kube, namespace, engine, L.ROLE_RESTORE))
        if oracle:  # the captured process's own question, asked again of the restored one
            request = oracle["request"]
            again = ask(kube, namespace, engine, request["prompt"], request["max_tokens"])
            assert again["token_ids"] == oracle["token_ids"], (again, oracle)
            same_as_captured.append(again["token_ids"])
        stop(kube, namespace, engine)
    cold_name = f"{engine}-cold"
    kube.kubectl("apply", "-f", "-", input=json.dumps(gpu_endpoint(cold_name, namespace, chart_image, gpu,
                 host_python, False, engine, model, args)))  # fmt: skip
    cold = timed_start(kube, namespace, cold_name, L.ROLE_COLD)
    stop(kube, namespace, cold_name)
    starts.append(cold)
    for start in starts:
        difference = first_difference(start.token_ids, cold.token_ids)
        report.append({"engine": engine, **dataclasses.asdict(start), "differs_from_cold_at": difference})
    if oracle:  # the builtin engine's snapshots record no answer: no row for it
        report.append({"engine": engine, "kind": "captured", "seconds": 0, "phases": {},
                       "captured_answer": oracle, "restored_answers": same_as_captured})  # fmt: skip
    compare(starts[:-1], cold)
    return snap, starts


def through_keda_from_zero(
    kube: ControlPlane, gpu: RealNode, chart_image: str, host_python: HostPython, namespace: str,
    engine: str, model: str, args: list[str], report: list[dict[str, Any]], keda: str | None,
) -> None:  # fmt: skip
    """Scale from zero as users autoscale: the two endpoints `engine_flow` left at zero (its snapshot Ready,
    and its cold twin) fronted by KEDA's HTTP add-on; a request to the interceptor is held while KEDA scales
    its endpoint to one, restored or cold, timed from the request to its first token; then KEDA takes it
    back to zero (one GPU: the next replica needs the one before it gone). Scaling is no part of a
    snapshot's request, so the snapshot captured for `kubectl scale` serves here too, with no capture of its
    own. Without KEDA built, a report row says so."""
    if keda is None:
        step = f"{engine}: KEDA is not built here, no scale from zero"
        report.append({"engine": "-", "kind": "node", "step": step, "seconds": 0})
        return
    names = {L.ROLE_RESTORE: engine, L.ROLE_COLD: f"{engine}-cold"}
    for kind, name in names.items():
        body = gpu_endpoint(name, namespace, chart_image, gpu, host_python, kind == L.ROLE_RESTORE, engine,
                            model, args)  # fmt: skip
        kube.kubectl("apply", "-f", "-", input=json.dumps(autoscaled(body, 0, 1)))
    starts = {}
    for kind, name in names.items():
        starts[kind] = timed_start(kube, namespace, name, kind, interceptor=keda)
        waiter(kube, namespace)(lambda name=name: at_zero(kube, namespace, name) or None,
                                f"KEDA taking {name} back to zero", START_TIMEOUT)  # fmt: skip
    restored, cold = starts[L.ROLE_RESTORE], starts[L.ROLE_COLD]
    for start in (restored, cold):
        difference = first_difference(start.token_ids, cold.token_ids)
        report.append({"engine": f"{engine}, KEDA HTTP add-on", **dataclasses.asdict(start),
                       "differs_from_cold_at": difference})  # fmt: skip
    assert restored.text.strip() and restored.token_ids == cold.token_ids, (restored, cold)


def keda_if_built(request: pytest.FixtureRequest) -> str | None:
    """KEDA's interceptor address, None where KEDA is not built (its part of a test is then left out)."""
    try:
        return request.getfixturevalue("keda")
    except pytest.skip.Exception:
        return None


GPU_CHECK = """
import torch
print(torch.cuda.get_device_name(0), torch.cuda.mem_get_info()[1] >> 30, "GiB")
"""
AGENT_CUDA_CHECK = """
from warmstart.host.cuda_driver import gpu_devices
print([(device.name, device.compute_capability) for device in gpu_devices()])
"""


def test_a_pod_is_given_its_gpu_and_the_agent_reaches_the_driver(
    kube: ControlPlane, gpu: RealNode, chart_image: str, host_python: HostPython, namespace: str,
    release: str,
) -> None:  # fmt: skip
    """What every later step needs, seen first: a pod asking for one GPU gets one through the device plugin
    (and sees it with the machine's torch), and the agent's CUDA driver sees the node's GPUs."""
    if not gpu.gpu:
        pytest.skip("no GPU on this node (a rehearsal on CPU)")
    env = [*host_python.env, {"name": "LD_LIBRARY_PATH", "value": str(gpu_node.driver_library_dir())}]
    container = {
        "name": "gpu",
        "image": chart_image,
        "imagePullPolicy": "Never",
        "command": [host_python.python, "-c", GPU_CHECK],
        "env": env,
        "volumeMounts": host_python.volume_mounts,
        "resources": {"limits": {gpu_node.RESOURCE: 1}},
    }
    spec = {**gpu.pod_placement(), "restartPolicy": "Never", "containers": [container],
            "volumes": host_python.volumes}  # fmt: skip
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "gpu"}, "spec": spec}
    kube.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod))

    def finished() -> dict[str, Any] | None:
        found = get(kube, "pod", namespace, "gpu")
        return found if found and found["status"].get("phase") in ("Succeeded", "Failed") else None

    done = waiter(kube, namespace)(finished, "the GPU pod to finish", START_TIMEOUT)
    logs = kube.kubectl("logs", "-n", namespace, "gpu").stdout
    assert done["status"]["phase"] == "Succeeded" and "NVIDIA" in logs, logs
    agent = next(p for p in items(kube, "pod", namespace, "app.kubernetes.io/component=agent")
                 if p["spec"].get("nodeName") == gpu.name)  # fmt: skip
    seen = kube.kubectl("exec", "-n", namespace, agent["metadata"]["name"], "--", "python3", "-c",
                        AGENT_CUDA_CHECK, check=False)  # fmt: skip
    assert seen.returncode == 0 and "NVIDIA" in seen.stdout, seen.stdout + seen.stderr


def test_builtin_engine_gpu_replicas_restore_and_answer_like_a_cold_pod(
    kube: ControlPlane, gpu: RealNode, chart_image: str, host_python: HostPython, namespace: str,
    release: str,
    report: list[dict[str, Any]], tmp_path: Path, request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """`kubectl scale` from zero, restored and cold; a request at zero through KEDA, restored and cold; then
    the refusals on the GPU node."""
    model, args = builtin_shapes(gpu)
    snap, _ = engine_flow(kube, gpu, chart_image, host_python, namespace, "builtin", model, args, report)
    through_keda_from_zero(kube, gpu, chart_image, host_python, namespace, "builtin", model, args, report,
                           keda_if_built(request))  # fmt: skip
    refusals_on_the_gpu_node(kube, gpu, namespace, snap, tmp_path)


def builtin_shapes(gpu: RealNode) -> tuple[str, list[str]]:
    """The builtin engine's model and arguments: Qwen3's shapes (SHAPE) on a GPU, the tiny model in a
    rehearsal."""
    return (SHAPE, ["--max-model-len=1024", "--max-num-seqs=16"]) if gpu.gpu else ("tiny", [])


def vllm_args() -> list[str]:
    return ["--max-model-len=1024", "--gpu-memory-utilization=0.85"]


def vllm_shapes(gpu: RealNode, namespace: str) -> tuple[str, list[str]]:
    """vLLM's model (Qwen3's shapes, SHAPE, written on the node where the pods mount it) and arguments; the
    test skips where vLLM or the GPU is missing."""
    if importlib.util.find_spec("vllm") is None or not gpu.gpu:
        pytest.skip("vLLM is not installed here (hack/device-vllm-prepare.sh carries it to the GPU machine)")
    name = f"{SHAPE}-vllm"
    vllm_model(gpu.shadow("/var/lib/warmstart") / namespace / "models" / name, SHAPE)
    return f"/cache/models/{name}", vllm_args()


def test_vllm_gpu_replicas_restore_and_answer_like_a_cold_pod(
    kube: ControlPlane, gpu: RealNode, chart_image: str, host_python: HostPython, namespace: str,
    release: str,
    report: list[dict[str, Any]], request: pytest.FixtureRequest,
) -> None:  # fmt: skip
    """`kubectl scale` from zero, restored and cold; a request at zero through KEDA, restored and cold."""
    model, args = vllm_shapes(gpu, namespace)
    engine_flow(kube, gpu, chart_image, host_python, namespace, "vllm", model, args, report)
    through_keda_from_zero(kube, gpu, chart_image, host_python, namespace, "vllm", model, args, report,
                           keda_if_built(request))  # fmt: skip


def vllm_model(directory: Path, shape: str) -> None:
    """Qwen3's shapes, seeded random weights and a small tokenizer, as the vLLM benchmark writes them."""
    vllm_bench().write_model(directory, shape)


def vllm_bench() -> ModuleType:
    """`benchmarks/vllm_bench.py`, imported by name (its dataclasses look their module up in sys.modules)."""
    benchmarks = str(ROOT / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.append(benchmarks)
    return importlib.import_module("vllm_bench")


def another_gpu(product: str) -> str:
    """A real GPU product other than `product` (the node's own card, as its snapshot records it)."""
    return next(other for other in OTHER_GPUS if other != product)


# --- refusals on the GPU node ----------------------------------------------------------------------------


def refusals_on_the_gpu_node(
    kube: ControlPlane, gpu: RealNode, namespace: str, snap: dict[str, Any], tmp_path: Path
) -> None:
    """Each ends in a Ready replica, started cold, with an Event saying why, and no GPU memory held by what
    did not finish."""
    store = agent_store(gpu, namespace)
    snapshot_id = snap["status"]["snapshotId"]
    if gpu.gpu:  # a CPU snapshot records no GPU to differ
        other = another_gpu(snap["status"]["identity"]["gpu_product"])
        directory = store.root / "snapshots" / snapshot_id
        with signed_for_another_gpu(kube, namespace, snap, directory, other, tmp_path):
            pod = cold_after_refusal(kube, namespace, "RestoreRefused")
            assert "gpu_product" in pod["event"] and other in pod["event"], pod["event"]
    killed_mid_restore(kube, gpu, namespace)
    tamper(store, snapshot_id)
    pod = cold_after_refusal(kube, namespace, "RestoreFailed")
    assert "digest" in pod["event"].lower() or "sha256" in pod["event"].lower(), pod["event"]
    stop(kube, namespace, "builtin")
    assert not gpu.gpu or gpu_processes() == [], "no process holds GPU memory once every replica is gone"


def cold_after_refusal(kube: ControlPlane, namespace: str, reason: str) -> dict[str, Any]:
    """Scale the builtin endpoint to one: its restore pod is refused (`reason`), starts cold, turns Ready."""
    scale(kube, namespace, "builtin", 1)
    wait = waiter(kube, namespace)
    pod = wait(lambda: next((p for p in worker_pods(kube, namespace, L.ROLE_RESTORE, "builtin") if ready(p)),
                            None), f"a replica Ready after {reason}", START_TIMEOUT)  # fmt: skip
    name = pod["metadata"]["name"]
    events = [e for e in events_of(kube, namespace, name) if e["reason"] == reason]
    assert events, [e["reason"] for e in events_of(kube, namespace, name)]
    assert all(s["restartCount"] == 0 for s in pod["status"]["containerStatuses"]), "no crash loop"
    stop(kube, namespace, "builtin")
    return {"pod": name, "event": events[0]["message"]}


@contextlib.contextmanager
def signed_for_another_gpu(
    kube: ControlPlane, namespace: str, snap: dict[str, Any], directory: Path, product: str, tmp_path: Path
) -> Iterator[None]:
    """The snapshot's manifest and InferenceSnapshot re-made, signed with the cluster's key, naming another
    GPU `product`: what a snapshot captured on another node type would be. Put back afterwards."""
    secret = get(kube, "secret", namespace, f"{RELEASE}-warmstart-signing-key")
    key = tmp_path / "key"
    key.write_bytes(base64.b64decode(secret["data"]["key"]))
    originals = {name: (directory / name).read_bytes() for name in ("manifest.json", "manifest.sig")}
    manifest = json.loads(originals["manifest.json"])
    identity = SnapshotIdentity.from_dict({**manifest["identity"], "gpu_product": product})
    manifest.update(identity=identity.to_dict(), identity_hash=identity.digest())
    forged = json.dumps(manifest, sort_keys=True).encode()
    name, status = snap["metadata"]["name"], snap["status"]

    def put(files: dict[str, bytes], patch: dict[str, Any]) -> None:
        for file, content in files.items():
            (directory / file).chmod(0o600)
            (directory / file).write_bytes(content)
        kube.kubectl("patch", "isnap", name, "-n", namespace, "--subresource=status", "--type=merge",
                     "-p", json.dumps({"status": patch}))  # fmt: skip

    put({"manifest.json": forged, "manifest.sig": signature_document(load_signer(key), forged)},
        {"identity": identity.to_dict(), "identityHash": identity.digest()})  # fmt: skip
    try:
        yield
    finally:
        put(originals, {"identity": status["identity"], "identityHash": status["identityHash"]})


def killed_mid_restore(kube: ControlPlane, gpu: RealNode, namespace: str) -> None:
    """The agent's processes are killed once a restore holds the pod's claim: the restarted agent answers the
    pod, which starts cold and turns Ready; nothing of the interrupted restore keeps GPU memory."""
    cgroups = agent_cgroups(kube, namespace, gpu)
    earlier = restore_claims(gpu)
    scale(kube, namespace, "builtin", 1)
    wait_for(lambda: restore_claims(gpu) - earlier, timeout=START_TIMEOUT, interval=0.002,
             message="a new restore holding its pod's claim")  # fmt: skip
    kill_agent(cgroups)
    pod = waiter(kube, namespace)(
        lambda: next((p for p in worker_pods(kube, namespace, L.ROLE_RESTORE, "builtin") if ready(p)), None),
        "the replica Ready after the agent was killed", START_TIMEOUT,
    )  # fmt: skip
    reasons = {e["reason"] for e in events_of(kube, namespace, pod["metadata"]["name"])}
    assert "RestoreInterrupted" in reasons and "Restored" not in reasons, reasons
    held = gpu_processes() if gpu.gpu else [(0, 0)]
    assert len(held) == 1, f"one process holds GPU memory, the Ready replica's engine: {held}"
    stop(kube, namespace, "builtin")
