"""Restore pods prefer the node holding their snapshot, only where no other node can read it."""

from __future__ import annotations

from warmstart.operator.placement import (
    NODE_LOCAL,
    OBJECT_STORE,
    SHARED_VOLUME,
    prefer_node,
    preferred_node,
    restore_node,
)


def test_only_a_node_local_store_ties_restores_to_the_capturing_node():
    assert restore_node(NODE_LOCAL, "gpu-1") == "gpu-1"
    assert restore_node(NODE_LOCAL, "") == ""  # a snapshot whose node was not recorded
    assert restore_node(SHARED_VOLUME, "gpu-1") == restore_node(OBJECT_STORE, "gpu-1") == ""


def test_the_preference_is_by_node_name_and_never_required():
    pod: dict = {}
    prefer_node(pod, "gpu-1")
    (term,) = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term == {
        "weight": 100,
        "preference": {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-1"]}]},
    }
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["nodeAffinity"]
    assert preferred_node(pod) == "gpu-1"


def test_the_preference_joins_an_affinity_the_pod_already_has():
    required = {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["a"]}]}]
    }
    theirs = {
        "weight": 5,
        "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z"]}]},
    }
    pod = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": required,
                "preferredDuringSchedulingIgnoredDuringExecution": [theirs],
            },
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
        }
    }
    prefer_node(pod, "gpu-2")
    node_affinity = pod["affinity"]["nodeAffinity"]
    assert node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] == required
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"][0] == theirs
    assert "podAntiAffinity" in pod["affinity"]
    assert preferred_node(pod) == "gpu-2"
    assert (
        preferred_node(
            {"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [theirs]}}}
        )
        == ""
    )
    assert preferred_node({}) == ""
