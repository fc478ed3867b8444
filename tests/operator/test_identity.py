from __future__ import annotations

import pytest
from builders import endpoint_spec

from warmstart.operator.identity import endpoint_identity, model_reference_digest
from warmstart.operator.spec import parse_spec


def digest(**overrides) -> str:
    return endpoint_identity(parse_spec(endpoint_spec(**overrides))).digest()


def test_same_spec_same_hash_and_scaling_fields_do_not_count():
    assert digest() == digest()
    assert digest() == digest(replicas=7, template={"nodeSelector": {"a": "b"}})


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
        {"resources": {"gpus": 1, "gpuProduct": "NVIDIA-H200"}},
    ],
)
def test_what_a_restore_depends_on_changes_the_hash(overrides):
    assert digest(**overrides) != digest()


def test_model_digest_is_a_reference_digest():
    identity = endpoint_identity(parse_spec(endpoint_spec()))
    assert identity.model_digest == model_reference_digest("Qwen/Qwen3-0.6B", "main")
    assert identity.device == "cuda" and identity.image.endswith(":0.1")
