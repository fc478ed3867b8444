"""What a restore pod must show before it is given a snapshot, measured cheaply by its worker.

A snapshot's identity (`identity.py`) is what the captured process *is*, measured once its engine had loaded,
which is the cost a restore avoids. So the capturing worker also records these facts (the agent signs them
into the snapshot's manifest), and each restore pod's worker measures them again as it starts, before any
engine exists, and writes them to its control directory (`restore-facts`). The node agent compares the two
before CRIU sees a byte: any difference refuses the restore, naming the fact, and the worker cold-starts;
the snapshot is not at fault and nothing is counted against it.

- the engine and its version, read from installed metadata (no engine is imported);
- the worker's engine flags (`--mode` and `--control-dir` left out: they differ by role);
- the model's files: for each, its size and a digest of sampled regions (`engines.digest.sampled_digest`).

The rule for the model's files: every byte is digested at capture (the identity's `model_digest`); each
restore re-reads a few MiB per file (its head, its tail and evenly spaced windows), whatever the model's size,
and nothing that differs between nodes (no times, no inodes). A file that changed size, or changed in any
sampled region, is caught; a same-size change confined to unsampled bytes is not.

The pod's facts come from the tenant's own worker: a worker that misreports them can only get its own
namespace's snapshot (which it may have anyway) or a cold start. They are checked, never trusted further.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_FILES = 4096
MAX_TEXT = 4096


class FactsInvalid(ValueError):
    """The facts are not what a worker writes (wrong types, too large)."""


@dataclass(frozen=True)
class RestoreFacts:
    engine: str
    engine_version: str
    worker_args: tuple[str, ...]
    model_dir: str
    model_files: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (size, sampled digest)
    error: str = ""  # why the worker could not measure them (e.g. its model files are missing)

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "engine_version": self.engine_version,
            "worker_args": list(self.worker_args),
            "model_dir": self.model_dir,
            "model_files": {name: list(entry) for name, entry in sorted(self.model_files.items())},
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: Any) -> RestoreFacts:
        """Facts from JSON a worker wrote; FactsInvalid naming what is wrong."""
        if not isinstance(data, dict):
            raise FactsInvalid("the facts are not a JSON object")
        args = data.get("worker_args")
        if not isinstance(args, list) or len(args) > MAX_FILES or not all(_is_text(a) for a in args):
            raise FactsInvalid("worker_args is not a list of strings")
        files = data.get("model_files")
        if not isinstance(files, dict) or len(files) > MAX_FILES:
            raise FactsInvalid(f"model_files is not an object of at most {MAX_FILES} files")
        return cls(
            engine=_text(data, "engine"),
            engine_version=_text(data, "engine_version"),
            worker_args=tuple(args),
            model_dir=_text(data, "model_dir"),
            model_files={name: _file_entry(name, entry) for name, entry in files.items()},
            error=_text(data, "error"),
        )

    def mismatches(self, pod: RestoreFacts) -> list[str]:
        """What the restore pod shows differently from the capture (self), one line per fact; empty: none."""
        if pod.error:
            return [f"the pod's worker could not measure its model files: {pod.error}"]
        found = [
            f"{name}: the snapshot has {mine!r}, the pod has {theirs!r}"
            for name, mine, theirs in (
                ("engine", self.engine, pod.engine),
                ("engine version", self.engine_version, pod.engine_version),
                ("worker flags", " ".join(self.worker_args), " ".join(pod.worker_args)),
            )
            if mine != theirs
        ]
        if changed := self.changed_files(pod):
            found.append(f"model {pod.model_dir or self.model_dir}: {', '.join(changed)} since the snapshot")
        return found

    def changed_files(self, pod: RestoreFacts) -> list[str]:
        """The model files that differ, each with how."""
        changes = []
        for name in sorted(self.model_files.keys() | pod.model_files.keys()):
            mine, theirs = self.model_files.get(name), pod.model_files.get(name)
            if theirs is None:
                changes.append(f"{name} is missing")
            elif mine is None:
                changes.append(f"{name} was added")
            elif mine[0] != theirs[0]:
                changes.append(f"{name} changed size ({mine[0]} -> {theirs[0]} bytes)")
            elif mine[1] != theirs[1]:
                changes.append(f"{name} changed content")
        return changes


def _is_text(value: Any) -> bool:
    return isinstance(value, str) and len(value) <= MAX_TEXT


def _text(data: dict[str, Any], key: str) -> str:
    value = data.get(key, "")
    if not _is_text(value):
        raise FactsInvalid(f"{key} is not a string of at most {MAX_TEXT} characters")
    return value


def _file_entry(name: Any, entry: Any) -> tuple[int, str]:
    if not _is_text(name) or not name:
        raise FactsInvalid("a model file name is not a string")
    valid = (
        isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], int)
        and not isinstance(entry[0], bool)
        and entry[0] >= 0
        and _is_text(entry[1])
    )
    if not valid:
        raise FactsInvalid(f"model file {name!r} is not [size, digest]")
    return entry[0], entry[1]
