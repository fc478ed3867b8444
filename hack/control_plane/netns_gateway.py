"""The real node's gateway between the machine's loopback and the node's network namespace.

The apiserver listens on the machine's loopback only; the node (kubelet, kube-proxy, pods) lives in a network
namespace of its own with no link to the machine. This process, running in the machine's namespace, opens
sockets inside the node's namespace (setns around socket(); a socket stays in the namespace it was made in):

- a listener at API_IP:<apiserver port> inside the node's namespace, forwarded to the apiserver on loopback
  (what kubelet, kube-proxy and the `kubernetes` Service's endpoint use);
- an HTTP CONNECT proxy on a unix socket for the apiserver's egress selector (`cluster`): exec, logs and
  port-forward to the kubelet, and anything else the apiserver sends to nodes, pods or Services, dialled
  from inside the node's namespaces, and only to the node's own address ranges (--allow).

    python -m control_plane.netns_gateway --netns /proc/PID/ns/net --listen IP:PORT \\
        --upstream 127.0.0.1:PORT --egress-socket PATH --allow CIDR [--allow CIDR ...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import ipaddress
import os
import signal
import socket
import sys
from pathlib import Path

CLONE_NEWNET = 0x40000000
CONNECT_HEADER_LIMIT = 8192
DIAL_TIMEOUT_SECONDS = 10.0
COPY_CHUNK = 1 << 16


class NamespaceSockets:
    """Makes sockets inside one network namespace while this thread otherwise stays in its own."""

    def __init__(self, netns_path: str) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._target = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
        self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)

    def _enter(self, fd: int) -> None:
        if self._libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns: {os.strerror(error)}")

    def tcp_socket(self) -> socket.socket:
        self._enter(self._target)
        try:
            made = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        finally:
            self._enter(self._home)
        made.setblocking(False)
        return made


def parse_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    ipaddress.ip_address(host)
    return host, int(port)


async def copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(COPY_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


async def splice(
    left: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    right: tuple[asyncio.StreamReader, asyncio.StreamWriter],
) -> None:
    try:
        await asyncio.gather(copy(left[0], right[1]), copy(right[0], left[1]))
    finally:
        for writer in (left[1], right[1]):
            writer.close()


class Gateway:
    def __init__(
        self, sockets: NamespaceSockets, upstream: tuple[str, int], allowed: list[ipaddress.IPv4Network]
    ) -> None:
        self.sockets = sockets
        self.upstream = upstream
        self.allowed = allowed

    def allowed_destination(self, host: str) -> bool:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in subnet for subnet in self.allowed)

    async def forward_to_apiserver(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        await splice((reader, writer), upstream)

    async def dial_in_namespace(
        self, host: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        made = self.sockets.tcp_socket()
        try:
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(loop.sock_connect(made, (host, port)), DIAL_TIMEOUT_SECONDS)
        except BaseException:
            made.close()
            raise
        return await asyncio.open_connection(sock=made)

    async def connect_proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One HTTP CONNECT tunnel, as the apiserver's egress selector opens them."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        method, _, rest = head.decode("latin-1").partition(" ")
        target = rest.split(" ", 1)[0]
        host, _, port_text = target.rpartition(":")
        if method != "CONNECT" or not port_text.isdigit() or not self.allowed_destination(host):
            await self.refuse(writer, "403 Forbidden", f"only CONNECT to the real node's addresses: {target}")
            return
        try:
            destination = await self.dial_in_namespace(host, int(port_text))
        except (TimeoutError, OSError) as error:
            await self.refuse(writer, "502 Bad Gateway", f"{target}: {error}")
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await splice((reader, writer), destination)

    @staticmethod
    async def refuse(writer: asyncio.StreamWriter, status: str, reason: str) -> None:
        body = reason.encode()
        writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()


async def serve(args: argparse.Namespace) -> None:
    sockets = NamespaceSockets(args.netns)
    allowed = [ipaddress.IPv4Network(cidr) for cidr in args.allow]
    gateway = Gateway(sockets, parse_address(args.upstream), allowed)
    listener = sockets.tcp_socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(parse_address(args.listen))
    listener.listen(128)
    api = await asyncio.start_server(gateway.forward_to_apiserver, sock=listener)
    egress_path = Path(args.egress_socket)
    egress_path.unlink(missing_ok=True)
    # Created last: its appearance tells the node that both ends are ready.
    egress = await asyncio.start_unix_server(
        gateway.connect_proxy, path=str(egress_path), limit=CONNECT_HEADER_LIMIT
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signal_number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signal_number, stop.set)
    print(f"gateway: {args.listen} (in {args.netns}) -> {args.upstream}; egress {egress_path}", flush=True)
    async with api, egress:
        await stop.wait()
    egress_path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="netns_gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--netns", required=True, help="the node's network namespace (/proc/PID/ns/net)")
    parser.add_argument("--listen", required=True, help="IP:PORT inside that namespace")
    parser.add_argument("--upstream", required=True, help="the apiserver, IP:PORT on this machine's loopback")
    parser.add_argument("--egress-socket", required=True, help="unix socket for the apiserver's egress")
    parser.add_argument("--allow", action="append", default=[], help="a CIDR egress may reach (repeat)")
    asyncio.run(serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
