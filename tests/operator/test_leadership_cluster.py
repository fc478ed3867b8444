"""Two operator replicas on a real API server: the holder of the Lease acts, the other only waits, and takes
over when the first is killed."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
from cluster_calls import TIMEOUT, apply, endpoint, get
from operator_process import OperatorProcess

pytestmark = [pytest.mark.integration, pytest.mark.spawns, pytest.mark.any_cluster]

ACTING = "this replica acts"
LEASE_SECONDS = 15  # the chart's and the command's default


def _reconciles(process: OperatorProcess) -> float:
    """Reconciles this replica ran, whatever their handler and result."""
    pattern = re.compile(r"^warmstart_operator_reconciles_total\{[^}]*\} (\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(process.metrics()))


def _scale(kube, namespace: str, replicas: int) -> None:
    kube.kubectl("scale", "iep/web", "-n", namespace, f"--replicas={replicas}")
    kube.wait_for(
        lambda: (get(kube, "deployment", namespace, "web") or {}).get("spec", {}).get("replicas") == replicas,
        timeout=TIMEOUT + LEASE_SECONDS, message=f"Deployment replicas {replicas}",
    )  # fmt: skip


def test_two_replicas_one_acts_and_the_other_takes_over_when_it_is_killed(
    kube, namespace, crds, tmp_path: Path
) -> None:
    env = {
        "WARMSTART_OPERATOR_RESYNC_SECONDS": "2", "WARMSTART_OPERATOR_LEASE_NAMESPACE": namespace,
        "WARMSTART_OPERATOR_LEASE_NAME": "warmstart-operator",
    }  # fmt: skip
    replicas = [OperatorProcess(kube.kubeconfig, tmp_path / f"operator-{i}.log", env=env) for i in (0, 1)]
    try:
        for replica in replicas:
            replica.start()  # live as soon as it campaigns: a waiting replica is healthy
        apply(kube, endpoint("web", namespace, snapshot={"enabled": False}))
        kube.wait_for(lambda: get(kube, "deployment", namespace, "web"), timeout=TIMEOUT, message="web")
        for count in (2, 3, 1):  # churn while both run, with resyncs every 2 s in between
            _scale(kube, namespace, count)
        acting = [replica for replica in replicas if _reconciles(replica) > 0]
        assert len(acting) == 1, [(_reconciles(r), r.log_tail(5)) for r in replicas]
        (leader,) = acting
        (follower,) = [replica for replica in replicas if replica is not leader]
        assert ACTING in leader.log_path.read_text() and ACTING not in follower.log_path.read_text()
        lease = get(kube, "lease", namespace, "warmstart-operator")
        assert lease and lease["spec"]["holderIdentity"]

        assert leader.process is not None
        os.killpg(leader.process.pid, signal.SIGKILL)  # no goodbye: its Lease has to expire
        leader.process.wait(10)
        _scale(kube, namespace, 2)  # only the follower can have done it
        kube.wait_for(lambda: _reconciles(follower) > 0, timeout=30, message="follower reconciles")
        assert ACTING in follower.log_path.read_text()
        taken = get(kube, "lease", namespace, "warmstart-operator")
        assert taken["spec"]["holderIdentity"] != lease["spec"]["holderIdentity"]
        assert "Traceback" not in follower.log_path.read_text(errors="replace"), follower.log_tail(80)
    finally:
        for replica in replicas:
            replica.stop()
