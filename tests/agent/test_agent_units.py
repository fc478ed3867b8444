"""The node agent's parts that need no cluster: /proc scanning and NSpid translation (real processes in an
unshare'd PID namespace), store-cleanup decisions, pod facts, the gRPC API and the metrics endpoint."""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from support import agent_settings, processes_by_environment, wait_until

from warmstart.agent import pods
from warmstart.agent.agent import Agent, Operation
from warmstart.agent.capture import request_problem
from warmstart.agent.cleanup import snapshots_to_remove
from warmstart.agent.context import NodeContext
from warmstart.agent.cri import ContainerRuntime
from warmstart.agent.grpc_api import serve
from warmstart.agent.kube_status import KubeStatus
from warmstart.agent.metrics import AgentMetrics
from warmstart.agent.objects import store_snapshot_id
from warmstart.agent.pods import (
    PodProcessError,
    PodSandbox,
    control_dir_on_host,
    control_volume_holders,
    mount_points,
    pod_processes,
    read_environ,
    supervisor_of,
)
from warmstart.agent.proto import agent_pb2, agent_pb2_grpc, cri_pb2, cri_pb2_grpc
from warmstart.agent.restore import worker_port
from warmstart.agent.settings import AgentSettings
from warmstart.api import labels as L
from warmstart.api.capture_record import CaptureRecord, WorkerRecord
from warmstart.checkpoint.sandbox import namespace_pids
from warmstart.host.command_settings import SettingsError, load
from warmstart.snapshot.signing import generate_hmac_key, load_signer, load_verifier
from warmstart.snapshot.store import Snapshot, SnapshotStore

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="PID namespaces (unshare) need root")


# --- /proc scanning ----------------------------------------------------------------------------------


def test_control_dir_is_the_pods_control_empty_dir(tmp_path: Path) -> None:
    uid = "0b3c8f0e-1111-4222-8333-444455556666"
    assert control_dir_on_host(tmp_path, uid) == (
        tmp_path / "pods" / uid / "volumes" / "kubernetes.io~empty-dir" / "control"
    )
    for bad in ("", "../etc", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="not a pod uid"):
            control_dir_on_host(tmp_path, bad)


@pytest.fixture
def pod_uid() -> str:
    return str(uuid.uuid4())


@pytest.fixture
def plain_process(pod_uid: str) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(["sleep", "60"], env={**os.environ, L.POD_UID_ENV: pod_uid})
    yield process
    process.kill()
    process.wait()


@pytest.mark.spawns
def test_processes_are_found_by_their_pod_uid_environment(
    plain_process: subprocess.Popen[bytes], pod_uid: str
) -> None:
    wait_until(
        lambda: processes_by_environment(pod_uid) == [plain_process.pid],
        what="the process found by its pod uid",
    )
    assert read_environ(plain_process.pid)[L.POD_UID_ENV] == pod_uid
    assert processes_by_environment(str(uuid.uuid4())) == []
    assert supervisor_of([plain_process.pid]) is None  # not in a PID namespace of its own: no container init


CID = "3f" * 32


def _fake_proc(tmp_path: Path, processes: dict[int, tuple[str, bytes]]) -> Path:
    for pid, (cgroup, environ) in processes.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "environ").write_bytes(environ)
        (tmp_path / str(pid) / "cgroup").write_text(cgroup + "\n")
    return tmp_path


