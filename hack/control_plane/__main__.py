"""hack/control-plane {build,images,addons,up,down,status,bin-dir}: the local Kubernetes control plane (and
one real node) by hand."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import build, node_build, s3, versions

if TYPE_CHECKING:
    from .cluster import ControlPlane
    from .node import RealNode


def up_state_dir() -> Path:
    return versions.cache_root() / "up"


def command_build(args: argparse.Namespace) -> int:
    status = build.main_with(force=args.force)
    if status != 0:
        return status
    try:
        s3.build_s3_server(force=args.force)
    except build.BuildError as error:
        print(f"S3 server build failed: {error}", file=sys.stderr)
        return 1
    if args.no_node:
        return 0
    try:
        node_build.build_node(force=args.force)
        if args.gpu:
            node_build.build_gpu_plugin(force=args.force)
    except build.BuildError as error:
        print(f"real node build failed: {error}", file=sys.stderr)
        return 1
    return 0


def command_images(args: argparse.Namespace) -> int:
    from . import images

    return images.main_with(force=args.force)


def command_addons(args: argparse.Namespace) -> int:
    from . import addons, monitoring

    return addons.main_with(force=args.force) or monitoring.main_with(force=args.force)


def node_state_dir() -> Path:
    return up_state_dir() / "node"


def command_up(args: argparse.Namespace) -> int:
    from . import cluster_stores
    from .cluster import ControlPlane, ControlPlaneError, load_state, stop_recorded

    state_dir = up_state_dir()
    state = load_state(state_dir)
    if state is not None and running_names(state):
        print(f"already running at {state['server']}", file=sys.stderr)
        print(f"export KUBECONFIG={state['kubeconfig']}")
        return 0
    cluster_stores.stop_object_store(state_dir)
    stop_recorded(state_dir)
    shutil.rmtree(state_dir, ignore_errors=True)
    plane = ControlPlane(state_dir=state_dir, nodes=args.nodes, die_with_parent=False)
    try:
        plane.start()
    except (ControlPlaneError, TimeoutError) as error:
        print(f"control plane failed to start: {error}\nlogs: {state_dir / 'logs'}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    plane.save_state()
    print(
        f"control plane up in {plane.startup_seconds:.1f}s (apiserver ready "
        f"{plane.timings['apiserver-ready']:.1f}s) at {plane.server}; {args.nodes} kwok GPU nodes; "
        f"logs in {state_dir / 'logs'}",
        file=sys.stderr,
    )
    wants_node = args.real_node or args.second_node or args.object_store or args.shared_volume
    if wants_node and start_real_nodes(plane, args) != 0:
        return 1
    print(f"export KUBECONFIG={plane.kubeconfig}")
    return 0


def start_real_nodes(plane: ControlPlane, args: argparse.Namespace) -> int:
    """The real node with what runs on it, then what `args` adds: the second node, the cluster stores."""
    from . import cluster_stores, network
    from .cluster import ControlPlaneError

    node = start_node(plane, node_state_dir())
    if node is None or start_addons(plane, node) != 0:
        return 1
    if args.second_node and start_node(plane, up_state_dir() / "node-b", first=node) is None:
        return 1
    stores, namespace = [], args.store_namespace
    try:
        if args.object_store:
            stores.append(cluster_stores.start_object_store(plane, node, up_state_dir(), namespace))
        if args.shared_volume:
            stores.append(cluster_stores.create_shared_store(plane, up_state_dir(), namespace))
    except (ControlPlaneError, TimeoutError) as error:
        print(f"the cluster store failed to start: {error}", file=sys.stderr)
        return 1
    for values in stores:
        print(f"the store's chart values, to add to the testbed's (docs/real-node.md), the agent on every "
              f"real node: {values}", file=sys.stderr)  # fmt: skip
    if stores and not args.second_node:
        print(f"one real node: `up --second-node` starts {network.SECOND_NODE_NAME} too", file=sys.stderr)
    return 0


def start_node(plane: ControlPlane, state_dir: Path, first: RealNode | None = None) -> RealNode | None:
    """A started real node (the second one when `first` is given), or None after saying why it did not."""
    from . import addons, gpu_node, images, monitoring, network
    from .node import NodeError, NodeImage, RealNode, node_summary

    built = images.built_images()
    if first is None:  # the add-ons run on the first node only
        built = {**built, **addons.built_images(), **monitoring.built_images()}
    node = RealNode(
        plane=plane,
        state_dir=state_dir,
        images=[NodeImage(reference, path) for reference, path in built.items()],
        die_with_parent=False,
        gpu=first is None and not gpu_node.missing_parts(),  # a GPU node wherever one can run
        name=network.NODE_NAME if first is None else network.SECOND_NODE_NAME,
        first=first,
    )
    try:
        node.start()
    except (NodeError, TimeoutError) as error:
        print(f"real node failed to start: {error}\nlogs: {node.state_dir / 'logs'}", file=sys.stderr)
        return None
    print(f"{node_summary(node)}; logs in {node.state_dir / 'logs'}", file=sys.stderr)
    return node


def start_addons(plane: ControlPlane, node: RealNode) -> int:
    from . import addons, monitoring
    from .cluster import ControlPlaneError

    if addons.is_cached():
        try:
            addons.install(plane, node.pod_placement())
        except ControlPlaneError as error:
            print(f"KEDA failed to start: {error}", file=sys.stderr)
            return 1
        print("KEDA and its HTTP add-on installed (namespace keda)", file=sys.stderr)
    if monitoring.is_cached():
        try:
            address = monitoring.install(plane, node.pod_placement())
        except ControlPlaneError as error:
            print(f"Prometheus failed to start: {error}", file=sys.stderr)
            return 1
        print(f"prometheus-operator, Prometheus ({address}) and prometheus-adapter installed "
              f"(namespace {monitoring.NAMESPACE})", file=sys.stderr)  # fmt: skip
    return 0


def running_names(state: dict[str, object]) -> list[str]:
    from .cluster import process_alive, process_runs_binary

    processes = state["processes"]
    assert isinstance(processes, dict)
    bin_dir = Path(str(state["bin_dir"]))
    return [
        name for name, pid in processes.items() if process_alive(pid) and process_runs_binary(pid, bin_dir)
    ]


def command_down(_args: argparse.Namespace) -> int:
    from . import cluster_stores
    from .cluster import stop_recorded
    from .node import stop_recorded_node

    if cluster_stores.stop_object_store(up_state_dir()):
        print("stopped the object store")
    if stop_recorded_node():
        print("stopped the real node")
    stopped = stop_recorded(up_state_dir())
    print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    return 0


def command_status(_args: argparse.Namespace) -> int:
    from . import cluster_stores, network
    from .cluster import load_state
    from .node import NodeRecord, missing_parts

    print(f"binaries: {'built' if build.is_cached() else 'not built'} ({versions.bin_dir()})")
    reasons = missing_parts()
    print(f"real node: {'ready to start' if not reasons else '; '.join(reasons)}")
    for name in (network.NODE_NAME, network.SECOND_NODE_NAME):
        record = NodeRecord.load(name)
        if record is not None:
            alive = "running" if record.holder_alive() else "stale (run down)"
            print(f"real node {name}: {alive} ({record.state_dir})")
    if endpoint := cluster_stores.object_store_endpoint(up_state_dir()):
        print(f"object store: {endpoint}, bucket {cluster_stores.BUCKET}")
    state = load_state(up_state_dir())
    if state is None:
        print("control plane: down")
        return 1
    alive = running_names(state)
    expected = list(state["processes"])
    print(f"control plane: {state['server']}; running {len(alive)}/{len(expected)}: {', '.join(alive)}")
    print(f"export KUBECONFIG={state['kubeconfig']}")
    return 0 if len(alive) == len(expected) else 1


def command_bin_dir(_args: argparse.Namespace) -> int:
    print(versions.bin_dir())
    return 0


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="hack/control-plane", description=__doc__)
    commands = root.add_subparsers(dest="command", required=True)
    build_parser = commands.add_parser(
        "build", help="build the binaries (the tests' S3 server too) and fetch CRDs into the cache (once)"
    )
    build_parser.add_argument("--force", action="store_true", help="rebuild even when the cache is current")
    build_parser.add_argument(
        "--no-node", action="store_true", help="only the control plane, not kubelet/kube-proxy/pause"
    )
    build_parser.add_argument(
        "--gpu", action="store_true", help="also NVIDIA's device plugin, for a real node on a GPU machine"
    )
    build_parser.set_defaults(func=command_build)
    images_parser = commands.add_parser(
        "images", help="build the chart's images from the Dockerfile with BuildKit (cached by input hash)"
    )
    images_parser.add_argument(
        "--force", action="store_true", help="rebuild even when the inputs are the same"
    )
    images_parser.set_defaults(func=command_images)
    addons_parser = commands.add_parser(
        "addons",
        help="build KEDA, its HTTP add-on, Prometheus, prometheus-operator and prometheus-adapter from their "
        "Go modules, as images for the real node",
    )
    addons_parser.add_argument("--force", action="store_true", help="rebuild even when the cache is current")
    addons_parser.set_defaults(func=command_addons)
    up = commands.add_parser("up", help="start a detached control plane and print `export KUBECONFIG=...`")
    up.add_argument("--nodes", type=positive_int, default=2, help="number of fake GPU nodes (default 2)")
    up.add_argument(
        "--real-node", action="store_true", help="also start one real node (kubelet + containerd)"
    )
    up.add_argument(
        "--second-node", action="store_true",
        help="also a second real node (implies --real-node): a snapshot captured on one restores there",
    )  # fmt: skip
    up.add_argument(
        "--object-store", action="store_true",
        help="also an S3 server both real nodes reach, as the cluster's snapshot store (implies --real-node)",
    )  # fmt: skip
    up.add_argument(
        "--shared-volume", action="store_true",
        help="also a ReadWriteMany volume every real node mounts, as the cluster's snapshot store "
        "(implies --real-node)",
    )  # fmt: skip
    up.add_argument(
        "--store-namespace", default="warmstart",
        help="the release's namespace, where the store's Secret or claim goes (default warmstart)",
    )  # fmt: skip
    up.set_defaults(func=command_up)
    commands.add_parser("down", help="stop the control plane (and real node) started by `up`").set_defaults(
        func=command_down
    )
    commands.add_parser("status", help="show what is built and running").set_defaults(func=command_status)
    commands.add_parser("bin-dir", help="print the directory holding the binaries").set_defaults(
        func=command_bin_dir
    )
    return root


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
