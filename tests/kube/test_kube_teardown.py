"""Stopping the control plane leaves no process behind: after a pytest session interrupted with Ctrl-C,
after its parent is killed outright, and after `hack/control-plane down`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from control_plane import build, versions
from control_plane.cluster import wait_for
from support import python_path_env, with_default_sigint

pytestmark = [pytest.mark.integration, pytest.mark.spawns]

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
HACK = REPO / "hack"


@pytest.fixture(autouse=True)
def _needs_binaries() -> None:
    if not build.is_cached():
        pytest.skip(f"control plane not built in {versions.cache_root()}: run `hack/control-plane build`")


def process_groups_alive(groups: set[int]) -> set[int]:
    """Which of `groups` still have a live (non-zombie) member anywhere on the machine."""
    alive: set[int] = set()
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        state, process_group = fields[0], int(fields[2])
        if process_group in groups and state != "Z":
            alive.add(process_group)
    return alive


def wait_for_file(path: Path, process: subprocess.Popen[str], timeout: float = 180) -> dict[str, int]:
    def written() -> dict[str, int] | None:
        if process.poll() is not None:
            raise AssertionError(f"exited early with {process.returncode}:\n{process.stdout.read()}")
        return json.loads(path.read_text()) if path.is_file() else None

    return wait_for(written, timeout=timeout, message=f"{path.name} from the child process")


def assert_all_gone(pids: dict[str, int]) -> None:
    assert set(pids) >= {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}
    groups = set(pids.values())
    wait_for(lambda: not process_groups_alive(groups), timeout=30, message="all control-plane processes gone")


INNER_TEST = """
    import json, os, pathlib, time

    def test_hold(kube):
        pathlib.Path(os.environ["PIDS_FILE"]).write_text(json.dumps(kube.pids()))
        time.sleep(600)
"""


def test_fixture_teardown_on_ctrl_c_leaves_no_process(tmp_path: Path):
    (tmp_path / "test_hold.py").write_text(textwrap.dedent(INNER_TEST))
    pids_file = tmp_path / "pids.json"
    env = {**python_path_env(TESTS, HACK), "PIDS_FILE": str(pids_file), "WARMSTART_KUBE_NODES": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "kube_plugin", "-p", "no:cacheprovider"]
    session = subprocess.Popen(
        [*command, "--rootdir", str(tmp_path), str(tmp_path / "test_hold.py")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=with_default_sigint,
    )
    try:
        pids = wait_for_file(pids_file, session)
        session.send_signal(signal.SIGINT)
        output, _ = session.communicate(timeout=120)
    finally:
        if session.poll() is None:
            session.kill()
            session.wait()
    assert "KeyboardInterrupt" in output
    assert_all_gone(pids)


PARENT_SCRIPT = """
    import json, pathlib, sys, time
    from control_plane.cluster import ControlPlane

    plane = ControlPlane(state_dir=pathlib.Path(sys.argv[1]), crd_dir=None, nodes=1)
    plane.start()
    pathlib.Path(sys.argv[2]).write_text(json.dumps(plane.pids()))
    time.sleep(600)
"""


def test_killing_the_parent_stops_the_control_plane(tmp_path: Path):
    pids_file = tmp_path / "pids.json"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(PARENT_SCRIPT),
            str(tmp_path / "k"),
            str(pids_file),
        ],
        env=python_path_env(HACK),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        pids = wait_for_file(pids_file, parent)
    finally:
        parent.kill()
        parent.wait()
    assert_all_gone(pids)


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(REPO / "hack" / "control-plane"), *args], env=env, capture_output=True, text=True, timeout=240
    )


def test_up_status_down_leaves_no_process(tmp_path: Path):
    # A private cache whose binaries are the built ones, so `up` state never touches the developer's.
    cache = tmp_path / "cache"
    (cache / "k8s").mkdir(parents=True)
    for built in (versions.bin_dir(), versions.kwok_stage_dir(), versions.crd_dir(), versions.stamp_path()):
        (cache / "k8s" / built.name).symlink_to(built)
    env = {**os.environ, "WARMSTART_CACHE": str(cache), "PYTHON": sys.executable}
    up = run_cli("up", "--nodes", "1", env=env)
    try:
        assert up.returncode == 0, up.stderr
        assert up.stdout.startswith("export KUBECONFIG=")
        state = json.loads((cache / "k8s" / "up" / "state.json").read_text())
        assert run_cli("status", env=env).returncode == 0
        kubeconfig = up.stdout.strip().split("=", 1)[1]
        nodes = subprocess.run(
            [str(versions.bin_dir() / "kubectl"), "--kubeconfig", kubeconfig, "get", "nodes", "-o", "name"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert nodes.stdout.split() == ["node/kwok-gpu-0"]
    finally:
        down = run_cli("down", env=env)
    assert down.returncode == 0, down.stderr
    assert "kube-apiserver" in down.stdout
    assert_all_gone(state["processes"])
    assert run_cli("status", env=env).returncode != 0