def test_processes_are_found_by_the_pod_and_container_cgroups(tmp_path: Path) -> None:
    """The kubelet's and the runtime's cgroup path names pod and container (cgroupfs and systemd drivers);
    the environment, which the tenant controls, never counts against a cgroup match."""
    uid = "0b3c8f0e-1111-4222-8333-444455556666"
    other = "9" * 64
    proc = _fake_proc(tmp_path, {
        10: (f"4:memory:/kubepods/besteffort/pod{uid}/{CID}\n0::/", b"PATH=/bin\0"),
        11: (f"4:memory:/kubepods/besteffort/pod{uid}/{other}", b""),  # the pod's pause container
        12: (f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-containerd-{CID}.scope", b""),
        13: ("0::/system.slice/other.service", f"{L.POD_UID_ENV}={uid}\0".encode()),  # claims the pod
        14: (f"4:memory:/kubepods/pod{uid}x/{CID}", b""),  # a look-alike component
    })  # fmt: skip
    assert pod_processes(uid, proc=proc) == [10, 11, 12]
    assert pod_processes(uid, proc=proc, container=f"containerd://{CID}") == [10, 12]
    assert pod_processes(uid, proc=proc, container=other) == [11]
    assert pod_processes(str(uuid.uuid4()), proc=proc, container=CID) == []
    with pytest.raises(ValueError, match="not a container id"):
        pod_processes(uid, proc=proc, container="../x")


def test_before_the_kubelet_reports_it_the_worker_is_the_one_container_mounting_the_control_volume(
    tmp_path: Path,
) -> None:
    """The PID 1 (one PID namespace below the host's) of the pod's container that mounts the control volume
    where the operator mounts it; not the pause container, not a namespace nested inside the worker, and
    nobody when two containers mount it."""
    uid = "0b3c8f0e-1111-4222-8333-444455556666"
    pause, worker = f"4:memory:/kubepods/pod{uid}/{'9' * 64}", f"4:memory:/kubepods/pod{uid}/{CID}"
    cgroups = {10: worker, 11: pause, 12: worker, 13: worker, 14: "0::/user.slice"}
    proc = _fake_proc(tmp_path, {pid: (cgroup, b"") for pid, cgroup in cgroups.items()})
    control = f"1 2 0:5 /pods/{uid}/volumes/x/control {L.CONTROL_DIR_PATH} rw - ext4 x rw"
    for pid, nspid, mounts in [
        (10, "10 1", ["1 0 0:1 / / rw - overlay overlay rw", control]),  # the worker's supervisor
        (11, "11 1", ["1 0 0:1 / / rw - overlay overlay rw"]),  # the pause container
        (12, "12 7", [control]),  # the engine, beside the supervisor
        (13, "13 5 1", [control]),  # PID 1 of a namespace the tenant made inside the worker
        (14, "14 1", [control]),  # outside the pod
    ]:
        (proc / str(pid) / "status").write_text(f"Name:\tx\nNSpid:\t{nspid.replace(' ', chr(9))}\n")
        (proc / str(pid) / "mountinfo").write_text("\n".join(mounts) + "\n")
    assert control_volume_holders(uid, proc=proc) == [10]
    assert mount_points(10, proc) == {"/", L.CONTROL_DIR_PATH}
    (proc / "11" / "mountinfo").write_text(control + "\n")  # two containers mount it: no guess
    assert control_volume_holders(uid, proc=proc) == []
    (proc / "11" / "mountinfo").write_text("1 0 0:1 /a /with\\040space rw - ext4 x rw\n")
    assert mount_points(11, proc) == {"/with space"}


def test_the_environment_never_counts(tmp_path: Path) -> None:
    """A process that names a pod in its environment (which the tenant sets) is not the pod's: the agent
    has no lookup by environment at all."""
    uid = "0b3c8f0e-1111-4222-8333-444455556666"
    proc = _fake_proc(tmp_path, {
        13: ("0::/user.slice", f"{L.POD_UID_ENV}={uid}\0".encode()),
        14: (f"4:memory:/kubepods/besteffort/pod{uid}/{CID}", b""),
    })  # fmt: skip
    assert pod_processes(uid, proc=proc) == [14]
    assert not hasattr(pods, "POD_LOOKUPS")
    assert pod_processes(str(uuid.uuid4()), proc=proc) == []


@pytest.fixture
def namespaced_pod(pod_uid: str) -> Iterator[subprocess.Popen[bytes]]:
    """A "container": a new PID namespace whose PID 1 is a shell that started one more process (PID 2)."""
    if os.geteuid() != 0:
        pytest.skip("PID namespaces (unshare) need root")
    if shutil.which("unshare") is None:
        pytest.skip("util-linux unshare is missing")
    process = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "--",
         "/bin/sh", "-c", "sleep 60 & exec sleep 61"],
        env={**os.environ, L.POD_UID_ENV: pod_uid}, start_new_session=True,
    )  # fmt: skip
    wait_until(
        lambda: len(processes_by_environment(pod_uid)) == 3,
        what="unshare, its init and its second process",
    )
    yield process
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.spawns
@needs_root
def test_supervisor_is_the_process_whose_nspid_ends_in_one(
    namespaced_pod: subprocess.Popen[bytes], pod_uid: str
) -> None:
    found = processes_by_environment(pod_uid)
    init = supervisor_of(found)
    assert init is not None and init != namespaced_pod.pid  # `unshare` itself lives in the host namespace
    assert namespace_pids(init)[-1] == 1
    assert Path(f"/proc/{init}/cmdline").read_bytes().split(b"\0")[0] == b"sleep"


