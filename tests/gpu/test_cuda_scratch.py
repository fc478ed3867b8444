"""The CUDA-graph scratch pool on a real GPU: released memory goes back to the driver, graphs replay after."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _free_device_bytes() -> int:
    import torch

    torch.cuda.synchronize()
    free, _total = torch.cuda.mem_get_info()
    return free


def _captured_chain(pool_id: object):
    """A graph of 8 matmuls over a 2048-wide input; its intermediates (~64 MiB) live in the given pool.

    Captured on the stream it was warmed up on, as the engine does: cuBLAS's per-stream workspace, which
    outlives the graph's replays, is then allocated outside the pool.
    """
    import torch

    generator = torch.Generator(device="cuda").manual_seed(3)
    weights = [torch.randn(2048, 2048, device="cuda", generator=generator) / 45 for _ in range(8)]
    x = torch.randn(1024, 2048, device="cuda", generator=generator)

    def forward() -> torch.Tensor:
        h = x
        for w in weights:
            h = torch.tanh(h @ w) + 0.5 * h  # keeps a few intermediates alive at once
        return h

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool_id, stream=side):
        out = forward()
    torch.cuda.current_stream().wait_stream(side)
    graph.inputs = (weights, x)  # the graph reads them by address: they must outlive it
    return graph, out


def test_release_gives_memory_back_and_graph_replays_identically(gpu: None) -> None:
    import torch

    from warmstart.gpu.cuda_scratch import CudaScratchPool

    scratch = CudaScratchPool("cuda")
    graph, out = _captured_chain(scratch.id)
    graph.replay()
    expected = out.clone()
    assert scratch.nbytes >= out.numel() * out.element_size()
    address = out.data_ptr()

    before = _free_device_bytes()
    freed = scratch.release()
    after = _free_device_bytes()
    assert freed == scratch.nbytes
    assert after - before >= freed  # the driver got the physical memory back
    assert scratch.released

    scratch.reacquire()
    assert not scratch.released
    out.fill_(float("nan"))  # fresh memory holds garbage until a replay writes it
    graph.replay()
    torch.cuda.synchronize()
    assert out.data_ptr() == address
    assert torch.equal(out, expected)


def test_graphs_sharing_the_pool_survive_two_cycles(gpu: None) -> None:
    import torch

    from warmstart.gpu.cuda_scratch import CudaScratchPool

    scratch = CudaScratchPool("cuda")
    first, out_first = _captured_chain(scratch.id)
    second, out_second = _captured_chain(scratch.id)
    first.replay()
    second.replay()
    expected = (out_first.clone(), out_second.clone())
    for _ in range(2):
        scratch.release()
        scratch.reacquire()
        first.replay()
        second.replay()
        torch.cuda.synchronize()
        assert torch.equal(out_first, expected[0])
        assert torch.equal(out_second, expected[1])


def test_builtin_engine_answers_identically_after_releasing_its_scratch(gpu: None, tmp_path) -> None:
    from warmstart.engines.base import GenerationRequest, SamplingParams
    from warmstart.engines.builtin.engine import BuiltinEngine

    engine = BuiltinEngine(
        model="tiny", model_dir=tmp_path / "tiny", device="cuda", max_num_seqs=4, release_weights=True
    )
    engine.load()
    engine.warm_up()
    requests = [
        GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=12, ignore_eos=True))
        for prompt in ("scratch pools", "hold nothing", "worth keeping")
    ]
    before = [result.token_ids for result in engine.generate(requests)]
    assert engine.describe()["graph_scratch_bytes"] > 0
    engine.release()
    engine.reacquire()
    after = [result.token_ids for result in engine.generate(requests)]
    engine.close()
    assert after == before
