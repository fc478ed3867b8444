"""Helpers shared by test packages: loopback ports, completions against a worker, the CRIU 4 command, a
CRIU that records its calls, polling waits, and the environment of a child Python."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

HELM_KUBE_VERSION = "1.35.0"  # helm template alone assumes an old Kubernetes; the chart needs >= 1.29

REPO = Path(__file__).resolve().parent.parent
CRIU_SHIM = REPO / "hack" / "criu"
PORTABLE_CRIU = REPO / ".dev" / "criu"
POLL_SECONDS = 0.02

T = TypeVar("T")
S = TypeVar("S")

# One greedy and one seeded sampled request: a restored worker must answer both byte for byte as before.
PROMPTS = [
    {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0},
    {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.9, "seed": 1234},
]

# What the demo model writes: letters, spaces and a little punctuation (its training text has nothing else).
WORD_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,.'\n")


def share_of_word_characters(text: str) -> float:
    return sum(char in WORD_CHARACTERS for char in text) / max(len(text), 1)


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
    from warmstart.checkpoint.criu import Criu, CriuError

    try:
        Criu(command).version()
    except CriuError as exc:
        pytest.skip(f"no usable CRIU 4: {exc}")
    return command


def recording_criu_command(directory: Path, criu_command: str) -> tuple[str, Callable[[], list[str]]]:
    """The real CRIU behind a wrapper script that records each invocation's subcommand.

    Returns the wrapper's command and a function listing the subcommands run so far.
    """
    calls = directory / "criu-calls"
    wrapper = directory / "criu-wrapper"
    wrapper.write_text(f'#!/bin/sh\necho "$1" >> {calls}\nexec {criu_command} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper), lambda: calls.read_text().split() if calls.exists() else []


def wait_until(condition: Callable[[], T], what: str = "condition", timeout: float = 30.0) -> T:
    """Poll `condition` until it returns something truthy, and return that; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        found = condition()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        time.sleep(POLL_SECONDS)


def wait_for_line(path: Path, timeout: float = 30.0) -> str:
    """The text of `path` once it exists and ends with a newline (completely written)."""

    def complete() -> str:
        text = path.read_text() if path.exists() else ""
        return text if text.endswith("\n") else ""

    return wait_until(complete, f"{path} written", timeout)


def python_path_env(*directories: Path) -> dict[str, str]:
    """This process's environment with `directories` first on PYTHONPATH: a child Python that imports the
    tests' own modules (pytest's `pythonpath` setting reaches only the pytest process)."""
    inherited = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, directories), *inherited])}


def with_default_sigint() -> None:
    """A `preexec_fn` for a child the test interrupts with SIGINT: a suite started from a background job
    inherits SIGINT ignored, and a child started so would never see its Ctrl-C."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def helm_binary() -> str:
    """helm as `hack/control-plane build` builds it (else on PATH); skips the test without one."""
    from warmstart.host.env import cache_dir

    cached = cache_dir() / "k8s" / "bin" / "helm"
    found = str(cached) if cached.exists() else shutil.which("helm")
    if not found:
        pytest.skip("helm is not installed: run `hack/control-plane build` (it builds helm)")
    return found


def helm_template(chart: Path, *flags: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`helm template t <chart>` for the Kubernetes version the chart targets in the tests."""
    command = [helm_binary(), "template", "t", str(chart), "--kube-version", HELM_KUBE_VERSION, *flags]
    return subprocess.run(command, capture_output=True, text=True, check=check)


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path`: that of the innermost mount above it (the last one listed
    where two share a mount point, as it is the one on top)."""
    resolved, innermost, kind = path.resolve(), "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, escaped_point, fstype, *_ = line.split()
        point = escaped_point.encode().decode("unicode_escape")  # spaces and tabs come as octal escapes
        if (resolved == Path(point) or Path(point) in resolved.parents) and len(point) >= len(innermost):
            innermost, kind = point, fstype
    return kind


def page_cache_kept(path: Path) -> str | None:
    """Why files under `path` cannot leave the page cache (tmpfs, ramfs), None when they can."""
    kind = filesystem_type(path)
    if kind in ("tmpfs", "ramfs"):
        return f"{path} is on {kind}, whose pages cannot leave the page cache"
    return None


def processes_by_environment(pod_uid: str, container: str | None = None) -> list[int]:
    """The host PIDs whose environment names `pod_uid`: how tests whose "pods" are local sandboxes (no
    kubelet, no pod cgroups) find them. Never the agent's own lookup, which a tenant could steer this way."""
    from warmstart.agent.pods import host_process_ids, read_environ
    from warmstart.api.labels import POD_UID_ENV

    return sorted(pid for pid in host_process_ids() if read_environ(pid).get(POD_UID_ENV) == pod_uid)


def agent_settings(**fields: Any) -> Any:
    """The agent's settings from `fields` alone (not the environment), checked as `warmstart agent` checks
    them; no container runtime to ask unless `cri_socket` is given."""
    from warmstart.agent.settings import AgentSettings

    class Given(AgentSettings):
        @classmethod
        def settings_customise_sources(cls, _: Any, init_settings: Any, **others: Any) -> tuple[Any, ...]:
            return (init_settings,)

    given = {name: str(value) if isinstance(value, Path) else value for name, value in fields.items()}
    return Given(**{"cri_socket": "", **given})


def find_sandbox_pods(agent: Any) -> None:
    """Make `agent` find its pods' processes by `processes_by_environment` (its pods are local sandboxes)."""
    from warmstart.agent.pods import PodSandbox

    node = agent.node

    def find(pod: dict[str, Any]) -> PodSandbox:
        return PodSandbox.find(
            pod["metadata"]["uid"], node.config.kubelet_root, node.config.start_timeout, node.stopping.is_set,
            lookup=processes_by_environment,
        )  # fmt: skip

    node.find_pod = find


def container_settings(container: dict[str, Any], command: str, model: type[S]) -> S:
    """The settings a rendered chart container's `warmstart <command>` runs with: its arguments read by that
    command's own parser and its environment (a value from the downward API stands in as `<fieldPath>`)."""
    from unittest import mock

    from warmstart.cli import build_parser
    from warmstart.host.command_settings import load

    args = container["args"]
    parsed = build_parser().parse_args(args[args.index(command) :])
    env = {
        item["name"]: item.get(
            "value", f"<{item.get('valueFrom', {}).get('fieldRef', {}).get('fieldPath', '')}>"
        )
        for item in container.get("env", [])
    }
    with mock.patch.dict(os.environ, env, clear=True):
        return load(model, parsed)
