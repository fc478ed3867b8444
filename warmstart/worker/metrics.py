"""Prometheus metrics of one worker, in their own registry (served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "warmstart_worker_requests", "HTTP requests by route and status code",
            ["route", "status"], registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "warmstart_worker_request_duration_seconds", "HTTP request latency by route",
            ["route"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "warmstart_worker_prompt_tokens", "Prompt tokens processed", registry=self.registry
        )
        self.completion_tokens = Counter(
            "warmstart_worker_completion_tokens", "Completion tokens generated", registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "warmstart_worker_time_to_first_token_seconds", "Time from request to its first output token",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.start_seconds = Gauge(
            "warmstart_worker_start_seconds",
            "Seconds from process start (cold) or from resume (restore) until the worker served",
            ["mode"], registry=self.registry,
        )  # fmt: skip
