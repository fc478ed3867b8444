"""The capture record: written and read through one typed model, wrong types refused, unknown keys kept."""

from __future__ import annotations

import json
import re

import pytest

from warmstart.api.capture_record import CaptureRecord, WorkerRecord
from warmstart.checkpoint.capture import CaptureError, worker_record
from warmstart.snapshot.manifest import Manifest, SnapshotInvalid

WRITTEN_BY_AN_AGENT = {
    "namespace": "ml",
    "inferenceSnapshot": "qwen-abc",
    "pod": "qwen-capture-1",
    "node": "gpu-1",
    "engine_pid": 7,
    "uses_cuda": True,
    "cuda_reason": "the engine holds a CUDA context",
    "cuda_pids": [7, 9],
    "sandbox_files": ["/tmp/engine.log"],
    "sandbox_mountpoint": "/run/warmstart/control",
    "worker": {
        "identity_hash": "ab" * 32,
        "engine": {"kind": "vllm", "warm_up": {"seconds": 1.5}},
        "model_dir": "/models/qwen",
        "weights_released": True,
        "host": "0.0.0.0",
        "port": 8000,
        "restore_facts": {"engine": "vllm"},
        "weight_staging": {"copies": []},
        "ranks": [7, 9],  # another engine's own fact
    },
    "written_by_a_newer_version": {"x": 1},
}


def test_a_record_reads_every_field_and_writes_back_what_it_read() -> None:
    record = CaptureRecord.of(WRITTEN_BY_AN_AGENT)
    assert (record.namespace, record.inference_snapshot, record.node) == ("ml", "qwen-abc", "gpu-1")
    assert record.uses_cuda and record.cuda_pids == [7, 9] and record.engine_pid == 7
    assert record.worker.model_dir == "/models/qwen" and record.worker.port == 8000
    assert record.worker.engine["warm_up"] == {"seconds": 1.5}
    assert record.worker.extra == {"ranks": [7, 9]}
    assert record.extra == {"written_by_a_newer_version": {"x": 1}}
    assert record.to_meta() == WRITTEN_BY_AN_AGENT


def test_an_empty_record_has_its_defaults_and_writes_nothing() -> None:
    record = CaptureRecord.of({})
    assert record == CaptureRecord() and record.worker == WorkerRecord()
    assert not record.uses_cuda and record.cuda_pids == [] and record.worker.restore_facts is None
    assert record.to_meta() == {}


@pytest.mark.parametrize(
    ("meta", "named"),
    [
        ({"uses_cuda": "yes"}, "uses_cuda must be bool"),
        ({"uses_cuda": 1}, "uses_cuda must be bool"),
        ({"engine_pid": True}, "engine_pid must be int | None"),
        ({"cuda_pids": [7, "8"]}, "cuda_pids must be list[int]"),
        ({"cuda_pids": 7}, "cuda_pids must be list[int]"),
        ({"namespace": None}, "namespace must be str"),
        ({"inferenceSnapshot": 3}, "inferenceSnapshot must be str"),
        ({"worker": ["not", "an", "object"]}, "worker must be an object"),
        ({"worker": {"model_dir": 3}}, "worker.model_dir must be str"),
        ({"worker": {"weight_staging": "plan"}}, "worker.weight_staging must be dict[str, Any] | None"),
    ],
)
def test_a_known_key_of_the_wrong_type_is_refused_by_name(meta: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match="the capture record is invalid") as refused:
        CaptureRecord.of(meta)
    assert named in str(refused.value)


def test_every_wrong_key_is_named_at_once() -> None:
    with pytest.raises(ValueError) as refused:
        CaptureRecord.of({"uses_cuda": "yes", "node": 1, "sandbox_files": [None]})
    assert all(key in str(refused.value) for key in ("uses_cuda", "node", "sandbox_files"))


def test_a_manifest_whose_record_is_wrong_is_invalid_before_anything_reads_it() -> None:
    manifest = {
        "schema": "warmstart.dev/snapshot-manifest/v2",
        "id": "0123456789ab-20261207000000-abcdef",
        "created": "2026-12-07T00:00:00.000000Z",
        "identity": {"model_digest": "sha256:" + "0" * 64, "engine": "builtin", "engine_version": "1"},
        "identity_hash": "h",
        "files": {},
        "meta": {"uses_cuda": "true"},
    }
    with pytest.raises(SnapshotInvalid, match=r"manifest field 'meta': .*uses_cuda must be bool"):
        Manifest.from_bytes(json.dumps(manifest).encode())
    manifest["meta"] = {"uses_cuda": True}
    assert Manifest.from_bytes(json.dumps(manifest).encode()).record.uses_cuda


def test_a_worker_request_of_the_wrong_type_fails_the_capture_before_it_is_signed() -> None:
    request = {"pid": 7, "identity": {"engine": "builtin"}, "model_dir": "/m", "port": "8000"}
    with pytest.raises(CaptureError, match=re.escape("worker.port must be int | None")):
        worker_record(request)
    request["port"] = 8000
    recorded = worker_record(request)
    assert recorded == WorkerRecord(model_dir="/m", port=8000)  # its identity and pid are recorded apart