@pytest.mark.spawns
@needs_root
def test_namespace_pids_translate_to_host_pids(
    namespaced_pod: subprocess.Popen[bytes], pod_uid: str, tmp_path: Path
) -> None:
    init = supervisor_of(processes_by_environment(pod_uid))
    assert init is not None
    pod = PodSandbox(tmp_path, init)
    (second,) = [pid for pid in pod.host_pids() if pid != init]
    assert namespace_pids(second) == [second, 2]
    assert pod.host_pid(2) == second
    assert pod.host_pid(1) == init
    assert pod.host_pid(3) is None
    assert pod.alive()
    os.kill(init, signal.SIGKILL)  # the container ends: its supervisor is gone
    wait_until(lambda: not pod.alive(), what="the pod seen as gone")


@pytest.mark.spawns
@needs_root
def test_find_needs_the_control_dir_and_reserve_moves_the_pid_counter(
    namespaced_pod: subprocess.Popen[bytes], pod_uid: str, tmp_path: Path
) -> None:
    with pytest.raises(PodProcessError, match="no control directory"):
        PodSandbox.find(pod_uid, tmp_path, lookup=processes_by_environment)
    control_dir_on_host(tmp_path, pod_uid).mkdir(parents=True)
    pod = PodSandbox.find(pod_uid, tmp_path, lookup=processes_by_environment)
    assert namespace_pids(pod.init_pid)[-1] == 1
    pod.reserve_low_pids()
    probe = subprocess.run(
        ["nsenter", f"--target={pod.init_pid}", "--pid", "--", "/bin/sh", "-c", "echo $$"],
        capture_output=True, text=True, check=True, timeout=10,
    )  # fmt: skip
    assert int(probe.stdout) > 1000


def test_find_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(PodProcessError, match="no process .* cgroups"):
        PodSandbox.find(str(uuid.uuid4()), tmp_path)


# --- decisions over pods and snapshots ---------------------------------------------------------------


def _publish(
    store: SnapshotStore, key: Path, content: bytes, namespace: str = "ml", node: str = "node-a"
) -> Snapshot:
    from warmstart.api.identity import SnapshotIdentity

    identity = SnapshotIdentity(model_digest="sha256:" + "ab" * 32, engine="builtin", engine_version="1")
    meta = {"namespace": namespace, "inferenceSnapshot": "s", "node": node}
    with store.stage(identity, meta=meta) as staging:
        (staging.dir / "criu").mkdir()
        (staging.dir / "criu" / "pages.img").write_bytes(content)
        return staging.publish(load_signer(key))


def _isnap(snapshot_id: str, namespace: str = "default", name: str = "s") -> dict:
    return {"metadata": {"name": name, "namespace": namespace}, "status": {"snapshotId": snapshot_id}}


def test_store_cleanup_takes_long_unreferenced_snapshots(tmp_path: Path) -> None:
    store, key = SnapshotStore(tmp_path / "store"), generate_hmac_key(tmp_path / "key")
    kept, orphan = (_publish(store, key, bytes([i]) * 100) for i in range(2))
    now = dt.datetime.now(dt.UTC).timestamp()
    assert snapshots_to_remove(store.list(), [_isnap(kept.id)], grace=3600, now=now) == []
    assert snapshots_to_remove(store.list(), [_isnap(kept.id)], grace=3600, now=now + 7200) == [orphan.id]


