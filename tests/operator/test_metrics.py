from __future__ import annotations

from prometheus_client import generate_latest

from warmstart.operator.metrics import OperatorMetrics


def test_metrics_export_reconciles_and_phases():
    metrics = OperatorMetrics()
    metrics.observe("create", "success", 0.2)
    metrics.observe("timer", "error", 0.01)
    metrics.endpoints.set("ns", "a", "Ready")
    metrics.endpoints.set("ns", "b", "Ready")
    metrics.endpoints.set("ns", "b", "Capturing")
    metrics.snapshots.set("ns", "s", "Failed")
    metrics.snapshots.forget("ns", "s")
    text = generate_latest(metrics.registry).decode()
    assert 'warmstart_operator_reconciles_total{handler="create",result="success"} 1.0' in text
    assert 'warmstart_operator_reconcile_seconds_count{handler="timer"} 1.0' in text
    assert 'warmstart_operator_endpoints{phase="Ready"} 1.0' in text
    assert 'warmstart_operator_endpoints{phase="Capturing"} 1.0' in text
    assert 'warmstart_operator_snapshots{phase="Failed"} 0.0' in text
