"""The node agent's gRPC API (`proto/agent.proto`): Status and ListSnapshots, messages encoded as JSON.

Served on a unix socket only root on the node may open; it answers for this node alone (its operations in
flight, the snapshots captured on it).

grpc's generic handlers carry the messages as JSON objects whose fields are those of the .proto, so neither
side needs generated code; `AgentClient` is the matching client.
"""

from __future__ import annotations

import json
import os
import stat
from concurrent import futures
from pathlib import Path
from typing import Any, Protocol

import grpc

SERVICE = "warmstart.agent.v1.Agent"
DEFAULT_TIMEOUT = 10.0


class AgentState(Protocol):
    def status(self) -> dict[str, Any]: ...

    def list_snapshots(self, identity_hash: str = "") -> list[dict[str, Any]]: ...


def _encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, sort_keys=True).encode()


def _decode(data: bytes) -> dict[str, Any]:
    decoded = json.loads(data or b"{}")
    if not isinstance(decoded, dict):
        raise ValueError("a message must be a JSON object")
    return decoded


def _handlers(state: AgentState) -> grpc.GenericRpcHandler:
    def status(_request: dict[str, Any], _context: grpc.ServicerContext) -> dict[str, Any]:
        return state.status()

    def list_snapshots(request: dict[str, Any], _context: grpc.ServicerContext) -> dict[str, Any]:
        return {"snapshots": state.list_snapshots(str(request.get("identity_hash", "")))}

    methods = {
        name: grpc.unary_unary_rpc_method_handler(
            function, request_deserializer=_decode, response_serializer=_encode
        )
        for name, function in (("Status", status), ("ListSnapshots", list_snapshots))
    }
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def serve(state: AgentState, socket_path: Path, workers: int = 4) -> grpc.Server:
    """Start the API on a unix socket only root may connect to (the API has no authentication of its own).

    A stale socket of an earlier agent is replaced; anything else at that path is refused.
    """
    _remove_stale_socket(socket_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    server.add_generic_rpc_handlers((_handlers(state),))
    previous = os.umask(0o177)  # the socket is created 0600: no window in which others may connect
    try:
        bound = server.add_insecure_port(f"unix:{socket_path}")
    finally:
        os.umask(previous)
    if bound == 0:
        raise OSError(f"cannot listen on {socket_path} for the agent's gRPC API")
    server.start()
    return server


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(f"{path} exists and is not a socket: refusing to replace it")
    path.unlink()


class AgentClient:
    def __init__(self, socket_path: Path, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.channel = grpc.insecure_channel(f"unix:{socket_path}")
        self.timeout = timeout

    def _call(self, method: str, request: dict[str, Any]) -> dict[str, Any]:
        stub = self.channel.unary_unary(
            f"/{SERVICE}/{method}", request_serializer=_encode, response_deserializer=_decode
        )
        return stub(request, timeout=self.timeout)

    def status(self) -> dict[str, Any]:
        return self._call("Status", {})

    def list_snapshots(self, identity_hash: str = "") -> list[dict[str, Any]]:
        return self._call("ListSnapshots", {"identity_hash": identity_hash})["snapshots"]

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
