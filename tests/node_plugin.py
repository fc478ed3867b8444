"""pytest fixtures for one real Kubernetes node beside the kwok ones (see `hack/control-plane`,
docs/real-node.md).

`real_node` (session scope, needs `kube`) starts containerd, kubelet, kube-proxy and CoreDNS in network and
mount namespaces of their own, with the images `hack/control-plane images` built imported into containerd, and
waits until the node is Ready. Its start time is printed like the control plane's. At the end of the session
(also on Ctrl-C) it is stopped and the session fails if the node left anything on the machine (processes,
mounts, cgroups, namespaces, links, nft tables, sysctls). When its parts are not built, or the machine cannot
run it (not root), tests using it are skipped with the reason. Tests using it are marked
`@pytest.mark.integration`.

The `real_node` object (control_plane.node.RealNode):
    .name                the Node's name; it carries the label and NoSchedule taint
                         warmstart.dev/real-node=true, so only pods meant for it land there
    .pod_placement()     nodeSelector + tolerations that put a pod on it
    .images              the images imported (.reference, .archive)
    .ctr(*args)          `ctr --namespace k8s.io ...` against the node's containerd, stdout
    .stop(), .start()    stop (undoing everything), start again
    .record              what the running node changed (None once stopped); .leftovers(record) lists
                         whatever of it is still there
    .startup_seconds, .timings

`second_node` (module scope, needs `real_node`): a second real node (control_plane.node.RealNode, named
warmstart-node-b, the chart's images imported) joined to the first: pods on either reach pods and Services on
both. Besides the first's label and taint it carries warmstart.dev/second-node as both, so only pods placed
with its `.pod_placement()` land there. Stopped when the module's tests end, checked like the first.

`chart_image` (session scope): the chart's image reference, imported into the node (skips when not built).

`keda` (session scope): KEDA and its HTTP add-on (`hack/control-plane addons`) installed on the real node,
from the manifests those projects ship; the interceptor proxy's in-cluster address (skips when not built).
The node runs CoreDNS, so pods resolve Services by name (`<service>.<namespace>`).

`prometheus` (session scope): prometheus-operator, the Prometheus it runs and prometheus-adapter (all from
`hack/control-plane addons`) on the real node, KEDA beside them; Prometheus's in-cluster address.

`host_python` (session scope): the test run's own Python environment (this virtual environment with torch,
its base interpreter, the repository for the editable install) as read-only hostPath volumes at the same
paths, so a pod of the chart's image can run the builtin engine without a worker image of several GB:
    .python              the interpreter to run in the pod (this session's sys.executable)
    .volumes, .volume_mounts
                         lists to add to a pod spec and its container
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from control_plane import addons, gpu_node, images, monitoring, network, versions
from control_plane.cluster import ControlPlane
from control_plane.node import (
    NodeBusyError,
    NodeImage,
    RealNode,
    missing_parts,
    node_summary,
)

STARTUP_KEY = pytest.StashKey[str]()
SECOND_STARTUP_KEY = pytest.StashKey[str]()


def _images_to_import() -> tuple[list[NodeImage], list[str]]:
    """Every built image, and the references among the chart's whose build predates the working tree."""
    built = images.built_images()
    current = images.current_images()
    stale = [reference for reference in built if reference not in current]
    every = {**built, **addons.built_images(), **monitoring.built_images()}
    return [NodeImage(reference, path) for reference, path in every.items()], stale


@pytest.fixture(scope="session")
def real_node(
    kube: ControlPlane, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealNode]:
    if reasons := missing_parts():
        pytest.skip(f"no real node: {'; '.join(reasons)}: run `hack/control-plane build` as root")
    node_images, stale = _images_to_import()
    gpu = not gpu_node.missing_parts()  # a GPU node wherever one can run (the GPU machine)
    node = RealNode(plane=kube, state_dir=tmp_path_factory.mktemp("node"), images=node_images, gpu=gpu)
    note = f" (images older than the working tree: {', '.join(stale)}; `hack/control-plane images`)"
    yield from _running(node, request, STARTUP_KEY, note if stale else "")


@pytest.fixture(scope="module")
def second_node(
    real_node: RealNode, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealNode]:
    """A second real node beside the first, for the tests of one module (it starts in about a minute, with
    the chart's images, and is stopped when the module ends)."""
    chart = [NodeImage(reference, path) for reference, path in images.built_images().items()]
    node = RealNode(plane=real_node.plane, state_dir=tmp_path_factory.mktemp("node-b"), images=chart,
                    name=network.SECOND_NODE_NAME, first=real_node)  # fmt: skip
    yield from _running(node, request, SECOND_STARTUP_KEY, "")


