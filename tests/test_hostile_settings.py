"""Every numeric, duration and path setting of every command given a hostile value, as a flag and as its
environment variable: refused with one clear error naming the flag and the variable, before the command does
anything, never a traceback; never a restore counted against a good snapshot for a bad setting.

The settings are parsed in this process where parsing is what the command does first; a representative
subset runs the real command line as a subprocess.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from warmstart.agent.settings import AgentSettings
from warmstart.api.control_dir import RESTORE_FACTS
from warmstart.api.worker_options import worker_flags_problem
from warmstart.cli import build_parser
from warmstart.host.command_settings import CommandSettings, SettingsError, load
from warmstart.host.env import MAX_SECONDS, checked_seconds
from warmstart.operator.settings import OperatorSettings
from warmstart.snapshot.remote.config import RemoteConfig, RemoteConfigError
from warmstart.snapshot.signing import SigningKeyError, generate_ed25519_keypair, generate_hmac_key
from warmstart.snapshot.signing_keys import signing_keys, verification_key
from warmstart.worker.options import check_worker_args

HUGE = "1e99"
DURATION = ["abc", "nan", "inf", "-inf", "-1", "0", HUGE, str(MAX_SECONDS * 2)]
DURATION_OR_ZERO = ["abc", "nan", "inf", "-1", HUGE]
COUNT = ["abc", "nan", "-1", "0", "1.5", HUGE, str(10**30)]
BYTES = ["abc", "nan", "-1", "1.5", HUGE, str(1 << 64)]
PORT = ["abc", "-1", "65536", HUGE]
TEXT = ["a\0b"]  # no variable can hold a NUL: flags only
NON_EMPTY_TEXT = ["", "a\0b"]

# Each numeric or path setting of the agent and the operator, with the values it must refuse.
AGENT = {
    "node": NON_EMPTY_TEXT, "store": NON_EMPTY_TEXT, "criu": NON_EMPTY_TEXT, "kubelet_root": NON_EMPTY_TEXT,
    "cri_socket": TEXT, "key": NON_EMPTY_TEXT, "metrics_port": PORT, "grpc_socket": TEXT,
    "listen_address": ["", "x", "999.1.1.1", "a\0b"], "max_captures": COUNT, "max_restores": COUNT,
    "resync": DURATION, "prestage_interval": DURATION, "prestage_max_bytes": BYTES, "pull_timeout": DURATION,
    "cache_max_bytes": BYTES, "cache_max_age": DURATION_OR_ZERO,
}  # fmt: skip
OPERATOR = {
    "metrics_port": PORT, "liveness_port": PORT, "leader_election_namespace": TEXT,
    "lease_name": NON_EMPTY_TEXT,
    "resync_seconds": DURATION, "capture_backoff_seconds": DURATION, "workers": COUNT,
    "retry_base_seconds": DURATION, "retry_max_seconds": DURATION,
}  # fmt: skip
# Settings that are neither numbers nor paths (switches, choices, lists, a selector checked on its own).
NOT_NUMBERS = {"transparent_hugepages", "verified_records", "namespace", "snapshot_store", "agent_namespace",
               "agent_selector"}  # fmt: skip
# Every numeric flag of `warmstart worker` (no variable, but --restore-timeout's).
WORKER = {
    "--seed": ["abc", "-1", str(1 << 32), HUGE], "--max-model-len": COUNT, "--max-num-seqs": COUNT,
    "--tensor-parallel-size": COUNT, "--gpu-memory-utilization": ["abc", "nan", "inf", "0", "-0.5", "1.5"],
    "--port": PORT, "--probe-port": PORT, "--start-timeout": DURATION, "--http-keep-alive-seconds": DURATION,
    "--http-max-connections": COUNT, "--http-max-connections-per-client": COUNT,
    "--http-body-timeout-seconds": DURATION, "--max-request-bytes": COUNT, "--max-n": COUNT,
    "--max-output-tokens": COUNT, "--restore-timeout": DURATION, "--cuda-graph-sizes": ["abc", "0", "1,-2"],
    "--sleep-level": ["0", "3", "abc"],
}  # fmt: skip
WORKER_VARIABLES = {
    "WARMSTART_RESTORE_TIMEOUT": "--restore-timeout / WARMSTART_RESTORE_TIMEOUT",
    "WARMSTART_RESTORE_ANSWER_TIMEOUT": "WARMSTART_RESTORE_ANSWER_TIMEOUT",
}
S3 = {
    "WARMSTART_S3_CONNECT_TIMEOUT": DURATION, "WARMSTART_S3_REQUEST_TIMEOUT": DURATION,
    "WARMSTART_S3_READ_TIMEOUT": DURATION, "WARMSTART_S3_RETRY_TIMEOUT": DURATION,
    "WARMSTART_S3_MAX_RETRIES": ["abc", "nan", "-1", "1.5", "1000", HUGE],
    "WARMSTART_S3_CONCURRENCY": COUNT + ["5000"],
}  # fmt: skip
MODELS: dict[str, tuple[type[CommandSettings], dict[str, list[str]]]] = {
    "agent": (AgentSettings, AGENT),
    "operator": (OperatorSettings, OPERATOR),
}


def _cases(command: str) -> list[Any]:
    model, table = MODELS[command]
    return [
        pytest.param(command, name, value, id=f"{command}-{name}-{value!r}")
        for name, values in table.items()
        for value in values
    ]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _load(command: str, *argv: str) -> CommandSettings:
    model = MODELS[command][0]
    required = ["--node", "n"] if command == "agent" and "--node" not in " ".join(argv) else []
    return load(model, build_parser(command).parse_args([command, *required, *argv]))


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in list(os.environ):
        if name.startswith("WARMSTART_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("command", sorted(MODELS))
def test_every_numeric_and_path_setting_has_hostile_values_here(command: str) -> None:
    model, table = MODELS[command]
    assert set(model.model_fields) - NOT_NUMBERS == set(table)


@pytest.mark.parametrize(("command", "name", "value"), _cases("agent") + _cases("operator"))
def test_a_hostile_flag_is_refused_naming_the_flag_and_the_variable(
    command: str, name: str, value: str, clean_environment: pytest.MonkeyPatch
) -> None:
    model = MODELS[command][0]
    with pytest.raises(SettingsError) as caught:
        _load(command, f"{_flag(name)}={value}")
    assert f"{_flag(name)} / {model.model_fields[name].validation_alias}:" in str(caught.value)


@pytest.mark.parametrize(
    ("command", "name", "value"),
    [case for case in _cases("agent") + _cases("operator") if case.values[2] and "\0" not in case.values[2]],
)
def test_a_hostile_variable_is_refused_naming_the_flag_and_the_variable(
    command: str, name: str, value: str, clean_environment: pytest.MonkeyPatch
) -> None:
    model = MODELS[command][0]
    variable = model.model_fields[name].validation_alias
    clean_environment.setenv(variable, value)
    with pytest.raises(SettingsError) as caught:
        _load(command)
    assert f"{_flag(name)} / {variable}:" in str(caught.value)


def test_an_empty_variable_is_unset_except_where_empty_means_none(
    clean_environment: pytest.MonkeyPatch,
) -> None:
    """A pod spec cannot unset a variable a chart sets: empty is unset (the default), but where the help says
    empty means none (the CRI socket, the gRPC socket), it means none: `agent.criSocket: ""` in the chart."""
    empty = ("WARMSTART_AGENT_PULL_TIMEOUT_SECONDS", "WARMSTART_AGENT_MAX_RESTORES",
             "WARMSTART_AGENT_CRI_SOCKET", "WARMSTART_AGENT_GRPC_SOCKET", "WARMSTART_STORE")  # fmt: skip
    for variable in empty:
        clean_environment.setenv(variable, "")
    settings = _load("agent")
    assert (settings.pull_timeout, settings.max_restores) == (120.0, 2)
    assert settings.store == "/var/lib/warmstart/store"
    assert (settings.cri_socket, settings.grpc_socket) == ("", "")
    assert "empty" in AgentSettings.model_fields["cri_socket"].description  # what the help promises


def test_zero_is_accepted_where_it_means_none(clean_environment: pytest.MonkeyPatch) -> None:
    settings = _load("agent", "--cache-max-age=0", "--prestage-max-bytes=0", "--metrics-port=0")
    assert (settings.cache_max_age, settings.prestage_max_bytes, settings.metrics_port) == (0.0, 0, 0)


def test_the_operator_refuses_retries_that_would_shrink(clean_environment: pytest.MonkeyPatch) -> None:
    with pytest.raises(SettingsError, match="--retry-base-seconds / WARMSTART_OPERATOR_RETRY_BASE_SECONDS"):
        _load("operator", "--retry-base-seconds=500", "--retry-max-seconds=60")


@pytest.mark.parametrize("value", [1e-3, 1, 30.5, MAX_SECONDS, "7", " 2.5 "], ids=lambda value: repr(value))
def test_one_check_of_every_duration_takes_finite_positive_seconds(value: Any) -> None:
    assert checked_seconds(value) == float(value)


@pytest.mark.parametrize("value", [True, None, "", "abc", "nan", "inf", "-1", 0, MAX_SECONDS * 2])
def test_one_check_of_every_duration_refuses_the_rest(value: Any) -> None:
    with pytest.raises(ValueError, match="seconds"):
        checked_seconds(value)


# --- warmstart worker ---------------------------------------------------------------------------------------


def test_every_numeric_worker_flag_has_hostile_values_here() -> None:
    parser = build_parser("worker")
    worker = next(a for a in parser._actions if a.dest == "command").choices["worker"]
    typed = {action.option_strings[-1] for action in worker._actions if action.type not in (None, str)}
    typed |= {
        action.option_strings[-1] for action in worker._actions if action.choices and action.type is int
    }
    assert typed - {"--engine-arg"} == set(WORKER)


@pytest.mark.parametrize(
    ("flag", "value"), [(flag, value) for flag, values in WORKER.items() for value in values]
)
def test_a_hostile_worker_flag_is_refused_naming_it(flag: str, value: str) -> None:
    """The worker's parser, as the worker and the operator (checking an endpoint's engine.args) use it."""
    problem = worker_flags_problem([f"{flag}={value}"])
    assert problem is not None and f"argument {flag}" in problem
    if flag == "--restore-timeout":
        assert "WARMSTART_RESTORE_TIMEOUT" in problem


@pytest.mark.parametrize("variable", sorted(WORKER_VARIABLES))
@pytest.mark.parametrize("value", DURATION)
def test_a_hostile_worker_variable_stops_the_worker_before_it_runs(
    variable: str, value: str, clean_environment: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_environment.setenv(variable, value)
    args = build_parser("worker").parse_args(["worker", "--mode", "restore", "--control-dir", str(tmp_path)])
    problem = check_worker_args(args)
    assert problem is not None and problem.startswith(f"{WORKER_VARIABLES[variable]}: ")
    assert repr(value) in problem


def test_an_empty_worker_variable_is_unset(clean_environment: pytest.MonkeyPatch, tmp_path: Path) -> None:
    clean_environment.setenv("WARMSTART_RESTORE_TIMEOUT", "")
    args = build_parser("worker").parse_args(["worker", "--mode", "restore", "--control-dir", str(tmp_path)])
    assert check_worker_args(args) is None and args.restore_timeout == 600.0
    clean_environment.setenv("WARMSTART_RESTORE_TIMEOUT", "12.5")
    assert check_worker_args(args) is None and args.restore_timeout == 600.0  # resolved once, kept
    again = build_parser("worker").parse_args(["worker", "--mode", "restore", "--control-dir", str(tmp_path)])
    assert check_worker_args(again) is None and again.restore_timeout == 12.5


# --- warmstart serve and the object store -------------------------------------------------------------------


@pytest.mark.parametrize("value", DURATION)
def test_a_hostile_serve_timeout_is_refused_naming_it(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser("serve").parse_args(["serve", "--store", "s", f"--ready-timeout={value}"])
    assert "argument --ready-timeout" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("variable", "value"), [(variable, value) for variable, values in S3.items() for value in values]
)
def test_a_hostile_object_store_variable_is_refused_naming_it(variable: str, value: str) -> None:
    with pytest.raises(RemoteConfigError, match=f"^{variable}: "):
        RemoteConfig.from_env({"WARMSTART_S3_BUCKET": "b", variable: value})


def test_object_store_bounds_given_directly_are_checked_too() -> None:
    with pytest.raises(RemoteConfigError, match="WARMSTART_S3_READ_TIMEOUT"):
        RemoteConfig(bucket="b", read_timeout=float("nan"))
    with pytest.raises(RemoteConfigError, match="WARMSTART_S3_CONCURRENCY"):
        RemoteConfig(bucket="b", concurrency=0)


# --- a key file given ---------------------------------------------------------------------------------------


def _give_to_another_user(path: Path) -> None:
    os.chown(path, 65534, 65534)


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (lambda path: path.chmod(0o644), "mode 0644"),
        (lambda path: path.chmod(0o640), "mode 0640"),
        (lambda path: path.chmod(0o602), "mode 0602"),
        pytest.param(
            _give_to_another_user, "owned by uid 65534",
            marks=pytest.mark.skipif(os.geteuid() != 0, reason="only root gives files away"),
        ),
        (lambda path: (path.unlink(), path.mkdir()), "not a real regular file"),
    ],
    ids=["world-readable", "group-readable", "world-writable", "another-owner", "a-directory"],
)  # fmt: skip
def test_a_key_file_given_is_refused_unless_private_to_its_owner(
    tmp_path: Path, spoil: Any, reason: str
) -> None:
    """As the store's generated key is: a key others could read lets them sign what root restores."""
    key = generate_hmac_key(tmp_path / "key")
    spoil(key)
    with pytest.raises(SigningKeyError, match=reason):
        signing_keys(tmp_path / "store", str(key))


