"""`warmstart serve` end to end with the builtin engine on CPU and real CRIU: cold start + capture, then
restores that answer byte-identically, refusals that fall back to a cold start, side-by-side restores."""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import (
    answers,
    completion,
    free_port,
    recording_criu_command,
    share_of_word_characters,
    wait_until,
)

from warmstart.api.identity import SnapshotIdentity
from warmstart.checkpoint.criu import Criu
from warmstart.serve.identity_cache import IdentityCache
from warmstart.serve.local_node import LocalNode
from warmstart.serve.worker_spec import StartReport, WorkerSpec
from warmstart.snapshot.signing_keys import default_key_path, signing_keys
from warmstart.snapshot.store import SnapshotStore

pytestmark = [pytest.mark.integration, pytest.mark.spawns]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def recording_criu(tmp_path: Path, criu_command: str) -> tuple[Criu, Callable[[], list[str]]]:
    wrapper, calls = recording_criu_command(tmp_path, criu_command)
    return Criu(wrapper, timeout=300), calls


@pytest.fixture
def make_node(tmp_path: Path, recording_criu) -> Iterator[Callable[..., LocalNode]]:
    nodes: list[LocalNode] = []
    store_root = tmp_path / "store"
    store_root.mkdir(exist_ok=True)
    signer, verifier, _ = signing_keys(store_root, None)

    def make(port: int | None = None) -> LocalNode:
        spec = WorkerSpec(port=port or free_port())
        node = LocalNode(
            spec, SnapshotStore(store_root), signer, verifier, recording_criu[0], tmp_path / "pods"
        )
        nodes.append(node)
        return node

    yield make
    for node in nodes:
        node.stop_all()


@pytest.fixture
def captured(make_node) -> tuple[StartReport, list[str], LocalNode]:
    """A first start (cold + capture) whose source keeps serving; its answers before it is stopped."""
    node = make_node()
    report = node.start()
    assert report.mode == "cold+capture", report.reason
    original = answers(node.spec.base_url)
    node.stop_all()
    return report, original, node


def test_later_start_restores_and_answers_byte_identically(captured, make_node) -> None:
    first, original_answers, _ = captured
    node = make_node()
    report = node.start()
    assert report.mode == "restore", report.reason
    assert report.snapshot_id == first.snapshot_id
    assert answers(node.spec.base_url) == original_answers


def test_two_restores_run_side_by_side_and_answer_identically(captured, make_node) -> None:
    first, original_answers, _ = captured
    nodes = [make_node(), make_node()]
    reports = [node.start() for node in nodes]
    assert [report.mode for report in reports] == ["restore", "restore"]
    sandboxes = [node.sandboxes[-1] for node in nodes]
    engines = [[pid for pid in sb.host_pids() if pid != sb.init_pid] for sb in sandboxes]
    assert engines[0] and engines[1] and not set(engines[0]) & set(engines[1])
    assert sandboxes[0].pid_namespace != sandboxes[1].pid_namespace
    assert [answers(node.spec.base_url) for node in nodes] == [original_answers, original_answers]


def test_the_restore_floor_reads_the_captured_image_and_restores_a_process_with_criu(
    captured, criu_command: str, tmp_path: Path
) -> None:
    """What the benchmarks put each restore against (`restore_bench.restore_floors`), from a real snapshot:
    every byte of its CRIU image read, plus CRIU's own restore of a trivial process."""
    from restore_bench import restore_floors

    first, _, node = captured
    snapshot = node.store.get(first.snapshot_id)
    (tmp_path / "floor").mkdir()
    (floor,) = restore_floors(
        node.store, snapshot, Criu(criu_command, timeout=300), tmp_path / "floor", can_drop=False
    )
    image = sum(entry.size for name, entry in snapshot.files.items() if name.startswith("criu/"))
    fixed = float(re.search(r"CRIU fixed ([0-9.]+) s", floor.detail).group(1))
    assert image > 50 << 20 and f"{image / 2**30:.2f} GiB read" in floor.detail, floor.detail
    assert floor.cache == "hot" and 0 < fixed < floor.seconds, floor.detail


