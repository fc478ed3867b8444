"""Capture into a real store and restore from it, with real CRIU, on a small stateful process."""

from __future__ import annotations

import json
import logging
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import recording_criu_command, wait_for_line, wait_until

from warmstart.api.control_dir import (
    READY_FOR_SNAPSHOT,
    RESTORE_COMPLETE,
    RESTORE_FAILED,
    SNAPSHOT_COMPLETE,
    ControlDir,
)
from warmstart.api.identity import SnapshotIdentity
from warmstart.checkpoint import weight_staging
from warmstart.checkpoint.capture import CaptureError, CaptureOptions, capture
from warmstart.checkpoint.criu import Criu
from warmstart.checkpoint.restore import (
    LAZY_PAGES_ENV,
    FailureCounter,
    PidTaken,
    RestoreFailed,
    RestoreRefused,
    restore,
)
from warmstart.checkpoint.sandbox import MOUNTPOINT, Sandbox, namespace_pids, waiting_init_command
from warmstart.gpu.weight_stager.plan import StagingPlan
from warmstart.snapshot import verify
from warmstart.snapshot.layout import SIGNATURE_FILE
from warmstart.snapshot.signing import load_signer, load_verifier, signature_document
from warmstart.snapshot.store import Snapshot, SnapshotStore

pytestmark = [pytest.mark.integration, pytest.mark.spawns]
TARGET = Path(__file__).with_name("target_process.py")
RANKS = Path(__file__).with_name("ranks_target.py")  # two ranks of a tensor-parallel product (gloo)


def _identity(seed: int) -> SnapshotIdentity:
    return SnapshotIdentity(model_digest=f"sha256:{seed:0>64}", engine="target", engine_version="1")


@pytest.fixture
def counting_criu(tmp_path: Path, criu_command: str) -> tuple[Criu, Callable[[], list[str]]]:
    """The real CRIU behind a wrapper that records each invocation's subcommand."""
    wrapper, invoked = recording_criu_command(tmp_path, criu_command)
    return Criu(wrapper, timeout=120), invoked


def _start_target(
    host_dir: Path, seed: int, sandboxes: list[Sandbox], *extra: str, program: Path = TARGET
) -> Sandbox:
    (host_dir / "control" / "logs").mkdir(parents=True)
    control = MOUNTPOINT / "control"
    target = f"{shlex.quote(sys.executable)} {program} {control} {seed} {' '.join(extra)}"
    script = f"setsid {target} </dev/null >{control}/logs/out 2>&1"
    sandbox = Sandbox.start(host_dir, ["/bin/sh", "-c", script + " & wait"])
    sandboxes.append(sandbox)
    return sandbox


def _capture(tmp_path: Path, store: SnapshotStore, key: Path, criu: Criu, sandboxes: list[Sandbox], **kw):
    sandbox = _start_target(tmp_path / "capture", 9, sandboxes)
    result = capture(
        store=store, signer=load_signer(key), sandbox=sandbox,
        control=ControlDir(sandbox.host_dir / "control"), criu=criu, options=CaptureOptions(**kw),
    )  # fmt: skip
    return sandbox, result


def _restore_into_new_sandbox(
    tmp_path: Path, name: str, store: SnapshotStore, key: Path, snapshot_id: str, criu: Criu,
    sandboxes: list[Sandbox], identity: SnapshotIdentity | None = None, port: int = 9100,
):  # fmt: skip
    sandbox = Sandbox.start(tmp_path / name, waiting_init_command(), reserve_pids=True)
    sandboxes.append(sandbox)
    control = ControlDir(sandbox.host_dir / "control")
    result = restore(
        store=store, verifier=load_verifier(key), snapshot_id=snapshot_id,
        expected_identity=identity or _identity(9), sandbox=sandbox, control=control, criu=criu,
        work_dir=tmp_path / f"{name}-work", resume_payload={"port": port},
    )  # fmt: skip
    return sandbox, result


def test_source_keeps_serving_and_restore_answers_identically(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox]
) -> None:
    criu, _ = counting_criu
    source, captured = _capture(tmp_path, store, key, criu, sandboxes, resume_payload={"port": 9000})
    assert store.list() and store.list()[0].id == captured.snapshot.id
    assert {"wait_ready", "criu_dump", "publish"} <= set(captured.timings)
    assert "criu/inventory.img" in captured.snapshot.files
    # one core-<id>.img per thread: what the capture's check of restorable ids reads
    assert f"criu/core-{captured.snapshot.record.engine_pid}.img" in captured.snapshot.files
    assert "sandbox/control/logs/out" in captured.snapshot.files
    source_answer = wait_for_line(source.host_dir / "control" / "answer").split()
    assert source_answer[2] == "9000"  # the source resumed in place with its payload

    restored, result = _restore_into_new_sandbox(
        tmp_path, "restored", store, key, captured.snapshot.id, criu, sandboxes
    )
    restored_answer = wait_for_line(restored.host_dir / "control" / "answer").split()
    assert restored_answer[0] == source_answer[0]
    assert restored_answer[2] == "9100"
    assert result.host_pid != result.namespace_pid
    assert restored.process.wait(timeout=30) == 0


