"""`warmstart operator`: run the InferenceEndpoint operator (kopf)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from warmstart.config import env_int, env_str


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the Kubernetes operator for InferenceEndpoints",
        description="Reconcile InferenceEndpoints into Deployments, Services, autoscalers and snapshots. "
        "Every flag also reads an environment variable (shown in brackets).",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=None,
        help="watch this namespace (repeatable; globs like 'team-*' work) [WARMSTART_OPERATOR_NAMESPACES, "
        "comma-separated]",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (default)")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=env_int("WARMSTART_OPERATOR_METRICS_PORT_NUMBER", 8080),
        help="Prometheus metrics port, 0 to disable [WARMSTART_OPERATOR_METRICS_PORT_NUMBER, default 8080]",
    )
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=env_int("WARMSTART_OPERATOR_LIVENESS_PORT_NUMBER", 8081),
        help="liveness endpoint port (/healthz), 0 to disable "
        "[WARMSTART_OPERATOR_LIVENESS_PORT_NUMBER, default 8081]",
    )
    parser.add_argument(
        "--leader-election-namespace",
        default=env_str("WARMSTART_OPERATOR_LEASE_NAMESPACE", ""),
        help="act only while holding a Lease in this namespace, so that one of several replicas acts; "
        "empty: act alone [WARMSTART_OPERATOR_LEASE_NAMESPACE]",
    )
    parser.add_argument(
        "--lease-name",
        default=env_str("WARMSTART_OPERATOR_LEASE_NAME", "warmstart-operator"),
        help="the Lease's name [WARMSTART_OPERATOR_LEASE_NAME, default warmstart-operator]",
    )
    parser.set_defaults(func=run_operator)


def resolve_namespaces(args: argparse.Namespace) -> list[str]:
    """Namespaces to watch; empty means all."""
    if args.all_namespaces:
        return []
    if args.namespace:
        return list(args.namespace)
    from_env = os.environ.get("WARMSTART_OPERATOR_NAMESPACES", "")
    return [ns.strip() for ns in from_env.split(",") if ns.strip()]


def _check_port(flag: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise SystemExit(f"{flag} must be between 0 and 65535, got {port}")


class ObjectNamingFormatter(logging.Formatter):
    """Prefixes a record about one object with `[namespace/name]`: kopf passes the object of its per-object
    records (handler outcomes, retries) in the record's `k8s_ref`, not in the message."""

    def format(self, record: logging.LogRecord) -> str:
        ref = getattr(record, "k8s_ref", None)
        if isinstance(ref, dict) and ref.get("name"):
            where = f"{ref['namespace']}/{ref['name']}" if ref.get("namespace") else str(ref["name"])
            record = copy.copy(record)  # other handlers format the same record
            record.msg, record.args = f"[{where}] {record.getMessage()}", None
        return super().format(record)


def name_objects_in_logs() -> None:
    for handler in logging.getLogger().handlers:
        fmt = handler.formatter._fmt if handler.formatter is not None else None  # keep the format set up
        handler.setFormatter(ObjectNamingFormatter(fmt))


@contextlib.contextmanager
def _follower_liveness(port: int) -> Iterator[None]:
    """/healthz answered while this replica waits for the Lease (kopf serves it once it runs)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *_: Any) -> None:  # the kubelet asks every few seconds
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Healthy)
    threading.Thread(target=server.serve_forever, name="follower-liveness", daemon=True).start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()


def _wait_to_lead(args: argparse.Namespace) -> bool:
    """Campaign for the Lease; True once this replica holds it, False if it was told to stop first. The
    liveness endpoint answers meanwhile: a follower is healthy."""
    from warmstart.kube.client import api_client
    from warmstart.operator.leadership import Leadership, LeaseSettings, exit_now

    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    settings = LeaseSettings(namespace=args.leader_election_namespace, name=args.lease_name)
    leadership = Leadership(settings, api_client(), on_lost=exit_now)
    leadership.start()
    with _follower_liveness(args.liveness_port) if args.liveness_port else contextlib.nullcontext():
        return leadership.wait_to_lead(stopping)


def run_operator(args: argparse.Namespace) -> int:
    import asyncio

    import kopf

    from warmstart.operator import login  # noqa: F401  (registers how kopf reaches the API server)

    try:
        from warmstart.operator import handlers  # registers the handlers; reads its settings
    except ValueError as exc:  # a WARMSTART_OPERATOR_* variable that cannot be used
        raise SystemExit(f"error: {exc}") from exc
    from warmstart.operator.metrics import METRICS

    _check_port("--metrics-port", args.metrics_port)
    _check_port("--liveness-port", args.liveness_port)
    namespaces = resolve_namespaces(args)
    if args.metrics_port:
        METRICS.serve(args.metrics_port)
    liveness = f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None
    name_objects_in_logs()
    if args.leader_election_namespace and not _wait_to_lead(args):
        return 0  # stopped before it ever acted
    while True:
        # A handler sets this when one of our CRDs appeared after kopf's scan of the API, which kopf may
        # never notice: kopf then stops and starts again here, scanning afresh.
        handlers.Runtime.restart = restart = threading.Event()
        asyncio.run(
            kopf.operator(
                standalone=True,  # one replica acts: the Lease's holder (kopf's peering would pause all)
                clusterwide=not namespaces,
                namespaces=namespaces,
                liveness_endpoint=liveness,
                stop_flag=restart,
            )
        )
        if not restart.is_set():
            return 0
        logging.getLogger(__name__).info("starting kopf again to serve the CRDs that appeared")
