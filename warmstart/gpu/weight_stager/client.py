"""The engine's side: wait for its stager, take the staged memory's descriptor and report, acknowledge."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from typing import Any

from warmstart.gpu.weight_stager.channel import ACK, socket_address
from warmstart.gpu.weight_stager.plan import MAX_SEGMENTS

ENGINE_WAIT_SECONDS = 600.0  # an engine waits this long for its stager's answer (it hears at once if it dies)


class StagedWeightsUnavailable(RuntimeError):
    """No staged weights to map: the stager failed, was not there, or hung up; the engine refills."""


def receive_staged_weights(
    socket_path: str | os.PathLike[str], timeout: float = ENGINE_WAIT_SECONDS
) -> tuple[list[int], dict[str, Any]]:
    """Wait for the stager at `socket_path`; return the shared memory's file descriptors (one per allocation
    of the plan, in order) and its report.

    The caller maps the descriptors, closes them, then calls `acknowledge`. Raises `StagedWeightsUnavailable`
    with the reason whenever there is nothing to map.
    """
    deadline = time.monotonic() + timeout
    connection = _connect(socket_path, deadline)
    fds: list[int] = []
    try:
        connection.settimeout(max(0.1, deadline - time.monotonic()))
        message, fds, _flags, _address = socket.recv_fds(connection, 1 << 16, MAX_SEGMENTS)
        report = json.loads(message or b'{"error": "the stager hung up"}')
        if not fds:
            raise StagedWeightsUnavailable(
                f"the weight stager failed: {report.get('error', 'no descriptor')}"
            )
        if not isinstance(report.get("bytes"), int):
            raise StagedWeightsUnavailable(f"the weight stager sent a report without its size: {report}")
    except (OSError, ValueError, AttributeError, StagedWeightsUnavailable) as exc:
        for fd in fds:
            os.close(fd)
        connection.close()
        if isinstance(exc, StagedWeightsUnavailable):
            raise
        raise StagedWeightsUnavailable(f"no usable answer from the weight stager: {exc}") from exc
    report["_connection"] = connection
    return fds, report


def acknowledge(report: dict[str, Any]) -> None:
    """Tell the stager its memory is mapped here (it may exit now) and hang up."""
    connection = report.pop("_connection", None)
    if connection is not None:
        with contextlib.suppress(OSError):
            connection.sendall(ACK)
        connection.close()


def _connect(path: str | os.PathLike[str], deadline: float) -> socket.socket:
    """Connect, waiting only while the socket does not exist yet (a stager binding it itself)."""
    while True:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with socket_address(path) as address:
                connection.connect(address)
            return connection
        except FileNotFoundError as exc:
            connection.close()
            if time.monotonic() > deadline:
                raise StagedWeightsUnavailable(f"no weight stager at {path}: {exc}") from exc
            time.sleep(0.005)
        except OSError as exc:  # refused (the stager is gone), not permitted, ...: final
            connection.close()
            raise StagedWeightsUnavailable(f"cannot reach the weight stager at {path}: {exc}") from exc
