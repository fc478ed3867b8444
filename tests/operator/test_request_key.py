"""The request key: what an endpoint asks a snapshot for (never the snapshot's runtime identity)."""

from __future__ import annotations

import pytest
from builders import endpoint_spec

from warmstart.operator.request_key import request_key, request_key_hash
from warmstart.operator.spec import parse_spec


def key_hash(**overrides) -> str:
    return request_key_hash(request_key(parse_spec(endpoint_spec(**overrides))))


def test_same_spec_same_key_and_scaling_fields_do_not_count():
    assert key_hash() == key_hash()
    assert key_hash() == key_hash(replicas=7, template={"nodeSelector": {"a": "b"}})


@pytest.mark.parametrize(
    "overrides",
    [
        {
            "engine": {
                "kind": "vllm",
                "image": "registry.example/warmstart-worker:0.2",
                "args": ["--enforce-eager"],
            }
        },
        {"engine": {"kind": "vllm", "image": "registry.example/warmstart-worker:0.1", "args": []}},
        {
            "engine": {
                "kind": "vllm",
                "image": "registry.example/warmstart-worker:0.1",
                "args": ["--enforce-eager"],
                "dtype": "bfloat16",
            }
        },
        {"model": {"uri": "Qwen/Qwen3-8B", "revision": "main"}},
        {"model": {"uri": "Qwen/Qwen3-0.6B", "revision": "abc123"}},
        {"model": {"uri": "Qwen/Qwen3-0.6B", "revision": "main", "servedName": "other"}},
        {"resources": {"gpus": 1, "gpuProduct": "NVIDIA-H200"}},
    ],
)
def test_what_a_snapshot_depends_on_changes_the_key(overrides):
    assert key_hash(**overrides) != key_hash()


def test_the_key_names_the_request_not_a_measured_identity():
    key = request_key(parse_spec(endpoint_spec()))
    assert key["model"]["uri"] == "Qwen/Qwen3-0.6B" and key["engine"]["image"].endswith(":0.1")
    assert "model_digest" not in str(key) and "driver" not in str(key)
