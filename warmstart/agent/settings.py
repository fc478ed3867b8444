"""The node agent's settings: each a flag of `warmstart agent` and an environment variable (the chart's
DaemonSet sets the variables)."""

from __future__ import annotations

from typing import Literal

from warmstart.checkpoint.hugepages import MODES as HUGEPAGES_MODES
from warmstart.settings import CommandSettings, setting

DEFAULT_GRPC_SOCKET = "/run/warmstart/agent.sock"
DEFAULT_PRESTAGE_MAX_BYTES = 64 << 30


class AgentSettings(CommandSettings):
    node: str = setting(
        "",
        "WARMSTART_NODE_NAME",
        "this node's name as the API server knows it (the chart: the pod's spec.nodeName)",
        min_length=1,
    )
    store: str = setting(
        "/var/lib/warmstart/store", "WARMSTART_STORE", "snapshot store directory", min_length=1
    )
    criu: str = setting("criu", "WARMSTART_CRIU", "the CRIU 4 command line", min_length=1)
    kubelet_root: str = setting(
        "/var/lib/kubelet",
        "WARMSTART_KUBELET_ROOT",
        "the kubelet's root directory as mounted in the agent",
        min_length=1,
    )
    cri_socket: str = setting(
        "/run/containerd/containerd.sock",
        "WARMSTART_AGENT_CRI_SOCKET",
        "the container runtime's CRI socket as mounted in the agent, asked which image a worker runs "
        "from (empty, or no socket there: the kubelet's report is awaited)",
    )
    key: str | None = setting(
        None,
        "WARMSTART_SIGNING_KEY",
        "signing key file, e.g. a mounted Secret (unset: an HMAC key generated once "
        "for the store in $WARMSTART_KEY_DIR, never inside the store)",
    )
    metrics_port: int = setting(
        9400, "WARMSTART_AGENT_METRICS_PORT_NUMBER", "Prometheus port, 0 for none", ge=0, le=65535
    )
    grpc_socket: str = setting(
        DEFAULT_GRPC_SOCKET,
        "WARMSTART_AGENT_GRPC_SOCKET",
        "unix socket of the gRPC API (root only), empty for none",
    )
    listen_address: str = setting(
        "0.0.0.0", "WARMSTART_AGENT_LISTEN_ADDRESS", "address of the metrics endpoint"
    )
    max_captures: int = setting(1, "WARMSTART_AGENT_MAX_CAPTURES", "concurrent captures on this node", ge=1)
    max_restores: int = setting(2, "WARMSTART_AGENT_MAX_RESTORES", "concurrent restores on this node", ge=1)
    resync: float = setting(
        30.0, "WARMSTART_AGENT_RESYNC_SECONDS", "seconds between full relists of pods", gt=0
    )
    prestage_interval: float = setting(
        30.0,
        "WARMSTART_AGENT_PRESTAGE_INTERVAL_SECONDS",
        "seconds between passes that keep the snapshots of "
        "endpoints with snapshot.prestage PageCache in this node's page cache",
        gt=0,
    )
    prestage_max_bytes: int = setting(
        DEFAULT_PRESTAGE_MAX_BYTES,
        "WARMSTART_AGENT_PRESTAGE_MAX_BYTES",
        "bytes of snapshots kept in the page cache, newest first (0: no pre-staging; the agent's memory "
        "limit caps it, since the page cache it fills is charged to its cgroup)",
        ge=0,
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
    pull_timeout: float = setting(
        120.0,
        "WARMSTART_AGENT_PULL_TIMEOUT_SECONDS",
        "seconds a restore may spend pulling its snapshot from the "
        "object store (WARMSTART_S3_BUCKET and the other WARMSTART_S3_* variables name it) before its worker "
        "starts cold",
        gt=0,
    )
    cache_max_bytes: int = setting(
        0,
        "WARMSTART_AGENT_CACHE_MAX_BYTES",
        "bound this node's cache of the object store, least recently used snapshots first (0: none)",
        ge=0,
    )
    cache_max_age: float = setting(
        0.0,
        "WARMSTART_AGENT_CACHE_MAX_AGE_SECONDS",
        "remove cached snapshots unused for this many seconds (0: never)",
        ge=0,
    )