def test_the_demo_model_answers_in_words_identically_after_a_restore(tmp_path: Path, recording_criu) -> None:
    """What `make demo` serves: the trained `demo` preset (trained once into the cache, then reused), captured
    on its first start and restored on the next, answering in the same words."""
    store_root = tmp_path / "store"
    signer, verifier, _ = signing_keys(store_root, None)
    body = {"prompt": "The snapshot", "max_tokens": 64, "temperature": 0}
    started: list[LocalNode] = []
    texts = []
    try:
        for expected in ("cold+capture", "restore"):
            spec = WorkerSpec(model="demo", port=free_port())
            node = LocalNode(
                spec, SnapshotStore(store_root), signer, verifier, recording_criu[0], tmp_path / "p"
            )
            started.append(node)
            report = node.start()
            assert report.mode == expected, report.reason
            texts.append(completion(spec.base_url, "demo", body))
            print(f"{report.mode} in {report.seconds_to_ready:.2f} s: {texts[-1]!r}")
            node.stop_all()
    finally:
        for node in started:
            node.stop_all()
    assert texts[0] == texts[1]
    assert texts[0].strip() and share_of_word_characters(texts[0]) > 0.9, texts[0]


def test_tampered_snapshot_is_refused_before_criu_and_the_worker_cold_starts(
    captured, make_node, recording_criu
) -> None:
    first, original_answers, node = captured
    snapshot = node.store.get(first.snapshot_id)
    inventory = node.store.blob_path(snapshot.files["criu/inventory.img"].digest)
    inventory.chmod(0o644)
    inventory.write_bytes(inventory.read_bytes()[:-1] + b"\x00")
    calls_before = recording_criu[1]()
    node = make_node()
    report = node.start()
    assert report.mode == "cold"
    assert "corrupted" in report.reason or "bytes" in report.reason
    assert recording_criu[1]() == calls_before  # CRIU never ran on the tampered image
    assert answers(node.spec.base_url) == original_answers  # the cold-started worker serves the same model


def test_foreign_identity_is_refused_before_criu_and_the_worker_cold_starts(
    captured, make_node, recording_criu
) -> None:
    first, _, _ = captured
    node = make_node()
    here, _ = node.identities.lookup(node.spec)
    assert here is not None
    foreign = SnapshotIdentity.from_dict({**here.to_dict(), "gpu_product": "NVIDIA H200", "device": "cuda"})
    calls_before = recording_criu[1]()
    report = node.start_restored(first.snapshot_id, foreign)
    assert report.mode == "cold"
    assert "gpu_product" in report.reason and "device" in report.reason
    assert recording_criu[1]() == calls_before


def test_an_edited_identity_record_is_not_trusted(captured) -> None:
    _, _, node = captured
    cache = IdentityCache(node.store.root, node.signer, node.verifier)
    entry_file = next(cache.directory.glob("*.json"))
    entry = json.loads(entry_file.read_text())
    entry["files"] = {"model.safetensors": [1, 1]}
    entry_file.write_text(json.dumps(entry, sort_keys=True))
    identity, reason = cache.lookup(node.spec)
    assert identity is None and "not trusted" in reason  # editing the entry breaks its signature


def test_serve_command_once_prints_the_table(tmp_path: Path, criu_command: str) -> None:
    store = tmp_path / "store"
    command = [sys.executable, "-m", "warmstart", "serve", "--store", str(store), "--port", str(free_port()),
               "--criu", criu_command, "--once", "--work-dir", str(tmp_path / "pods")]  # fmt: skip
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "cold+capture" in first.stdout and "generated a signing key" in first.stdout
    assert stat.S_IMODE(default_key_path(store).stat().st_mode) == 0o600
    assert not (store / "keys").exists()  # the key never lives inside the store it protects
    began = time.monotonic()
    second = subprocess.run(command, capture_output=True, text=True, timeout=600)
    wall = time.monotonic() - began
    assert second.returncode == 0, second.stderr[-2000:]
    assert "│ restore " in second.stdout
    # the command's own start, before the restore's clock: counted, and within the command's whole run
    before = re.search(r"phases: command_start (\d+\.\d+)s, verify_materialize", second.stdout)
    assert before is not None, second.stdout[-2000:]
    assert 0.0 < float(before.group(1)) < wall
    shutil.rmtree(tmp_path / "pods", ignore_errors=True)


def test_serve_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    store, pods = str(tmp_path / "store"), str(tmp_path / "pods")
    command = [sys.executable, "-m", "warmstart", "serve", "--store", store, "--port", str(free_port()),
               "--criu", "/nonexistent/criu", "--work-dir", pods]  # fmt: skip
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("w") as stdout, err.open("w") as stderr:
        serve = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True)
    try:
        wait_until(lambda: "serving on" in out.read_text(), "serve serving", timeout=300)
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)
    finally:
        serve.kill()
    assert serve.returncode == 0, err.read_text()[-2000:]
    assert "stopping" in out.read_text() and "Traceback" not in err.read_text()
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not left, f"processes of this serve still running: {left}"


