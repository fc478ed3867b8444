import threading
import time

import pytest

from warmstart.identity import SnapshotIdentity, canonical_json
from warmstart.protocol import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, ControlDir, SignalTimeout


def make_identity(**changes):
    base = dict(
        model_digest="sha256:abc",
        engine="builtin",
        engine_version="0.1.0",
        engine_args={"max_seq_len": 256, "batch_sizes": [1, 2]},
        dtype="float32",
    )
    base.update(changes)
    return SnapshotIdentity(**base)


def test_identity_hash_is_stable_and_order_independent():
    a = make_identity(engine_args={"a": 1, "b": [1, 2]})
    b = make_identity(engine_args={"b": [1, 2], "a": 1})
    assert a.digest() == b.digest()
    assert len(a.digest()) == 64
    assert canonical_json({"b": 1, "a": 2}) == b'{"a":2,"b":1}'


@pytest.mark.parametrize(
    "field,value",
    [
        ("model_digest", "sha256:def"),
        ("engine_version", "0.2.0"),
        ("engine_args", {"max_seq_len": 512}),
        ("dtype", "bfloat16"),
        ("parallelism", 2),
        ("gpu_product", "NVIDIA H200"),
        ("driver_major", 580),
        ("image", "worker:v2"),
        ("device", "cuda"),
        ("compute_capability", "9.0"),
    ],
)
def test_every_field_changes_the_hash_and_is_named(field, value):
    a, b = make_identity(), make_identity(**{field: value})
    assert a.digest() != b.digest()
    assert [m.split(":")[0] for m in a.mismatches(b)] == [field]


def test_identity_round_trip_and_rejects_unknown_fields():
    a = make_identity()
    assert SnapshotIdentity.from_dict(a.to_dict()) == a
    with pytest.raises(ValueError, match="unknown identity fields: gpu_count"):
        SnapshotIdentity.from_dict({**a.to_dict(), "gpu_count": 8})
    with pytest.raises(ValueError, match="identity_version 99"):
        SnapshotIdentity.from_dict({**a.to_dict(), "identity_version": 99})


def test_control_dir_send_wait_and_clear(tmp_path):
    control = ControlDir(tmp_path / "control")
    with pytest.raises(SignalTimeout):
        control.wait(READY_FOR_SNAPSHOT, timeout=0.05)

    def later():
        time.sleep(0.05)
        control.send(RESTORE_COMPLETE, {"port": 1234})

    threading.Thread(target=later).start()
    signal = control.wait(READY_FOR_SNAPSHOT, RESTORE_COMPLETE, timeout=5)
    assert (signal.name, signal.payload) == (RESTORE_COMPLETE, {"port": 1234})
    assert not list(control.path.glob(".*tmp")), "no temporary file may stay behind"
    control.clear()
    assert not control.present(RESTORE_COMPLETE)
    with pytest.raises(ValueError, match="unknown signal"):
        control.send("go")
