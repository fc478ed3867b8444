"""This machine's worker identities, learnt from cold starts and signed with the store's key."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from warmstart import __version__
from warmstart.host.fileio import UnsafeInput, directory_fd, loads_json, read_regular_file, write_atomic
from warmstart.serve.worker_spec import WorkerSpec

if TYPE_CHECKING:
    from warmstart.api.identity import SnapshotIdentity
    from warmstart.snapshot.signing import Signer, Verifier
    from warmstart.snapshot.store import SnapshotStore


IDENTITIES_DIR = "identities"
MAX_RECORD_BYTES = 4 << 20
MAX_SIGNATURE_BYTES = 64 << 10


class RecordRefused(Exception):
    """An identity record that is not trusted: unsigned, forged, malformed, or recorded under another key."""


class IdentityCache:
    """This machine's worker identities, learnt from cold starts, so a restore need not load the engine.

    A worker's identity is only known once its engine has loaded (model digest, resolved engine arguments),
    which is the cost a restore avoids. So each capture records the identity its worker reported, keyed by
    everything that identity derives from and that is cheap to read here: engine, model, device, worker
    arguments, Python's version, where and when torch and vLLM were installed and their version files,
    warmstart's version and its own source files, NVIDIA driver and GPU model, the image name; and the model
    files' sizes and mtimes. Any change there is a miss, and a miss is a cold start that records afresh.
    Entries are signed with the store's key, like manifests, and name their key inside the signed bytes: a
    record copied over another key's file name is refused.

    The record is written after the snapshot is published, and the snapshot's meta names the key too, so a
    start that finds no record (the last one died in between) recovers it from the published snapshot.
    """

    def __init__(self, store_root: Path, signer: Signer, verifier: Verifier) -> None:
        self.store_root = Path(store_root)
        self.directory = self.store_root / IDENTITIES_DIR
        self.signer = signer
        self.verifier = verifier

    @staticmethod
    def key(spec: WorkerSpec) -> str:
        facts = {
            "engine": spec.engine, "model": spec.model, "device": spec.device, "args": spec.extra_args,
            "python": sys.version, "torch": _package_fingerprint("torch"),
            "vllm": _package_fingerprint("vllm"),
            "warmstart": __version__, "nvidia": _nvidia_facts(),
            "image": os.environ.get("WARMSTART_IMAGE", ""), "cache": os.environ.get("WARMSTART_CACHE", ""),
            "code": _code_fingerprint(),
        }  # fmt: skip
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()

    def record(self, spec: WorkerSpec, identity: SnapshotIdentity, model_dir: str) -> None:
        self._write(self.key(spec), identity, model_dir)

    def _write(self, key: str, identity: SnapshotIdentity, model_dir: str) -> None:
        from warmstart.snapshot.signing import signature_document

        entry = {
            "key": key,
            "identity": identity.to_dict(),
            "model_dir": model_dir,
            "files": _fingerprint(model_dir),
        }
        data = json.dumps(entry, sort_keys=True).encode()
        with directory_fd(self.store_root, IDENTITIES_DIR, create=True) as fd:
            write_atomic(Path(f"{key}.json"), data, dir_fd=fd)
            write_atomic(Path(f"{key}.sig"), signature_document(self.signer, data), dir_fd=fd)

    def lookup(self, spec: WorkerSpec) -> tuple[SnapshotIdentity | None, str]:
        """The identity a worker of `spec` has here, or None with the reason."""
        key = self.key(spec)
        try:
            entry = self._read_verified(key)
            identity = _identity_of(entry)
        except FileNotFoundError:
            return None, "no earlier start of this engine, model, device and software here"
        except RecordRefused as exc:
            return None, f"the recorded identity {self.directory / key}.json is not trusted: {exc}"
        if _fingerprint(entry["model_dir"]) != entry["files"]:
            return None, f"the model files in {entry['model_dir']} changed since the last capture"
        return identity, ""

    def _read_verified(self, key: str) -> dict[str, Any]:
        """The signed record stored under `key`; FileNotFoundError, or RecordRefused saying why not."""
        from warmstart.snapshot.signing import SignatureInvalid, verify_document

        try:
            with directory_fd(self.store_root, IDENTITIES_DIR) as fd:
                data = read_regular_file(f"{key}.json", MAX_RECORD_BYTES, dir_fd=fd)
                signature = read_regular_file(f"{key}.sig", MAX_SIGNATURE_BYTES, dir_fd=fd)
            verify_document(self.verifier, data, signature)
            entry = loads_json(data, "the identity record")
        except FileNotFoundError:
            raise
        except (OSError, UnsafeInput, SignatureInvalid) as exc:
            raise RecordRefused(str(exc)) from exc
        if not isinstance(entry, dict) or entry.get("key") != key:
            raise RecordRefused("it was recorded for another worker (its signed key differs from its name)")
        if not _is_path(entry.get("model_dir")) or not isinstance(entry.get("files"), dict):
            raise RecordRefused("it lacks 'model_dir' (a path) or 'files'")
        return entry

    def recover(self, spec: WorkerSpec, store: SnapshotStore) -> tuple[SnapshotIdentity | None, str]:
        """The identity from the newest signed snapshot captured for `spec`, recorded again; else None."""
        from warmstart.snapshot.manifest import SnapshotError

        key = self.key(spec)
        try:
            snapshots = store.list(verifier=self.verifier)  # signed with this key, checked before parsing
        except (SnapshotError, OSError):
            return None, ""
        for snapshot in snapshots:
            if snapshot.record.identity_cache_key != key:
                continue
            model_dir = snapshot.record.worker.model_dir
            if not _is_path(model_dir) or _changed_since(model_dir, snapshot.created.timestamp()):
                continue
            note = f"identity recovered from snapshot {snapshot.id} (its record was missing)"
            try:
                self._write(key, snapshot.identity, model_dir)
            except (OSError, UnsafeInput) as exc:
                note += f"; it could not be recorded again ({exc})"
            return snapshot.identity, note
        return None, ""


def _identity_of(entry: dict[str, Any]) -> SnapshotIdentity:
    from warmstart.api.identity import SnapshotIdentity

    try:
        return SnapshotIdentity.from_dict(entry["identity"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RecordRefused(f"its 'identity' is not an identity ({exc})") from exc


def _is_path(value: Any) -> bool:
    """A string the OS can take as a path (a NUL byte makes every call raise ValueError, not OSError)."""
    return isinstance(value, str) and bool(value) and "\0" not in value


def _changed_since(model_dir: str, timestamp: float) -> bool:
    """Whether a model file was modified after `timestamp` (or the directory cannot be read)."""
    files = _fingerprint(model_dir)
    return not files or any(mtime_ns / 1e9 > timestamp for _, mtime_ns in files.values())


def _code_fingerprint() -> str:
    """Sizes and mtimes of warmstart's own modules: an edited checkout is another worker image."""
    package = Path(__file__).resolve().parents[1]  # the warmstart package
    entries = []
    for path in package.rglob("*.py"):
        info = path.stat()
        entries.append((str(path.relative_to(package)), info.st_size, info.st_mtime_ns))
    return hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()


