"""UTC time and the timestamps Kubernetes objects carry (RFC 3339, seconds, `Z`): one helper for each."""

from __future__ import annotations

import datetime as dt


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def format_time(moment: dt.datetime | None = None) -> str:
    """`moment` (default: now) as Kubernetes writes times, e.g. 2026-12-03T16:20:00Z."""
    return (moment or utc_now()).astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
