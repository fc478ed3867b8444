from __future__ import annotations

import pytest
from builders import endpoint_spec

from warmstart.operator.spec import InvalidSpec, parse_spec


def test_defaults_match_the_crd_defaults():
    spec = parse_spec(
        {
            "model": {"uri": "m"},
            "engine": {"kind": "builtin", "image": "img"},
            "snapshot": {"storage": {"claimName": "s"}},
        }
    )
    assert spec.replicas == 1
    assert spec.resources.gpus == 1
    assert spec.engine.dtype == "auto" and spec.engine.port == 8000
    assert spec.autoscaling.mode == "none"
    assert spec.snapshot.enabled and spec.snapshot.retention == 2
    assert spec.model.name_on_api == "m"


def test_full_spec_is_parsed():
    spec = parse_spec(
        endpoint_spec(
            replicas=3,
            autoscaling={
                "mode": "keda",
                "minReplicas": 0,
                "maxReplicas": 5,
                "metric": {"name": "vllm:num_requests_waiting", "target": "2"},
            },
            template={"nodeSelector": {"pool": "h200"}, "env": [{"name": "A", "value": "1"}]},
        )
    )
    assert spec.replicas == 3
    assert spec.autoscaling.metric is not None and spec.autoscaling.metric.name == "vllm:num_requests_waiting"
    assert spec.template.node_selector == {"pool": "h200"}
    assert spec.engine.args == ("--enforce-eager",)


MOUNT_A = {"name": "a", "mountPath": "/a"}
VOLUME_A = {"name": "a"}


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"replicas": -1}, "spec.replicas"),
        ({"engine": {"kind": "tgi", "image": "i"}}, "spec.engine.kind"),
        ({"engine": {"kind": "vllm"}}, "spec.engine.image"),
        ({"model": {"revision": "x"}}, "spec.model.uri"),
        (
            {
                "autoscaling": {
                    "mode": "hpa",
                    "minReplicas": 5,
                    "maxReplicas": 2,
                    "metric": {"name": "m", "target": "1"},
                }
            },
            "spec.autoscaling.minReplicas",
        ),
        (
            {"autoscaling": {"mode": "hpa", "minReplicas": 0, "metric": {"name": "m", "target": "1"}}},
            "spec.autoscaling.minReplicas",
        ),
        ({"autoscaling": {"mode": "hpa"}}, "spec.autoscaling.metric"),
        ({"snapshot": {"enabled": True}}, "spec.snapshot.storage.claimName"),
        ({"resources": {"gpus": 0, "gpuProduct": "NVIDIA-H200"}}, "spec.resources.gpuProduct"),
        ({"snapshot": {"enabled": "yes", "storage": {"claimName": "s"}}}, "spec.snapshot.enabled"),
        ({"monitoring": {"serviceMonitor": "false"}}, "spec.monitoring.serviceMonitor"),
        ({"template": {"volumes": [{"name": "control", "emptyDir": {}}]}}, "spec.template.volumes[0].name"),
        ({"template": {"volumes": [{"name": "a"}, {"name": "a"}]}}, "spec.template.volumes[1].name"),
        ({"template": {"volumeMounts": [MOUNT_A]}}, "spec.template.volumeMounts[0].name"),
        (
            {"template": {"volumes": [VOLUME_A], "volumeMounts": [{**MOUNT_A, "mountPath": "/dev/shm/"}]}},
            "spec.template.volumeMounts[0].mountPath",
        ),
    ],
)
def test_invalid_specs_name_the_field(overrides, field):
    with pytest.raises(InvalidSpec) as caught:
        parse_spec(endpoint_spec(**overrides))
    assert str(caught.value).startswith(field + ":")


def test_missing_model_is_named():
    spec = endpoint_spec()
    del spec["model"]
    with pytest.raises(InvalidSpec, match=r"^spec\.model: is required"):
        parse_spec(spec)


def test_missing_snapshot_policy_is_named():
    spec = endpoint_spec()
    del spec["snapshot"]
    with pytest.raises(InvalidSpec, match=r"^spec\.snapshot: is required"):
        parse_spec(spec)


def test_snapshots_disabled_needs_no_storage():
    assert not parse_spec(endpoint_spec(snapshot={"enabled": False})).snapshot.enabled


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-such-flag"], "the worker would refuse them: unrecognized arguments: --no-such-flag"),
        (["--max-num-seqs", "many"], "the worker would refuse them: argument --max-num-seqs: invalid int"),
        (["--port", "9000"], "--port is set by the operator: use engine.port"),
        (["--device=cpu"], "--device is set by the operator: use resources.gpus"),
        (["--", "--enforce-eager"], "unrecognized arguments: --"),
    ],
)
def test_engine_args_the_worker_would_refuse_are_rejected(args, message):
    engine = {"kind": "vllm", "image": "img", "args": args}
    with pytest.raises(InvalidSpec, match="^spec.engine.args: ") as caught:
        parse_spec(endpoint_spec(engine=engine))
    assert message in str(caught.value)


def test_engine_args_the_worker_takes_are_kept_in_order():
    args = ["--enforce-eager", "--max-num-seqs", "64", "--engine-arg", "max_num_batched_tokens=8192"]
    spec = parse_spec(endpoint_spec(engine={"kind": "vllm", "image": "img", "args": args}))
    assert spec.engine.args == tuple(args)


def test_a_model_revision_needs_the_vllm_engine():
    engine = {"kind": "builtin", "image": "img"}
    with pytest.raises(InvalidSpec, match="^spec.model.revision: .*needs engine.kind vllm"):
        parse_spec(endpoint_spec(engine=engine, model={"uri": "tiny", "revision": "main"}))
