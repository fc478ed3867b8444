"""Settings shared by every mode, from flags or environment (WARMSTART_*)."""

from __future__ import annotations

import math
import os
from pathlib import Path

# The longest duration a setting may give (ten years): a wait longer than about 292 years overflows
# `threading.Event.wait`, and one of years is a typing mistake more likely than a wish.
MAX_SECONDS = 10 * 365 * 86400.0


def cache_dir() -> Path:
    """Where setup scripts keep what they build or fetch (CRIU, the local control plane)."""
    return Path(os.environ.get("WARMSTART_CACHE", Path.home() / ".cache" / "warmstart"))


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_flag(name: str, default: bool = True) -> bool:
    """A switch: "0", "false", "no" or "off" (any case) turn it off, anything else on; unset is `default`."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "no", "off")


def checked_seconds(value: object, *, zero: bool = False) -> float:
    """`value` (a number, or its text) as a duration in seconds: finite, greater than zero (or zero, where
    `zero` lets it mean "none"), at most MAX_SECONDS. ValueError saying what is wrong otherwise: the one
    check of every duration setting of every command (flags, environment variables, settings models)."""
    if isinstance(value, bool):
        raise ValueError("must be a number of seconds, not a switch")
    try:
        seconds = float(value.strip() if isinstance(value, str) else value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError("must be a number of seconds") from None
    if not math.isfinite(seconds):
        raise ValueError("must be a finite number of seconds")
    if seconds < 0 or (seconds == 0 and not zero):
        raise ValueError("must be zero or more seconds" if zero else "must be more than 0 seconds")
    if seconds > MAX_SECONDS:
        raise ValueError(f"must be at most {MAX_SECONDS:.0f} seconds (ten years)")
    return seconds


def env_seconds(name: str, default: float, flag: str | None = None, *, zero: bool = False) -> float:
    """A duration from the variable `name` (`checked_seconds`), `default` when it is unset or empty;
    ValueError naming the variable (and the `flag` that wins over it) otherwise."""
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return checked_seconds(value, zero=zero)
    except ValueError as exc:
        where = f"{flag} / {name}" if flag else name
        raise ValueError(f"{where}: {exc} (got {value!r})") from None


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not an integer") from exc


def default_criu_command() -> str:
    """The CRIU command: WARMSTART_CRIU, else `criu` on PATH."""
    return os.environ.get("WARMSTART_CRIU", "criu")
