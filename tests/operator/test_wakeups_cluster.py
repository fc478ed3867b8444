"""A child's own change brings its endpoint back at once, through the operator's check of it: with the
periodic resync an hour away, only the child's event can have done it."""

from __future__ import annotations

import pytest
from cluster_calls import TIMEOUT, apply, endpoint, get
from operator_process import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.any_cluster]


def test_a_child_changed_by_hand_wakes_its_endpoint_without_waiting_for_the_resync(
    kube, crds, namespace, tmp_path
):
    operator = OperatorProcess(
        kube.kubeconfig, tmp_path / "operator.log", env={"WARMSTART_OPERATOR_RESYNC_SECONDS": "3600"}
    )
    operator.start()
    try:
        apply(kube, endpoint("woken", namespace, snapshot={"enabled": False}))
        service = kube.wait_for(
            lambda: get(kube, "service", namespace, "woken"), timeout=TIMEOUT, message="service"
        )
        kube.wait_for(
            lambda: get(kube, "deployment", namespace, "woken"), timeout=TIMEOUT, message="deployment"
        )
        kube.kubectl("delete", "service", "woken", "-n", namespace)
        kube.wait_for(
            lambda: (
                (s := get(kube, "service", namespace, "woken"))
                and s["metadata"]["uid"] != service["metadata"]["uid"]
            ),
            timeout=TIMEOUT,
            message="service recreated",
        )
        kube.kubectl("scale", "deployment/woken", "-n", namespace, "--replicas=5")
        kube.wait_for(
            lambda: get(kube, "deployment", namespace, "woken")["spec"]["replicas"] == 1,
            timeout=TIMEOUT,
            message="hand-edited replicas put back",
        )
        body = get(kube, "iep", namespace, "woken") or {}
        assert not body["metadata"].get("finalizers")
        assert "kopf" not in body.get("status", {})  # the status is the reconcile's alone
    finally:
        operator.stop()
    assert "Traceback" not in operator.log_path.read_text(errors="replace"), operator.log_tail(120)
