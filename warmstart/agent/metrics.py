"""Prometheus metrics of the node agent: captures and restores by result, their durations and bytes, and what
it keeps pre-staged in its node's page cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

DURATION_BUCKETS = (0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)


@dataclass
class AgentMetrics:
    """One registry per agent, so several agents (tests) never share series."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.captures = Counter("warmstart_agent_captures_total", "Captures", ["result"], registry=r)
        self.restores = Counter("warmstart_agent_restores_total", "Restores", ["result"], registry=r)
        self.capture_seconds = Histogram(
            "warmstart_agent_capture_seconds", "Capture duration", buckets=DURATION_BUCKETS, registry=r
        )
        self.restore_seconds = Histogram(
            "warmstart_agent_restore_seconds", "Restore duration", buckets=DURATION_BUCKETS, registry=r
        )
        self.captured_bytes = Counter(
            "warmstart_agent_captured_bytes_total", "Bytes of snapshots captured", registry=r
        )
        self.restored_bytes = Counter(
            "warmstart_agent_restored_bytes_total", "Bytes of snapshots restored", registry=r
        )
        self.in_flight = Gauge("warmstart_agent_in_flight", "Operations running", ["operation"], registry=r)
        self.store_deleted = Counter(
            "warmstart_agent_store_snapshots_deleted_total", "Store snapshots removed by cleanup", registry=r
        )
        self.prestaged_bytes = Gauge(
            "warmstart_agent_prestaged_bytes", "Bytes of a pre-staged snapshot in this node's page cache",
            ["namespace", "snapshot"], registry=r,
        )  # fmt: skip
        self.prestage_read_bytes = Counter(
            "warmstart_agent_prestage_read_bytes_total", "Bytes read to pre-stage snapshots", registry=r
        )
        self.remote_bytes = Counter(
            "warmstart_agent_object_store_bytes_total",
            "Bytes moved between this node's cache and the object store (direction: push or pull; reason: "
            "capture, restore or prestage)",
            ["direction", "reason"], registry=r,
        )  # fmt: skip
        self.remote_failures = Counter(
            "warmstart_agent_object_store_failures_total", "Transfers with the object store that failed",
            ["direction", "reason"], registry=r,
        )  # fmt: skip
        self.cache_bytes = Gauge(
            "warmstart_agent_cache_bytes",
            "Bytes of blobs in this node's cache of the object store after its last trim", registry=r,
        )  # fmt: skip
        self.cache_max_bytes = Gauge(
            "warmstart_agent_cache_max_bytes", "The bound of this node's cache (0: none)", registry=r
        )
        self.prestage_seconds = Histogram(
            "warmstart_agent_prestage_seconds", "Duration of a pre-staging pass", buckets=DURATION_BUCKETS,
            registry=r,
        )  # fmt: skip

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        start_http_server(port, addr=address, registry=self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The current value of one sample (0 when absent)."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0
