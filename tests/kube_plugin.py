"""pytest fixtures backed by a real local Kubernetes control plane (see `hack/control-plane`).

`kube` (session scope) starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok on
loopback, registers fake GPU nodes and installs the third-party CRDs (KEDA ScaledObject,
TriggerAuthentication, ClusterTriggerAuthentication, HTTPScaledObject; prometheus-operator ServiceMonitor,
PodMonitor). It is torn down at the end of the session (also on Ctrl-C) and leaves no process behind. When
the binaries are not built, tests using it are skipped with the command that builds them. Tests using it are
marked `@pytest.mark.integration`.

The `kube` object:
    .kubeconfig          Path of an admin (system:masters) kubeconfig
    .server              "https://127.0.0.1:<port>"
    .bin_dir             Path holding kubectl, helm, kwok, etcd, kube-* binaries
    .api_client()        a new kubernetes.client.ApiClient for this cluster
    .kubectl(*args, check=True, input=None, timeout=120) -> subprocess.CompletedProcess[str]
    .helm(*args, check=True, input=None, timeout=120)    -> subprocess.CompletedProcess[str]
                         (KUBECONFIG and private HELM_*_HOME directories are set)
    .wait_for(predicate, timeout=60, interval=0.2, message="...")
                         returns the predicate's first truthy value, raises TimeoutError naming `message`
    .nodes               number of fake nodes, named kwok-gpu-0 .. kwok-gpu-{n-1}; each has
                         nvidia.com/gpu: 8 (capacity and allocatable) and label type=kwok
    .startup_seconds, .timings
                         how long the start took (printed in the terminal summary)
    .pids()              {component name: pid} of the running processes

`namespace` (function scope): the name of a fresh namespace whose `default` ServiceAccount exists (so pods
can be created at once); deleted when the test ends.

`wait_for(predicate, timeout, ...)` is also importable from this module.

Environment: WARMSTART_CACHE (where binaries are cached), WARMSTART_KUBE_NODES (fake nodes, default 2),
WARMSTART_TEST_KUBECONFIG: a kubeconfig naming another cluster, which `kube` is then instead of the local
control plane (no fake nodes, .pids() empty); the tests marked `any_cluster` run against it, each other test
using `kube` skips with the reason (it needs the local control plane's kwok nodes, processes or real nodes).
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from control_plane import build, versions
from control_plane.cluster import ControlPlane, wait_for
from control_plane.external import KUBECONFIG_ENV, ExternalCluster

__all__ = ["ControlPlane", "wait_for"]

STARTUP_KEY = pytest.StashKey[str]()


def fake_node_count() -> int:
    text = os.environ.get("WARMSTART_KUBE_NODES", "2")
    if not text.isdigit():
        raise pytest.UsageError(f"WARMSTART_KUBE_NODES must be a whole number >= 0, got {text!r}")
    return int(text)


def external_kubeconfig() -> str:
    return os.environ.get(KUBECONFIG_ENV, "")


def pytest_runtest_setup(item: pytest.Item) -> None:
    uses_kube = "kube" in getattr(item, "fixturenames", ())
    if external_kubeconfig() and uses_kube and item.get_closest_marker("any_cluster") is None:
        pytest.skip(
            "needs the local control plane (its kwok nodes, its processes or a real node of this machine), "
            f"not the cluster {KUBECONFIG_ENV} names"
        )


@pytest.fixture(scope="session")
def kube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    if external := external_kubeconfig():
        cluster = ExternalCluster(Path(external), tmp_path_factory.mktemp("kube"))
        cluster.check_reachable()
        yield cluster  # type: ignore[misc]  # the part of ControlPlane's interface the any_cluster tests use
        return
    if not build.is_cached():
        pytest.skip(
            f"the local Kubernetes control plane is not built in {versions.cache_root()}: "
            "run `hack/control-plane build`"
        )
    plane = ControlPlane(state_dir=tmp_path_factory.mktemp("kube"), nodes=fake_node_count())
    plane.start()
    summary = (
        f"local control plane (Kubernetes {versions.KUBERNETES}) started in {plane.startup_seconds:.1f}s: "
        + ", ".join(f"{phase} {seconds:.1f}s" for phase, seconds in plane.timings.items() if phase != "total")
    )
    request.config.stash[STARTUP_KEY] = summary
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\n{summary}")
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture
def namespace(kube: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    stem = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{stem or 'test'}-{uuid.uuid4().hex[:6]}"
    kube.kubectl("create", "namespace", name)
    kube.wait_default_service_account(name)
    try:
        yield name
    finally:
        kube.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    summary = config.stash.get(STARTUP_KEY, None)
    if summary:
        terminalreporter.write_line(summary)
