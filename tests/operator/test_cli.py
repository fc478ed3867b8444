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


def test_ports_and_peering_default_from_env(monkeypatch):
    monkeypatch.setenv("WARMSTART_OPERATOR_METRICS_PORT", "9100")
    monkeypatch.setenv("WARMSTART_OPERATOR_PEERING", "warmstart")
    args = parse()
    assert (args.metrics_port, args.liveness_port, args.peering) == (9100, 8081, "warmstart")


def test_namespace_and_all_namespaces_exclude_each_other():
    with pytest.raises(SystemExit):
        parse("-n", "a", "-A")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("WARMSTART_OPERATOR_WORKERS", "0"),
        ("WARMSTART_OPERATOR_RESYNC_SECONDS", "0"),
        ("WARMSTART_OPERATOR_CAPTURE_BACKOFF_SECONDS", "-1"),
    ],
)
def test_unusable_operator_settings_name_the_variable(monkeypatch, variable, value):
    from warmstart.operator.handlers import OperatorSettings

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"^{variable} must be"):
        OperatorSettings.from_env()
