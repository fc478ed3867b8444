"""What an InferenceEndpoint asks a snapshot for: its request key.

The operator never sees the model's bytes, the image's digest or the GPU it lands on, so it cannot know a
snapshot's *identity* (what the worker measures and the agent records at capture). It knows what the
endpoint asks for: the model reference, the engine, its image and arguments, the resources. The request key
finds the snapshots made for that request; the agent checks a snapshot's recorded identity against the node
and the pod before it restores anything.
"""

from __future__ import annotations

import hashlib
from typing import Any

from warmstart.api.endpoint import EndpointSpec
from warmstart.api.identity import canonical_json

REQUEST_KEY_VERSION = 1


def request_key(spec: EndpointSpec) -> dict[str, Any]:
    """The fields of a spec a snapshot depends on (scaling, placement and snapshot policy do not count)."""
    engine, resources = spec.engine, spec.resources
    return {
        "version": REQUEST_KEY_VERSION,
        "model": {
            "uri": spec.model.uri,
            "revision": spec.model.revision,
            "servedName": spec.model.name_on_api,
        },
        "engine": {
            "kind": engine.kind,
            "image": engine.image,
            "version": engine.version,
            "args": list(engine.args),
            "dtype": engine.dtype,
            "tensorParallelSize": engine.tensor_parallel_size,
        },
        "resources": {"gpus": resources.gpus, "gpuProduct": resources.gpu_product},
    }


def request_key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(key)).hexdigest()
