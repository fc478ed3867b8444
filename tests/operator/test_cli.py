from __future__ import annotations

import argparse

import pytest

from warmstart.operator.cli import register, resolve_namespaces


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["operator", *argv])


def test_namespaces_from_flags_env_or_all(monkeypatch):
    monkeypatch.delenv("WARMSTART_OPERATOR_NAMESPACES", raising=False)
    assert resolve_namespaces(parse()) == []
    assert resolve_namespaces(parse("-n", "a", "--namespace", "team-*")) == ["a", "team-*"]
    monkeypatch.setenv("WARMSTART_OPERATOR_NAMESPACES", "x, y,")
    assert resolve_namespaces(parse()) == ["x", "y"]
    assert resolve_namespaces(parse("--all-namespaces")) == []


def test_ports_and_leader_election_default_from_env(monkeypatch):
    monkeypatch.setenv("WARMSTART_OPERATOR_METRICS_PORT_NUMBER", "9100")
    monkeypatch.setenv("WARMSTART_OPERATOR_LEASE_NAMESPACE", "warmstart")
    args = parse()
    assert (args.metrics_port, args.liveness_port) == (9100, 8081)
    assert (args.leader_election_namespace, args.lease_name) == ("warmstart", "warmstart-operator")


def test_namespace_and_all_namespaces_exclude_each_other():
    with pytest.raises(SystemExit):
        parse("-n", "a", "-A")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("WARMSTART_OPERATOR_WORKERS", "0"),
        ("WARMSTART_OPERATOR_RESYNC_SECONDS", "0"),
        ("WARMSTART_OPERATOR_CAPTURE_BACKOFF_SECONDS", "-1"),
        ("WARMSTART_OPERATOR_SNAPSHOT_STORE", "nfs"),
    ],
)
def test_unusable_operator_settings_name_the_variable(monkeypatch, variable, value):
    from warmstart.operator.handlers import OperatorSettings

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"^{variable} must be"):
        OperatorSettings.from_env()


def test_the_snapshot_store_is_node_local_unless_the_chart_says_otherwise(monkeypatch):
    from warmstart.operator.handlers import OperatorSettings

    monkeypatch.delenv("WARMSTART_OPERATOR_SNAPSHOT_STORE", raising=False)
    assert OperatorSettings.from_env().snapshot_store == "node-local"
    monkeypatch.setenv("WARMSTART_OPERATOR_SNAPSHOT_STORE", "object-store")
    assert OperatorSettings.from_env().snapshot_store == "object-store"