def test_a_private_key_file_given_is_used_also_through_a_secrets_symbolic_link(tmp_path: Path) -> None:
    data = tmp_path / "..data"
    data.mkdir()
    key = generate_hmac_key(data / "key")
    link = tmp_path / "key"
    link.symlink_to(data / "key")  # a mounted Secret's file
    signer, verifier, note = signing_keys(tmp_path / "store", str(link))
    assert signer.key_id == verifier.key_id and note == ""
    assert stat.S_IMODE(key.stat().st_mode) == 0o600


def test_a_public_key_may_be_read_by_anyone_but_written_by_no_one_else(tmp_path: Path) -> None:
    _, public = generate_ed25519_keypair(tmp_path / "keys")
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    verification_key(tmp_path / "store", str(public))
    public.chmod(0o664)
    with pytest.raises(SigningKeyError, match="mode 0664"):
        verification_key(tmp_path / "store", str(public))


# --- a pull's timeout bounds the whole pull -----------------------------------------------------------------


class _SlowClient:
    """Sends a piece in many small chunks, slowly, as a stalling object store would."""

    where = "s3://slow"

    def read_into(self, key: str, sink: Any, expected: int, byte_range: Any = None) -> int:
        sent = 0
        while sent < expected:
            time.sleep(0.05)
            sink(memoryview(b"x" * 16))
            sent += 16
        return sent


