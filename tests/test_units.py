"""Pure logic of the node mechanics and the one-machine mode: failure counting, identity records, tables."""

from __future__ import annotations

import multiprocessing
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import restore_bench
from restore_bench import Floor, Series, _rows
from support import REPO

from warmstart.api.identity import SnapshotIdentity
from warmstart.api.snapshot import MAX_RESTORE_FAILURES, Phase, SnapshotStatus, derive_phase
from warmstart.checkpoint.restore import FailureCounter
from warmstart.serve.identity_cache import IdentityCache
from warmstart.serve.local_node import prune_work_dir
from warmstart.serve.worker_spec import WorkerSpec
from warmstart.snapshot.signing_keys import signing_keys

IDENTITY = SnapshotIdentity(model_digest="sha256:" + "ab" * 32, engine="builtin", engine_version="x")


def test_failure_counter_marks_invalid_after_max(tmp_path: Path) -> None:
    counter = FailureCounter(tmp_path, max_failures=2)
    assert counter.count("snap") == 0 and not counter.invalid("snap")
    assert counter.record("snap", "CRIU restore failed: boom") == 1
    assert not counter.invalid("snap")
    assert counter.record("snap", "again") == 2
    assert counter.invalid("snap") and counter.last_reason("snap") == "again"
    counter.clear("snap")
    assert counter.count("snap") == 0


def test_a_node_gives_a_snapshot_up_when_its_status_turns_invalid(tmp_path: Path) -> None:
    """One limit for both: the node stops trying a snapshot at the count that makes the operator mark it
    Invalid (the one-machine mode has no operator, only the node's count)."""
    counter = FailureCounter(tmp_path)
    for failures in range(1, MAX_RESTORE_FAILURES + 1):
        counter.record("snap", "boom")
        phase, _, _ = derive_phase(SnapshotStatus(restore_failures=failures))
        assert counter.invalid("snap") == (phase == Phase.INVALID), failures
    assert counter.invalid("snap")


def _record_failures(store: str, times: int) -> None:
    counter = FailureCounter(Path(store))
    for _ in range(times):
        counter.record("snap", "boom")


@pytest.mark.spawns
def test_failure_counter_loses_no_concurrent_failure(tmp_path: Path) -> None:
    """Restores failing at once in several processes (one node's agent, or agents sharing a store's volume)
    each count: the record is read, added to and written under a lock."""
    processes, each = 6, 40
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes) as pool:
        pool.starmap(_record_failures, [(str(tmp_path), each)] * processes)
    assert FailureCounter(tmp_path).count("snap") == processes * each


