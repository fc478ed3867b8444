"""What a vLLM process holds that CRIU cannot dump, and how the engine avoids it.

An in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, a world of one) opens, besides its CUDA
descriptors (released by the CUDA checkpoint):

* torch.distributed's rendezvous store: vLLM's single-process executor initialises the default process group
  with ``tcp://<ip>:<free port>``, so a ``TCPStore`` server (a listening socket plus an established client
  connection to itself) lives for the life of the process, and its libuv backend maps an ``io_uring`` on new
  kernels. CRIU cannot dump an io_uring at all, nor an established TCP connection without
  ``--tcp-established``. A world of one needs no network rendezvous: `use_file_rendezvous` points the
  executor at a ``file://`` store instead (no socket, no event loop), and ``USE_LIBUV=0`` keeps any other
  TCPStore off libuv.
* the gloo CPU group (for a world of one it only holds a listening socket and an epoll), which CRIU >= 4.2
  dumps and restores; CRIU 4.1.1 cannot dump any inet socket on kernels 6.16+.

`open_resources` lists what is still open, by kind, so the engine's log and `ready-for-snapshot` payload say
what the dump will meet.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from warmstart.api.control_dir import CONTROL_DIR_ENV

log = logging.getLogger(__name__)

UNDUMPABLE = ("anon_inode:[io_uring]",)
ENV_DEFAULTS = {
    # The engine core in this process: one process holding the CUDA context is what a checkpoint captures.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # torch.distributed's TCPStore without libuv (libuv uses io_uring on new kernels).
    "USE_LIBUV": "0",
    "VLLM_NO_USAGE_STATS": "1",  # the usage reporter starts a thread that tries the network
    # The gloo group's (and NCCL's bootstrap) listening sockets on loopback, not on the pod's address: a
    # restore into another pod, which has another address, must bind them again (all ranks share one host).
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}


# Where Triton and Inductor build the shared objects the engine loads (kernel launchers, Triton's CUDA
# helpers): the restored process maps them again, so they must be there in the new pod, as they were.
# Under the control directory they travel with the snapshot (the agent carries what the engine maps there);
# in the container's own files (their default, under $HOME and /tmp) a new pod has none of them. vLLM moves
# both caches under VLLM_CACHE_ROOT once it compiles the model, hence that one too.
JIT_CACHE_DIRS = {
    "TRITON_CACHE_DIR": "jit-cache/triton",
    "TORCHINDUCTOR_CACHE_DIR": "jit-cache/inductor",
    "VLLM_CACHE_ROOT": "jit-cache/vllm",
}


def apply_env_defaults(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set the variables above where the user did not; returns those set."""
    environ = os.environ if environ is None else environ  # type: ignore[assignment]
    defaults = dict(ENV_DEFAULTS)
    control = environ.get(CONTROL_DIR_ENV)
    if control:
        defaults.update({key: str(Path(control) / folder) for key, folder in JIT_CACHE_DIRS.items()})
    applied = {key: value for key, value in defaults.items() if key not in environ}
    environ.update(applied)
    return applied


def use_file_rendezvous(vllm_module: Any) -> str | None:
    """Make vLLM's single-process executor rendezvous through a file store instead of TCP.

    Returns the init method now used, or None when this vLLM has no such executor (nothing is changed).
    Idempotent: a second call keeps the first file.
    """
    try:
        from vllm.v1.executor import uniproc_executor
    except ImportError:
        log.warning("vLLM %s has no v1 single-process executor; its rendezvous stays on TCP",
                    getattr(vllm_module, "__version__", "?"))  # fmt: skip
        return None
    executor = getattr(uniproc_executor, "UniProcExecutor", None)
    original = getattr(executor, "_distributed_args", None)
    if executor is None or original is None:
        return None
    if getattr(original, "_warmstart_file_store", None):
        return original._warmstart_file_store
    base = Path(tempfile.mkdtemp(prefix="warmstart-vllm-rdzv-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    store = base / f"store-{os.getpid()}"
    method = f"file://{store}"

    def distributed_args(self: Any) -> tuple[str, int, int]:
        _tcp, rank, local_rank = original(self)
        return method, rank, local_rank

    distributed_args._warmstart_file_store = method  # type: ignore[attr-defined]
    executor._distributed_args = distributed_args
    return method


def open_resources(pid: int | str = "self") -> dict[str, int]:
    """Counts of what the process holds: descriptors by kind (inet sockets split by protocol) and
    anonymous-inode memory mappings (``map:anon_inode:[...]``)."""
    proc = Path("/proc") / str(pid)
    inet = _inet_socket_inodes(proc)
    kinds: Counter[str] = Counter()
    try:
        fds = list((proc / "fd").iterdir())
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            kinds[inet.get(target[8:-1], "socket:other")] += 1
        elif target.startswith("anon_inode:"):
            kinds[target] += 1
        elif target.startswith("/dev/nvidia"):
            kinds["/dev/nvidia*"] += 1
        elif target.startswith("pipe:"):
            kinds["pipe"] += 1
        else:
            kinds["file"] += 1
    try:
        for line in (proc / "maps").read_text().splitlines():
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("anon_inode:"):
                kinds["map:" + fields[5]] += 1
    except OSError:
        pass
    return dict(sorted(kinds.items()))


def undumpable(resources: dict[str, int]) -> list[str]:
    """What in `resources` CRIU cannot dump whatever its options (empty when nothing)."""
    return [kind for kind in resources if any(kind.endswith(bad) for bad in UNDUMPABLE)]


def _inet_socket_inodes(proc: Path) -> dict[str, str]:
    """socket inode -> 'tcp:listen' | 'tcp:established' | 'tcp:other' | 'udp', from the process's netns."""
    inodes: dict[str, str] = {}
    for name in ("tcp", "tcp6"):
        for fields in _net_table(proc / "net" / name):
            state = {"0A": "listen", "01": "established"}.get(fields[3], "other")
            inodes[fields[9]] = f"tcp:{state}"
    for name in ("udp", "udp6"):
        for fields in _net_table(proc / "net" / name):
            inodes[fields[9]] = "udp"
    return inodes


def _net_table(path: Path) -> list[list[str]]:
    try:
        lines = path.read_text().splitlines()[1:]
    except OSError:
        return []
    return [fields for fields in (line.split() for line in lines) if len(fields) > 9]
