import re
import threading
import time
from pathlib import Path

import pytest

from warmstart.api.control_dir import READY_FOR_SNAPSHOT, RESTORE_COMPLETE, ControlDir, SignalTimeout
from warmstart.api.identity import SnapshotIdentity, canonical_json


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


# What Kubernetes puts into a pod's environment for each Service of its namespace (service links):
# <NAME>_SERVICE_HOST, <NAME>_SERVICE_PORT[_<PORT NAME>],
# <NAME>_PORT[_<NUMBER>_<PROTOCOL>[_PROTO|_PORT|_ADDR]].
SERVICE_LINK = re.compile(
    r"_SERVICE_HOST$|_SERVICE_PORT(_[A-Z0-9_]+)?$|_PORT$|_PORT_\d+_(TCP|UDP|SCTP)(_PROTO|_PORT|_ADDR)?$"
)


def test_no_setting_can_be_shadowed_by_a_service_link():
    """A Service named like a setting (e.g. `warmstart-operator-metrics` -> WARMSTART_OPERATOR_METRICS_PORT)
    must never be read as that setting, however the chart or a user names Services."""
    root = Path(__file__).resolve().parent.parent
    sources = [*root.joinpath("warmstart").rglob("*.py"), *root.joinpath("charts").rglob("*.yaml")]
    names = {name for path in sources for name in re.findall(r"\bWARMSTART_[A-Z0-9_]+\b", path.read_text())}
    assert "WARMSTART_OPERATOR_METRICS_PORT_NUMBER" in names  # the scan finds the settings
    assert sorted(name for name in names if SERVICE_LINK.search(name)) == []
