"""Prometheus metrics of one worker, in their own registry (served at /metrics).

Every HTTP response is counted in `warmstart_worker_requests_total{route, status}`, errors included (a
request whose client left before its answer is counted with status 499). For autoscalers (HPA through a
metrics adapter, KEDA's Prometheus scaler), two gauges with stable names, counting generation requests
(one per choice: a request with n = 4 counts 4):
- `warmstart_worker_requests_running`: generating, i.e. the engine has produced their first token;
- `warmstart_worker_requests_waiting`: accepted but without a first token yet (queued for a free engine
  slot, or being prefilled).
Their sum is the load on this worker; `waiting` above zero for long means it needs help.
Behind vLLM's own server (the vllm engine's `--api vllm`) the two follow vLLM's scheduler
(`vllm:num_requests_waiting`, `vllm:num_requests_running`), its responses are counted here by vLLM's routes
(requests and latency), and the token and time-to-first-token series are vLLM's.
`warmstart_worker_requests_cancelled_total` counts generations stopped because their client went away.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "warmstart_worker_requests", "HTTP responses by route and status code (499: the client left)",
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
        self.requests_running = Gauge(
            "warmstart_worker_requests_running",
            "Generation requests (one per choice) the engine is producing tokens for",
            registry=self.registry,
        )
        self.requests_waiting = Gauge(
            "warmstart_worker_requests_waiting",
            "Generation requests (one per choice) accepted but without their first token yet",
            registry=self.registry,
        )
        self.requests_cancelled = Counter(
            "warmstart_worker_requests_cancelled",
            "Generation requests stopped because their client disconnected",
            registry=self.registry,
        )

    @contextlib.contextmanager
    def generation(self) -> Iterator[GenerationTracker]:
        """Track one generation request: waiting until `tracker.started()`, then running, until the end."""
        tracker = GenerationTracker(self)
        self.requests_waiting.inc()
        try:
            yield tracker
        finally:
            (self.requests_running if tracker.running else self.requests_waiting).dec()


class GenerationTracker:
    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics
        self.running = False

    def started(self) -> None:
        if not self.running:
            self._metrics.requests_waiting.dec()
            self._metrics.requests_running.inc()
            self.running = True