class _ReadyImpostor(http.server.BaseHTTPRequestHandler):
    """Another program on serve's port that answers /ready as a serving worker would."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        body = b'{"status": "ready", "model": "tiny"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port held by an HTTP server of this test process that answers /ready with 200."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ReadyImpostor)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_serve_never_takes_another_process_on_its_port_for_its_worker(tmp_path: Path, busy_port: int) -> None:
    command = [sys.executable, "-m", "warmstart", "serve", "--store", str(tmp_path / "store"),
               "--port", str(busy_port), "--criu", "/nonexistent/criu", "--once"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 1, result.stdout[-2000:]  # it reported a cold start and exited 0 before
    assert f"answered by another process (pid {os.getpid()}" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


SECOND_SIGNAL = """
import os, signal, time
from warmstart.serve.cli import _stop_on_signals
_stop_on_signals()
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
except KeyboardInterrupt:
    os.kill(os.getpid(), signal.SIGTERM)  # another during the clean-up (a supervisor signalling the group)
    time.sleep(0.1)
    print("cleaned up")
"""


def test_a_second_signal_does_not_cut_serves_clean_up_short() -> None:
    result = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "cleaned up", result.stderr[-2000:]


def _cuda_available() -> bool:
    from warmstart.checkpoint import cuda

    try:
        cuda.driver()
    except cuda.CudaUnavailable:
        return False
    return True


@pytest.mark.gpu
def test_cuda_worker_restores_byte_identically(tmp_path: Path, recording_criu) -> None:
    if not _cuda_available():
        pytest.skip("needs an NVIDIA GPU with driver >= 570 (CUDA checkpoint API)")
    store_root = tmp_path / "store"
    signer, verifier, _ = signing_keys(store_root, None)
    nodes = []
    try:
        for expected in ("cold+capture", "restore"):
            spec = WorkerSpec(device="cuda", port=free_port())
            node = LocalNode(
                spec, SnapshotStore(store_root), signer, verifier, recording_criu[0], tmp_path / "p"
            )
            nodes.append(node)
            report = node.start()
            assert report.mode == expected, report.reason
            if expected == "cold+capture":
                assert "cuda_checkpoint" in report.timings and "cuda_restore" in report.timings
                original = answers(spec.base_url)
            else:
                assert "cuda_driver" in report.timings and "cuda_restore" in report.timings
                assert answers(spec.base_url) == original
                logs = "".join(path.read_text(errors="replace") for path in (tmp_path / "p").rglob("*.log"))
                assert "mapped from the weight stager" in logs, "the restore should start a weight stager"
            node.stop_all()
    finally:
        for node in nodes:
            node.stop_all()


def test_a_tensor_parallel_worker_is_captured_and_restored_with_all_its_ranks(
    tmp_path: Path, recording_criu
) -> None:
    """Two ranks (gloo on CPU): captured as one tree, restored together, answering as before; a restore
    under another parallelism is a different snapshot identity (a cold start, not a wrong restore)."""
    store_root = tmp_path / "store"
    signer, verifier, _ = signing_keys(store_root, None)
    started: list[LocalNode] = []

    def start(*extra: str) -> tuple[StartReport, LocalNode]:
        spec = WorkerSpec(port=free_port(), extra_args=list(extra))
        node = LocalNode(spec, SnapshotStore(store_root), signer, verifier, recording_criu[0], tmp_path / "p")
        started.append(node)
        return node.start(), node

    try:
        first, node = start("--tensor-parallel-size", "2")
        assert first.mode == "cold+capture", first.reason
        original = answers(node.spec.base_url)
        node.stop_all()
        snapshot = SnapshotStore(store_root).get(first.snapshot_id)
        assert snapshot.identity.parallelism == 2
        assert len([name for name in snapshot.files if name.startswith("criu/pstree")]) == 1
        ranks = {name for name in snapshot.files if name.startswith("criu/core-")}
        assert len(ranks) >= 2  # the engine process and its rank (one image per thread)

        again, node = start("--tensor-parallel-size", "2")
        assert again.mode == "restore" and again.snapshot_id == first.snapshot_id, again.reason
        assert answers(node.spec.base_url) == original
        node.stop_all()

        single, node = start()
        assert single.mode == "cold+capture" and single.snapshot_id != first.snapshot_id
        assert answers(node.spec.base_url) == original  # the same model: one rank or two, the same tokens
    finally:
        for node in started:
            node.stop_all()
