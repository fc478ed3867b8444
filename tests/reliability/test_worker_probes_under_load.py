"""The kubelet's probes against a real worker that is flooded with the costliest bodies a client may send:
bodies at the size limit that are one long list of token ids. Every probe is asked as the pod's probes ask
(the paths and the timeout the operator gives them) and must pass. Loopback only, bounded in count and
time."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from builders import endpoint_body
from support import free_port
from worker_helpers import Worker

from warmstart.api import labels as L
from warmstart.operator import children
from warmstart.operator.spec import parse_spec
from warmstart.worker.openai_requests import RequestLimits

pytestmark = [pytest.mark.reliability, pytest.mark.spawns]

SENDERS = (4, 8)
BODIES_PER_SENDER = 3
PROBE_EVERY_SECONDS = 0.2
SENDER_TIMEOUT_SECONDS = 120.0
REFERENCE = {
    "model": "tiny",
    "prompt": "The quick brown fox",
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
    "return_token_ids": True,
}


def token_id_body(size: int = RequestLimits().max_body_bytes) -> bytes:
    """A completion body of `size` bytes whose prompt is a list of about size / 2 token ids."""
    head, tail = b'{"model":"tiny","prompt":[', b"1]}"
    return head + b"1," * ((size - len(head) - len(tail)) // 2) + tail


def pod_probes() -> list[tuple[str, float]]:
    """(path, timeoutSeconds) of the readiness and liveness probes of a worker pod the operator builds."""
    body = endpoint_body()
    owner, spec = children.Owner.from_body(body), parse_spec(body["spec"])
    pod = children.deployment(owner, spec, L.ROLE_COLD, "", "ab" * 32)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    probes = (container["readinessProbe"], container["livenessProbe"])
    return [(probe["httpGet"]["path"], float(probe["timeoutSeconds"])) for probe in probes]


class Prober(threading.Thread):
    """Asks `url` every PROBE_EVERY_SECONDS with `timeout`, as the kubelet does, until stopped."""

    def __init__(self, url: str, timeout: float) -> None:
        super().__init__(name=f"prober {url}", daemon=True)
        self.url, self.timeout, self.stop = url, timeout, threading.Event()
        self.failures: list[str] = []
        self.asked = 0
        self.slowest = 0.0

    def run(self) -> None:
        with httpx.Client(timeout=self.timeout) as client:
            while not self.stop.is_set():
                started = time.monotonic()
                self._ask(client)
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.stop.wait(PROBE_EVERY_SECONDS)

    def _ask(self, client: httpx.Client) -> None:
        self.asked += 1
        try:
            status = client.get(self.url).status_code
        except httpx.HTTPError as error:
            self.failures.append(type(error).__name__)
            return
        if status != 200:
            self.failures.append(str(status))


def flood(port: int, senders: int, body: bytes) -> collections.Counter[str]:
    """`senders` clients at once, each posting `body` BODIES_PER_SENDER times; the statuses they got."""
    statuses: collections.Counter[str] = collections.Counter()

    def send() -> None:
        with httpx.Client(timeout=SENDER_TIMEOUT_SECONDS) as client:
            for _ in range(BODIES_PER_SENDER):
                try:
                    response = client.post(f"http://127.0.0.1:{port}/v1/completions", content=body)
                    statuses[str(response.status_code)] += 1
                except httpx.HTTPError as error:
                    statuses[type(error).__name__] += 1

    threads = [threading.Thread(target=send, name=f"sender-{n}", daemon=True) for n in range(senders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=SENDER_TIMEOUT_SECONDS * BODIES_PER_SENDER)
    return statuses


def reference_completion(port: int) -> tuple[list[int], str]:
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=REFERENCE, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["token_ids"], choice["text"]


@pytest.fixture
def probed_worker(worker_cache: Path, tmp_path: Path) -> Iterator[tuple[Worker, int, int]]:
    """A real cold worker with the supervisor's probe endpoints, as the operator starts it."""
    port, probe_port = free_port(), free_port()
    process = Worker(
        worker_cache, tmp_path, "--mode", "cold", "--port", str(port), "--probe-port", str(probe_port)
    )
    process.wait_ready(port)
    yield process, port, probe_port
    assert process.stop() == 0, process.logs()


def test_probes_pass_while_token_id_bodies_flood_the_worker(probed_worker) -> None:
    process, port, probe_port = probed_worker
    before = reference_completion(port)
    body = token_id_body()
    failed: list[str] = []
    for senders in SENDERS:
        probers = [Prober(f"http://127.0.0.1:{probe_port}{path}", timeout) for path, timeout in pod_probes()]
        for prober in probers:
            prober.start()
        started = time.monotonic()
        statuses = flood(port, senders, body)
        for prober in probers:
            prober.stop.set()
            prober.join(timeout=30)
        print(
            f"{senders} senders x {BODIES_PER_SENDER} bodies of {len(body)} bytes in "
            f"{time.monotonic() - started:.1f} s: {dict(statuses)}; "
            + "; ".join(
                f"{p.url.split(str(probe_port))[1]} {len(p.failures)} of {p.asked} probes failed "
                f"(slowest {p.slowest:.2f} s)"
                for p in probers
            )
        )
        assert statuses == {"400": senders * BODIES_PER_SENDER}, statuses
        failed += [f"{senders} senders, {p.url}: {p.failures}" for p in probers if p.failures]
    assert not failed, failed
    after = reference_completion(port)
    assert after == before and after[1], (before, after)
    assert "unexpected error" not in process.logs()
