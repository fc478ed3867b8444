"""How the worker Deployment replaces its pods: a surge where the cluster has room, one at a time until the
rollout ends where it has none, read from the pods' templates and the scheduler's words."""

from __future__ import annotations

from typing import Any

from warmstart.operator.rollout import (
    ONE_AT_A_TIME,
    SURGE,
    rolling_out,
    rolling_update,
    waiting_for_room,
    waits_for_room,
)

NO_GPU = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. preemption: 0/2 nodes are available: ..."
NO_MATCH = "0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector."


def pod(name: str, template: str, unschedulable: str = "") -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "False" if unschedulable else "True"}]
    if unschedulable:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": unschedulable})  # fmt: skip
    return {
        "metadata": {"name": name, "labels": {"pod-template-hash": template}},
        "status": {"conditions": conditions},
    }


def deployment(
    strategy: dict[str, int], progress: str = "ReplicaSetUpdated", observed: int = 2
) -> dict[str, Any]:
    return {
        "metadata": {"generation": 2},
        "spec": {"strategy": {"type": "RollingUpdate", "rollingUpdate": dict(strategy)}},
        "status": {
            "observedGeneration": observed,
            "conditions": [{"type": "Progressing", "reason": progress}],
        },
    }


def test_a_surge_while_there_is_no_rollout_or_room_for_one() -> None:
    serving = [pod("old", "a")]
    assert not rolling_out(serving) and rolling_update(None, serving) == SURGE
    surging = [pod("old", "a"), pod("new", "b")]
    assert rolling_out(surging) and rolling_update(deployment(SURGE), surging) == SURGE
    assert waiting_for_room(deployment(SURGE), surging) == set()


def test_no_room_for_the_surge_pod_replaces_one_at_a_time_until_the_rollout_ends() -> None:
    stuck = [pod("old", "a"), pod("new", "b", unschedulable=NO_GPU)]
    assert waits_for_room(stuck[1]) and rolling_update(deployment(SURGE), stuck) == ONE_AT_A_TIME
    assert waiting_for_room(deployment(SURGE), stuck) == {"new"}
    # Kept until the Deployment controller says the rollout ended, though no pod waits any more (the next
    # old pod is replaced), or the old ones are gone while the last replacement is not placed yet.
    replacing = [pod("old-2", "a"), pod("new", "b")]
    assert rolling_update(deployment(ONE_AT_A_TIME), replacing) == ONE_AT_A_TIME
    alone = [pod("new", "b", unschedulable=NO_GPU)]
    assert rolling_update(deployment(ONE_AT_A_TIME), alone) == ONE_AT_A_TIME
    assert waiting_for_room(deployment(ONE_AT_A_TIME), alone) == {"new"}
    assert rolling_update(
        deployment(ONE_AT_A_TIME, observed=1, progress="NewReplicaSetAvailable"), alone
    ) == (ONE_AT_A_TIME)  # the controller has not seen the strategy change yet
    assert (
        rolling_update(deployment(ONE_AT_A_TIME, progress="NewReplicaSetAvailable"), [pod("new", "b")])
        == SURGE
    )


def test_a_rollout_past_its_progress_deadline_no_longer_hides_a_pod_without_room() -> None:
    stuck = deployment(ONE_AT_A_TIME, progress="ProgressDeadlineExceeded")
    alone = [pod("new", "b", unschedulable=NO_GPU)]
    assert rolling_update(stuck, alone) == SURGE
    assert waiting_for_room(stuck, alone) == set()


def test_a_pod_that_can_go_nowhere_for_another_reason_leaves_the_old_ones_serving_and_is_reported() -> None:
    misplaced = [pod("old", "a"), pod("new", "b", unschedulable=NO_MATCH)]
    assert not waits_for_room(misplaced[1])
    assert rolling_update(deployment(SURGE), misplaced) == SURGE
    assert waiting_for_room(deployment(SURGE), misplaced) == set()


def test_a_scale_up_without_room_is_no_rollout_and_is_reported() -> None:
    scaled = [pod("one", "a"), pod("two", "a", unschedulable=NO_GPU)]
    steady = deployment(SURGE, progress="NewReplicaSetAvailable")
    assert rolling_update(steady, scaled) == SURGE
    assert waiting_for_room(steady, scaled) == set()
