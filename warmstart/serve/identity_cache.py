"""This machine's worker identities, learnt from cold starts and signed with the store's key."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.fileio import write_atomic
from warmstart.serve.worker_spec import WorkerSpec

if TYPE_CHECKING:
    from warmstart.identity import SnapshotIdentity
    from warmstart.snapshot.signing import Signer, Verifier


class IdentityCache:
    """This machine's worker identities, learnt from cold starts, so a restore need not load the engine.

    A worker's identity is only known once its engine has loaded (model digest, resolved engine arguments),
    which is the cost a restore avoids. So each capture records the identity its worker reported, keyed by
    everything that identity derives from and that is cheap to read here: engine, model, device, worker
    arguments, Python/torch/warmstart versions and warmstart's own source files, NVIDIA driver and GPU
    model, the image name; and the model files' sizes and mtimes. Any change there is a miss, and a miss is
    a cold start that records afresh. Entries are signed with the store's key, like manifests.
    """

    def __init__(self, store_root: Path, signer: Signer, verifier: Verifier) -> None:
        self.directory = store_root / "identities"
        self.signer = signer
        self.verifier = verifier

    @staticmethod
    def key(spec: WorkerSpec) -> str:
        facts = {
            "engine": spec.engine, "model": spec.model, "device": spec.device, "args": spec.extra_args,
            "python": sys.version, "torch": _distribution_version("torch"),
            "warmstart": _distribution_version("warmstart"), "nvidia": _nvidia_facts(),
            "image": os.environ.get("WARMSTART_IMAGE", ""), "cache": os.environ.get("WARMSTART_CACHE", ""),
            "code": _code_fingerprint(),
        }  # fmt: skip
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()

    def record(self, spec: WorkerSpec, identity: SnapshotIdentity, model_dir: str) -> None:
        entry = {"identity": identity.to_dict(), "model_dir": model_dir, "files": _fingerprint(model_dir)}
        data = json.dumps(entry, sort_keys=True).encode()
        from warmstart.snapshot.signing import signature_document

        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / f"{self.key(spec)}.json"
        write_atomic(target, data)
        write_atomic(target.with_suffix(".sig"), signature_document(self.signer, data))

    def lookup(self, spec: WorkerSpec) -> tuple[SnapshotIdentity | None, str]:
        """The identity a worker of `spec` has here, or None with the reason."""
        from warmstart.identity import SnapshotIdentity
        from warmstart.snapshot.signing import SignatureInvalid, verify_document

        target = self.directory / f"{self.key(spec)}.json"
        try:
            data = target.read_bytes()
            verify_document(self.verifier, data, target.with_suffix(".sig").read_bytes())
        except FileNotFoundError:
            return None, "no earlier start of this engine, model, device and software here"
        except SignatureInvalid as exc:
            return None, f"the recorded identity {target} is not trusted: {exc}"
        entry = json.loads(data)
        if _fingerprint(entry["model_dir"]) != entry["files"]:
            return None, f"the model files in {entry['model_dir']} changed since the last capture"
        return SnapshotIdentity.from_dict(entry["identity"]), ""


def _code_fingerprint() -> str:
    """Sizes and mtimes of warmstart's own modules: an edited checkout is another worker image."""
    package = Path(__file__).resolve().parents[1]  # the warmstart package
    entries = []
    for path in package.rglob("*.py"):
        info = path.stat()
        entries.append((str(path.relative_to(package)), info.st_size, info.st_mtime_ns))
    return hashlib.sha256(json.dumps(sorted(entries)).encode()).hexdigest()


def _distribution_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


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
