"""`warmstart operator`: run the InferenceEndpoint operator (kopf)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Coroutine, Iterator
from typing import Any

from warmstart.host.command_settings import SettingsError, add_arguments, load
from warmstart.operator.settings import OperatorSettings


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "operator",
        help="run the Kubernetes operator for InferenceEndpoints",
        description="Reconcile InferenceEndpoints into Deployments, Services, autoscalers and snapshots. "
        "Every flag also reads an environment variable (shown in brackets); a flag given wins.",
    )
    scope = parser.add_mutually_exclusive_group()
    add_arguments(parser, OperatorSettings, short={"namespace": "-n"}, groups={"namespace": scope})
    scope.add_argument(
        "--all-namespaces",
        "-A",
        action="store_true",
        help="watch every namespace, whatever the variable says",
    )
    parser.set_defaults(func=run_operator)


def watched_namespaces(settings: OperatorSettings, args: argparse.Namespace) -> list[str]:
    """Namespaces to watch; empty means all."""
    return [] if args.all_namespaces else list(settings.namespace)


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


def _wait_to_lead(settings: OperatorSettings) -> bool:
    """Campaign for the Lease; True once this replica holds it, False if it was told to stop first. The
    liveness endpoint answers meanwhile: a follower is healthy."""
    from warmstart.kube.client import api_client
    from warmstart.operator.leadership import Leadership, exit_now

    stopping = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    leadership = Leadership(settings.leader_election_namespace, settings.lease_name, api_client(), exit_now)
    with _follower_liveness(settings.liveness_port) if settings.liveness_port else contextlib.nullcontext():
        return leadership.wait_to_lead(stopping)


class StartupError(Exception):
    """The operator cannot start as set up; the message names what to fix."""


def _check_credentials() -> None:
    """The API server's credentials load (kopf's login would retry a failure for minutes, deaf to SIGTERM)."""
    from kubernetes.config import ConfigException

    from warmstart.kube.client import load_configuration

    try:
        load_configuration()
    except (ConfigException, OSError, ValueError) as exc:
        raise StartupError(
            f"no Kubernetes credentials: {exc} (the pod's service account, else KUBECONFIG or ~/.kube/config)"
        ) from None


def _check_port_free(port: int, setting: str) -> None:
    """StartupError naming `setting` when `port` cannot be listened on (kopf listens on it later)."""
    if not port:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as exc:
            raise StartupError(f"{setting}: cannot listen on port {port}: {exc.strerror}") from None


def _serve_metrics(metrics: Any, port: int) -> None:
    try:
        metrics.serve(port)
    except OSError as exc:
        raise StartupError(
            f"--metrics-port / WARMSTART_OPERATOR_METRICS_PORT_NUMBER: cannot listen on port {port}: "
            f"{exc.strerror or exc}"
        ) from None


def _run_until_stopped(main: Coroutine[Any, Any, None]) -> None:
    """`asyncio.run(main)`, but without waiting for the threads of handlers still at work once kopf stopped
    (e.g. one retrying an API server that is down): their results are of no use any more."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # shuts its executor down without waiting for it


def _leave_lingering_handlers() -> None:
    """Exit now when kopf stopped (a signal) while handler threads still run: the interpreter would wait
    for them, deaf to the signal, as long as their API server calls retry. The state is the API server's,
    so nothing is lost."""
    lingering = [
        thread.name for thread in threading.enumerate()
        if thread is not threading.current_thread() and not thread.daemon and thread.is_alive()
    ]  # fmt: skip
    if not lingering:
        return
    # Debug: kopf's idle executor threads are among them at every stop, which is no problem to report.
    logging.getLogger(__name__).debug(
        "stopping without waiting for %d thread(s): %s", len(lingering), lingering
    )
    logging.shutdown()
    os._exit(0)


def run_operator(args: argparse.Namespace) -> int:
    import kopf

    from warmstart.operator import (
        handlers,  # registers the handlers
        login,  # noqa: F401  (registers how kopf reaches the API server)
    )
    from warmstart.operator.metrics import METRICS

    try:
        settings = load(OperatorSettings, args)
        _check_credentials()
        _check_port_free(settings.liveness_port, "--liveness-port / WARMSTART_OPERATOR_LIVENESS_PORT_NUMBER")
        if settings.metrics_port:
            _serve_metrics(METRICS, settings.metrics_port)
    except (SettingsError, StartupError) as exc:
        print(f"warmstart operator: {exc}", file=sys.stderr)
        return 2
    handlers.configure(settings)
    namespaces = watched_namespaces(settings, args)
    liveness = f"http://0.0.0.0:{settings.liveness_port}/healthz" if settings.liveness_port else None
    for handler in logging.getLogger().handlers:
        fmt = handler.formatter._fmt if handler.formatter is not None else None  # keep the format set up
        handler.setFormatter(ObjectNamingFormatter(fmt))
    if settings.leader_election_namespace and not _wait_to_lead(settings):
        return 0  # stopped before it ever acted
    while True:
        # A handler sets this when one of our CRDs appeared after kopf's scan of the API, which kopf may
        # never notice: kopf then stops and starts again here, scanning afresh.
        handlers.Runtime.restart = restart = threading.Event()
        _run_until_stopped(
            kopf.operator(
                standalone=True,  # one replica acts: the Lease's holder (kopf's peering would pause all)
                clusterwide=not namespaces,
                namespaces=namespaces,
                liveness_endpoint=liveness,
                stop_flag=restart,
            )
        )
        if not restart.is_set():
            _leave_lingering_handlers()
            return 0
        logging.getLogger(__name__).info("starting kopf again to serve the CRDs that appeared")