def test_exit_mode_source_exits_once_told_snapshot_complete(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox]
) -> None:
    criu, _ = counting_criu
    source, captured = _capture(tmp_path, store, key, criu, sandboxes, keep_serving=False)
    ControlDir(source.host_dir / "control").send(SNAPSHOT_COMPLETE, {"snapshot": captured.snapshot.id})
    assert source.process.wait(timeout=30) == 0
    assert not (source.host_dir / "control" / "answer").exists()
    restored, _ = _restore_into_new_sandbox(tmp_path, "r", store, key, captured.snapshot.id, criu, sandboxes)
    assert len(wait_for_line(restored.host_dir / "control" / "answer").split()[0]) == 64


def _flip_a_byte_of_the_memory_image(store: SnapshotStore, snapshot: Snapshot) -> None:
    pages = max(
        (name for name in snapshot.files if name.startswith("criu/pages-")),
        key=lambda name: snapshot.files[name].size,
    )
    blob = store.blob_path(snapshot.files[pages].digest)
    blob.chmod(0o644)
    with open(blob, "r+b") as handle:
        first = handle.read(1)
        handle.seek(0)
        handle.write(bytes([first[0] ^ 0xFF]))


def _manifest_with_plan(snapshot: Snapshot, plan: StagingPlan) -> bytes:
    """The stored manifest, as JSON, with a weight staging plan added to its meta."""
    manifest = json.loads((snapshot.path / "manifest.json").read_text())
    manifest["meta"].update(uses_cuda=True, worker={"weight_staging": plan.to_dict()})
    return json.dumps(manifest).encode()


def _replace(snapshot: Snapshot, name: str, content: bytes) -> None:
    (snapshot.path / name).chmod(0o644)
    (snapshot.path / name).write_bytes(content)


def _record_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str, events: list[str], event: str):
    """Wrap `owner.name` so that each call appends `event` first; returns the objects it was called on."""
    original, receivers = getattr(owner, name), []

    def recorded(*args: object) -> object:
        events.append(event)
        receivers.append(args[0] if args else None)
        return original(*args)

    monkeypatch.setattr(owner, name, recorded)
    return receivers


def test_tampered_snapshot_is_refused_before_criu_runs(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox]
) -> None:
    criu, invoked = counting_criu
    _, captured = _capture(tmp_path, store, key, criu, sandboxes)
    _flip_a_byte_of_the_memory_image(store, captured.snapshot)
    calls_before = invoked()
    with pytest.raises(RestoreRefused, match="corrupted"):
        _restore_into_new_sandbox(tmp_path, "r", store, key, captured.snapshot.id, criu, sandboxes)
    assert invoked() == calls_before  # CRIU never saw the tampered image
    failed = ControlDir(tmp_path / "r" / "control").read(RESTORE_FAILED)
    assert failed is not None and "corrupted" in failed.payload["reason"]
    assert FailureCounter(store.root).count(captured.snapshot.id) == 1


def test_tampered_manifest_is_refused_by_its_signature(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox]
) -> None:
    criu, invoked = counting_criu
    _, captured = _capture(tmp_path, store, key, criu, sandboxes)
    manifest_file = captured.snapshot.path / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["meta"]["engine_pid"] = 1
    manifest_file.chmod(0o644)
    manifest_file.write_text(json.dumps(manifest))
    calls_before = invoked()
    with pytest.raises(RestoreRefused, match="signature"):
        _restore_into_new_sandbox(tmp_path, "r", store, key, captured.snapshot.id, criu, sandboxes)
    assert invoked() == calls_before


