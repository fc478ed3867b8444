"""With the operator gone (as after `helm uninstall`), nothing the operator made waits for it: an endpoint,
then its namespace, are deleted, and the garbage collector takes the children and snapshots."""

from __future__ import annotations

import pytest
from cluster_calls import TIMEOUT, apply, endpoint, get, items
from operator_process import OperatorProcess

from warmstart.api import labels as L

pytestmark = [pytest.mark.integration, pytest.mark.spawns, pytest.mark.any_cluster]


def test_endpoints_and_their_namespace_are_deleted_without_the_operator(kube, crds, namespace, tmp_path):
    operator = OperatorProcess(
        kube.kubeconfig, tmp_path / "operator.log", env={"WARMSTART_OPERATOR_RESYNC_SECONDS": "2"}
    )
    operator.start()
    try:
        for name in ("first", "second"):
            apply(kube, endpoint(name, namespace, replicas=1))
        snapshots = kube.wait_for(
            lambda: (s := items(kube, "isnap", namespace, L.ENDPOINT_LABEL)) and len(s) == 2 and s,
            timeout=TIMEOUT,
            message="a snapshot of each endpoint",
        )
        kube.wait_for(
            lambda: all((get(kube, "iep", namespace, n) or {}).get("status") for n in ("first", "second")),
            timeout=TIMEOUT,
            message="both endpoints served",
        )
    finally:
        operator.stop()
    assert "Traceback" not in operator.log_path.read_text(errors="replace"), operator.log_tail(120)

    kube.kubectl("delete", "iep", "first", "-n", namespace, "--wait=true", "--timeout=60s")
    gone = snapshots[0]["metadata"]["name"] if snapshots[0]["spec"]["endpoint"] == "first" else ""
    gone = gone or snapshots[1]["metadata"]["name"]
    kube.wait_for(
        lambda: (
            get(kube, "isnap", namespace, gone) is None
            and get(kube, "deployment", namespace, "first") is None
        ),
        timeout=TIMEOUT,
        message="the deleted endpoint's snapshot and Deployment collected",
    )
    kube.kubectl("delete", "namespace", namespace, "--wait=true", "--timeout=120s")
    assert kube.kubectl("get", "namespace", namespace, check=False).returncode != 0
