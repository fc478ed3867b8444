"""The Unix socket between a stager and its engine: addresses of any length, the listening side, and the
engine's acknowledgement that it mapped the staged memory."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

ACK = b"mapped"
SOCKET_PATH_LIMIT = 100  # sun_path holds 108 bytes; longer paths go through /proc/self/fd/<dir>/<name>


@contextlib.contextmanager
def socket_address(path: str | os.PathLike[str]) -> Iterator[str]:
    """An address for `path` that fits a Unix socket (a pod's control directory can be 120 bytes deep)."""
    path = os.fspath(path)
    if len(os.fsencode(path)) <= SOCKET_PATH_LIMIT:
        yield path
        return
    directory = os.open(os.path.dirname(path) or ".", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield f"/proc/self/fd/{directory}/{os.path.basename(path)}"
    finally:
        os.close(directory)


def listen(path: str | os.PathLike[str]) -> socket.socket:
    """A listening Unix socket at `path` that any user may connect to (the engine need not be root).

    Bound under a temporary name and renamed into place once it listens: a client that sees the path never
    meets a bound socket that refuses connections."""
    path = os.fspath(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    pending = f"{path}.{os.getpid()}.pending"
    try:
        with socket_address(pending) as address:
            listener.bind(address)
            os.chmod(address, 0o666)
            listener.listen(1)
            with socket_address(path) as final:
                os.rename(address, final)
    except BaseException:
        listener.close()
        with contextlib.suppress(OSError), socket_address(pending) as address:
            os.unlink(address)
        raise
    return listener