def test_a_pulls_timeout_stops_a_piece_under_way(tmp_path: Path) -> None:
    """The deadline was checked only before each piece started: one large piece ran on past it."""
    from warmstart.snapshot.remote.object_keys import Keys
    from warmstart.snapshot.remote.objects import RemoteUnavailable
    from warmstart.snapshot.remote.pull import Piece, _Pull

    target = tmp_path / "blob"
    target.write_bytes(b"")
    job = _Pull(_SlowClient(), Keys(""), None, "snap", lambda _: None,  # type: ignore[arg-type]
                deadline=time.monotonic() + 0.3, timeout=0.3)  # fmt: skip
    started = time.monotonic()
    with pytest.raises(RemoteUnavailable, match="did not finish within 0.3s"):
        job._fetch_piece(Piece("sha256:" + "0" * 64, target, 0, 16 * 200, None))  # 10 s of chunks
    assert time.monotonic() - started < 2


# --- the real command lines ---------------------------------------------------------------------------------


def _run(
    argv: list[str], tmp_path: Path, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART_", "KUBECONFIG", "AWS_"))}
    base |= {"KUBECONFIG": str(tmp_path / "no-kubeconfig"), "HOME": str(tmp_path), "WARMSTART_KEY_DIR":
             str(tmp_path / "keys"), "KUBERNETES_SERVICE_HOST": ""}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "warmstart", *argv], env=base | (env or {}), capture_output=True, text=True,
        timeout=timeout, cwd=tmp_path,
    )  # fmt: skip


