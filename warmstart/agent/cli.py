"""`warmstart agent`: run the node agent (flags, or the environment the chart's DaemonSet sets)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmstart.agent.settings import AgentSettings
from warmstart.checkpoint import hugepages
from warmstart.host.command_settings import SettingsError, add_arguments, load

if TYPE_CHECKING:
    from warmstart.agent.agent import Agent

log = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 20.0


class StartupError(Exception):
    """The agent cannot start as set up; the message names the setting to fix."""


def _run(args: argparse.Namespace) -> int:
    try:
        agent, server = _start(load(AgentSettings, args), args)
    except (SettingsError, StartupError, ValueError) as exc:  # RemoteConfigError: a bucket named but unusable
        print(f"warmstart agent: {exc}", file=sys.stderr)
        return 2

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        agent.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    config = agent.config
    log.info("agent on node %s: store %s, kubelet root %s", config.node, config.store, config.kubelet_root)
    agent.run()
    if not agent.wait_idle(STOP_GRACE_SECONDS):
        log.warning("stopping with work in flight; interrupted captures leave nothing visible")
    if server is not None:
        server.stop(grace=2)
    return 0


def _start(settings: AgentSettings, args: argparse.Namespace) -> tuple[Agent, Any]:
    """The agent and its gRPC server (None without one), every part checked as it is set up; StartupError
    naming the setting of the first that cannot be, before the node is touched or any work begins."""
    from kubernetes.config import ConfigException

    from warmstart.agent import grpc_api
    from warmstart.agent.agent import Agent
    from warmstart.agent.kube_status import KubeStatus
    from warmstart.agent.metrics import AgentMetrics
    from warmstart.kube.client import api_client
    from warmstart.snapshot.remote import RemoteConfig
    from warmstart.snapshot.signing import SigningKeyError
    from warmstart.snapshot.signing_keys import signing_keys

    remote = RemoteConfig.from_env() if os.environ.get("WARMSTART_S3_BUCKET") else None
    if not Path(settings.kubelet_root).is_dir():
        log.warning("--kubelet-root / WARMSTART_KUBELET_ROOT: %s is no directory (yet): no pod's control "
                    "directory can be found until it is", settings.kubelet_root)  # fmt: skip
    store = Path(settings.store)
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"--store / WARMSTART_STORE: {store} cannot be made: {exc.strerror}") from None
    try:
        signer, verifier, note = signing_keys(store, settings.key)
    except (OSError, SigningKeyError) as exc:
        where = (
            "--key / WARMSTART_SIGNING_KEY"
            if settings.key
            else "the store's generated key ($WARMSTART_KEY_DIR)"
        )
        raise StartupError(f"{where}: {exc}") from None
    if note:
        log.info(note)
    try:
        kube = api_client(args.kubeconfig)
    except (ConfigException, OSError, ValueError) as exc:
        raise StartupError(
            f"no Kubernetes credentials: {exc} (--kubeconfig, else the pod's service account, else "
            "KUBECONFIG or ~/.kube/config)"
        ) from None
    metrics = AgentMetrics()
    try:
        agent = Agent(settings, KubeStatus(kube, settings.node), signer, verifier, metrics, remote)
    except OSError as exc:
        raise StartupError(f"the store {store} cannot be used: {exc}") from None
    if settings.metrics_port:
        try:
            metrics.serve(settings.metrics_port, settings.listen_address)
        except OSError as exc:
            raise StartupError(
                f"--metrics-port / WARMSTART_AGENT_METRICS_PORT_NUMBER, --listen-address / "
                f"WARMSTART_AGENT_LISTEN_ADDRESS: cannot listen on {settings.listen_address} port "
                f"{settings.metrics_port}: {exc.strerror or exc}"
            ) from None
    server = None
    if settings.grpc_socket:
        socket_path = Path(settings.grpc_socket)
        try:
            socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            server = grpc_api.serve(agent, socket_path)
        except (OSError, RuntimeError) as exc:
            raise StartupError(
                f"--grpc-socket / WARMSTART_AGENT_GRPC_SOCKET: cannot serve on {socket_path}: "
                f"{getattr(exc, 'strerror', None) or exc}"
            ) from None
        log.info("gRPC API on unix socket %s", socket_path)
    if settings.transparent_hugepages:
        setting = hugepages.node_setting()
        try:
            before = hugepages.set_mode(settings.transparent_hugepages, setting)
        except (OSError, ValueError) as exc:
            log.warning("could not set transparent huge pages to %s: %s", settings.transparent_hugepages, exc)
        else:
            log.info("transparent huge pages on this node: %s (was %s; %s)", settings.transparent_hugepages,
                     before, setting)  # fmt: skip
    return agent, server


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
