"""`warmstart/worker/connections.py` subclasses uvicorn's H11Protocol and reads its internals, which uvicorn
does not promise to keep: pyproject.toml pins the release it was written against, and these tests fail,
naming what moved, when a uvicorn release changes what the subclass relies on."""

from __future__ import annotations

import asyncio
import inspect
from importlib import metadata
from typing import Any

import h11
from packaging.requirements import Requirement
from packaging.version import Version
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from warmstart.worker.connections import BoundedHeadConnection, ConnectionLimits, protocol_for

# uvicorn's hooks the subclass overrides, calling uvicorn's own.
OVERRIDDEN = ("connection_made", "data_received", "handle_events", "on_response_complete", "connection_lost")
# uvicorn's per-connection state the subclass reads once a connection is made, and once a head is in.
READ_AFTER_CONNECT = ("conn", "loop", "cycle", "transport", "connections", "client")
READ_AFTER_HEAD = ("headers",)
CYCLE_FIELDS = ("keep_alive", "response_complete", "response_started")


class Transport(asyncio.Transport):
    """What uvicorn asks of a connection's transport, with nothing on the wire."""

    def __init__(self) -> None:
        super().__init__()
        self.closing, self.written = False, b""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("192.0.2.1", 5555), "sockname": ("192.0.2.2", 8000)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def test_the_installed_uvicorn_is_a_release_the_pin_allows() -> None:
    requirements = [Requirement(text) for text in metadata.requires("warmstart") or []]
    (pin,) = [requirement for requirement in requirements if requirement.name == "uvicorn"]
    installed = Version(metadata.version("uvicorn"))
    assert installed in pin.specifier, f"uvicorn {installed} is outside {pin}: check connections.py first"
    assert Version("1000") not in pin.specifier, f"{pin}: a release not checked yet must not be installed"


def test_the_hooks_the_subclass_overrides_are_uvicorns_with_the_same_parameters() -> None:
    guarded = protocol_for(ConnectionLimits())
    for name in OVERRIDDEN:
        assert name in vars(H11Protocol), f"uvicorn's H11Protocol no longer defines {name}"
        ours, theirs = (inspect.signature(getattr(cls, name)) for cls in (guarded, H11Protocol))
        assert list(ours.parameters) == list(theirs.parameters), (name, ours, theirs)


def test_a_connection_and_a_request_head_carry_the_state_the_subclass_reads() -> None:
    async def exercise() -> None:
        config = Config(app=app, http=protocol_for(ConnectionLimits()), log_config=None)
        config.load()  # what uvicorn's server does: the class given as `http` is the one it instantiates
        state = ServerState()
        protocol = config.http_protocol_class(config=config, server_state=state, app_state={})
        assert isinstance(protocol.conn, BoundedHeadConnection)  # set after uvicorn's own, in __init__
        transport = Transport()
        protocol.connection_made(transport)
        for name in READ_AFTER_CONNECT:
            assert hasattr(protocol, name), f"uvicorn's H11Protocol has no {name} once a connection is made"
        assert protocol in protocol.connections and protocol.client == ("192.0.2.1", 5555)
        protocol.data_received(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        for name in READ_AFTER_HEAD:
            assert hasattr(protocol, name), f"uvicorn's H11Protocol has no {name} once a head is in"
        for field in CYCLE_FIELDS:
            assert hasattr(protocol.cycle, field), f"uvicorn's RequestResponseCycle has no {field}"
        await asyncio.sleep(0.05)  # the app answers
        assert transport.written.startswith(b"HTTP/1.1 204"), transport.written
        assert protocol.conn.our_state in (h11.IDLE, h11.DONE)
        protocol.connection_lost(None)
        assert protocol not in protocol.connections

    asyncio.run(exercise())