def _refused(result: subprocess.CompletedProcess[str], *names: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    for name in names:
        assert name in result.stderr, result.stderr[-2000:]


AGENT_ARGS = ["agent", "--node", "n", "--metrics-port", "0", "--grpc-socket", ""]


@pytest.mark.spawns
@pytest.mark.parametrize("value", ["abc", "nan", "-1"])
def test_a_restore_worker_with_a_bad_timeout_stops_before_a_restore_could_start(
    value: str, tmp_path: Path
) -> None:
    """WARMSTART_RESTORE_TIMEOUT=abc used to end the worker in a traceback after it had written its restore
    facts: the agent then restored into a pod whose worker was gone, CRIU failed (exit -9) and the failure
    counted against a good snapshot. Now the worker stops first, naming the setting, and writes nothing: the
    agent finds no restore facts and refuses the pod without counting it against the snapshot."""
    control = tmp_path / "control"
    control.mkdir()
    argv = ["worker", "--mode", "restore", "--control-dir", str(control)]
    result = _run(argv, tmp_path, {"WARMSTART_RESTORE_TIMEOUT": value})
    _refused(result, "--restore-timeout / WARMSTART_RESTORE_TIMEOUT", repr(value))
    assert not (control / RESTORE_FACTS).exists()
    flag = _run([*argv, "--restore-timeout", value if value != "-1" else "-0.5"], tmp_path)
    _refused(flag, "argument --restore-timeout")
    assert not (control / RESTORE_FACTS).exists()


@pytest.mark.spawns
@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--prestage-interval", "inf"], {}, ["--prestage-interval / WARMSTART_AGENT_PRESTAGE_INTERVAL"]),
        ([], {"WARMSTART_AGENT_PULL_TIMEOUT_SECONDS": "nan"}, ["--pull-timeout / WARMSTART_AGENT_PULL"]),
        ([], {"WARMSTART_AGENT_MAX_RESTORES": "0"}, ["--max-restores / WARMSTART_AGENT_MAX_RESTORES"]),
        (["--listen-address", "nowhere"], {}, ["--listen-address / WARMSTART_AGENT_LISTEN_ADDRESS"]),
        ([], {"WARMSTART_S3_BUCKET": "b", "WARMSTART_S3_CONCURRENCY": "0"}, ["WARMSTART_S3_CONCURRENCY"]),
        ([], {"WARMSTART_S3_BUCKET": "b", "WARMSTART_S3_READ_TIMEOUT": "inf"}, ["WARMSTART_S3_READ_TIMEOUT"]),
        (["--key", "/etc/passwd"], {}, ["--key / WARMSTART_SIGNING_KEY", "mode 0644"]),
        ([], {"WARMSTART_SIGNING_KEY": "/nonexistent/key"}, ["--key / WARMSTART_SIGNING_KEY", "/nonexist"]),
        (["--store", "/etc/passwd"], {}, ["--store / WARMSTART_STORE", "/etc/passwd"]),
        ([], {}, ["no Kubernetes credentials", "--kubeconfig"]),
    ],
    ids=["interval-inf", "pull-nan", "restores-0", "address", "s3-concurrency", "s3-read-inf", "key-readable",
         "key-missing", "store-a-file", "no-kubeconfig"],
)  # fmt: skip
def test_the_agent_refuses_bad_settings_before_it_runs(
    argv: list[str], env: dict[str, str], names: list[str], tmp_path: Path
) -> None:
    if "/etc/passwd" in argv and stat.S_IMODE(os.stat("/etc/passwd").st_mode) & 0o044 == 0:
        pytest.skip("/etc/passwd is not readable by others here")
    _refused(_run([*AGENT_ARGS, "--store", str(tmp_path / "store"), *argv], tmp_path, env), *names)


