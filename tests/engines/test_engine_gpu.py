"""The builtin engine on a GPU: CUDA-graph decode, memory released and re-acquired around a checkpoint."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (the `engine` extra)")

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU: torch.cuda.is_available() is False here", allow_module_level=True)

from warmstart.engines.base import GenerationRequest, SamplingParams  # noqa: E402
from warmstart.engines.builtin.engine import BuiltinEngine  # noqa: E402
from warmstart.engines.builtin.model_dir import ensure_model  # noqa: E402
from warmstart.gpu.weight_stager.stage import COPY_PATHS  # noqa: E402
from warmstart.host.cuda_driver import device_with_uuid  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _vmm_available() -> bool:
    try:
        from warmstart.gpu.arena import create_arena

        create_arena("cuda-vmm", "cuda")
    except Exception:
        return False
    return True


VMM_SKIP = pytest.mark.skipif(not _vmm_available(), reason="the cuda-vmm arena is unavailable here")
ARENAS = ["torch", pytest.param("cuda-vmm", marks=VMM_SKIP)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-models")
    return {
        "tiny": ensure_model(root / "tiny", "tiny", seed=0, device="cuda"),
        "qwen3-0.6b": ensure_model(root / "qwen3-0.6b", "qwen3-0.6b", seed=0, device="cuda"),
    }


@pytest.fixture
def make_engine(models: dict[str, Path]) -> Iterator:
    engines: list[BuiltinEngine] = []

    def make(model: str = "tiny", **options: object) -> BuiltinEngine:
        engine = BuiltinEngine(model=model, model_dir=models[model], device="cuda", **options)
        engine.load()
        engine.warm_up()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()
    torch.cuda.empty_cache()


def _greedy(prompt: str = "The GPU test", max_tokens: int = 32) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_graph_replay_matches_eager_decode(make_engine) -> None:
    engine = make_engine(max_num_seqs=4, cuda_graph_sizes=[1, 2, 4])
    assert engine._graphs is not None
    model = engine._model
    prompts = ["first prompt", "second, longer prompt", "third"]
    with torch.no_grad():
        for slot, prompt in enumerate(prompts):
            model.prefill(torch.tensor(engine.tokenizer.encode(prompt), device="cuda"), slot)
        tokens = torch.tensor([65, 66, 67], device="cuda")
        positions = torch.tensor([len(engine.tokenizer.encode(p)) for p in prompts], device="cuda")
        slots = torch.tensor([0, 1, 2], device="cuda")
        graphed = engine._decode(tokens, positions, slots).clone()  # batch 3 padded to the size-4 graph
        eager = model.decode(tokens, positions, slots, context=int(positions.max()) + 1)
    torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)


def test_cuda_logits_agree_with_cpu(make_engine, models: dict[str, Path]) -> None:
    engine = make_engine()
    cpu = BuiltinEngine(model="tiny", model_dir=models["tiny"], device="cpu")
    cpu.load()
    ids = engine.tokenizer.encode("same weights, two devices")
    with torch.no_grad():
        on_gpu = engine._model.prefill(torch.tensor(ids, device="cuda"), 0).cpu()
        on_cpu = cpu._model.prefill(torch.tensor(ids), 0)
    cpu.close()
    torch.testing.assert_close(on_gpu, on_cpu, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("arena", ARENAS)
def test_release_frees_gpu_memory_and_reacquire_restores_outputs(make_engine, arena: str) -> None:
    engine = make_engine("qwen3-0.6b", arena=arena, release_weights=True, max_model_len=1024, max_num_seqs=4)
    before = engine.generate([_greedy()])[0].token_ids
    addresses = engine._memory.addresses()
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    assert engine.release() is True
    free_released, _ = torch.cuda.mem_get_info()
    weights = engine._memory.weights.nbytes
    assert free_released - free_before >= 0.9 * weights, "releasing must hand the weights' memory back"
    started = time.perf_counter()
    engine.reacquire()
    elapsed = time.perf_counter() - started
    print(f"\n[{arena}] reacquire of {weights / 1e9:.2f} GB weights + KV: {elapsed:.3f} s")
    if engine._memory.weights.keeps_address:
        assert engine._memory.addresses() == addresses
        assert engine._graphs.captures == 1, "graphs over unmoved memory must not be captured again"
    else:
        assert engine._graphs.captures == (1 if engine._memory.addresses() == addresses else 2)
    assert engine.generate([_greedy()])[0].token_ids == before


def test_batched_generation_on_qwen3_shapes(make_engine) -> None:
    engine = make_engine("qwen3-0.6b", max_model_len=1024, max_num_seqs=8)
    requests = [_greedy(f"request {i}", max_tokens=16 + i) for i in range(8)]
    started = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - started
    assert [len(result.token_ids) for result in results] == [16 + i for i in range(8)]
    print(f"\n8 requests, {sum(16 + i for i in range(8))} tokens in {elapsed:.3f} s")


@pytest.mark.spawns
def test_compiled_decode_matches_eager(make_engine) -> None:
    engine = make_engine(compile=True, max_num_seqs=2, cuda_graph_sizes=[1, 2])
    plain = make_engine(max_num_seqs=2, cuda_graph_sizes=[1, 2])
    compiled_tokens = engine.generate([_greedy(max_tokens=16)])[0].token_ids
    assert compiled_tokens == plain.generate([_greedy(max_tokens=16)])[0].token_ids


def _start_stager(
    plan_json: str, tmp_path: Path, copy: str = COPY_PATHS[0]
) -> tuple[subprocess.Popen[bytes], Path]:
    plan = tmp_path / "plan.json"
    plan.write_text(plan_json)
    socket_path = tmp_path / "stager.sock"
    command = [sys.executable, "-m", "warmstart.gpu.weight_stager", "--plan", str(plan), "--copy", copy]
    return subprocess.Popen([*command, "--socket", str(socket_path)], cwd=REPO), socket_path


@pytest.mark.spawns
@VMM_SKIP
@pytest.mark.parametrize("copy", COPY_PATHS)
def test_weights_staged_by_another_process_serve_the_same_outputs(
    make_engine, tmp_path: Path, copy: str
) -> None:
    engine = make_engine(
        "qwen3-0.6b", arena="cuda-vmm", release_weights=True, max_model_len=1024, max_num_seqs=4
    )
    before = engine.generate([_greedy()])[0].token_ids
    addresses = engine._memory.addresses()
    assert engine.release() is True
    plan = engine.weight_staging_plan()
    assert plan is not None and plan.range_bytes >= engine._memory.weights.nbytes
    assert device_with_uuid(plan.device_uuid) == plan.device_index  # the stager finds the GPU by its UUID
    stager, socket_path = _start_stager(plan.to_json(), tmp_path, copy)
    engine.expect_staged_weights(socket_path)
    engine.reacquire()
    assert stager.wait(timeout=60) == 0
    assert engine.last_refill_stats["staged"] is True, "the weights must come from the stager, not a refill"
    assert engine.last_refill_stats["copy"] == copy, "every piece copied the way asked (none fell back)"
    assert engine._memory.addresses() == addresses and engine._graphs.captures == 1
    # the stager has exited: its memory lives on through the engine's mapping
    assert engine.generate([_greedy()])[0].token_ids == before
    free_before, _ = torch.cuda.mem_get_info()
    engine.release()  # and goes back to the driver when the engine lets go
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after - free_before >= 0.9 * engine._memory.weights.nbytes


@pytest.mark.spawns
@VMM_SKIP
def test_a_failing_stager_leaves_the_engine_to_refill(make_engine, tmp_path: Path) -> None:
    engine = make_engine("tiny", arena="cuda-vmm", release_weights=True)
    before = engine.generate([_greedy()])[0].token_ids
    engine.release()
    plan = engine.weight_staging_plan()
    broken = plan.to_json().replace(str(engine.model_dir), str(tmp_path / "gone"))  # files that are not there
    stager, socket_path = _start_stager(broken, tmp_path)
    engine.expect_staged_weights(socket_path)
    engine.reacquire()
    assert stager.wait(timeout=60) == 1
    assert not engine.last_refill_stats.get("staged")
    assert engine.generate([_greedy()])[0].token_ids == before


@pytest.mark.spawns
@VMM_SKIP
def test_a_stager_hands_over_allocations_of_the_planned_sizes_that_outlive_it(tmp_path: Path) -> None:
    """vLLM's KV cache as the stager's block: the stager allocates the planned segments, fills the copies
    across them, and hands over one descriptor each; the engine's view shows the bytes, and the handles it
    takes over keep the memory (mapped anywhere) after the view and the stager are gone."""
    from warmstart.gpu.cuda_arena import VmmRange, allocation_granularity, imported_block, read_write_access
    from warmstart.gpu.weight_stager.client import acknowledge, receive_staged_weights
    from warmstart.gpu.weight_stager.plan import StagingPlan
    from warmstart.host.cuda_driver import check, driver

    granule = allocation_granularity(0)
    payload = bytes(range(256)) * (3 * granule // 256)  # spans the first two segments and part of the third
    (tmp_path / "w.bin").write_bytes(payload)
    segments = (granule, granule, 2 * granule)
    plan = StagingPlan(0, sum(segments), ((str(tmp_path / "w.bin"), 0, 0, len(payload)),), "", segments)
    stager, socket_path = _start_stager(plan.to_json(), tmp_path)
    fds, report = receive_staged_weights(socket_path, timeout=60)
    try:
        assert len(fds) == len(segments) and report["bytes"] == len(payload)
        with imported_block(0, fds, segments) as block:
            assert bytes(block.tensor[: len(payload)].cpu().numpy()) == payload
            handles = block.take_handles()
    finally:
        for fd in fds:
            os.close(fd)
        acknowledge(report)
    assert stager.wait(timeout=60) == 0
    cu = driver()
    third = VmmRange(0, segments[2], backed=False)
    try:
        check(cu.cuMemMap(third.address, segments[2], 0, handles[2], 0), "cuMemMap")
        check(cu.cuMemSetAccess(third.address, segments[2], [read_write_access(0)], 1), "cuMemSetAccess")
        out = (ctypes.c_ubyte * granule)()
        check(cu.cuMemcpyDtoH(out, third.address, granule), "cuMemcpyDtoH")
        assert bytes(out) == payload[2 * granule : 3 * granule]
        check(cu.cuMemUnmap(third.address, segments[2]), "cuMemUnmap")
    finally:
        for handle in handles:
            cu.cuMemRelease(handle)
        third.free()
