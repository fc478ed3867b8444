"""Tensor parallelism in the builtin engine on CPU: real rank processes, gloo, the same tokens as one rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from warmstart.checkpoint.cuda import process_tree
from warmstart.engines import create_engine
from warmstart.engines.base import Engine, EngineError, GenerationRequest, SamplingParams
from warmstart.engines.builtin.parallel import shard_config, shard_weights
from warmstart.engines.builtin.shapes import PRESETS

PROMPTS = ["hello world", "the snapshot restores the worker", "x"]


def greedy_tokens(engine: Engine) -> list[tuple[int, ...]]:
    greedy = SamplingParams(max_tokens=12, temperature=0)
    requests = [
        GenerationRequest(prompt=p, sampling=greedy, request_id=str(i)) for i, p in enumerate(PROMPTS)
    ]
    return [result.token_ids for result in engine.generate(requests)]


def rank_processes() -> list[int]:
    """This process's children that run a follower rank."""
    children = process_tree(os.getpid())[1:]
    return [
        pid
        for pid in children
        if b"warmstart.engines.builtin.parallel" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


@pytest.mark.spawns
def test_two_ranks_give_one_rank_s_tokens_and_survive_leaving_and_rejoining_their_group() -> None:
    tokens = {}
    for size in (1, 2):
        engine = create_engine("builtin", model="tiny", device="cpu", tensor_parallel_size=size)
        try:
            engine.load()
            engine.warm_up()
            tokens[size] = greedy_tokens(engine)
            assert len(rank_processes()) == size - 1  # the other ranks really are processes of their own
            assert engine.identity().parallelism == size
            engine.release()  # the ranks leave their group, as before a checkpoint
            engine.reacquire()  # and meet again through a new rendezvous
            assert greedy_tokens(engine) == tokens[size]
        finally:
            engine.close()
    assert tokens[2] == tokens[1]


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_them() -> None:
    with pytest.raises(EngineError, match=r"does not divide the model's num_key_value_heads \(2\)"):
        shard_config(PRESETS["tiny"], 4)
    with pytest.raises(EngineError, match="tensor_parallel_size must be a positive integer"):
        create_engine("builtin", model="tiny", tensor_parallel_size=0)
    with pytest.raises(EngineError, match="--compile is not supported"):
        create_engine("builtin", model="tiny", tensor_parallel_size=2, compile=True)


def test_slices_put_back_together_give_the_whole_tensors() -> None:
    weights = {
        "model.layers.0.self_attn.q_proj.weight": torch.arange(24.0).view(6, 4),
        "model.layers.0.self_attn.o_proj.weight": torch.arange(24.0).view(4, 6),
        "model.norm.weight": torch.ones(4),
    }
    halves = [shard_weights(weights, rank, 2) for rank in (0, 1)]
    assert torch.equal(torch.cat([h["model.layers.0.self_attn.q_proj.weight"] for h in halves], 0),
                       weights["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    assert torch.equal(torch.cat([h["model.layers.0.self_attn.o_proj.weight"] for h in halves], 1),
                       weights["model.layers.0.self_attn.o_proj.weight"])  # fmt: skip
    assert all(torch.equal(h["model.norm.weight"], weights["model.norm.weight"]) for h in halves)
