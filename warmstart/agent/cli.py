"""`warmstart agent`: run the node agent (flags, or the environment the chart's DaemonSet sets)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from warmstart.checkpoint import hugepages
from warmstart.config import default_criu_command, env_int

log = logging.getLogger(__name__)

DEFAULT_METRICS_PORT = 9400
DEFAULT_GRPC_SOCKET = "/run/warmstart/agent.sock"
STOP_GRACE_SECONDS = 20.0
DEFAULT_PRESTAGE_MAX_BYTES = 64 << 30


def _run(args: argparse.Namespace) -> int:
    from warmstart.agent import grpc_api
    from warmstart.agent.agent import Agent, AgentConfig
    from warmstart.agent.kube_status import KubeStatus
    from warmstart.agent.metrics import AgentMetrics
    from warmstart.kube.client import api_client
    from warmstart.snapshot.keys import signing_keys
    from warmstart.snapshot.remote import RemoteConfig

    try:
        if args.metrics_port is None:
            args.metrics_port = env_int("WARMSTART_AGENT_METRICS_PORT_NUMBER", DEFAULT_METRICS_PORT)
        config = AgentConfig(
            node=args.node, store=Path(args.store).resolve(), criu_command=args.criu,
            kubelet_root=Path(args.kubelet_root), key=args.key, max_captures=args.max_captures,
            max_restores=args.max_restores, resync_seconds=args.resync,
            prestage_interval=args.prestage_interval, prestage_max_bytes=args.prestage_max_bytes,
            remote=RemoteConfig.from_env() if os.environ.get("WARMSTART_S3_BUCKET") else None,
            pull_timeout=args.pull_timeout, cache_max_bytes=args.cache_max_bytes,
            cache_max_age=args.cache_max_age,
        )  # fmt: skip
    except ValueError as exc:  # RemoteConfigError too: a bucket named but unusable
        print(f"warmstart agent: {exc}", file=sys.stderr)
        return 2
    if args.transparent_hugepages:
        try:
            hugepages.set_mode(args.transparent_hugepages)
        except (OSError, ValueError) as exc:
            log.warning("could not set transparent huge pages to %s: %s", args.transparent_hugepages, exc)
    config.store.mkdir(parents=True, exist_ok=True)
    signer, verifier, note = signing_keys(config.store, config.key)
    if note:
        log.info(note)
    metrics = AgentMetrics()
    agent = Agent(config, KubeStatus(api_client(args.kubeconfig), config.node), signer, verifier, metrics)
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.listen_address)
    server = None
    if args.grpc_socket:
        socket_path = Path(args.grpc_socket)
        socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        server = grpc_api.serve(agent, socket_path)
        log.info("gRPC API on unix socket %s", socket_path)

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        agent.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("agent on node %s: store %s, kubelet root %s", config.node, config.store, config.kubelet_root)
    agent.run()
    if not agent.wait_idle(STOP_GRACE_SECONDS):
        log.warning("stopping with work in flight; interrupted captures leave nothing visible")
    if server is not None:
        server.stop(grace=2)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "agent",
        help="the node agent: captures and restores worker pods on this node",
        description=(
            "The node agent (one per node, privileged, host PID namespace): captures worker pods into the "
            "snapshot store and restores snapshots into new worker pods. Every flag has an environment "
            "fallback, named in its help."
        ),
    )
    env = os.environ.get
    parser.add_argument(
        "--node", default=env("WARMSTART_NODE_NAME", ""),
        help="this node's name as the API server knows it (WARMSTART_NODE_NAME; the chart sets it from the "
        "pod's spec.nodeName)",
    )  # fmt: skip
    parser.add_argument(
        "--store", default=env("WARMSTART_STORE", "/var/lib/warmstart/store"),
        help="snapshot store directory (WARMSTART_STORE)",
    )  # fmt: skip
    parser.add_argument(
        "--criu",
        default=default_criu_command(),
        help="the CRIU 4 command line (WARMSTART_CRIU; default criu)",
    )
    parser.add_argument(
        "--kubelet-root", default=env("WARMSTART_KUBELET_ROOT", "/var/lib/kubelet"),
        help="the kubelet's root directory as mounted in the agent (WARMSTART_KUBELET_ROOT)",
    )  # fmt: skip
    parser.add_argument(
        "--key", default=env("WARMSTART_SIGNING_KEY") or None,
        help="signing key file, e.g. a mounted Secret (WARMSTART_SIGNING_KEY; default: an HMAC key generated "
        "once for the store in $WARMSTART_KEY_DIR, never inside the store)",
    )  # fmt: skip
    parser.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster, else KUBECONFIG)")
    parser.add_argument(
        "--metrics-port", type=int, default=None,
        help="Prometheus port, 0 for none (WARMSTART_AGENT_METRICS_PORT_NUMBER)",
    )  # fmt: skip
    parser.add_argument(
        "--grpc-socket", default=env("WARMSTART_AGENT_GRPC_SOCKET", DEFAULT_GRPC_SOCKET),
        help="unix socket of the gRPC API (root only), empty for none (WARMSTART_AGENT_GRPC_SOCKET)",
    )  # fmt: skip
    parser.add_argument(
        "--listen-address", default=env("WARMSTART_AGENT_LISTEN_ADDRESS", "0.0.0.0"),
        help="address of the metrics endpoint (WARMSTART_AGENT_LISTEN_ADDRESS)",
    )  # fmt: skip
    parser.add_argument("--max-captures", type=int, default=1, help="concurrent captures on this node")
    parser.add_argument("--max-restores", type=int, default=2, help="concurrent restores on this node")
    parser.add_argument("--resync", type=float, default=30.0, help="seconds between full relists of pods")
    parser.add_argument(
        "--prestage-interval", type=float, default=30.0,
        help="seconds between passes that keep the snapshots of endpoints with snapshot.prestage PageCache "
        "in this node's page cache",
    )  # fmt: skip
    parser.add_argument(
        "--prestage-max-bytes", type=int, default=DEFAULT_PRESTAGE_MAX_BYTES,
        help="bytes of snapshots kept in the page cache, newest first (0: no pre-staging; the agent's memory "
        "limit caps it, since the page cache it fills is charged to its cgroup)",
    )  # fmt: skip
    parser.add_argument(
        "--transparent-hugepages", choices=hugepages.MODES, default=None,
        help="select this transparent huge pages mode on the node at start (always lets CRIU restore into "
        "2 MiB pages); it stays after the agent stops; default: leave the node's as it is",
    )  # fmt: skip
    parser.add_argument(
        "--pull-timeout", type=float, default=120.0,
        help="seconds a restore may spend pulling its snapshot from the object store (WARMSTART_S3_BUCKET "
        "and the other WARMSTART_S3_* variables name it) before its worker starts cold",
    )  # fmt: skip
    parser.add_argument(
        "--cache-max-bytes", type=int, default=0,
        help="bound this node's cache of the object store, least recently used snapshots first (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--cache-max-age", type=float, default=0.0,
        help="remove cached snapshots unused for this many seconds (0: never)",
    )  # fmt: skip
    parser.set_defaults(func=_run)
