"""Arenas: one flat byte buffer per device that tensors are views of.

Keeping all weights (or the whole KV cache) in one buffer with a known layout lets an engine drop the
memory before a checkpoint and get it back after a resume without rebuilding its model:
`release()` frees the bytes, `reacquire()` gets fresh bytes (at the same address where the backend can, so
captured CUDA graphs stay valid), and the owner refills them.

Backends: `TorchArena` (CPU and plain CUDA through torch's allocator; a reacquire may move the buffer) and,
on CUDA, a virtual-memory arena in `warmstart.gpu.cuda_arena` that keeps its virtual address.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


class ArenaReleasedError(RuntimeError):
    """The arena's memory was released; call `reacquire()` first."""


@runtime_checkable
class Arena(Protocol):
    """A flat uint8 buffer on one device whose memory can be given back and taken again."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        """Reserve and back `nbytes`; returns the flat uint8 tensor. Called once."""

    def release(self) -> None:
        """Free the memory; views of the old tensor must no longer be used."""

    def reacquire(self) -> torch.Tensor:
        """Back the arena with memory again (contents undefined) and return the tensor."""

    @property
    def tensor(self) -> torch.Tensor:
        """The live buffer; raises ArenaReleasedError while released."""

    @property
    def nbytes(self) -> int: ...

    @property
    def released(self) -> bool: ...

    @property
    def keeps_address(self) -> bool:
        """True when `reacquire()` always returns memory at the address it had before."""


class TorchArena:
    """An arena backed by one torch allocation. A reacquire may return a different address."""

    keeps_address = False

    def __init__(self, device: str | torch.device = "cpu") -> None:
        import torch

        self.device = torch.device(device)
        self._nbytes = 0
        self._tensor: torch.Tensor | None = None

    def allocate(self, nbytes: int) -> torch.Tensor:
        if nbytes < 0:
            raise ValueError(f"arena size must be >= 0, got {nbytes}")
        if self._nbytes or self._tensor is not None:
            raise RuntimeError("arena already allocated; use release()/reacquire() to cycle its memory")
        self._nbytes = nbytes
        return self.reacquire()

    def release(self) -> None:
        self._tensor = None
        if self.device.type == "cuda":
            import torch

            # Give the cached blocks back to the driver, else a GPU checkpoint still carries them.
            torch.cuda.empty_cache()

    def reacquire(self) -> torch.Tensor:
        import torch

        if self._tensor is None:
            self._tensor = torch.empty(self._nbytes, dtype=torch.uint8, device=self.device)
        return self._tensor

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ArenaReleasedError(f"the {self.device} arena is released; call reacquire() first")
        return self._tensor

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def released(self) -> bool:
        return self._tensor is None


def create_arena(kind: str, device: str | torch.device) -> Arena:
    """Build an arena backend by name (`torch`, or `cuda-vmm` on CUDA)."""
    if kind == "torch":
        return TorchArena(device)
    if kind == "cuda-vmm":
        from warmstart.gpu.cuda_arena import CudaVmmArena

        return CudaVmmArena(device)
    raise ValueError(f"unknown arena {kind!r}; choose one of: cuda-vmm, torch")


def round_up(value: int, multiple: int) -> int:
    """`value` rounded up to a multiple of `multiple` (an alignment or an allocation granularity)."""
    return (value + multiple - 1) // multiple * multiple
