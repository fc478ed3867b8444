"""The node's transparent huge pages mode, selected when asked (the agent's `agent.transparentHugepages`,
`warmstart serve --transparent-hugepages`).

With THP `always`, CRIU writes a restored process's memory into 2 MiB pages instead of faulting it in 4 KiB
at a time: on the H200 a 3.3 GiB vLLM image restored in 1.2-1.6 s instead of 2.0-2.3 s, a 1.8 GiB builtin
engine's in 1.07 s instead of 1.31 s (BENCHMARKS.md).
The engine's own `MADV_HUGEPAGE` on its mappings gave no such gain (`madvise` mode). The setting is the
whole node's: it is left alone unless asked, and what changed is logged.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# The host's setting as the chart mounts it into the agent: a container's own /sys can be read-only (it was
# in the agent's pod on a real node, privileged as it is), a bind mount of the host's directory is not.
HOST_THP_ENABLED = Path("/host/sys/kernel/mm/transparent_hugepage/enabled")
MODES = ("always", "madvise", "never")


def node_setting() -> Path:
    """The file that selects this node's mode from here: the host's, where it is mounted, else our own."""
    return HOST_THP_ENABLED if HOST_THP_ENABLED.exists() else THP_ENABLED


def current_mode(path: Path = THP_ENABLED) -> str:
    """The selected mode: the bracketed word of the kernel's `always [madvise] never`."""
    text = path.read_text()
    start, end = text.find("["), text.find("]")
    if not 0 <= start < end:
        raise ValueError(f"{path} does not say which mode is selected: {text.strip()!r}")
    return text[start + 1 : end]


def set_mode(mode: str, path: Path = THP_ENABLED) -> str:
    """Select `mode` unless it already is; returns the mode before. OSError where the setting cannot be
    written, even when `mode` is selected already: a setting that could not change it is said at once."""
    if mode not in MODES:
        raise ValueError(f"transparent huge pages mode must be one of {', '.join(MODES)}, got {mode!r}")
    before = current_mode(path)
    if not os.access(path, os.W_OK):
        raise OSError(errno.EACCES, f"{path} cannot be written here (read-only, or not ours)")
    if before != mode:
        path.write_text(mode)
        log.info("transparent huge pages on this node: %s -> %s (%s)", before, mode, path)
    return before


@contextlib.contextmanager
def selected(mode: str | None, path: Path = THP_ENABLED) -> Iterator[None]:
    """`mode` selected while the block runs (None: the node's left as it is), the earlier one after."""
    if mode is None:
        yield
        return
    before = set_mode(mode, path)
    try:
        yield
    finally:
        set_mode(before, path)
