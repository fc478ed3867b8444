from __future__ import annotations

import argparse

import pytest

from warmstart.host.command_settings import SettingsError, load
from warmstart.operator.cli import register, watched_namespaces
from warmstart.operator.settings import OperatorSettings


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["operator", *argv])


def namespaces(*argv: str) -> list[str]:
    args = parse(*argv)
    return watched_namespaces(load(OperatorSettings, args), args)


def test_namespaces_from_flags_env_or_all(monkeypatch):
    monkeypatch.delenv("WARMSTART_OPERATOR_NAMESPACES", raising=False)
    assert namespaces() == []
    assert namespaces("-n", "a", "--namespace", "team-*") == ["a", "team-*"]
    monkeypatch.setenv("WARMSTART_OPERATOR_NAMESPACES", "x, y,")
    assert namespaces() == ["x", "y"]
    assert namespaces("-n", "z") == ["z"]  # a flag given wins
    assert namespaces("--all-namespaces") == []


def test_ports_and_leader_election_default_from_env(monkeypatch):
    monkeypatch.setenv("WARMSTART_OPERATOR_METRICS_PORT_NUMBER", "9100")
    monkeypatch.setenv("WARMSTART_OPERATOR_LEASE_NAMESPACE", "warmstart")
    settings = load(OperatorSettings, parse())
    assert (settings.metrics_port, settings.liveness_port) == (9100, 8081)
    assert (settings.leader_election_namespace, settings.lease_name) == ("warmstart", "warmstart-operator")
    assert load(OperatorSettings, parse("--metrics-port", "0")).metrics_port == 0


def test_namespace_and_all_namespaces_exclude_each_other():
    with pytest.raises(SystemExit):
        parse("-n", "a", "-A")


@pytest.mark.parametrize(
    ("variable", "value", "flag"),
    [
        ("WARMSTART_OPERATOR_WORKERS", "0", "--workers"),
        ("WARMSTART_OPERATOR_RESYNC_SECONDS", "0", "--resync-seconds"),
        ("WARMSTART_OPERATOR_CAPTURE_BACKOFF_SECONDS", "-1", "--capture-backoff-seconds"),
        ("WARMSTART_OPERATOR_SNAPSHOT_STORE", "nfs", "--snapshot-store"),
        ("WARMSTART_OPERATOR_METRICS_PORT_NUMBER", "70000", "--metrics-port"),
        ("WARMSTART_OPERATOR_AGENT_SELECTOR", "a!=b", "--agent-selector"),
    ],
)
def test_unusable_operator_settings_name_the_flag_and_the_variable(monkeypatch, variable, value, flag):
    monkeypatch.setenv(variable, value)
    if variable == "WARMSTART_OPERATOR_AGENT_SELECTOR":
        monkeypatch.setenv("WARMSTART_OPERATOR_AGENT_NAMESPACE", "warmstart")
    with pytest.raises(SettingsError, match=f"{flag} / {variable}: .*got '{value}'"):
        load(OperatorSettings, parse())


def test_every_problem_is_named_at_once(monkeypatch):
    monkeypatch.setenv("WARMSTART_OPERATOR_WORKERS", "many")
    with pytest.raises(SettingsError) as caught:
        load(OperatorSettings, parse("--liveness-port", "-1", "--snapshot-store", "nfs"))
    message = str(caught.value)
    for named in ("--workers / WARMSTART_OPERATOR_WORKERS", "--liveness-port", "--snapshot-store"):
        assert named in message


def test_the_snapshot_store_is_node_local_unless_the_chart_says_otherwise(monkeypatch):
    monkeypatch.delenv("WARMSTART_OPERATOR_SNAPSHOT_STORE", raising=False)
    assert load(OperatorSettings).snapshot_store == "node-local"
    monkeypatch.setenv("WARMSTART_OPERATOR_SNAPSHOT_STORE", "object-store")
    assert load(OperatorSettings).snapshot_store == "object-store"
