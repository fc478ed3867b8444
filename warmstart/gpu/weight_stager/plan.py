"""The staging plan: what a stager copies where in the engine's weight range, written by the engine at
capture and checked before the stager follows it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

RANGE_SLACK_BYTES = 1 << 29  # allocation granularity and more: how far the range may reach past the copies
MAX_SEGMENTS = 250  # descriptors in one message (the kernel takes at most 253)

Copy = tuple[str, int, int, int]  # file, offset in the file, offset in the weight range, bytes


@dataclass(frozen=True)
class StagingPlan:
    """What to put where, in the engine's weight range on one GPU."""

    device_index: int  # the engine's CUDA ordinal; `device_uuid`, when known, decides
    range_bytes: int  # the engine's weight range, rounded up to the allocation granularity
    copies: tuple[Copy, ...]
    device_uuid: str = ""  # the same GPU in the stager's process, whatever its ordinal there
    # When set, the range is these allocations end to end, each handed over on its own: memory the engine
    # keeps after the copies (vLLM's KV cache), so the range may reach far past the copies.
    segments: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> StagingPlan:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StagingPlan:
        """A plan from its dict form; ValueError (or KeyError/TypeError) names what is wrong."""
        copies = tuple((str(p), int(f), int(a), int(n)) for p, f, a, n in data["copies"])
        uuid = str(data.get("device_uuid", ""))
        segments = tuple(int(size) for size in data.get("segments", ()))
        plan = cls(int(data["device_index"]), int(data["range_bytes"]), copies, uuid, segments)
        plan.check()
        return plan

    def check(self) -> None:
        if not self.copies:
            raise ValueError("staging plan: no copies")
        for path, file_offset, offset, nbytes in self.copies:
            if not path.startswith("/"):
                raise ValueError(f"staging plan: {path!r} is not an absolute path")
            if file_offset < 0 or offset < 0 or nbytes <= 0 or offset + nbytes > self.range_bytes:
                raise ValueError(
                    f"staging plan: copy of {nbytes} bytes from {path} to {offset} is out of range"
                )
        if self.segments:
            self._check_segments()
            return
        end = max(offset + nbytes for _, _, offset, nbytes in self.copies)
        if self.range_bytes > end + RANGE_SLACK_BYTES:
            raise ValueError(f"staging plan: a range of {self.range_bytes} bytes for {end} bytes of copies")

    def _check_segments(self) -> None:
        if len(self.segments) > MAX_SEGMENTS or min(self.segments) <= 0:
            raise ValueError(f"staging plan: {len(self.segments)} segments (1 to {MAX_SEGMENTS}, none empty)")
        if sum(self.segments) != self.range_bytes:
            raise ValueError(
                f"staging plan: segments of {sum(self.segments)} bytes for a range of {self.range_bytes}"
            )

    @property
    def copied_bytes(self) -> int:
        """The bytes the copies fill."""
        return sum(nbytes for _, _, _, nbytes in self.copies)

    @property
    def allocations(self) -> tuple[int, ...]:
        """The sizes of the allocations the range is made of, in order."""
        return self.segments or (self.range_bytes,)