@pytest.mark.spawns
def test_the_agent_names_a_metrics_port_in_use(tmp_path: Path) -> None:
    import socket

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {token: t}}]\n"
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = ["agent", "--node", "n", "--store", str(tmp_path / "store"), "--grpc-socket", "",
                "--metrics-port", port, "--listen-address", "127.0.0.1"]  # fmt: skip
        result = _run(argv, tmp_path, {"KUBECONFIG": str(kubeconfig)})
    _refused(result, "--metrics-port / WARMSTART_AGENT_METRICS_PORT_NUMBER", "in use")


@pytest.mark.spawns
@pytest.mark.parametrize(
    ("argv", "env", "names"),
    [
        (["--resync-seconds", "-1"], {}, ["--resync-seconds / WARMSTART_OPERATOR_RESYNC_SECONDS"]),
        ([], {"WARMSTART_OPERATOR_WORKERS": "1e99"}, ["--workers / WARMSTART_OPERATOR_WORKERS"]),
        ([], {"WARMSTART_OPERATOR_RETRY_MAX_SECONDS": "nan"}, ["--retry-max-seconds"]),
        (["--metrics-port", "0", "--liveness-port", "0"], {}, ["no Kubernetes credentials"]),
    ],
    ids=["resync-negative", "workers-huge", "retry-nan", "no-kubeconfig"],
)
def test_the_operator_refuses_bad_settings_before_it_runs(
    argv: list[str], env: dict[str, str], names: list[str], tmp_path: Path
) -> None:
    _refused(_run(["operator", *argv], tmp_path, env), *names)


