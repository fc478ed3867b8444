"""Tensor parallelism for the builtin engine: one process per rank, all in the engine process's tree.

Each rank holds a slice of every layer (its share of the query and KV heads, of the MLP's intermediate
width; the embeddings, norms and output head whole) and the two partial sums of a layer (after the
attention output and after the MLP's down projection) are added over ranks with `all_reduce`. Rank 0 is the
engine process: it runs the scheduler, and before each model call sends the call over a pipe to the other
ranks, which make the same call on their slices; their logits are the same and go unused.

Around a checkpoint every rank leaves its process group (`leave`): no communicator, no socket stays open,
only the pipes join the ranks, and CRIU dumps and restores them as one tree (the agent CUDA-checkpoints every
rank's process, all or none). After resume rank 0 names a new rendezvous (a file store: the ranks share a
machine) and all ranks join it again (`rejoin`). Backend: gloo on CPU, NCCL on CUDA (rank r on cuda:r).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import weakref
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

from warmstart.engines.base import EngineError
from warmstart.engines.builtin.model import KVCache, Transformer, kv_nbytes
from warmstart.engines.builtin.shapes import ModelConfig

log = logging.getLogger(__name__)

GROUP_TIMEOUT = timedelta(seconds=120)
# Tensors split by output rows (their rank's heads or MLP columns) and by input columns (the matching slice
# of what they read); every other tensor is whole on every rank.
ROW_SPLIT = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight")  # fmt: skip
COLUMN_SPLIT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The model one rank of `size` computes: its share of the heads and of the MLP's width."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(config, name) % size:
            raise EngineError(f"tensor parallel size {size} does not divide the model's {name} "
                              f"({getattr(config, name)})")  # fmt: skip
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // size,
        num_key_value_heads=config.num_key_value_heads // size,
        intermediate_size=config.intermediate_size // size,
    )


def shard_weights(weights: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s slices of a whole model's tensors (copies, contiguous)."""
    shards = {}
    for name, tensor in weights.items():
        if name.endswith(ROW_SPLIT):
            tensor = tensor.chunk(size, dim=0)[rank]
        elif name.endswith(COLUMN_SPLIT):
            tensor = tensor.chunk(size, dim=1)[rank]
        shards[name] = tensor.contiguous()
    return shards


def all_reduce(partial: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(partial)
    return partial


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def join(store: str, rank: int, size: int, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=size,
                            timeout=GROUP_TIMEOUT)  # fmt: skip


def leave() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def send(pipe: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message)
    pipe.write(struct.pack("<I", len(data)) + data)
    pipe.flush()


def receive(pipe: BinaryIO) -> Any:
    head = pipe.read(4)
    if len(head) < 4:
        raise EOFError("the other rank closed its pipe")
    (length,) = struct.unpack("<I", head)
    return pickle.loads(pipe.read(length))


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """What a follower rank needs to build its slice of the model (sent over its pipe at start)."""

    model_dir: str
    rank: int
    size: int
    device: str
    max_len: int
    slots: int


class ParallelModel(Transformer):
    """Rank 0's model: its slice of the whole, and the other ranks following each call over their pipes."""

    def __init__(self, config: ModelConfig, device: torch.device, max_len: int, spec: RankSpec) -> None:
        super().__init__(config, device, max_len, reduce=all_reduce)
        self.size = spec.size
        self._spec = spec
        self._followers: list[tuple[subprocess.Popen[bytes], BinaryIO, BinaryIO]] = []
        self._rendezvous = Path(tempfile.mkdtemp(prefix="warmstart-tp-"))
        # Removed at close, or at exit when the engine is never closed.
        self._remove_rendezvous = weakref.finalize(self, shutil.rmtree, self._rendezvous, ignore_errors=True)
        self._round = 0
        self.joined = False

    def bind(self, weights: dict[str, torch.Tensor]) -> None:
        super().bind(shard_weights(weights, 0, self.size))

    def start(self) -> None:
        """Start ranks 1..size-1, wait for each to hold its slice, and join the group with them."""
        for rank in range(1, self.size):
            self._followers.append(_start_follower(dataclasses.replace(self._spec, rank=rank)))
        self._wait_all("loaded")
        self.rejoin()

    def prefill(self, token_ids: torch.Tensor, slot: int) -> torch.Tensor:
        self._tell(("prefill", token_ids.tolist(), slot))
        return super().prefill(token_ids, slot)

    def decode(self, *batch: torch.Tensor, context: int | None = None) -> torch.Tensor:
        """`Transformer.decode` on every rank; `batch` is its token ids, positions and KV slots."""
        self._tell(("decode", *(tensor.tolist() for tensor in batch), context))
        return super().decode(*batch, context)

    def leave(self) -> None:
        """Every rank leaves the group: nothing of the collectives stays open (before a checkpoint)."""
        self._tell(("leave",))
        leave()
        self._wait_all("left")
        self.joined = False

    def rejoin(self) -> None:
        """Every rank joins a new group (after start or resume), through a new file store."""
        self._round += 1
        self._rendezvous.mkdir(parents=True, exist_ok=True)  # a restored tree may run where /tmp is new
        store = self._rendezvous / f"store-{self._round}"
        store.unlink(missing_ok=True)
        self._tell(("join", str(store)))
        join(str(store), 0, self.size, self.device)
        self._wait_all("joined")
        self.joined = True

    def close(self) -> None:
        for process, commands, answers in self._followers:
            with contextlib.suppress(OSError):
                send(commands, ("stop",))
            commands.close()
            answers.close()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._followers = []
        leave()
        self._remove_rendezvous()

    def _tell(self, message: tuple[Any, ...]) -> None:
        for process, commands, _answers in self._followers:
            try:
                send(commands, message)
            except OSError as exc:
                raise EngineError(f"tensor-parallel rank (pid {process.pid}) is gone: {exc}") from exc

    def _wait_all(self, expected: str) -> None:
        for process, _commands, answers in self._followers:
            try:
                answer = receive(answers)
            except EOFError as exc:
                raise EngineError(f"tensor-parallel rank (pid {process.pid}) exited") from exc
            if answer != expected:
                raise EngineError(f"tensor-parallel rank (pid {process.pid}): {answer}")


def _start_follower(spec: RankSpec) -> tuple[subprocess.Popen[bytes], BinaryIO, BinaryIO]:
    rank_reads, to_rank = os.pipe()  # (read end, write end)
    from_rank, rank_writes = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "warmstart.engines.builtin.parallel", str(rank_reads), str(rank_writes)],
        pass_fds=(rank_reads, rank_writes), stdin=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(rank_reads)
    os.close(rank_writes)
    commands, answers = os.fdopen(to_rank, "wb"), os.fdopen(from_rank, "rb")
    send(commands, spec)
    return process, commands, answers


