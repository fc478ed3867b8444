"""The node agent's gRPC API (`proto/agent.proto`): Status and ListSnapshots, messages encoded as JSON.

grpc's generic handlers carry the messages as JSON objects whose fields are those of the .proto, so neither
side needs generated code; `AgentClient` is the matching client.
"""

from __future__ import annotations

import json
from concurrent import futures
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


def serve(state: AgentState, address: str, workers: int = 4) -> tuple[grpc.Server, int]:
    """Start the API on `address` ("127.0.0.1:0" picks a port); returns the server and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    server.add_generic_rpc_handlers((_handlers(state),))
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address} for the agent's gRPC API (port taken or address wrong)")
    server.start()
    return server, port


class AgentClient:
    def __init__(self, target: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.channel = grpc.insecure_channel(target)
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
