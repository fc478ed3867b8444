"""Operator metrics (Prometheus): reconciles, their latency, endpoints and snapshots by phase."""

from __future__ import annotations

import threading
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

ENDPOINT_PHASES = ("Pending", "Capturing", "Ready", "Degraded", "ScaledToZero")
SNAPSHOT_PHASES = ("Pending", "Capturing", "Ready", "Failed", "Invalid")


class PhaseBook(Collector):
    """The last known phase of every object, exported as one gauge per phase."""

    def __init__(self, metric: str, documentation: str, phases: tuple[str, ...]) -> None:
        self.metric, self.documentation, self.phases = metric, documentation, phases
        self._phases: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()

    def set(self, namespace: str, name: str, phase: str) -> None:
        with self._lock:
            self._phases[(namespace, name)] = phase

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._phases.pop((namespace, name), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            tally = Tally(self._phases.values())
        family = GaugeMetricFamily(self.metric, self.documentation, labels=["phase"])
        for phase in (*self.phases, *sorted(set(tally) - set(self.phases))):
            family.add_metric([phase], tally[phase])
        yield family


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            "warmstart_operator_reconciles",
            "Reconciles by handler and result",
            ["handler", "result"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "warmstart_operator_reconcile_seconds",
            "Reconcile latency by handler",
            ["handler"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.endpoints = PhaseBook(
            "warmstart_operator_endpoints", "InferenceEndpoints by phase", ENDPOINT_PHASES
        )
        self.snapshots = PhaseBook(
            "warmstart_operator_snapshots", "InferenceSnapshots by phase", SNAPSHOT_PHASES
        )
        self.registry.register(self.endpoints)
        self.registry.register(self.snapshots)

    def observe(self, handler: str, result: str, seconds: float) -> None:
        self.reconciles.labels(handler=handler, result=result).inc()
        self.latency.labels(handler=handler).observe(seconds)

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        start_http_server(port, addr=address, registry=self.registry)


METRICS = OperatorMetrics()