def test_store_snapshot_id_and_worker_port() -> None:
    assert store_snapshot_id({"status": {"snapshotId": "abc", "storagePath": "snapshots/abc"}}) == "abc"
    assert store_snapshot_id({"status": {}}) == ""
    by_port = {"spec": {"containers": [{"ports": [{"containerPort": 8080}], "args": ["--port", "1"]}]}}
    assert worker_port(by_port) == 8080
    assert worker_port({"spec": {"containers": [{"args": ["worker", "--port", "8001"]}]}}) == 8001
    assert worker_port({"spec": {"containers": [{"args": ["worker", "--port=8002"]}]}}) == 8002
    assert worker_port({"spec": {"containers": [{"args": ["worker", "--port"]}]}}) is None


def test_request_problem_covers_a_malformed_payload_as_well_as_another_engine() -> None:
    """Both mean no capture, and both must resume the waiting worker (the agent acts on any problem)."""
    from warmstart.api.identity import SnapshotIdentity

    identity = SnapshotIdentity(model_digest="sha256:" + "cd" * 32, engine="builtin", engine_version="1")
    payload = {"identity": identity.to_dict(), "pid": 2}
    key = {"engine": {"kind": "builtin", "tensorParallelSize": 1}, "resources": {"gpus": 0}}
    assert request_problem(payload, key) is None
    gpu_key = {"engine": {"kind": "vllm", "tensorParallelSize": 2}, "resources": {"gpus": 2}}
    problem = request_problem(payload, gpu_key) or ""
    assert "engine 'builtin' (asked for 'vllm')" in problem and "device 'cpu' (asked for 'cuda')" in problem
    assert "parallelism 1 (asked for 2)" in problem
    assert "no valid 'identity'" in (request_problem({"pid": 2}, key) or "")


@pytest.mark.parametrize(
    ("variable", "value", "flag"),
    [
        ("WARMSTART_NODE_NAME", "", "--node"),
        ("WARMSTART_AGENT_MAX_CAPTURES", "0", "--max-captures"),
        ("WARMSTART_AGENT_PRESTAGE_MAX_BYTES", "-1", "--prestage-max-bytes"),
        ("WARMSTART_AGENT_PRESTAGE_INTERVAL_SECONDS", "0", "--prestage-interval"),
    ],
)
def test_settings_name_what_to_fix(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, flag: str
) -> None:
    monkeypatch.setenv("WARMSTART_NODE_NAME", "n")
    monkeypatch.setenv(variable, value)
    if value == "":  # an empty variable is unset: the node then has no name at all
        monkeypatch.delenv(variable)
    with pytest.raises(SettingsError, match=f"^{flag} / {variable}: "):
        load(AgentSettings)


# --- gRPC and metrics --------------------------------------------------------------------------------


@pytest.fixture
def offline_agent(tmp_path: Path) -> Agent:
    """A real agent that never reaches an API server (the gRPC API reads only local state)."""
    from kubernetes import client

    key = generate_hmac_key(tmp_path / "key")
    config = agent_settings(node="node-a", store=tmp_path / "store", criu=tmp_path / "no-criu")
    kube = KubeStatus(client.ApiClient(client.Configuration()), "node-a")
    return Agent(config, kube, load_signer(key), load_verifier(key))


def test_a_deleted_inference_snapshot_takes_the_store_files_captured_for_it_alone(
    offline_agent: Agent, tmp_path: Path
) -> None:
    """Its own deletion removes a snapshot at once; a copy of its InferenceSnapshot in another namespace (or
    under another name) names the same store snapshot, and its deletion removes nothing."""
    first, second = (
        _publish(offline_agent.node.store, tmp_path / "key", bytes([i]) * 10, namespace="team-a")
        for i in range(2)
    )
    offline_agent.cleanup.forget_deleted(_isnap(second.id, namespace="team-b"))
    offline_agent.cleanup.forget_deleted(_isnap(second.id, namespace="team-a", name="copy"))
    offline_agent.cleanup.forget_deleted(_isnap(first.id, namespace="team-a"))
    assert [snapshot.id for snapshot in offline_agent.node.store.list()] == [second.id]
    offline_agent.cleanup.forget_deleted(_isnap(first.id, namespace="team-a"))  # already gone: no error
    assert offline_agent.metrics.value("warmstart_agent_store_snapshots_deleted_total") == 1


