"""Whether the worker serve started is the one serving: a 200 from `/ready` on its port counts only when the
connection that carried it was accepted by a process of that worker.

Anything can listen on a port (another serve, an old worker, any program): its answer proves nothing.
The kernel does: the accepted end of the probe's connection is a socket in `/proc/net/tcp` (or `tcp6`),
local address = the probe's peer, remote address = the probe's own, and its inode is a descriptor of the
process that accepted it (`/proc/<pid>/fd/* -> socket:[inode]`). Nothing a process can say about itself
enters into it.
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

PROC = Path("/proc")
PROBE_TIMEOUT_SECONDS = 2.0


def import_http_client_meanwhile() -> None:
    """Import `http.client` (tens of milliseconds: it brings the email parser and ssl) on a thread, so that
    a restore's probes find it loaded: imported at the top, it would be paid before the start's clock."""
    threading.Thread(
        target=importlib.import_module, args=("http.client",), name="warmstart-import-http", daemon=True
    ).start()


@contextlib.contextmanager
def ready_probe(host: str, port: int, path: str) -> Iterator[int | None]:
    """GET `path`; inside the block, None unless it answered 200, else the inode of the server's end of
    the connection (0 when the kernel lists none): the connection stays open meanwhile, so the server's
    end is still a descriptor of the process that accepted it."""
    import http.client

    connection = http.client.HTTPConnection(host, port, timeout=PROBE_TIMEOUT_SECONDS)
    with contextlib.closing(connection):
        inode = None
        with contextlib.suppress(OSError, http.client.HTTPException):
            connection.connect()
            probe = connection.sock
            connection.request("GET", path)
            response = connection.getresponse()
            response.read()
            if response.status == 200:
                inode = accepted_socket_inode(probe)
        yield inode


def accepted_socket_inode(probe: socket.socket) -> int:
    """The inode of the socket at the other end of the connected TCP socket `probe` (same network
    namespace), 0 when it is not listed."""
    local, peer = probe.getsockname(), probe.getpeername()
    wanted = {
        (_proc_address(peer[0], peer[1], mapped), _proc_address(local[0], local[1], mapped))
        for mapped in (False, True)
    }
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (PROC / "net" / table).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 9 and (fields[1], fields[2]) in wanted:
                    return int(fields[9])
    return 0


def _proc_address(host: str, port: int, mapped: bool) -> str:
    """`host:port` as /proc/net/tcp{,6} print it: the address in 32-bit words of host byte order, hex."""
    address = ipaddress.ip_address(host.split("%")[0])
    if mapped and address.version == 4:
        address = ipaddress.IPv6Address(f"::ffff:{address}")
    packed = address.packed
    words = struct.unpack(f"<{len(packed) // 4}I", packed)
    return "".join(f"{word:08X}" for word in words) + f":{port:04X}"


def socket_holder(inode: int) -> str:
    """`pid N (command)` of a process holding socket `inode`, '' when none can be seen from here."""
    for entry in PROC.iterdir():
        if entry.name.isdigit() and has_socket(int(entry.name), inode):
            with contextlib.suppress(OSError):
                return f"pid {entry.name} ({(entry / 'comm').read_text().strip()})"
            return f"pid {entry.name}"
    return ""


def has_socket(pid: int, inode: int) -> bool:
    """Whether process `pid` has a descriptor of socket `inode`."""
    wanted = f"socket:[{inode}]"
    fd_dir = PROC / str(pid) / "fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return False
    for name in names:
        with contextlib.suppress(OSError):
            if os.readlink(fd_dir / name) == wanted:
                return True
    return False