@pytest.mark.spawns
def test_the_operator_stops_on_sigterm_while_its_start_up_fails(tmp_path: Path) -> None:
    """An API server that refuses connections: kopf's start-up handler retries in a thread, which the
    interpreter used to wait for at exit (60-100 s) after SIGTERM."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: c, user: u}}]\nusers: [{name: u, user: {token: t}}]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WARMSTART_", "KUBERNETES_"))}
    log = tmp_path / "operator.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "warmstart", "operator", "--metrics-port", "0", "--liveness-port", "0"],
            env=env | {"KUBECONFIG": str(kubeconfig)}, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while "failed temporarily" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "failed temporarily" in log.read_text(), log.read_text()[-2000:]
        process.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert process.wait(timeout=20) == 0
        assert time.monotonic() - stopped < 15
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.spawns
@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--ready-timeout", "nan"], ["argument --ready-timeout"]),
        (["--store", ""], ["--store: must name a file or directory"]),
        (["--key", "/etc/passwd"], ["--key", "mode 0644"]),
    ],
    ids=["ready-timeout", "store-empty", "key-readable"],
)
def test_serve_refuses_bad_settings_before_it_runs(argv: list[str], names: list[str], tmp_path: Path) -> None:
    _refused(_run(["serve", "--store", str(tmp_path / "store"), *argv], tmp_path), *names)
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


@pytest.fixture(scope="module", autouse=True)
def threads_before() -> set[threading.Thread]:
    """The threads alive before this module's tests: what other modules left is theirs to answer for."""
    return set(threading.enumerate())


def test_no_thread_is_left_behind(threads_before: set[threading.Thread]) -> None:
    """What the commands run in process here (settings, start-up checks) leave no thread that would hold up
    a process's exit."""
    new = [thread for thread in threading.enumerate() if thread not in threads_before]
    left = [thread.name for thread in new if not thread.daemon and thread.is_alive()]
    assert left == [], left