def _running(node: RealNode, request: pytest.FixtureRequest, key: pytest.StashKey[str], note: str
             ) -> Iterator[RealNode]:  # fmt: skip
    """Start the node (skip when another run holds it), print how long it took, yield it, stop it, and fail
    the run if it left anything on the machine."""
    try:
        node.start()
    except NodeBusyError as error:
        pytest.skip(f"no real node for this session: {error}")
    except Exception as error:
        raise RuntimeError(f"the real node did not start: {error}\n{node.log_tails()}") from error
    summary = node_summary(node) + note
    request.config.stash[key] = summary
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\n{summary}")
    try:
        yield node
    finally:
        record = node.record
        node.stop()
        if record is not None and (left := node.leftovers(record)):
            pytest.fail(f"the real node {node.name} left things behind:\n" + "\n".join(left), pytrace=False)


@pytest.fixture(scope="session")
def chart_image(real_node: RealNode) -> str:
    wanted = images.chart_images()[0].reference
    if wanted not in {image.reference for image in real_node.images}:
        pytest.skip(
            f"{wanted} is not built in {versions.images_cache_dir()}: run `hack/control-plane images`"
        )
    return wanted


@dataclass(frozen=True)
class HostPython:
    """The test run's interpreter for a pod: read-only hostPath volumes at the same paths and the environment
    (`PATH` with a `warmstart` launcher, `PYTHONPATH` naming the source the tests import)."""

    python: str
    volumes: list[dict[str, Any]] = field(default_factory=list)
    volume_mounts: list[dict[str, Any]] = field(default_factory=list)
    env: list[dict[str, str]] = field(default_factory=list)


def warmstart_source() -> Path:
    """The directory the `warmstart` package is imported from (an editable install's checkout, resolved)."""
    package = importlib.util.find_spec("warmstart")
    assert package is not None and package.submodule_search_locations
    return Path(next(iter(package.submodule_search_locations))).resolve().parent


def extra_python_paths() -> list[Path]:
    """Directories PYTHONPATH adds (packages installed beside the environment, resolved)."""
    entries = [Path(entry).resolve() for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return [entry for entry in entries if entry.is_dir()]


def host_python_paths(*more: Path) -> list[Path]:
    """What the interpreter needs: the environment, its base installation, the source the tests import, what
    PYTHONPATH adds, and `more`; links resolved (a pod sees only the paths mounted, not the links to them)."""
    paths = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), warmstart_source(),
             *extra_python_paths(), *(path.resolve() for path in more)}  # fmt: skip
    # Nested paths (a .venv inside the repository) are covered by their parent's mount.
    return sorted(p for p in paths if not any(p != other and p.is_relative_to(other) for other in paths))


def environment_python() -> str:
    """This environment's interpreter at its resolved location: a virtual environment is one only when its
    python is run from inside it (the link's target is the base interpreter, outside the environment)."""
    inside = Path(sys.prefix).resolve() / "bin" / Path(sys.executable).name
    return str(inside if inside.exists() else Path(sys.executable).resolve())


def host_python_mounts(launcher_dir: Path) -> HostPython:
    """This interpreter, and the read-only hostPath volumes and environment a pod needs to run it; a
    `warmstart` command in `launcher_dir` (the operator's worker pods run `warmstart`)."""
    python = environment_python()
    launcher_dir.mkdir(parents=True, exist_ok=True)
    launcher = launcher_dir / "warmstart"
    launcher.write_text(f'#!/bin/sh\nexec {python} -m warmstart "$@"\n')
    launcher.chmod(0o755)
    volumes, mounts = [], []
    for index, path in enumerate(host_python_paths(launcher_dir)):
        name = f"host-python-{index}"
        volumes.append({"name": name, "hostPath": {"path": str(path), "type": "Directory"}})
        mounts.append({"name": name, "mountPath": str(path), "readOnly": True})
    python_path = os.pathsep.join(str(path) for path in [warmstart_source(), *extra_python_paths()])
    env = [
        {"name": "PATH", "value": f"{launcher_dir.resolve()}:/usr/local/bin:/usr/bin:/bin"},
        {"name": "PYTHONPATH", "value": python_path},
    ]
    return HostPython(python=python, volumes=volumes, volume_mounts=mounts, env=env)


@pytest.fixture(scope="session")
def host_python(tmp_path_factory: pytest.TempPathFactory) -> HostPython:
    return host_python_mounts(tmp_path_factory.mktemp("launcher"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    for key in (STARTUP_KEY, SECOND_STARTUP_KEY):
        if summary := config.stash.get(key, None):
            terminalreporter.write_line(summary)


@pytest.fixture(scope="session")
def keda(kube: ControlPlane, real_node: RealNode) -> str:
    """KEDA and its HTTP add-on running on the real node; the interceptor proxy's address in the cluster."""
    if reason := addons.missing_reason():
        pytest.skip(reason)
    addons.install(kube, real_node.pod_placement())
    return addons.interceptor_address()


@pytest.fixture(scope="session")
def prometheus(kube: ControlPlane, real_node: RealNode, keda: str) -> str:
    """prometheus-operator, a Prometheus it runs (every ServiceMonitor of the cluster) and prometheus-adapter
    (the custom metrics API) on the real node; Prometheus's address in the cluster (skips when not built).
    KEDA too: its Prometheus scaler reads that Prometheus."""
    if reason := monitoring.missing_reason():
        pytest.skip(reason)
    return monitoring.install(kube, real_node.pod_placement())