def test_prestage_takes_only_snapshots_signed_with_its_key(offline_agent: Agent, tmp_path: Path) -> None:
    ours = _publish(offline_agent.node.store, tmp_path / "key", b"x" * 10, namespace="team-a")
    forged = _publish(offline_agent.node.store, generate_hmac_key(tmp_path / "another-key"), b"y" * 10,
                      namespace="team-a")  # fmt: skip
    with contextlib.ExitStack() as held:
        stored = offline_agent.prestage._stored(_isnap(ours.id, namespace="team-a"), held)
        assert stored is not None and stored.id == ours.id
        assert offline_agent.prestage._stored(_isnap(forged.id, namespace="team-a"), held) is None


@pytest.mark.spawns
def test_grpc_answers_on_a_root_only_socket_for_this_node_alone(offline_agent: Agent, tmp_path: Path) -> None:
    published = _publish(offline_agent.node.store, tmp_path / "key", b"x" * 1000, namespace="team-a")
    _publish(offline_agent.node.store, tmp_path / "key", b"y" * 10, node="node-b")  # a shared store
    _publish(offline_agent.node.store, generate_hmac_key(tmp_path / "another-key"), b"z" * 10)  # not ours
    socket_path = tmp_path / "run" / "agent.sock"
    socket_path.parent.mkdir()
    socket_path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError, match="not a socket"):
        serve(offline_agent, socket_path)
    socket_path.unlink()
    server = serve(offline_agent, socket_path)
    assert stat.S_IMODE(socket_path.lstat().st_mode) == 0o600 and socket_path.stat().st_uid == os.getuid()
    try:
        with grpc.insecure_channel(f"unix:{socket_path}") as channel:  # the client generated from the .proto
            agent = agent_pb2_grpc.AgentStub(channel)
            status = agent.Status(agent_pb2.StatusRequest(), timeout=10)
            listed = agent.ListSnapshots(agent_pb2.ListSnapshotsRequest(), timeout=10).snapshots
            other = agent.ListSnapshots(agent_pb2.ListSnapshotsRequest(identity_hash="ff" * 6), timeout=10)
    finally:
        server.stop(grace=None)
    assert status.node == "node-a" and list(other.snapshots) == []
    assert status.criu_version == "" and "no-criu" in status.criu_error
    assert list(status.in_flight) == [] and (status.cuda_available or status.cuda_reason)
    assert [(s.id, s.namespace, s.size) for s in listed] == [(published.id, "team-a", 1000)]
    assert listed[0].identity_hash == published.identity_hash and listed[0].created


@pytest.mark.spawns
def test_the_generated_grpc_code_is_current(tmp_path: Path) -> None:
    """The *_pb2*.py files are what hack/generate-proto makes of the .proto files today."""
    repo, python_dir = Path(__file__).resolve().parents[2], Path(sys.executable).parent
    command = [str(repo / "hack" / "generate-proto"), str(tmp_path)]
    environment = {**os.environ, "PATH": f"{python_dir}:{os.environ['PATH']}"}
    subprocess.run(command, check=True, timeout=120, env=environment)
    generated = sorted((tmp_path / "warmstart" / "agent" / "proto").iterdir())
    assert [path.name for path in generated] == [
        f"{name}{suffix}" for name in ("agent", "cri") for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
    ]
    checked_in = repo / "warmstart" / "agent" / "proto"
    stale = [path.name for path in generated if path.read_bytes() != (checked_in / path.name).read_bytes()]
    assert stale == [], f"run hack/generate-proto: {stale} differ from the .proto files"


def test_metrics_endpoint_serves_the_agents_series() -> None:
    import socket

    metrics = AgentMetrics()
    metrics.restores.labels("failed").inc()
    metrics.restore_seconds.observe(1.5)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    metrics.serve(port, "127.0.0.1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'warmstart_agent_restores_total{result="failed"} 1.0' in text
    assert "warmstart_agent_restore_seconds_count 1.0" in text
    assert metrics.value("warmstart_agent_restores_total", {"result": "failed"}) == 1.0


@pytest.mark.spawns
def test_agent_cli_is_registered() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "warmstart", "agent", "--node", ""], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "WARMSTART_NODE_NAME" in result.stderr


