"""Helpers shared by test packages: loopback ports, completions against a worker, the CRIU 4 command."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CRIU_SHIM = REPO / "hack" / "criu"
PORTABLE_CRIU = REPO / ".dev" / "criu"

# One greedy and one seeded sampled request: a restored worker must answer both byte for byte as before.
PROMPTS = [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "seed": 1234},
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def completion(base_url: str, model: str, body: dict) -> str:
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps({"model": model, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())["choices"][0]["text"]


def answers(base_url: str, model: str = "tiny") -> list[str]:
    """The worker's answers to PROMPTS, in order."""
    return [completion(base_url, model, body) for body in PROMPTS]


def _criu_candidate() -> str | None:
    configured = os.environ.get("WARMSTART_CRIU")
    if configured:
        return configured
    probe = subprocess.run([str(REPO / "hack" / "criu-setup"), "--print"], capture_output=True, text=True)
    if probe.returncode == 0:
        return str(CRIU_SHIM)
    if (PORTABLE_CRIU / "criu").exists():  # the folder carried to a GPU host
        return f"{PORTABLE_CRIU}/ld-linux-x86-64.so.2 --library-path {PORTABLE_CRIU} {PORTABLE_CRIU}/criu"
    return shutil.which("criu")


def criu_command_or_skip() -> str:
    """A working CRIU >= 4 command line; skips, saying why, when not root or none is set up."""
    if os.geteuid() != 0:
        pytest.skip("CRIU and PID/mount namespaces need root")
    command = _criu_candidate()
    if command is None:
        pytest.skip("no CRIU 4 here: run hack/criu-setup (or set WARMSTART_CRIU)")
    from warmstart.snapshot_agent.criu import Criu, CriuError

    try:
        Criu(command).version()
    except CriuError as exc:
        pytest.skip(f"no usable CRIU 4: {exc}")
    return command
