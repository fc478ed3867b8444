"""Property-based fuzzing of what the store parses: manifests, signatures, state files, and the verifier on
signed manifests of any shape. Every input is accepted as valid or refused with the store's own error type,
never another exception. Example counts are fixed and there is no deadline: bounded, not timed."""

from __future__ import annotations

import base64
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_store_hostile import IDENTITY, make_store

from warmstart.checkpoint.restore import FailureCounter
from warmstart.fileio import UnsafeInput, loads_json
from warmstart.serve.identity_cache import IdentityCache
from warmstart.serve.worker_spec import WorkerSpec
from warmstart.snapshot.keys import signing_keys
from warmstart.snapshot.manifest import Manifest, SnapshotError, SnapshotInvalid
from warmstart.snapshot.signing import SignatureInvalid, signature_document, verify_document

pytestmark = pytest.mark.reliability
EXAMPLES = 300
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
TRIED: Counter[str] = Counter()
REFUSED: Counter[str] = Counter()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=30,
)


@pytest.fixture(scope="module", autouse=True)
def report_counts(pytestconfig: pytest.Config) -> Iterator[None]:
    yield
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is not None:
        for kind in sorted(TRIED):
            with capture.global_and_fixture_disabled():
                reporter.write_line(
                    f"fuzz {kind}: {TRIED[kind]} inputs tried, {REFUSED[kind]} refused, no other error"
                )


def tally(kind: str, refused: bool) -> None:
    TRIED[kind] += 1
    REFUSED[kind] += refused


@pytest.fixture(scope="module")
def valid_manifest(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    s = make_store(tmp_path_factory.mktemp("fuzz"))
    return json.loads((s.snapshot.path / "manifest.json").read_bytes())


def mutated(base: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """The valid manifest with a few fields replaced by any JSON, at the top or one level down."""
    result = json.loads(json.dumps(base))
    for _ in range(data.draw(st.integers(1, 3))):
        target = result
        if data.draw(st.booleans()):
            nested = [k for k, v in result.items() if isinstance(v, dict)]
            if nested:
                target = result[data.draw(st.sampled_from(nested))]
        keys = [*target, "extra"] if target else ["extra"]
        target[data.draw(st.sampled_from(keys))] = data.draw(json_values)
    return result


def parse_manifest(raw: bytes) -> bool:
    try:
        Manifest.from_bytes(raw)
    except SnapshotInvalid:
        return True
    return False


@FUZZ
@given(raw=st.binary(max_size=2000))
def test_manifest_parsing_of_any_bytes(raw: bytes) -> None:
    tally("manifest bytes", parse_manifest(raw))


@FUZZ
@given(data=st.data())
def test_manifest_parsing_of_mutated_manifests(valid_manifest: dict[str, Any], data: st.DataObject) -> None:
    tally("manifest fields", parse_manifest(json.dumps(mutated(valid_manifest, data)).encode()))


@FUZZ
@given(depth=st.integers(1, 5000), opener=st.sampled_from([b"[", b'{"k":']))
def test_nesting_of_any_depth(depth: int, opener: bytes) -> None:
    closer = b"]" if opener == b"[" else b"}"
    raw = opener * depth + b"0" + closer * depth
    tally("nesting", parse_manifest(raw))
    try:
        loads_json(raw, "state file")
    except UnsafeInput:
        assert depth > 32


@FUZZ
@given(document=st.one_of(st.binary(max_size=500), json_values.map(lambda v: json.dumps(v).encode())))
def test_signature_documents_of_any_shape(tmp_path_factory: pytest.TempPathFactory, document: bytes) -> None:
    verifier = signature_verifier(tmp_path_factory)
    try:
        verify_document(verifier, b"data", document)
    except SignatureInvalid:
        tally("signature", True)
        return
    pytest.fail(f"a signature document not made with the key was accepted: {document!r}")


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(["algorithm", "key_id", "signature"]), json_values, max_size=3))
def test_signature_fields_of_any_type(
    tmp_path_factory: pytest.TempPathFactory, fields: dict[str, Any]
) -> None:
    verifier = signature_verifier(tmp_path_factory)
    document = {
        "algorithm": verifier.algorithm,
        "key_id": verifier.key_id,
        "signature": base64.b64encode(b"x").decode(),
    }
    document.update(fields)
    try:
        verify_document(verifier, b"data", json.dumps(document).encode())
    except SignatureInvalid:
        tally("signature fields", True)
        return
    pytest.fail(f"a signature not made with the key was accepted: {document!r}")