def test_restore_work_directories_of_no_running_restore_are_reclaimed(offline_agent: Agent) -> None:
    """An agent killed mid-restore leaves its work directory (hard links into the store's blobs); the next
    agent removes it at start and the cleanup loop removes any other one no restore runs for."""
    root = offline_agent.config.restore_work_dir
    for uid in ("interrupted", "running"):
        (root / uid / "criu").mkdir(parents=True)
        (root / uid / "criu" / "pages-1.img").write_bytes(b"x" * 4096)
    (root / "stray-link").symlink_to(root / "running")
    offline_agent._in_flight["running"] = Operation("restore", "ns/p", "s")
    assert sorted(offline_agent.cleanup.reclaim_work_dirs()) == ["interrupted", "stray-link"]
    assert sorted(os.listdir(root)) == ["running"]
    assert (root / "running" / "criu" / "pages-1.img").exists()  # a link is removed, never followed
    offline_agent._in_flight.clear()
    assert offline_agent.cleanup.reclaim_work_dirs() == ["running"]


@pytest.mark.spawns
def test_an_agent_starting_removes_the_staging_a_killed_capture_left(offline_agent: Agent) -> None:
    """Not a cleanup interval later: on a shared volume such a staging holds a whole capture's size."""
    script = (
        "import sys; from pathlib import Path; from warmstart.snapshot.store import SnapshotStore; "
        "from warmstart.snapshot.staging_owner import create_staging_root; "
        "print(create_staging_root(SnapshotStore(Path(sys.argv[1])).layout))"
    )
    store = offline_agent.node.store
    store.layout.ensure()
    made = subprocess.run([sys.executable, "-c", script, str(store.root)], capture_output=True, text=True,
                          check=True, timeout=60)  # fmt: skip
    staging = Path(made.stdout.strip())  # its owner exited without publishing, as a killed capture does
    assert staging.is_dir()
    offline_agent.node.stopping.set()  # the loop's start only
    offline_agent.cleanup.loop()
    assert not staging.exists()


def test_a_runtime_that_cannot_be_asked_answers_nothing(tmp_path: Path) -> None:
    assert ContainerRuntime(tmp_path / "absent.sock").container_image("uid", "worker") == ""
    with socket.socket(socket.AF_UNIX) as unanswered:  # a socket nobody listens on
        unanswered.bind(str(tmp_path / "cri.sock"))
        assert ContainerRuntime(tmp_path / "cri.sock").container_image("uid", "worker") == ""


class _RuntimeListingLate(cri_pb2_grpc.RuntimeServiceServicer):
    """A CRI runtime service whose pod has an exited first attempt of the worker (another image) and, from its
    `listed_from`th list on, a second attempt in `state`."""

    def __init__(self, listed_from: int, state: int = cri_pb2.CONTAINER_CREATED) -> None:
        self.lists, self.listed_from, self.state = 0, listed_from, state

    def ListContainers(self, request, context):  # noqa: N802 (the CRI's name)
        self.lists += 1
        assert request.filter.label_selector["io.kubernetes.pod.uid"] == "uid"
        exited = cri_pb2.Container(
            id="old",
            metadata=cri_pb2.ContainerMetadata(name="worker", attempt=0),
            state=cri_pb2.CONTAINER_EXITED,
        )
        if self.lists < self.listed_from:
            return cri_pb2.ListContainersResponse(containers=[exited])
        new = cri_pb2.Container(
            id="new", metadata=cri_pb2.ContainerMetadata(name="worker", attempt=1), state=self.state
        )
        return cri_pb2.ListContainersResponse(containers=[new, exited])

    def ContainerStatus(self, request, context):  # noqa: N802
        images = {"new": "sha256:new", "old": "sha256:old"}
        return cri_pb2.ContainerStatusResponse(
            status=cri_pb2.ContainerStatus(image_ref=images[request.container_id])
        )