def follow(commands: BinaryIO, answers: BinaryIO) -> int:
    """A follower rank: build its slice, then make every call rank 0 sends until told to stop."""
    spec: RankSpec = receive(commands)
    device = rank_device(torch.device(spec.device), spec.rank)
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL and every allocation on this rank's GPU only
        model = _load_slice(spec, device)
    except Exception as exc:  # noqa: BLE001 (rank 0 reports it; it would otherwise wait for a join)
        send(answers, f"could not load its slice of the model: {exc}")
        return 1
    send(answers, "loaded")
    while True:
        try:
            message = receive(commands)
        except EOFError:
            message = ("stop",)  # rank 0 went away
        kind = message[0]
        if kind == "prefill":
            model.prefill(torch.tensor(message[1], dtype=torch.long, device=device), message[2])
        elif kind == "decode":
            tokens, positions, slots = (
                torch.tensor(ids, dtype=torch.long, device=device) for ids in message[1:4]
            )
            model.decode(tokens, positions, slots, message[4])
        elif kind == "join":
            join(message[1], spec.rank, spec.size, device)
            send(answers, "joined")
        elif kind == "leave":
            leave()
            send(answers, "left")
        elif kind == "stop":
            leave()
            return 0


def _load_slice(spec: RankSpec, device: torch.device) -> Transformer:
    from safetensors.torch import load_file

    from warmstart.engines.digest import weight_files

    config = ModelConfig.load(Path(spec.model_dir))
    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(spec.model_dir):
        weights.update(load_file(str(path), device="cpu"))  # whole on the host, only the slice on the GPU
    local = shard_config(config, spec.size)
    model = Transformer(local, device, spec.max_len, reduce=all_reduce)
    model.bind({name: t.to(device) for name, t in shard_weights(weights, spec.rank, spec.size).items()})
    del weights
    kv = torch.empty(kv_nbytes(local, spec.slots, spec.max_len), dtype=torch.uint8, device=device)
    model.bind_kv(KVCache(kv, local, spec.slots, spec.max_len))
    return model


def main() -> int:
    logging.basicConfig(level=os.environ.get("WARMSTART_LOG_LEVEL", "INFO"))
    with os.fdopen(int(sys.argv[1]), "rb") as commands, os.fdopen(int(sys.argv[2]), "wb") as answers:
        return follow(commands, answers)


if __name__ == "__main__":
    sys.exit(main())