_VERIFIERS: dict[str, Any] = {}


def signature_verifier(factory: pytest.TempPathFactory) -> Any:
    if "key" not in _VERIFIERS:
        _, verifier, _ = signing_keys(factory.mktemp("key"), None)
        _VERIFIERS["key"] = verifier
    return _VERIFIERS["key"]


@FUZZ
@given(data=st.data())
def test_the_verifier_on_signed_manifests_of_any_shape(
    tmp_path_factory: pytest.TempPathFactory, valid_manifest: dict[str, Any], data: st.DataObject
) -> None:
    """Signed with the store's real key, so every check past the signature sees the hostile fields."""
    s = fuzz_store(tmp_path_factory)
    manifest = mutated(valid_manifest, data) if data.draw(st.booleans()) else data.draw(json_values)
    raw = json.dumps(manifest).encode()
    (s.snapshot.path / "manifest.json").write_bytes(raw)
    (s.snapshot.path / "manifest.sig").write_bytes(signature_document(s.signer, raw))
    try:
        s.store.verify(s.snapshot.id, s.verifier)
        s.store.list()
        s.store.gc(dry_run=True)
    except SnapshotError:
        tally("verifier", True)
        return
    tally("verifier", False)


_STORES: dict[str, Any] = {}


def fuzz_store(factory: pytest.TempPathFactory) -> Any:
    if "store" not in _STORES:
        _STORES["store"] = make_store(factory.mktemp("verifier"))
    return _STORES["store"]


@FUZZ
@given(content=st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode())))
def test_failure_counter_records_of_any_content(
    tmp_path_factory: pytest.TempPathFactory, content: bytes
) -> None:
    root = fuzz_store(tmp_path_factory).root
    (root / "restore-failures").mkdir(exist_ok=True)
    (root / "restore-failures" / "0123456789ab-20260101000000-abcdef.json").write_bytes(content)
    counter = FailureCounter(root)
    count = counter.count("0123456789ab-20260101000000-abcdef")
    assert (
        isinstance(count, int)
        and count >= 0
        and isinstance(counter.last_reason("0123456789ab-20260101000000-abcdef"), str)
    )
    tally("failure counter", count == 0)


@FUZZ
@given(data=st.data())
def test_identity_records_of_any_shape(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    """Signed with the real key: the record's shape is checked, not only its signature."""
    s = fuzz_store(tmp_path_factory)
    cache = IdentityCache(s.root, s.signer, s.verifier)
    spec = WorkerSpec(model="fuzz")
    key = cache.key(spec)
    record: Any = {"key": key, "identity": IDENTITY.to_dict(), "model_dir": "/nonexistent", "files": {}}
    record[data.draw(st.sampled_from(["key", "identity", "model_dir", "files", "extra"]))] = data.draw(
        json_values
    )
    if data.draw(st.booleans()):
        record = data.draw(json_values)
    raw = json.dumps(record).encode()
    cache.directory.mkdir(exist_ok=True)
    Path(cache.directory / f"{key}.json").write_bytes(raw)
    Path(cache.directory / f"{key}.sig").write_bytes(signature_document(s.signer, raw))
    identity, reason = cache.lookup(spec)
    tally("identity record", identity is None)


@pytest.mark.parametrize("model_dir", ["\x00", "/models/a\x00b", ""])
def test_an_identity_record_whose_model_dir_is_no_path_is_refused(
    tmp_path_factory: pytest.TempPathFactory, model_dir: str
) -> None:
    """Found by the test above: a NUL byte made the lookup raise ValueError instead of refusing."""
    s = fuzz_store(tmp_path_factory)
    cache = IdentityCache(s.root, s.signer, s.verifier)
    spec = WorkerSpec(model="fuzz")
    key = cache.key(spec)
    record = {"key": key, "identity": IDENTITY.to_dict(), "model_dir": model_dir, "files": {}}
    raw = json.dumps(record).encode()
    cache.directory.mkdir(exist_ok=True)
    Path(cache.directory / f"{key}.json").write_bytes(raw)
    Path(cache.directory / f"{key}.sig").write_bytes(signature_document(s.signer, raw))
    identity, reason = cache.lookup(spec)
    assert identity is None and "model_dir" in reason


def test_a_valid_manifest_is_accepted(valid_manifest: dict[str, Any]) -> None:
    assert Manifest.from_dict(valid_manifest).id == valid_manifest["id"]
