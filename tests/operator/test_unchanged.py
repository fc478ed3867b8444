"""What counts as a child the server already holds as wanted (so that the operator writes nothing)."""

from __future__ import annotations

import copy
from typing import Any

from warmstart.operator.unchanged import APPLIED_ANNOTATION, held, stamped


def wanted() -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "qwen", "namespace": "ml", "labels": {"app": "qwen", "tier": "gpu"}},
        "spec": {
            "replicas": 2,
            "template": {
                "metadata": {"annotations": {}, "labels": {"app": "qwen"}},
                "spec": {"containers": [{"name": "worker", "resources": {"limits": {"nvidia.com/gpu": 1}}}]},
            },
        },
    }


def as_served(applied: dict[str, Any]) -> dict[str, Any]:
    """What the apiserver returns: defaults and fields of its own added, quantities as strings."""
    server = copy.deepcopy(applied)
    server["metadata"].update(uid="u-1", resourceVersion="42", managedFields=[{"manager": "x"}])
    server["spec"]["strategy"] = {"type": "RollingUpdate"}
    del server["spec"]["template"]["metadata"]["annotations"]  # an empty map is not stored
    container = server["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"]["nvidia.com/gpu"] = "1"
    container["terminationMessagePath"] = "/dev/termination-log"
    server["status"] = {"replicas": 2}
    return server


def test_a_child_as_applied_plus_server_defaults_is_held() -> None:
    applied = stamped(wanted())
    assert held(as_served(applied), applied)


def test_a_missing_child_or_a_field_edited_by_hand_is_not_held() -> None:
    applied = stamped(wanted())
    scaled = as_served(applied)
    scaled["spec"]["replicas"] = 5
    relabelled = as_served(applied)
    del relabelled["metadata"]["labels"]["tier"]
    assert not held(None, applied)
    assert not held(scaled, applied)
    assert not held(relabelled, applied)


def test_a_field_the_operator_stopped_setting_changes_the_digest() -> None:
    before = as_served(stamped(wanted()))
    now = wanted()
    del now["metadata"]["labels"]["tier"]  # still on the server: containment alone would call it held
    assert not held(before, stamped(now))
    assert (
        stamped(now)["metadata"]["annotations"][APPLIED_ANNOTATION]
        != (before["metadata"]["annotations"][APPLIED_ANNOTATION])
    )


def test_a_list_of_another_length_is_not_held() -> None:
    applied = stamped(wanted())
    server = as_served(applied)
    server["spec"]["template"]["spec"]["containers"].append({"name": "sidecar"})
    assert not held(server, applied)
