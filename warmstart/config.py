"""Settings shared by every mode, from flags or environment (WARMSTART_*)."""

from __future__ import annotations

import os
from pathlib import Path


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


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not a number") from exc


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} is not an integer") from exc


def default_criu_command() -> str:
    """The CRIU command: WARMSTART_CRIU, else the cached CRIU 4 shim's target, else `criu` on PATH."""
    return os.environ.get("WARMSTART_CRIU", "criu")
