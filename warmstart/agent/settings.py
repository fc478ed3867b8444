"""The node agent's settings: each a flag of `warmstart agent` and an environment variable (the chart's
DaemonSet sets the variables). The agent runs on this one object (`NodeContext.config`)."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import field_validator

from warmstart.checkpoint.hugepages import MODES as HUGEPAGES_MODES
from warmstart.host.command_settings import (
    Bytes,
    CommandSettings,
    Count,
    NonEmptyText,
    Port,
    Seconds,
    SecondsOrZero,
    Text,
    setting,
)


class AgentSettings(CommandSettings):
    # Fixed, not settings: how long the agent waits, how often it cleans the store.
    start_timeout: ClassVar[float] = 300.0  # for a pod's container to appear on the host
    ready_timeout: ClassVar[float] = 1800.0  # for a capture pod's `ready-for-snapshot`
    criu_timeout: ClassVar[float] = 600.0
    cleanup_interval: ClassVar[float] = 300.0
    cleanup_grace: ClassVar[float] = 3600.0  # unreferenced store snapshots younger than this stay

    node: Text = setting(
        "",
        "WARMSTART_NODE_NAME",
        "this node's name as the API server knows it (the chart: the pod's spec.nodeName)",
        min_length=1,
    )
    store: Text = setting(
        "/var/lib/warmstart/store",
        "WARMSTART_STORE",
        "snapshot store directory",
        min_length=1,
        validate_default=True,  # made absolute (_absolute)
    )
    criu: Text = setting("criu", "WARMSTART_CRIU", "the CRIU 4 command line", min_length=1)
    kubelet_root: Text = setting(
        "/var/lib/kubelet",
        "WARMSTART_KUBELET_ROOT",
        "the kubelet's root directory as mounted in the agent",
        min_length=1,
    )
    cri_socket: Text = setting(
        "/run/containerd/containerd.sock",
        "WARMSTART_AGENT_CRI_SOCKET",
        "the container runtime's CRI socket as mounted in the agent, asked which image a worker runs "
        "from (empty, or no socket there: the kubelet's report is awaited)",
        empty_means_none=True,
    )
    key: NonEmptyText | None = setting(
        None,
        "WARMSTART_SIGNING_KEY",
        "signing key file, e.g. a mounted Secret, owned by root or this user and private to its owner "
        "(unset: an HMAC key generated once for the store in $WARMSTART_KEY_DIR, never inside the store)",
    )
    metrics_port: Port = setting(9400, "WARMSTART_AGENT_METRICS_PORT_NUMBER", "Prometheus port, 0 for none")
    grpc_socket: Text = setting(
        "/run/warmstart/agent.sock",
        "WARMSTART_AGENT_GRPC_SOCKET",
        "unix socket of the gRPC API (root only), empty for none",
        empty_means_none=True,
    )
    listen_address: Text = setting(
        "0.0.0.0", "WARMSTART_AGENT_LISTEN_ADDRESS", "IP address of the metrics endpoint"
    )
    max_captures: Count = setting(1, "WARMSTART_AGENT_MAX_CAPTURES", "concurrent captures on this node")
    max_restores: Count = setting(2, "WARMSTART_AGENT_MAX_RESTORES", "concurrent restores on this node")
    resync: Seconds = setting(30.0, "WARMSTART_AGENT_RESYNC_SECONDS", "seconds between full relists of pods")
    prestage_interval: Seconds = setting(
        30.0,
        "WARMSTART_AGENT_PRESTAGE_INTERVAL_SECONDS",
        "seconds between passes that keep the snapshots of "
        "endpoints with snapshot.prestage PageCache in this node's page cache",
    )
    prestage_max_bytes: Bytes = setting(
        64 << 30,
        "WARMSTART_AGENT_PRESTAGE_MAX_BYTES",
        "bytes of snapshots kept in the page cache, newest first (0: no pre-staging; the agent's memory "
        "limit caps it, since the page cache it fills is charged to its cgroup)",
    )
    transparent_hugepages: Literal[HUGEPAGES_MODES] | None = setting(  # type: ignore[valid-type]
        None,
        "WARMSTART_AGENT_TRANSPARENT_HUGEPAGES",
        "select this transparent huge pages mode on the node at "
        "start (always lets CRIU restore into 2 MiB pages); it stays after the agent stops; unset: leave the "
        "node's as it is",
    )
    verified_records: bool = setting(
        True,
        "WARMSTART_VERIFIED_RECORDS",
        "restore without hashing again a blob this node verified before, its inode, size and mtime "
        "unchanged since (any write through the filesystem moves the mtime); false: hash every blob on every "
        "restore, so damage beneath the filesystem is caught too",
    )
    pull_timeout: Seconds = setting(
        120.0,
        "WARMSTART_AGENT_PULL_TIMEOUT_SECONDS",
        "seconds a restore may spend pulling its snapshot from the "
        "object store (WARMSTART_S3_BUCKET and the other WARMSTART_S3_* variables name it) before its worker "
        "starts cold",
    )
    cache_max_bytes: Bytes = setting(
        0,
        "WARMSTART_AGENT_CACHE_MAX_BYTES",
        "bound this node's cache of the object store, least recently used snapshots first (0: none)",
    )
    cache_max_age: SecondsOrZero = setting(
        0.0,
        "WARMSTART_AGENT_CACHE_MAX_AGE_SECONDS",
        "remove cached snapshots unused for this many seconds (0: never)",
    )

    @property
    def restore_work_dir(self) -> Path:
        """Where restores materialise images: inside the store, one directory per node."""
        return Path(self.store) / "agent-work" / self.node

    @field_validator("store")
    @classmethod
    def _absolute(cls, text: str) -> str:
        return str(Path(text).resolve())

    @field_validator("listen_address")
    @classmethod
    def _an_ip_address(cls, text: str) -> str:
        try:
            ipaddress.ip_address(text)
        except ValueError:
            raise ValueError("must be an IP address, e.g. 0.0.0.0 or ::") from None
        return text
