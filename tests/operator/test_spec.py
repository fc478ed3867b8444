from __future__ import annotations

import pytest
from builders import endpoint_spec

from warmstart.api.endpoint import SnapshotPolicy
from warmstart.operator.spec import InvalidSpec, parse_spec


def test_defaults_match_the_crd_defaults():
    spec = parse_spec(
        {
            "model": {"uri": "m"},
            "engine": {"kind": "builtin", "image": "img"},
        }
    )
    assert spec.replicas == 1
    assert spec.resources.gpus == 1
    assert spec.engine.dtype == "auto" and spec.engine.port == 8000
    assert spec.autoscaling.mode == "none"
    assert spec.snapshot.enabled and spec.snapshot.retention == 2
    assert spec.snapshot.prestage == "None"
    assert spec.model.name_on_api == "m"


def test_full_spec_is_parsed():
    spec = parse_spec(
        endpoint_spec(
            replicas=3,
            autoscaling={
                "mode": "keda",
                "minReplicas": 0,
                "maxReplicas": 5,
                "metric": {"name": "requests", "target": "2", "query": "sum(rate(gateway_requests[1m]))"},
            },
            template={"nodeSelector": {"pool": "h200"}, "env": [{"name": "A", "value": "1"}]},
        )
    )
    assert spec.replicas == 3
    assert spec.autoscaling.metric is not None and spec.autoscaling.metric.name == "requests"
    assert spec.template.node_selector == {"pool": "h200"}
    assert spec.engine.args == ("--enforce-eager",)


METRIC = {"metric": {"name": "warmstart_worker_requests_waiting", "target": "2"}}
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
        ({"autoscaling": {"mode": "none", "minReplicas": 0}}, "spec.autoscaling.minReplicas"),
        (
            {"autoscaling": {"mode": "keda", "minReplicas": 0, "metric": {"name": "m", "target": "1"}}},
            "spec.autoscaling.minReplicas",
        ),
        (
            {"autoscaling": {"mode": "http", "metric": {"name": "m", "target": "1"}}},
            "spec.autoscaling.metric",
        ),
        ({"autoscaling": {"mode": "keda", **METRIC, "http": {}}}, "spec.autoscaling.http"),
        (
            {"autoscaling": {"mode": "http", "http": {"targetConcurrency": 0}}},
            "spec.autoscaling.http.targetConcurrency",
        ),
        ({"autoscaling": {"mode": "http", "http": {"hosts": [""]}}}, "spec.autoscaling.http.hosts"),
        ({"autoscaling": {"mode": "http", "http": {"hosts": "a.b"}}}, "spec.autoscaling.http.hosts"),
        (
            {"autoscaling": {"mode": "http", "http": {"pathPrefixes": ["/v1", "v2"]}}},
            "spec.autoscaling.http.pathPrefixes[1]",
        ),
        (
            {"autoscaling": {"mode": "http", "http": {"coldStartTimeoutSeconds": 0}}},
            "spec.autoscaling.http.coldStartTimeoutSeconds",
        ),
        (
            {"autoscaling": {"mode": "http", "http": {"responseTimeoutSeconds": "10m"}}},
            "spec.autoscaling.http.responseTimeoutSeconds",
        ),
        ({"resources": {"gpus": 0, "gpuProduct": "NVIDIA-H200"}}, "spec.resources.gpuProduct"),
        (
            {"engine": {"kind": "vllm", "image": "w:1", "tensorParallelSize": 2}, "resources": {"gpus": 1}},
            "spec.engine.tensorParallelSize",
        ),
        ({"snapshot": {"enabled": "yes"}}, "spec.snapshot.enabled"),
        ({"snapshot": {"prestage": "pagecache"}}, "spec.snapshot.prestage"),
        ({"snapshot": {"prestage": None}}, "spec.snapshot.prestage"),
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


def test_http_mode_scales_to_zero_without_a_metric_and_has_defaults():
    scaling = parse_spec(endpoint_spec(autoscaling={"mode": "http", "minReplicas": 0})).autoscaling
    assert scaling.mode == "http" and scaling.min_replicas == 0 and scaling.metric is None
    assert scaling.http.hosts == () and scaling.http.path_prefixes == ()
    assert scaling.http.target_concurrency == 1
    assert scaling.http.cold_start_timeout_seconds == 120 and scaling.http.response_timeout_seconds == 600


def test_http_mode_settings_are_parsed():
    http = {
        "hosts": ["qwen.example.com"],
        "pathPrefixes": ["/v1/"],
        "targetConcurrency": 8,
        "coldStartTimeoutSeconds": 300,
        "responseTimeoutSeconds": 900,
    }
    parsed = parse_spec(endpoint_spec(autoscaling={"mode": "http", "http": http})).autoscaling.http
    assert parsed.hosts == ("qwen.example.com",) and parsed.path_prefixes == ("/v1/",)
    assert parsed.target_concurrency == 8
    assert parsed.cold_start_timeout_seconds == 300 and parsed.response_timeout_seconds == 900


