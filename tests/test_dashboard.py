"""The chart's Grafana dashboard: shipped by the chart when enabled, and every query names a metric that the
operator, the node agent or the worker exports (a renamed metric fails here, not on someone's screen)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from support import helm_template

from warmstart.agent.metrics import AgentMetrics
from warmstart.operator.metrics import OperatorMetrics
from warmstart.worker.metrics import WorkerMetrics

CHART = Path(__file__).resolve().parents[1] / "charts" / "warmstart"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
METRIC_NAME = re.compile(r"\b(warmstart_[a-z0-9_]+)")


def exported_series() -> set[str]:
    """Every series name the project's three metric registries expose."""
    registries = [
        AgentMetrics().registry,
        WorkerMetrics().registry,
        OperatorMetrics(CollectorRegistry()).registry,
    ]
    names: set[str] = set()
    for registry in registries:
        for family in registry.collect():
            names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def rendered_dashboard() -> dict:
    out = helm_template(CHART, "--set", "metrics.dashboard.enabled=true").stdout
    maps = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "ConfigMap"]
    (configmap,) = [d for d in maps if d["metadata"]["name"] == "t-warmstart-dashboard"]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    return json.loads(configmap["data"]["warmstart.json"])


def queries(dashboard: dict) -> list[str]:
    found = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    found += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
    return found


@pytest.mark.spawns
def test_every_dashboard_query_names_an_exported_metric() -> None:
    dashboard = rendered_dashboard()
    exported = exported_series()
    assert len(dashboard["panels"]) >= 6
    named = {name for expr in queries(dashboard) for name in METRIC_NAME.findall(expr)}
    assert named, "the dashboard queries no warmstart metric"
    assert not named - exported, f"not exported by any component: {sorted(named - exported)}"
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        assert all(METRIC_NAME.search(t["expr"]) for t in panel["targets"]), panel["title"]


@pytest.mark.spawns
def test_the_dashboard_is_left_out_unless_asked_for() -> None:
    out = helm_template(CHART).stdout
    assert "t-warmstart-dashboard" not in out


@pytest.mark.parametrize("name", ["warmstart_agent_restores_total", "warmstart_worker_requests_waiting"])
def test_the_exported_set_is_what_the_components_serve(name: str) -> None:
    assert name in exported_series()