def test_failure_counter_rejects_path_like_ids(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a snapshot id"):
        FailureCounter(tmp_path).record("../etc", "x")


def test_identity_cache_round_trip_and_model_change(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    signer, verifier, note = signing_keys(tmp_path / "store", None)
    assert "generated a signing key" in note
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    weights = model_dir / "model.safetensors"
    weights.write_bytes(b"weights")
    cache = IdentityCache(tmp_path / "store", signer, verifier)
    spec = WorkerSpec(model="tiny")
    assert cache.lookup(spec)[0] is None
    cache.record(spec, IDENTITY, str(model_dir))
    assert cache.lookup(spec) == (IDENTITY, "")
    assert cache.lookup(WorkerSpec(model="tiny", device="cuda"))[0] is None  # another key
    weights.write_bytes(b"other weights")
    identity, reason = cache.lookup(spec)
    assert identity is None and "changed" in reason


def test_identity_cache_refuses_another_key(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    signer, _, _ = signing_keys(tmp_path / "a", None)
    _, other_verifier, _ = signing_keys(tmp_path / "b", None)
    IdentityCache(tmp_path / "a", signer, other_verifier).record(WorkerSpec(), IDENTITY, str(tmp_path))
    identity, reason = IdentityCache(tmp_path / "a", signer, other_verifier).lookup(WorkerSpec())
    assert identity is None and "not trusted" in reason


@pytest.mark.spawns
def test_prune_removes_only_dead_runs(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    (tmp_path / f"restore-1-{dead_pid}").mkdir()
    (tmp_path / f"restore-1-{dead_pid}-images").mkdir()
    (tmp_path / f"restore-1-{os.getpid()}").mkdir()
    prune_work_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"restore-1-{os.getpid()}"]


def test_bench_rows_compare_with_cold_and_floor() -> None:
    cold = Series("cold start", ready=[4.0, 2.0, 3.0], first_token=[3.1, 2.1, 4.1])
    restore = Series("restore", ready=[1.0, 0.5, 1.5], first_token=[1.1, 0.6, 1.6], outputs_identical=[True])
    dropped = Series("restore", ready=[5.0], first_token=[5.5], cache="dropped", outputs_identical=[False])
    rows = _rows([cold, restore, dropped], [Floor("hot", 0.55, "detail"), Floor("dropped", 5.0, "detail")])
    assert rows[0] == ["cold start", "hot", "3.00 s", "3.10 s", "2.10-4.10 s", "3", "", "", "1.0x", ""]
    assert rows[1][2:] == ["1.00 s", "1.10 s", "0.60-1.60 s", "3", "0.55 s", "2.00x", "2.8x", "yes"]
    assert rows[2][1:] == ["dropped", "5.00 s", "5.50 s", "5.50-5.50 s", "1", "5.00 s", "1.10x", "", "NO"]


def test_worker_command_carries_mode_port_and_control_dir() -> None:
    command = WorkerSpec(device="cuda", port=8123).command("restore", Path("/run/x/control"))
    assert command[1:4] == ["-m", "warmstart", "worker"]
    joined = " ".join(command)
    assert "--mode restore" in joined and "--port 8123" in joined and "--device cuda" in joined
    assert "--control-dir /run/x/control" in joined


@pytest.mark.spawns
def test_bench_refuses_fewer_than_one_repetition(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, restore_bench.__file__, "--store", str(tmp_path), "--repeat", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--repeat must be at least 1, got 0" in result.stderr


@pytest.mark.spawns
@pytest.mark.parametrize("command", [["-m", "warmstart", "serve"], [restore_bench.__file__]])
def test_serve_and_bench_refuse_a_port_out_of_range(tmp_path: Path, command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, *command, "--store", str(tmp_path), "--port", "70000"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "port must be between 0 and 65535, got 70000" in result.stderr


GPU_SCRIPT = REPO / "hack" / "device-gpu-bench.sh"


def _script_words(line: str) -> list[str]:
    """A shell line's words, with every `${VAR:+WORDS}` set and every `${VAR:-DEFAULT}` at its default."""
    line = re.sub(r"\$\{\w+:\+([^}]*)\}", r"\1", line)
    line = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", line)
    return shlex.split(line.replace('"$THP"', "always"))


def test_the_gpu_scripts_restore_benchmark_runs_parse_as_the_benchmark_takes_them() -> None:
    """What hack/device-gpu-bench.sh asks of the restore benchmark on the GPU machine, parsed here: a flag
    renamed or dropped fails in CI, not in a GPU call."""
    lines = GPU_SCRIPT.read_text().replace("\\\n", " ").splitlines()
    direct = [
        line.split("restore_bench.py", 1)[1].split("2>&1", 1)[0]
        for line in lines
        if "python3 benchmarks/restore_bench.py" in line
    ]
    fixed = direct[0].split('"$@"', 1)[0]  # bench_restore's own flags; its callers add theirs
    for line in direct[1:]:  # the script's runs outside bench_restore (the check mode)
        assert restore_bench.argument_parser().parse_args(_script_words(line)).device == "cuda", line
    assert len(direct) >= 2, direct
    calls = [_script_words(line) for line in lines if re.match(r"\s*(\S+=\S+ )?bench_restore ", line)]
    assert len(calls) >= 4, calls
    for words in calls:
        given = words[words.index("bench_restore") + 3 :]  # after the run's name and CRIU command
        args = restore_bench.argument_parser().parse_args([*_script_words(fixed), *given])
        assert args.device == "cuda" and args.model == "qwen3-8b" and args.worker_arg, args


@pytest.mark.spawns
@pytest.mark.parametrize("command", [["-m", "warmstart", "serve"], [restore_bench.__file__]])
def test_serve_and_bench_refuse_an_unknown_huge_pages_mode(tmp_path: Path, command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, *command, "--store", str(tmp_path),
         "--transparent-hugepages", "some"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--transparent-hugepages: invalid choice: 'some'" in result.stderr


@pytest.mark.parametrize("fresh_memory", [False, True])
def test_the_bench_reads_every_byte_into_reused_or_fresh_memory(tmp_path: Path, fresh_memory: bool) -> None:
    from restore_bench import READ_CHUNK, read_bandwidth

    files = [tmp_path / "a", tmp_path / "b", tmp_path / "empty"]
    files[0].write_bytes(b"x" * (READ_CHUNK + 5))  # a short last piece too
    files[1].write_bytes(b"y" * 7)
    files[2].touch()
    for threads in (1, 3):
        size, seconds = read_bandwidth(files, threads, fresh_memory=fresh_memory)
        assert size == READ_CHUNK + 12 and seconds > 0


@pytest.mark.spawns
def test_serve_names_the_logs_of_a_worker_that_exits_before_serving(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "warmstart", "serve", "--store", str(tmp_path), "--port", "0",
         "--criu", str(tmp_path / "no-criu"), "--worker-arg=--no-such-flag", "--once"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "the worker exited before it served; see " in result.stderr
    init_log = Path(result.stderr.split("; see ", 1)[1].split(" and ", 1)[0])
    assert "--no-such-flag" in init_log.read_text()  # the named log says what went wrong


def test_capture_refuses_ids_a_restore_sandbox_cannot_give_back(tmp_path: Path) -> None:
    from warmstart.checkpoint.capture import CaptureError, check_ids_restorable
    from warmstart.checkpoint.sandbox import RESERVED_PIDS

    for name in ("core-7.img", "core-31.img", "pstree.img", "pages-1.img"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / f"core-{RESERVED_PIDS}.img").write_bytes(b"")
    check_ids_restorable(tmp_path)  # ids up to the reserved bound stay free in a restore sandbox
    (tmp_path / f"core-{RESERVED_PIDS + 1}.img").write_bytes(b"")
    with pytest.raises(CaptureError, match=f"id {RESERVED_PIDS + 1}; restores keep only ids up to"):
        check_ids_restorable(tmp_path)


def test_identity_key_follows_the_installed_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another torch or vLLM (a new version file, or files written anew) is another key; reading it imports
    neither package."""
    package = tmp_path / "site" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('never imported')\n")
    (package / "version.py").write_text("__version__ = '1.0'\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    first = IdentityCache.key(WorkerSpec(model="tiny"))
    assert IdentityCache.key(WorkerSpec(model="tiny")) == first
    (package / "version.py").write_text("__version__ = '1.1'\n")
    assert IdentityCache.key(WorkerSpec(model="tiny")) != first
    assert "torch" not in sys.modules