def _package_fingerprint(name: str) -> str:
    """Where the package `name` is installed, when, and its version file's text; empty when it is not.

    Found without importing it, nor `importlib.metadata` (whose import alone takes tens of milliseconds,
    paid by every restore's command): a reinstall or an upgrade writes new files, so either shows."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return ""
    origin = Path(spec.origin)
    parts = [str(origin), str(origin.stat().st_mtime_ns)]
    for version_file in ("version.py", "_version.py"):
        with contextlib.suppress(OSError):
            parts.append((origin.parent / version_file).read_text()[:4096])
    return "\n".join(parts)


def _nvidia_facts() -> str:
    """Driver version and GPU models from /proc (empty without an NVIDIA driver)."""
    parts = []
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/driver/nvidia/version").read_text().splitlines()[0])
    with contextlib.suppress(OSError):
        for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
            parts += [line for line in info.read_text().splitlines() if line.startswith("Model:")]
    return "\n".join(parts)


def _fingerprint(model_dir: str) -> dict[str, list[int]]:
    """Name -> [size, mtime_ns] of every file in the model directory (not recursive)."""
    found: dict[str, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir(model_dir):
            if entry.is_file() and not entry.name.startswith("."):
                info = entry.stat()
                found[entry.name] = [info.st_size, info.st_mtime_ns]
    return found