@pytest.mark.parametrize(
    ("listed_from", "state", "expected"),
    [
        (1, cri_pb2.CONTAINER_CREATED, "sha256:new"),  # known from the container's creation
        (1, cri_pb2.CONTAINER_RUNNING, "sha256:new"),
        (4, cri_pb2.CONTAINER_RUNNING, "sha256:new"),  # listed late: asked again
        (1, cri_pb2.CONTAINER_EXITED, ""),  # an exited container is never the worker
        (10_000, cri_pb2.CONTAINER_RUNNING, ""),  # never listed: "" after a bounded time
    ],
)
def test_the_runtime_names_the_image_of_the_pods_live_worker_container(
    tmp_path: Path, listed_from: int, state: int, expected: str
) -> None:
    runtime = _RuntimeListingLate(listed_from, state)
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    cri_pb2_grpc.add_RuntimeServiceServicer_to_server(runtime, server)
    server.add_insecure_port(f"unix://{tmp_path / 'cri.sock'}")
    server.start()
    try:
        assert ContainerRuntime(tmp_path / "cri.sock").container_image("uid", "worker") == expected
    finally:
        server.stop(None)
    assert runtime.lists >= (listed_from if expected else 2)


def test_without_the_runtimes_answer_the_image_is_the_kubelets(tmp_path: Path) -> None:
    pod = {"metadata": {"namespace": "ns", "name": "p", "uid": "u"}}
    reported = {**pod, "status": {"containerStatuses": [{"name": "worker", "imageID": "sha256:abc"}]}}
    kube = SimpleNamespace(get_pod=lambda namespace, name: reported)
    silent = ContainerRuntime(tmp_path / "absent.sock")
    node = NodeContext(
        config=agent_settings(node="n", store=tmp_path), kube=kube, signer=None,
        verifier=None, metrics=None, store=None, criu=None, runtime=silent,
    )  # type: ignore[arg-type]  # fmt: skip
    assert node.worker_image(pod) == "sha256:abc"


def test_a_pod_whose_model_or_engine_changed_is_refused_with_a_typed_reason_and_its_facts_digest(
    offline_agent: Agent, tmp_path: Path
) -> None:
    """What the operator acts on to capture again: the kind of change and a digest of the pod's facts, the
    same for the same facts; a pod that could not measure its facts gets no such reason."""
    from warmstart.agent.restore import PodChanged, Refused
    from warmstart.api.control_dir import RESTORE_FACTS, ControlDir
    from warmstart.api.restore_facts import RestoreFacts

    captured = RestoreFacts("builtin", "1", ("--port", "8000"), "/m", {"model.safetensors": (10, "aa")})
    record = CaptureRecord(worker=WorkerRecord(restore_facts=captured.to_dict()))
    snapshot = SimpleNamespace(id="s", record=record)

    def refusal(facts: RestoreFacts, name: str) -> Refused:
        control = ControlDir(tmp_path / name)
        control.path.mkdir()
        control.send(RESTORE_FACTS, facts.to_dict())
        with pytest.raises(Refused) as caught:
            offline_agent.restore.check_restore_facts(snapshot, control)  # type: ignore[arg-type]
        return caught.value

    overwritten = RestoreFacts("builtin", "1", ("--port", "8000"), "/m", {"model.safetensors": (10, "bb")})
    model = refusal(overwritten, "model")
    assert isinstance(model, PodChanged) and "model.safetensors changed content" in str(model)
    assert model.report["refused"] == "ModelChanged" and len(model.report["factsDigest"]) == 64
    assert refusal(overwritten, "again").report == model.report  # type: ignore[attr-defined]
    flags = refusal(RestoreFacts("builtin", "1", ("--port", "9000"), "/m", captured.model_files), "flags")
    assert isinstance(flags, PodChanged) and flags.report["refused"] == "EngineChanged"
    assert flags.report["factsDigest"] != model.report["factsDigest"]
    unmeasured = refusal(RestoreFacts("builtin", "1", (), "/m", error="no model"), "unmeasured")
    assert not isinstance(unmeasured, PodChanged)
