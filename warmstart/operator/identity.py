"""InferenceEndpoint -> SnapshotIdentity, as far as the operator can know it.

On the cluster the operator never sees the model bytes, so the model digest is a digest of the model
*reference* (uri + revision). The driver version and compute capability are the node's: the agent
checks them against the snapshot's manifest at restore time, so they stay empty here.
"""

from __future__ import annotations

import hashlib

from warmstart.identity import SnapshotIdentity, canonical_json
from warmstart.operator.spec import EndpointSpec

MODEL_REFERENCE_SCHEME = "ref:sha256:"


def model_reference_digest(uri: str, revision: str) -> str:
    digest = hashlib.sha256(canonical_json({"uri": uri, "revision": revision})).hexdigest()
    return MODEL_REFERENCE_SCHEME + digest


def endpoint_identity(spec: EndpointSpec) -> SnapshotIdentity:
    engine = spec.engine
    gpus = spec.resources.gpus
    return SnapshotIdentity(
        model_digest=model_reference_digest(spec.model.uri, spec.model.revision),
        engine=engine.kind,
        engine_version=engine.version or engine.image,
        engine_args={"args": list(engine.args), "served_name": spec.model.name_on_api, "gpus": gpus},
        dtype=engine.dtype,
        parallelism=engine.tensor_parallel_size,
        device="cuda" if gpus > 0 else "cpu",
        gpu_product=spec.resources.gpu_product,
        image=engine.image,
    )