def test_missing_model_is_named():
    spec = endpoint_spec()
    del spec["model"]
    with pytest.raises(InvalidSpec, match=r"^spec\.model: is required"):
        parse_spec(spec)


def test_snapshots_need_no_policy():
    spec = endpoint_spec()
    del spec["snapshot"]
    assert parse_spec(spec).snapshot == SnapshotPolicy(enabled=True)
    policy = parse_spec(endpoint_spec(snapshot={"enabled": True, "retention": 3})).snapshot
    assert policy.enabled and policy.retention == 3


def test_a_removed_storage_field_is_ignored_as_the_api_server_prunes_it():
    """snapshot.storage left the CRD (the chart's agent.store is the one store): an object written before
    carries it until the API server prunes it, and it changes nothing meanwhile."""
    stale = endpoint_spec(snapshot={"enabled": True, "storage": {"claimName": "s", "subPath": "x"}})
    assert parse_spec(stale) == parse_spec(endpoint_spec(snapshot={"enabled": True}))


def test_every_section_with_a_problem_is_named_at_once():
    spec = endpoint_spec(
        replicas=-1,
        engine={"kind": "tgi", "image": "i"},
        autoscaling={"mode": "hpa"},
        template={"volumes": [{"name": "shm"}]},
        monitoring={"serviceMonitor": "yes"},
    )
    del spec["model"]
    with pytest.raises(InvalidSpec) as caught:
        parse_spec(spec)
    paths = [problem.path for problem in caught.value.problems]
    assert paths == [
        "model", "engine.kind", "replicas", "autoscaling.metric", "template.volumes[0].name",
        "monitoring.serviceMonitor",
    ]  # fmt: skip
    message = str(caught.value)
    assert message.startswith("spec.model: is required")
    assert all(f"spec.{path}: " in message for path in paths)


def test_a_flag_the_worker_refuses_hides_no_other_problem():
    spec = endpoint_spec(
        model={"uri": "tiny", "revision": "main"},
        engine={"kind": "builtin", "image": "i", "args": ["--no-such-flag"], "port": 80},
    )
    with pytest.raises(InvalidSpec) as caught:
        parse_spec(spec)
    assert [p.path for p in caught.value.problems] == ["engine.port"]  # the section stops at its first
    spec["engine"]["port"] = 8000
    with pytest.raises(InvalidSpec) as caught:
        parse_spec(spec)
    assert [p.path for p in caught.value.problems] == ["engine.args", "model.revision"]


def test_rules_across_sections_are_checked_beside_the_others():
    spec = endpoint_spec(
        model={"uri": "tiny", "revision": "main"},
        engine={"kind": "builtin", "image": "i", "tensorParallelSize": 2},
        service={"port": 0},
    )
    with pytest.raises(InvalidSpec) as caught:
        parse_spec(spec)
    assert [p.path for p in caught.value.problems] == [
        "model.revision", "engine.tensorParallelSize", "service.port",
    ]  # fmt: skip


def test_a_spec_that_is_not_an_object_is_one_problem():
    with pytest.raises(InvalidSpec) as caught:
        parse_spec(["model"])  # type: ignore[arg-type]
    assert [str(p) for p in caught.value.problems] == ["spec: must be an object"]


def test_prestage_policy_is_parsed():
    policy = parse_spec(endpoint_spec(snapshot={"prestage": "PageCache"}))
    assert policy.snapshot.prestage == "PageCache"


def test_snapshots_disabled_needs_no_storage():
    assert not parse_spec(endpoint_spec(snapshot={"enabled": False})).snapshot.enabled


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no-such-flag"], "the worker would refuse them: unrecognized arguments: --no-such-flag"),
        (["--max-num-seqs", "many"], "the worker would refuse them: argument --max-num-seqs: must be an int"),
        (["--port", "9000"], "--port is set by the operator: use engine.port"),
        (["--probe-port=9001"], "--probe-port is set by the operator: use engine.port"),
        (["--start-timeout", "5"], "--start-timeout is set by the operator"),
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


def test_every_problem_within_a_section_is_named_too():
    spec = endpoint_spec(
        model={"uri": "tiny", "revision": "main"},
        engine={"kind": "builtin", "image": "", "tensorParallelSize": 9, "args": ["--port=1"]},
        resources={"gpus": 1, "cpu": "lots"},
        autoscaling={"mode": "hpa", "minReplicas": 0, "maxReplicas": 0, "http": {}},
    )
    with pytest.raises(InvalidSpec) as caught:
        parse_spec(spec)
    assert [p.path for p in caught.value.problems] == [
        "engine.image", "engine.tensorParallelSize", "resources.cpu", "autoscaling.maxReplicas",
    ]  # fmt: skip
    spec["engine"] = {"kind": "builtin", "image": "i", "args": ["--port=1"]}
    spec["autoscaling"]["maxReplicas"] = 1
    with pytest.raises(InvalidSpec) as caught:
        parse_spec(spec)
    assert [p.path for p in caught.value.problems] == [
        "resources.cpu", "engine.args", "model.revision", "autoscaling.minReplicas", "autoscaling.metric",
        "autoscaling.http",
    ]  # fmt: skip
