from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Operation(_message.Message):
    __slots__ = ("kind", "pod", "snapshot", "since")
    KIND_FIELD_NUMBER: _ClassVar[int]
    POD_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    pod: str
    snapshot: str
    since: float
    def __init__(self, kind: _Optional[str] = ..., pod: _Optional[str] = ..., snapshot: _Optional[str] = ..., since: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("node", "criu_version", "criu_error", "cuda_available", "cuda_reason", "in_flight")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CRIU_VERSION_FIELD_NUMBER: _ClassVar[int]
    CRIU_ERROR_FIELD_NUMBER: _ClassVar[int]
    CUDA_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_REASON_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    node: str
    criu_version: str
    criu_error: str
    cuda_available: bool
    cuda_reason: str
    in_flight: _containers.RepeatedCompositeFieldContainer[Operation]
    def __init__(self, node: _Optional[str] = ..., criu_version: _Optional[str] = ..., criu_error: _Optional[str] = ..., cuda_available: _Optional[bool] = ..., cuda_reason: _Optional[str] = ..., in_flight: _Optional[_Iterable[_Union[Operation, _Mapping]]] = ...) -> None: ...

class ListSnapshotsRequest(_message.Message):
    __slots__ = ("identity_hash",)
    IDENTITY_HASH_FIELD_NUMBER: _ClassVar[int]
    identity_hash: str
    def __init__(self, identity_hash: _Optional[str] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("id", "identity_hash", "engine", "model_digest", "size", "created", "namespace", "inference_snapshot")
    ID_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_HASH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    id: str
    identity_hash: str
    engine: str
    model_digest: str
    size: int
    created: str
    namespace: str
    inference_snapshot: str
    def __init__(self, id: _Optional[str] = ..., identity_hash: _Optional[str] = ..., engine: _Optional[str] = ..., model_digest: _Optional[str] = ..., size: _Optional[int] = ..., created: _Optional[str] = ..., namespace: _Optional[str] = ..., inference_snapshot: _Optional[str] = ...) -> None: ...

class ListSnapshotsResponse(_message.Message):
    __slots__ = ("snapshots",)
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    snapshots: _containers.RepeatedCompositeFieldContainer[Snapshot]
    def __init__(self, snapshots: _Optional[_Iterable[_Union[Snapshot, _Mapping]]] = ...) -> None: ...
