"""`warmstart agent`: run the node agent (flags, or the environment the chart's DaemonSet sets)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from warmstart.agent.settings import AgentSettings
from warmstart.checkpoint import hugepages
from warmstart.settings import SettingsError, add_arguments, load

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 20.0


def _run(args: argparse.Namespace) -> int:
    from warmstart.agent import grpc_api
    from warmstart.agent.agent import Agent, AgentConfig
    from warmstart.agent.kube_status import KubeStatus
    from warmstart.agent.metrics import AgentMetrics
    from warmstart.kube.client import api_client
    from warmstart.snapshot.keys import signing_keys
    from warmstart.snapshot.remote import RemoteConfig

    try:
        settings = load(AgentSettings, args)
        config = AgentConfig(
            node=settings.node, store=Path(settings.store).resolve(), criu_command=settings.criu,
            kubelet_root=Path(settings.kubelet_root), key=settings.key, max_captures=settings.max_captures,
            cri_socket=Path(settings.cri_socket) if settings.cri_socket else None,
            max_restores=settings.max_restores, resync_seconds=settings.resync,
            prestage_interval=settings.prestage_interval, prestage_max_bytes=settings.prestage_max_bytes,
            remote=RemoteConfig.from_env() if os.environ.get("WARMSTART_S3_BUCKET") else None,
            pull_timeout=settings.pull_timeout, cache_max_bytes=settings.cache_max_bytes,
            cache_max_age=settings.cache_max_age, verified_records=settings.verified_records,
        )  # fmt: skip
    except (SettingsError, ValueError) as exc:  # RemoteConfigError too: a bucket named but unusable
        print(f"warmstart agent: {exc}", file=sys.stderr)
        return 2
    if settings.transparent_hugepages:
        try:
            hugepages.set_mode(settings.transparent_hugepages)
        except (OSError, ValueError) as exc:
            log.warning("could not set transparent huge pages to %s: %s", settings.transparent_hugepages, exc)
    config.store.mkdir(parents=True, exist_ok=True)
    signer, verifier, note = signing_keys(config.store, config.key)
    if note:
        log.info(note)
    metrics = AgentMetrics()
    agent = Agent(config, KubeStatus(api_client(args.kubeconfig), config.node), signer, verifier, metrics)
    if settings.metrics_port:
        metrics.serve(settings.metrics_port, settings.listen_address)
    server = None
    if settings.grpc_socket:
        socket_path = Path(settings.grpc_socket)
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
            "variable, named in its help; a flag given wins."
        ),
    )
    add_arguments(parser, AgentSettings)
    parser.add_argument("--kubeconfig", help="kubeconfig (default: in-cluster, else KUBECONFIG)")
    parser.set_defaults(func=_run)
