"""hack/control-plane {build,images,addons,up,down,status,bin-dir}: the local Kubernetes control plane (and
one real node) by hand."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from . import build, node_build, s3, versions


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
    from .cluster import ControlPlane, ControlPlaneError, load_state, stop_recorded

    state_dir = up_state_dir()
    state = load_state(state_dir)
    if state is not None and running_names(state):
        print(f"already running at {state['server']}", file=sys.stderr)
        print(f"export KUBECONFIG={state['kubeconfig']}")
        return 0
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
    if args.real_node and start_real_node(plane) != 0:
        return 1
    print(f"export KUBECONFIG={plane.kubeconfig}")
    return 0


def start_real_node(plane: object) -> int:
    from . import addons, gpu_node, images, monitoring
    from .cluster import ControlPlaneError
    from .node import NodeError, NodeImage, RealNode, node_summary

    built = {**images.built_images(), **addons.built_images(), **monitoring.built_images()}
    node_images = [NodeImage(reference, path) for reference, path in built.items()]
    node = RealNode(
        plane=plane,  # type: ignore[arg-type]
        state_dir=node_state_dir(),
        images=node_images,
        die_with_parent=False,
        gpu=not gpu_node.missing_parts(),  # a GPU node wherever one can run
    )
    try:
        node.start()
    except (NodeError, TimeoutError) as error:
        print(f"real node failed to start: {error}\nlogs: {node.state_dir / 'logs'}", file=sys.stderr)
        return 1
    print(f"{node_summary(node)}; logs in {node.state_dir / 'logs'}", file=sys.stderr)
    if addons.is_cached():
        try:
            addons.install(plane, node.pod_placement())  # type: ignore[arg-type]
        except ControlPlaneError as error:
            print(f"KEDA failed to start: {error}", file=sys.stderr)
            return 1
        print("KEDA and its HTTP add-on installed (namespace keda)", file=sys.stderr)
    if monitoring.is_cached():
        try:
            address = monitoring.install(plane, node.pod_placement())  # type: ignore[arg-type]
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
    from .cluster import stop_recorded
    from .node import stop_recorded_node

    if stop_recorded_node():
        print("stopped the real node")
    stopped = stop_recorded(up_state_dir())
    print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
    return 0


def command_status(_args: argparse.Namespace) -> int:
    from .cluster import load_state
    from .node import NodeRecord, missing_parts

    print(f"binaries: {'built' if build.is_cached() else 'not built'} ({versions.bin_dir()})")
    reasons = missing_parts()
    print(f"real node: {'ready to start' if not reasons else '; '.join(reasons)}")
    record = NodeRecord.load()
    if record is not None:
        print(f"real node: {'running' if record.holder_alive() else 'stale (run down)'} ({record.state_dir})")
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
