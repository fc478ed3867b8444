"""The watches' copies of the operator's children: answered while fresh, never past their age bound."""

from __future__ import annotations

from typing import Any

from warmstart.operator.seen_children import SeenChildren


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def deployment(replicas: int) -> dict[str, Any]:
    return {
        "kind": "Deployment",
        "metadata": {"name": "qwen", "namespace": "ml"},
        "spec": {"replicas": replicas},
    }


def test_a_copy_is_answered_until_it_is_older_than_the_bound() -> None:
    clock = Clock()
    seen = SeenChildren(max_age=300, clock=clock)
    seen.saw(deployment(1))
    clock.now = 300
    assert seen.fresh("Deployment", "ml", "qwen") == deployment(1)
    clock.now = 301
    assert seen.fresh("Deployment", "ml", "qwen") is None  # read again from the API server


def test_the_latest_copy_wins_and_a_deleted_child_is_forgotten() -> None:
    seen = SeenChildren(max_age=300, clock=Clock())
    seen.saw(deployment(1))
    seen.saw(deployment(5))  # scaled by hand
    assert seen.fresh("Deployment", "ml", "qwen") == deployment(5)
    seen.gone("Deployment", "ml", "qwen")
    assert seen.fresh("Deployment", "ml", "qwen") is None


def test_a_copy_handed_out_cannot_change_the_one_kept() -> None:
    seen = SeenChildren(max_age=300, clock=Clock())
    body = deployment(1)
    seen.saw(body)
    body["spec"]["replicas"] = 7
    seen.fresh("Deployment", "ml", "qwen")["spec"]["replicas"] = 9  # type: ignore[index]
    assert seen.fresh("Deployment", "ml", "qwen") == deployment(1)


def test_kinds_no_watch_keeps_up_to_date_are_not_kept() -> None:
    seen = SeenChildren(max_age=300, clock=Clock())
    seen.saw({"kind": "DaemonSet", "metadata": {"name": "qwen", "namespace": "ml"}})
    assert seen.fresh("DaemonSet", "ml", "qwen") is None
