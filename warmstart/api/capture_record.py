"""The capture record: what a capture writes into its snapshot's signed manifest (`meta`) for the restore,
the agent's housekeeping and `warmstart serve` to read.

Written and read through `CaptureRecord` only. The manifest keeps the record as the JSON object it signed;
keys this version does not know (a newer capture's) are kept there and ignored here, and a known key of the
wrong type makes the whole manifest invalid (`CaptureRecord.of` raises ValueError naming each such key).
Plain dataclasses, not pydantic: every restore parses a manifest, and a restore's command start counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "bool": (bool,),
    "int | None": (int, type(None)),
    "list[int]": (list,),
    "list[str]": (list,),
    "dict[str, Any]": (dict,),
    "dict[str, Any] | None": (dict, type(None)),
    "WorkerRecord": (dict,),
}
_ITEM_TYPES = {"list[int]": int, "list[str]": str}
_EXTRA = "extra"  # the field that keeps the keys this version does not know


@dataclass(frozen=True)
class WorkerRecord:
    """What the worker said when it asked for its snapshot (its request, less its identity and pid)."""

    identity_hash: str = ""
    engine: dict[str, Any] = field(default_factory=dict)  # the engine's own facts (kind, version, memory)
    model_dir: str = ""  # where the worker read its model from
    weights_released: bool = False
    host: str = ""
    port: int | None = None
    restore_facts: dict[str, Any] | None = None  # `warmstart.api.restore_facts.RestoreFacts`, as a dict
    weight_staging: dict[str, Any] | None = None  # the plan of a weights stager (`warmstart.gpu`)
    extra: dict[str, Any] = field(default_factory=dict)  # what else it said (another engine's facts)

    @classmethod
    def of(cls, data: Mapping[str, Any]) -> WorkerRecord:
        return cls(**_parsed(cls, data, "worker."))


@dataclass(frozen=True)
class CaptureRecord:
    """Who asked for the capture and what the restore needs to put the process back."""

    namespace: str = ""  # the pod's, on Kubernetes: a snapshot is restored into no other namespace
    inference_snapshot: str = field(default="", metadata={"key": "inferenceSnapshot"})
    pod: str = ""
    node: str = ""  # the node whose agent captured it
    model: str = ""
    identity_cache_key: str = ""  # `warmstart serve`'s record of the identity this snapshot belongs to
    engine_pid: int | None = None  # inside the sandbox
    uses_cuda: bool = False
    cuda_reason: str = ""
    cuda_pids: list[int] = field(default_factory=list)  # inside the sandbox: each is CUDA-restored
    sandbox_files: list[str] = field(default_factory=list)  # files the engine held open, copied back
    sandbox_mountpoint: str = ""
    worker: WorkerRecord = field(default_factory=WorkerRecord)
    extra: dict[str, Any] = field(default_factory=dict)  # keys of a newer version, kept as they were

    @classmethod
    def of(cls, meta: Mapping[str, Any]) -> CaptureRecord:
        """The record a manifest's `meta` holds; ValueError naming every known key of the wrong type."""
        return cls(**_parsed(cls, meta, ""))

    def to_meta(self) -> dict[str, Any]:
        """The JSON object a manifest signs: the fields that differ from their defaults, by their keys."""
        return _written(self)


def _key(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("key", f.name))


def _parsed(cls: type, data: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """`cls`'s fields from `data` (unknown keys into `extra`); ValueError naming each one of a wrong type."""
    fields = [f for f in dataclasses.fields(cls) if f.name != _EXTRA]
    problems = [_problem(f, data[_key(f)], prefix) for f in fields if _key(f) in data]
    if problems := [problem for problem in problems if problem]:
        raise ValueError("the capture record is invalid: " + "; ".join(problems))
    known = {f.name: data[_key(f)] for f in fields if _key(f) in data}
    if isinstance(known.get("worker"), dict):
        known["worker"] = WorkerRecord.of(known["worker"])
    return {**known, _EXTRA: {k: v for k, v in data.items() if k not in {_key(f) for f in fields}}}


def _problem(f: dataclasses.Field[Any], value: Any, prefix: str) -> str:
    """Why `value` cannot be field `f` ("" when it can): JSON types only, and a bool is no int."""
    allowed, item = _JSON_TYPES[str(f.type)], _ITEM_TYPES.get(str(f.type))
    wrong = not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)
    if not wrong and item is not None:
        wrong = any(not isinstance(v, item) or isinstance(v, bool) for v in value)
    shown = "an object" if f.type == "WorkerRecord" else str(f.type)
    return f"{prefix}{_key(f)} must be {shown}, not {value!r:.60}" if wrong else ""


def _written(record: CaptureRecord | WorkerRecord) -> dict[str, Any]:
    written: dict[str, Any] = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.name == _EXTRA:
            written.update({k: v for k, v in value.items() if k not in written})
        elif value != (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default):
            written[_key(f)] = _written(value) if isinstance(value, WorkerRecord) else value
    return written