def test_a_plan_added_to_a_stored_manifest_is_never_followed(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    criu, invoked = counting_criu
    _, captured = _capture(tmp_path, store, key, criu, sandboxes)
    plan = StagingPlan(0, 1 << 21, (("/etc/shadow", 0, 0, 4096),))  # what a tampered store would ask for
    _replace(captured.snapshot, "manifest.json", _manifest_with_plan(captured.snapshot, plan))
    started: list[weight_staging.StagerProcess] = []
    start = weight_staging.StagerProcess.start

    def recording_start(*args: object) -> weight_staging.StagerProcess:
        started.append(start(*args))  # type: ignore[arg-type]
        return started[-1]

    monkeypatch.setattr(weight_staging.StagerProcess, "start", recording_start)
    (tmp_path / "r" / "control").mkdir(parents=True)  # a pod's control directory, where its socket goes
    calls_before = invoked()
    with pytest.raises(RestoreRefused, match="signature"):
        _restore_into_new_sandbox(tmp_path, "r", store, key, captured.snapshot.id, criu, sandboxes)
    assert invoked() == calls_before
    assert len(started) == 1, "the stored manifest's plan started a stager before verification"
    stager = started[0]
    assert (
        stager._plan_pipe is None and stager.process.returncode is not None and stager.process.returncode < 0
    )
    assert not list((tmp_path / "r" / "control").glob("weight-stager-*.sock"))


def test_a_signed_plan_goes_to_the_stager_before_the_blobs_are_hashed_and_a_bad_blob_stops_it(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    criu, invoked = counting_criu
    _, captured = _capture(tmp_path, store, key, criu, sandboxes)
    raw = _manifest_with_plan(captured.snapshot, StagingPlan(0, 1 << 21, (("/weights.bin", 0, 0, 4096),)))
    _replace(captured.snapshot, "manifest.json", raw)
    _replace(captured.snapshot, SIGNATURE_FILE, signature_document(load_signer(key), raw))
    _flip_a_byte_of_the_memory_image(store, captured.snapshot)  # signed, but the memory image is not intact
    events: list[str] = []
    _record_calls(monkeypatch, weight_staging.StagerProcess, "send_plan", events, "plan")
    _record_calls(monkeypatch, verify, "verify_blobs", events, "hash")
    stopped = _record_calls(monkeypatch, weight_staging.StagerProcess, "stop", events, "stop")
    (tmp_path / "r" / "control").mkdir(parents=True)
    calls_before = invoked()
    with pytest.raises(RestoreRefused, match="corrupted"):
        _restore_into_new_sandbox(tmp_path, "r", store, key, captured.snapshot.id, criu, sandboxes)
    assert invoked() == calls_before  # CRIU never ran
    # the signed plan went to the stager before any blob was hashed; the bad blob then stopped it
    assert events == ["plan", "hash", "stop"]
    assert stopped[0].process.returncode is not None
    assert not list((tmp_path / "r" / "control").glob("weight-stager-*.sock"))


def test_foreign_identity_is_refused_before_criu_runs(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox]
) -> None:
    criu, invoked = counting_criu
    _, captured = _capture(tmp_path, store, key, criu, sandboxes)
    calls_before = invoked()
    with pytest.raises(RestoreRefused, match="model_digest"):
        _restore_into_new_sandbox(
            tmp_path, "r", store, key, captured.snapshot.id, criu, sandboxes, identity=_identity(10)
        )
    assert invoked() == calls_before


def test_failed_criu_restore_is_cleaned_up_and_counted(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox]
) -> None:
    criu, _ = counting_criu
    _, captured = _capture(tmp_path, store, key, criu, sandboxes)
    broken = Criu([*criu.command, "--no-such-criu-option"], timeout=60)
    counter = FailureCounter(store.root, max_failures=2)
    for attempt in (1, 2):
        with pytest.raises(RestoreFailed, match="CRIU restore failed"):
            _restore_into_new_sandbox(
                tmp_path, f"r{attempt}", store, key, captured.snapshot.id, broken, sandboxes
            )
        sandbox = sandboxes[-1]
        assert sandbox.host_pids() == [sandbox.init_pid]
        assert counter.count(captured.snapshot.id) == attempt
    assert counter.invalid(captured.snapshot.id)


def _hold_pid(sandbox: Sandbox, pid: int) -> int:
    """A process of the sandbox's PID namespace given `pid` there (as a pod's own process could hold it);
    its host PID."""
    script = f"echo {pid - 1} > /proc/sys/kernel/ns_last_pid; sleep 300 & wait"
    subprocess.Popen(["nsenter", f"--target={sandbox.init_pid}", "--pid", "--", "/bin/sh", "-c", script])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        held = [host for host in sandbox.host_pids() if namespace_pids(host)[-1:] == [pid]]
        if held:
            return held[0]
        time.sleep(0.05)
    raise AssertionError(f"PID {pid} not taken in the sandbox: {sandbox.host_pids()}")


