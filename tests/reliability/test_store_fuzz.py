"""Property-based fuzzing of what the store parses: manifests, signatures, state files, and the verifier on
signed manifests of any shape. Every input is accepted as valid or refused with the store's own error type,
never another exception. Example counts are fixed and there is no deadline: bounded, not timed."""

from __future__ import annotations

import base64
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_store_hostile import IDENTITY, make_store

from warmstart.checkpoint.restore import FailureCounter
from warmstart.host.fileio import UnsafeInput, loads_json
from warmstart.serve.identity_cache import IdentityCache
from warmstart.serve.worker_spec import WorkerSpec
from warmstart.snapshot.manifest import Manifest, SnapshotError, SnapshotInvalid
from warmstart.snapshot.signing import SignatureInvalid, Signer, Verifier, signature_document, verify_document
from warmstart.snapshot.signing_keys import signing_keys

pytestmark = pytest.mark.reliability
EXAMPLES = 300
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
TRIED: Counter[str] = Counter()
REFUSED: Counter[str] = Counter()
ACCEPTED: Counter[str] = Counter()  # genuine documents accepted (every other one must be refused)
SIGNED = b"data"

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
                genuine = f" ({ACCEPTED[kind]} genuine, accepted)" if kind in ACCEPTED else ""
                counts = f"{TRIED[kind]} inputs tried, {REFUSED[kind]} refused{genuine}"
                reporter.write_line(f"fuzz {kind}: {counts}, no other error")


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


def accepted(verifier: Verifier, document: bytes) -> bool:
    """Whether `verify_document` takes `document` as a signature of SIGNED by the verifier's key."""
    try:
        verify_document(verifier, SIGNED, document)
    except SignatureInvalid:
        return False
    return True


def is_genuine(document: bytes, genuine: bytes) -> bool:
    """`document` is the key's own signature document: the same JSON (Python's == takes 1 for True)."""
    try:
        parsed = json.loads(document)
    except ValueError:
        return False
    return json.dumps(parsed, sort_keys=True) == json.dumps(json.loads(genuine), sort_keys=True)


def check_verdict(verifier: Verifier, document: bytes, genuine: bytes) -> bool:
    """The oracle: the key's own signature document is accepted; any other, a forgery, is refused.
    Returns whether `document` was refused."""
    verdict = accepted(verifier, document)
    if is_genuine(document, genuine):
        assert verdict, f"the key's own signature was refused: {document!r}"
    else:
        assert not verdict, f"a forgery was accepted (a signature not made with the key): {document!r}"
    return not verdict


def tally_signature(kind: str, refused: bool) -> None:
    tally(kind, refused)
    ACCEPTED[kind] += not refused


# Well-formed signature values (base64 of any bytes, the right length among them): a forgery made of them
# passes every check of the document's shape and is refused by the cryptographic check alone.
well_formed_signatures = st.binary(max_size=64).map(lambda raw: base64.b64encode(raw).decode())


@FUZZ
@example(document=None)  # the genuine document: the verdict must be able to come out either way
@example(document=("signed by the key", b"other data"))
@given(
    document=st.one_of(
        st.none(),  # the key's own signature document of the data
        st.tuples(st.just("signed by the key"), st.binary(max_size=64)),  # ... of other bytes
        st.binary(max_size=500),
        json_values.map(lambda v: json.dumps(v).encode()),
    )
)
def test_signature_documents_of_any_shape(
    tmp_path_factory: pytest.TempPathFactory, document: bytes | tuple[str, bytes] | None
) -> None:
    signer, verifier = signature_keys(tmp_path_factory)
    genuine = signature_document(signer, SIGNED)
    if document is None:
        document = genuine
    elif isinstance(document, tuple):
        document = signature_document(signer, document[1])  # genuine only where those bytes are SIGNED
    tally_signature("signature", check_verdict(verifier, document, genuine))


@FUZZ
@example(fields={}, flipped_bit=None)  # nothing replaced: the genuine document
@example(fields={}, flipped_bit=0)
@given(
    fields=st.dictionaries(
        st.sampled_from(["algorithm", "key_id", "signature"]),
        json_values | well_formed_signatures,
        max_size=3,
    ),
    flipped_bit=st.none() | st.integers(min_value=0),
)
def test_signature_fields_of_any_type(
    tmp_path_factory: pytest.TempPathFactory, fields: dict[str, Any], flipped_bit: int | None
) -> None:
    """The key's own signature document, one bit of its signature flipped or not, with any of its fields
    replaced by any JSON: a forgery unless it comes out the same as the key's own."""
    signer, verifier = signature_keys(tmp_path_factory)
    genuine = signature_document(signer, SIGNED)
    document = json.loads(genuine)
    if flipped_bit is not None:
        signature = bytearray(base64.b64decode(document["signature"]))
        signature[flipped_bit // 8 % len(signature)] ^= 1 << flipped_bit % 8
        document["signature"] = base64.b64encode(signature).decode()
    document.update(fields)
    tally_signature("signature fields", check_verdict(verifier, json.dumps(document).encode(), genuine))


def test_the_signature_oracle_fails_a_verifier_that_takes_a_forgery_or_refuses_the_key(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two tests above can fail: with verification made to accept everything, a forgery fails the
    oracle; made to refuse everything, the key's own document does."""
    signer, verifier = signature_keys(tmp_path_factory)
    genuine = signature_document(signer, SIGNED)
    forgery = json.dumps({**json.loads(genuine), "signature": "AAAA" * 22}).encode()
    check_verdict(verifier, forgery, genuine)
    check_verdict(verifier, genuine, genuine)

    monkeypatch.setattr(sys.modules[__name__], "verify_document", lambda verifier, data, document: None)
    with pytest.raises(AssertionError, match="a forgery was accepted"):
        check_verdict(verifier, forgery, genuine)

    def refuse(verifier: Verifier, data: bytes, document: bytes) -> None:
        raise SignatureInvalid("refused whatever it is")

    monkeypatch.setattr(sys.modules[__name__], "verify_document", refuse)
    with pytest.raises(AssertionError, match="the key's own signature was refused"):
        check_verdict(verifier, genuine, genuine)


_KEYS: dict[str, tuple[Signer, Verifier]] = {}


def signature_keys(factory: pytest.TempPathFactory) -> tuple[Signer, Verifier]:
    if "key" not in _KEYS:
        signer, verifier, _ = signing_keys(factory.mktemp("key"), None)
        _KEYS["key"] = (signer, verifier)
    return _KEYS["key"]


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
    assert Manifest.from_bytes(json.dumps(valid_manifest).encode()).id == valid_manifest["id"]
