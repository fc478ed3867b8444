"""The engine process: `python -m warmstart.worker.engine_process ...`, spawned by `warmstart worker`.

cold:    load, warm up, serve HTTP.
capture: load, warm up, release memory, send `ready-for-snapshot`, then wait for the agent:
         `snapshot-complete` -> exit 0 (the snapshot was taken; this copy is done);
         `restore-complete`  -> this is a restored copy (or the resumed original): reacquire and serve;
         `restore-failed`    -> the live original carries on: reacquire and serve.
Until it serves, the process opens no socket, starts no thread holding one and keeps no descriptor on the
control directory, so CRIU can dump it as it is.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from warmstart.api.control_dir import (
    READY_FOR_SNAPSHOT,
    RESTORE_COMPLETE,
    RESTORE_FAILED,
    SNAPSHOT_COMPLETE,
    ControlDir,
    Signal,
)
from warmstart.api.worker_options import WorkerOptions, add_worker_arguments
from warmstart.host import procinfo
from warmstart.worker.connections import ConnectionLimits, quiet_connection_logs, uvicorn_options
from warmstart.worker.facts import measure_restore_facts
from warmstart.worker.openai_requests import RequestLimits

log = logging.getLogger("warmstart.worker.engine")

SIGNAL_POLL_SECONDS = 0.02


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="warmstart-engine", description=__doc__)
    add_worker_arguments(parser)
    parser.add_argument("--started-at", type=float, help="epoch seconds the worker started (for metrics)")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("WARMSTART_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.mode not in ("cold", "capture"):
        parser.error(f"the engine process runs in cold or capture mode, not {args.mode}")
    started_at = args.started_at or procinfo.process_start_time()
    signal.signal(signal.SIGTERM, _exit_on_signal)  # uvicorn handles it while serving

    from warmstart.engines import create_engine
    from warmstart.engines.base import EngineError

    try:
        engine = create_engine(args.engine, **WorkerOptions.of(args).engine_options())
        engine.load()
        engine.warm_up()
    except (EngineError, ValueError, OSError) as exc:
        log.error("the engine could not start: %s", exc)
        return 2
    # Build the app now (imports done, nothing opened) so a restored copy only has to bind and serve.
    connections = ConnectionLimits(
        max_connections=args.http_max_connections,
        max_connections_per_client=args.http_max_connections_per_client,
        keep_alive_seconds=args.http_keep_alive_seconds,
        body_timeout_seconds=args.http_body_timeout_seconds,
    )
    requests = RequestLimits(
        max_body_bytes=args.max_request_bytes, max_n=args.max_n, max_tokens=args.max_output_tokens
    )
    runner = _HttpRunner(engine, connections, requests)
    log.info("engine warm after %.2f s", time.time() - started_at)
    if args.mode == "cold":
        return runner.serve(args.host, args.port, "cold", started_at)
    return capture(engine, runner, args, started_at)


def capture(engine: Any, runner: _HttpRunner, args: argparse.Namespace, started_at: float) -> int:
    control = ControlDir(args.control_dir)
    identity = engine.identity()
    weights_released = engine.release()
    gc.collect()
    plan = (
        engine.weight_staging_plan() if weights_released and hasattr(engine, "weight_staging_plan") else None
    )
    payload = {
        "pid": os.getpid(),
        "identity": identity.to_dict(),
        "identity_hash": identity.digest(),
        "model_dir": str(getattr(engine, "model_dir", "")),
        "weights_released": weights_released,
        "engine": engine.describe(),
        "restore_facts": measure_restore_facts(args).to_dict(),
        "host": args.host,
        "port": args.port,
        **({"weight_staging": plan.to_dict()} if plan is not None else {}),
    }
    control.send(READY_FOR_SNAPSHOT, payload)
    log.info(
        "ready for snapshot (pid %d, identity %s, weights released: %s)",
        os.getpid(),
        identity.short(),
        weights_released,
    )
    # Restore first: a restored copy may find the original's `snapshot-complete` next to its own signal.
    received = control.wait(RESTORE_COMPLETE, RESTORE_FAILED, SNAPSHOT_COMPLETE, interval=SIGNAL_POLL_SECONDS)
    resumed_at = time.time()
    if received.name == SNAPSHOT_COMPLETE:
        log.info("snapshot complete; this process is done")
        engine.close()
        return 0
    mode, since = _resume_timing(received, resumed_at, started_at)
    host, port = _resume_address(received, args)
    _expect_staged_weights(engine, received, args.control_dir)
    engine.reacquire()
    log.info("resumed (%s) in %.3f s; serving on %s:%d", received.name, time.time() - resumed_at, host, port)
    # Reading smaps_rollup walks the page tables (10 ms for a 0.5 GiB process here): not before serving.
    threading.Thread(target=_log_host_memory, name="warmstart-memory-log", daemon=True).start()
    return runner.serve(host, port, mode, since)


def _log_host_memory() -> None:
    anonymous, huge = procinfo.anonymous_memory()
    log.info("host memory: %.0f MiB anonymous, %.0f MiB of it in huge pages", anonymous / 2**20, huge / 2**20)


def _resume_timing(received: Signal, resumed_at: float, started_at: float) -> tuple[str, float]:
    if received.name == RESTORE_FAILED:
        log.warning(
            "the agent reports restore-failed (%s); this original process serves instead",
            received.payload.get("reason", "no reason given"),
        )
        return "cold", started_at
    since = received.payload.get("restore_started_at")
    return "restore", float(since) if isinstance(since, int | float) else resumed_at


def _expect_staged_weights(engine: Any, received: Signal, control_dir: str) -> None:
    """Point the engine at the weight stager the restoring side started, if it says it did."""
    name = received.payload.get("weight_stager_socket")
    if name is None or not hasattr(engine, "expect_staged_weights"):
        return
    if not isinstance(name, str) or not name or "/" in name or name.startswith("."):
        log.error("ignoring weight_stager_socket %r in %s: not a file name", name, received.name)
        return
    engine.expect_staged_weights(os.path.join(control_dir, name))


def _resume_address(received: Signal, args: argparse.Namespace) -> tuple[str, int]:
    host, port = received.payload.get("host", args.host), received.payload.get("port", args.port)
    if not isinstance(host, str) or not host:
        log.error("ignoring host %r in %s: not a non-empty string", host, received.name)
        host = args.host
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        log.error("ignoring port %r in %s: not an integer in 0..65535", port, received.name)
        port = args.port
    return host, port


class _HttpRunner:
    def __init__(
        self,
        engine: Any,
        connection_limits: ConnectionLimits | None = None,
        request_limits: RequestLimits | None = None,
    ) -> None:
        import uvicorn

        from warmstart.worker.metrics import WorkerMetrics
        from warmstart.worker.server import CountResponses, ServerState, build_app

        self.engine = engine
        self.metrics = WorkerMetrics()
        self.state = ServerState()
        self.connection_limits = connection_limits or ConnectionLimits()
        engine_app = getattr(engine, "serving_app", None)
        own = engine_app(lambda: self.state.ready, self.metrics) if engine_app else None
        # An engine's own server builds its state in the serving loop (`prepare`), before the first request.
        self.prepare = getattr(own, "prepare", None)
        if own is None:
            self.app = build_app(engine, self.metrics, self.state, request_limits)
        else:
            if request_limits not in (None, RequestLimits()):
                log.warning(
                    "the engine serves its own HTTP app: --max-request-bytes, --max-n and "
                    "--max-output-tokens do not apply to it (give the engine's server its own limits, e.g. "
                    "--vllm-server-arg)"
                )
            self.app = CountResponses(own, self.metrics)
        self._uvicorn = uvicorn

    def serve(self, host: str, port: int, mode: str, since: float) -> int:
        runner = self

        class Server(self._uvicorn.Server):
            async def startup(self, sockets: Any = None) -> None:
                if runner.prepare is not None:
                    await runner.prepare()
                await super().startup(sockets=sockets)
                if not self.should_exit:
                    elapsed = time.time() - since
                    runner.metrics.start_seconds.labels(mode).set(elapsed)
                    runner.state.ready = True
                    log.info("serving (%s start: %.3f s)", mode, elapsed)

        quiet_connection_logs()
        config = self._uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level="info",
            lifespan="off",
            timeout_graceful_shutdown=5,
            **uvicorn_options(self.connection_limits),
        )
        server = Server(config)
        try:
            server.run()
        finally:
            self.engine.close()
        return 0 if server.started else 1


def _exit_on_signal(signum: int, _frame: Any) -> None:
    log.info("signal %d; exiting", signum)
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