def test_a_pid_taken_in_the_pod_fails_the_restore_without_counting_it_against_the_snapshot(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox]
) -> None:
    criu, _ = counting_criu
    _, captured = _capture(tmp_path, store, key, criu, sandboxes)
    engine_pid = captured.snapshot.record.engine_pid
    sandbox = Sandbox.start(tmp_path / "taken", waiting_init_command(), reserve_pids=True)
    sandboxes.append(sandbox)
    holder = _hold_pid(sandbox, engine_pid)
    control = ControlDir(sandbox.host_dir / "control")
    taken = (
        f"PID {engine_pid}, which the snapshot's process had, is taken in the pod by process named 'sleep'"
    )
    with pytest.raises(PidTaken, match=taken):
        restore(
            store=store, verifier=load_verifier(key), snapshot_id=captured.snapshot.id,
            expected_identity=_identity(9), sandbox=sandbox, control=control, criu=criu,
            work_dir=tmp_path / "taken-work",
        )  # fmt: skip
    answered = control.read(RESTORE_FAILED)  # the worker cold-starts
    assert answered is not None and f"PID {engine_pid}" in answered.payload["reason"]
    assert answered.payload["failures"] is None
    assert FailureCounter(store.root).count(captured.snapshot.id) == 0
    # cleaned up as any failed restore: init alone is left once the killed are reaped
    wait_until(lambda: sandbox.host_pids() == [sandbox.init_pid], "the pod's processes but init killed", 10)
    assert not Path(f"/proc/{holder}").exists()


def test_failed_dump_leaves_no_snapshot_and_source_keeps_serving(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox]
) -> None:
    criu, _ = counting_criu
    broken = Criu([*criu.command, "--no-such-criu-option"], timeout=60)
    sandbox = _start_target(tmp_path / "capture", 9, sandboxes)
    with pytest.raises(CaptureError, match="criu_dump"):
        capture(
            store=store, signer=load_signer(key), sandbox=sandbox,
            control=ControlDir(sandbox.host_dir / "control"), criu=broken,
        )  # fmt: skip
    assert store.list() == []
    assert not any((store.root / "staging").iterdir())
    assert len(wait_for_line(sandbox.host_dir / "control" / "answer").split()[0]) == 64
    assert ControlDir(sandbox.host_dir / "control").read(RESTORE_COMPLETE) is not None


def test_a_worker_writing_during_the_capture_is_refused(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox]
) -> None:
    criu, _ = counting_criu
    sandbox = _start_target(tmp_path / "capture", 9, sandboxes, "chatty")
    with pytest.raises(CaptureError, match=r"wrote to .*logs/out during the capture"):
        capture(
            store=store, signer=load_signer(key), sandbox=sandbox,
            control=ControlDir(sandbox.host_dir / "control"), criu=criu,
        )  # fmt: skip
    assert store.list() == []


@pytest.mark.parametrize(
    ("payload", "complaint"),
    [
        ({"identity": _identity(9).to_dict()}, "no 'pid'"),
        ({"identity": _identity(9).to_dict(), "pid": "one"}, "'pid'"),
        ({"pid": 2}, "no valid 'identity'"),
        ({"identity": _identity(9).to_dict(), "pid": 4242}, "not running in the sandbox"),
    ],
)
def test_a_bad_ready_payload_is_a_capture_error_and_the_worker_is_resumed(
    tmp_path: Path, store: SnapshotStore, key: Path, sandboxes: list[Sandbox], payload, complaint: str
) -> None:
    sandbox = Sandbox.start(tmp_path / "capture", ["/bin/sh", "-c", "sleep 600 & wait"])
    sandboxes.append(sandbox)
    control = ControlDir(sandbox.host_dir / "control")
    control.send(READY_FOR_SNAPSHOT, payload)
    with pytest.raises(CaptureError, match=complaint):
        capture(
            store=store, signer=load_signer(key), sandbox=sandbox, control=control,
            criu=Criu("criu-is-never-reached"), options=CaptureOptions(resume_payload={"port": 9000}),
        )  # fmt: skip
    resumed = control.read(RESTORE_COMPLETE)  # a worker left waiting would never serve
    assert resumed is not None and resumed.payload["port"] == 9000


def _capture_fails_and_source_serves(
    tmp_path: Path, store: SnapshotStore, key: Path, criu: Criu, sandboxes: list[Sandbox], match: str
) -> None:
    sandbox = _start_target(tmp_path / "capture", 9, sandboxes)
    with pytest.raises(CaptureError, match=match) as failure:
        capture(
            store=store, signer=load_signer(key), sandbox=sandbox,
            control=ControlDir(sandbox.host_dir / "control"), criu=criu,
        )  # fmt: skip
    print(f"capture refused as it should: {failure.value}")
    assert len(wait_for_line(sandbox.host_dir / "control" / "answer").split()[0]) == 64  # still serving
    assert ControlDir(sandbox.host_dir / "control").read(RESTORE_COMPLETE) is not None


