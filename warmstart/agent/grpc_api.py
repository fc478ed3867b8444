"""The node agent's gRPC API (`proto/agent.proto`): Status and ListSnapshots, in protobuf.

Served on a unix socket only root on the node may open; it answers for this node alone (its operations in
flight, the snapshots captured on it). `proto/agent_pb2*.py` are generated from the .proto by
`hack/generate-proto` (a test fails when they are stale): any gRPC client made from the .proto talks to it,
e.g. `grpcurl -plaintext -unix -import-path warmstart/agent/proto -proto agent.proto
/run/warmstart/agent.sock warmstart.agent.v1.Agent/Status`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from google.protobuf import json_format

from warmstart.agent.proto import agent_pb2, agent_pb2_grpc

if TYPE_CHECKING:
    from warmstart.agent.agent import Agent


class AgentServicer(agent_pb2_grpc.AgentServicer):
    """The .proto's service, answered from the agent's state (its dicts carry the messages' field names)."""

    def __init__(self, state: Agent) -> None:
        self.state = state

    def Status(  # the .proto's names
        self, request: agent_pb2.StatusRequest, context: grpc.ServicerContext
    ) -> agent_pb2.StatusResponse:
        return json_format.ParseDict(self.state.status(), agent_pb2.StatusResponse())

    def ListSnapshots(
        self, request: agent_pb2.ListSnapshotsRequest, context: grpc.ServicerContext
    ) -> agent_pb2.ListSnapshotsResponse:
        listed = self.state.list_snapshots(request.identity_hash)
        return json_format.ParseDict({"snapshots": listed}, agent_pb2.ListSnapshotsResponse())


def serve(state: Agent, socket_path: Path, workers: int = 4) -> grpc.Server:
    """Start the API on a unix socket only root may connect to (the API has no authentication of its own).

    A stale socket of an earlier agent is replaced; anything else at that path is refused.
    """
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(socket_path.lstat().st_mode):
            raise OSError(f"{socket_path} exists and is not a socket: refusing to replace it")
        socket_path.unlink()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    agent_pb2_grpc.add_AgentServicer_to_server(AgentServicer(state), server)
    previous = os.umask(0o177)  # the socket is created 0600: no window in which others may connect
    try:
        bound = server.add_insecure_port(f"unix:{socket_path}")
    finally:
        os.umask(previous)
    if bound == 0:
        raise OSError(f"cannot listen on {socket_path} for the agent's gRPC API")
    server.start()
    return server
