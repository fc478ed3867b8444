"""Exponential backoff: the one schedule behind the operator's retries and its capture attempts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """base, 2 x base, 4 x base, ... up to max seconds after the 1st, 2nd, 3rd, ... failure in a row."""

    base_seconds: float = 1.0
    max_seconds: float = 120.0

    def delay(self, failures: int) -> float:
        exponent = min(max(failures - 1, 0), 32)  # 2**32 x base is past any cap; keeps the float finite
        return min(self.max_seconds, self.base_seconds * 2**exponent)


CAPTURE_BACKOFF = Backoff(base_seconds=30.0, max_seconds=900.0)  # between capture attempts of one snapshot