@pytest.mark.reliability
def test_a_full_disk_fails_the_capture_cleanly(
    tmp_path: Path, key: Path, counting_criu, sandboxes: list[Sandbox], small_mount
) -> None:
    """The store's filesystem fills up mid-dump: no snapshot listed, nothing left that gc keeps."""
    criu, _ = counting_criu
    store = SnapshotStore(small_mount("1m") / "store")
    _capture_fails_and_source_serves(tmp_path, store, key, criu, sandboxes, "criu_dump|No space")
    assert store.list() == []
    store.gc(staging_older_than=0)
    assert not any((store.root / "staging").iterdir())


@pytest.mark.reliability
def test_an_unwritable_store_fails_the_capture_cleanly(
    tmp_path: Path, key: Path, counting_criu, sandboxes: list[Sandbox], small_mount
) -> None:
    criu, _ = counting_criu
    read_only = small_mount("1m", "ro")
    store = SnapshotStore(read_only / "store")
    _capture_fails_and_source_serves(tmp_path, store, key, criu, sandboxes, "Read-only file system")
    assert not (read_only / "store").exists()


@pytest.mark.reliability
def test_a_missing_criu_fails_the_capture_naming_it(
    tmp_path: Path, store: SnapshotStore, key: Path, sandboxes: list[Sandbox]
) -> None:
    missing = Criu(str(tmp_path / "no-criu-here"), timeout=30)
    _capture_fails_and_source_serves(tmp_path, store, key, missing, sandboxes, "no-criu-here")
    assert store.list() == []


def test_a_lazy_pages_restore_answers_identically(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox],
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    """WARMSTART_LAZY_PAGES=1: CRIU's lazy-pages daemon fills the restored process's memory on demand."""
    criu, invoked = counting_criu
    source, captured = _capture(tmp_path, store, key, criu, sandboxes, resume_payload={"port": 9000})
    source_answer = wait_for_line(source.host_dir / "control" / "answer").split()
    monkeypatch.setenv(LAZY_PAGES_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="warmstart.checkpoint.restore"):
        restored, _ = _restore_into_new_sandbox(
            tmp_path, "restored", store, key, captured.snapshot.id, criu, sandboxes
        )
    if fallback := [r.getMessage() for r in caplog.records if "without lazy pages" in r.getMessage()]:
        pytest.skip(f"this machine's CRIU cannot restore lazily: {fallback[0]}")
    assert "lazy-pages" in invoked(), invoked()
    restored_answer = wait_for_line(restored.host_dir / "control" / "answer").split()
    assert restored_answer[0] == source_answer[0] and restored_answer[2] == "9100"
    assert restored.process.wait(timeout=30) == 0


def test_every_rank_of_a_tensor_parallel_tree_is_captured_and_restored_together(
    tmp_path: Path, store: SnapshotStore, key: Path, counting_criu, sandboxes: list[Sandbox]
) -> None:
    criu, _ = counting_criu
    source = _start_target(tmp_path / "capture", 9, sandboxes, program=RANKS)
    captured = capture(
        store=store, signer=load_signer(key), sandbox=source, control=ControlDir(source.host_dir / "control"),
        criu=criu, options=CaptureOptions(resume_payload={"port": 9000}),
    )  # fmt: skip
    # PIDs inside the sandbox: the engine and the rank it started
    ranks = captured.snapshot.record.worker.extra["ranks"]
    for pid in ranks:
        assert f"criu/core-{pid}.img" in captured.snapshot.files  # one image holds every rank
    assert captured.snapshot.record.cuda_pids == []  # CPU ranks: no CUDA process to checkpoint
    source_answer = json.loads(wait_for_line(source.host_dir / "control" / "answer"))
    assert source_answer["after"] == source_answer["before"] and source_answer["matches_one_process"]

    identity = SnapshotIdentity(model_digest=f"sha256:{9:0>64}", engine="ranks", engine_version="1",
                                parallelism=2)  # fmt: skip
    restored, _result = _restore_into_new_sandbox(
        tmp_path, "restored", store, key, captured.snapshot.id, criu, sandboxes, identity=identity
    )
    answer = json.loads(wait_for_line(restored.host_dir / "control" / "answer"))
    # Both ranks came back (with their PIDs), met again through a new rendezvous and summed the same parts.
    assert answer["pids"] == ranks
    assert answer["after"] == source_answer["before"] and answer["matches_one_process"]
    assert restored.process.wait(timeout=60) == 0
