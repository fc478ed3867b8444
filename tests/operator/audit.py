"""The operator's requests as the apiserver's audit log recorded them (one JSON event per line).

The operator is told apart by its clients' user agents: kopf's and the Kubernetes Python client's. Whoever
reads these counts must make no request of their own with the Python client meanwhile (kubectl is fine).
"""

from __future__ import annotations

import datetime as dt
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OPERATOR_AGENTS = ("kopf/", "OpenAPI-Generator/")
WRITES = frozenset({"create", "update", "patch", "delete", "deletecollection"})


@dataclass(frozen=True)
class Request:
    verb: str
    resource: str  # e.g. "deployments", "inferenceendpoints/status"
    namespace: str
    name: str
    code: int
    at: dt.datetime

    @property
    def write(self) -> bool:
        return self.verb in WRITES


def _request(event: dict[str, Any]) -> Request:
    ref = event.get("objectRef") or {}
    resource = ref.get("resource", "")
    if ref.get("subresource"):
        resource = f"{resource}/{ref['subresource']}"
    stamp = event["stageTimestamp"].replace("Z", "+00:00")
    return Request(
        verb=event["verb"],
        resource=resource,
        namespace=ref.get("namespace", ""),
        name=ref.get("name", ""),
        code=int((event.get("responseStatus") or {}).get("code") or 0),
        at=dt.datetime.fromisoformat(stamp),
    )


def operator_requests(log: Path, since: dt.datetime, until: dt.datetime) -> list[Request]:
    """The operator's requests answered within [since, until)."""
    found = []
    for line in log.read_text(errors="replace").splitlines():
        event = json.loads(line)
        if not str(event.get("userAgent", "")).startswith(OPERATOR_AGENTS):
            continue
        request = _request(event)
        if since <= request.at < until:
            found.append(request)
    return found


def tally(requests: list[Request]) -> Counter[str]:
    """Requests counted by verb and resource, e.g. "patch deployments"."""
    return Counter(f"{r.verb} {r.resource}" for r in requests)


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)
