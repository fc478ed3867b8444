"""The builtin engine on CPU with the tiny preset: determinism, batching, release/reacquire, validation."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="needs torch (the `engine` extra)")

from warmstart.engines import ENGINE_FACTORIES, create_engine  # noqa: E402
from warmstart.engines.base import EngineError, GenerationRequest, RequestError, SamplingParams  # noqa: E402
from warmstart.engines.builtin.model_dir import ensure_model  # noqa: E402
from warmstart.engines.builtin.shapes import PRESETS, preset, tensor_shapes  # noqa: E402
from warmstart.engines.digest import DIGEST_SIDECAR, model_digest  # noqa: E402

PROMPT = "The quick brown fox"


def greedy(prompt: str = PROMPT, max_tokens: int = 24, **extra: object) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens, **extra))


def test_registry_names_the_known_engines() -> None:
    assert "builtin" in ENGINE_FACTORIES
    with pytest.raises(ValueError, match="unknown engine 'nope'; choose one of: builtin"):
        create_engine("nope")


def test_generated_weights_are_deterministic_per_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    again = ensure_model(tmp_path / "again", "tiny", seed=0)
    other = ensure_model(tmp_path / "other", "tiny", seed=1)
    assert model_digest(again) == model_digest(tiny_model_dir)
    assert model_digest(other) != model_digest(tiny_model_dir)


def test_digest_follows_the_bytes_not_the_cache(tmp_path: Path) -> None:
    model = ensure_model(tmp_path / "m", "tiny", seed=3)
    before = model_digest(model)
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert model_digest(model) != before


def test_hashing_the_files_gives_the_digest_the_writer_recorded(tmp_path: Path) -> None:
    model = ensure_model(tmp_path / "m", "tiny", seed=3)
    recorded = model_digest(model)  # from the sidecar written while the weights were generated
    (model / DIGEST_SIDECAR).unlink()
    assert model_digest(model) == recorded
    assert (model / DIGEST_SIDECAR).is_file()


@pytest.mark.parametrize(
    "sidecar",
    [b"[]", b"\xff\xfe", b'{"files": []}', b'{"files": {"model.safetensors": 7}}',
     b'{"files": {"model.safetensors": {"size": 1, "mtime_ns": 1, "sha256": ["x"]}}}'],
)  # fmt: skip
def test_a_sidecar_not_as_written_is_hashed_past_not_a_crash(tmp_path: Path, sidecar: bytes) -> None:
    model = ensure_model(tmp_path / "m", "tiny", seed=3)
    recorded = model_digest(model)
    (model / DIGEST_SIDECAR).write_bytes(sidecar)
    assert model_digest(model) == recorded  # every file hashed again, the sidecar rewritten
    assert model_digest(model) == recorded


def test_a_sidecars_hash_that_matches_the_files_sizes_and_times_is_taken(tmp_path: Path) -> None:
    """The cache is trusted for what it is: the worker's own files, the worker's own claim (the restore
    facts re-read samples of every file at each restore; the capture hashes every byte once)."""
    model = ensure_model(tmp_path / "m", "tiny", seed=3)
    recorded = model_digest(model)
    sidecar = json.loads((model / DIGEST_SIDECAR).read_text())
    sidecar["files"]["model.safetensors"]["sha256"] = "0" * 64
    (model / DIGEST_SIDECAR).write_text(json.dumps(sidecar))
    assert model_digest(model) != recorded


def test_preset_shapes_match_the_public_qwen3_configs() -> None:
    assert preset("qwen3-8b").parameter_count == pytest.approx(8.19e9, rel=0.01)
    assert preset("qwen3-0.6b").parameter_count == pytest.approx(0.596e9, rel=0.01)
    assert ("lm_head.weight", (151936, 4096)) in tensor_shapes(PRESETS["qwen3-8b"])
    with pytest.raises(ValueError, match="unknown model preset"):
        preset("qwen9")
    with pytest.raises(ValueError, match="num_key_value_heads"):
        preset("tiny", num_key_value_heads=3)


def test_prefill_and_decode_agree(make_engine) -> None:
    engine = make_engine()
    model = engine._model
    ids = torch.tensor(engine.tokenizer.encode("abcdefgh"))
    with torch.no_grad():
        whole = model.prefill(ids, slot=0)
        model.prefill(ids[:-1], slot=1)
        last = torch.tensor([len(ids) - 1])
        stepped = model.decode(ids[-1:], last, torch.tensor([1]), context=len(ids))
        stepped_full = model.decode(ids[-1:], last, torch.tensor([1]))  # the CUDA-graph shape path
    torch.testing.assert_close(stepped[0], whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(stepped_full[0], whole, rtol=1e-4, atol=1e-5)


def test_the_training_forward_agrees_with_prefill(make_engine) -> None:
    """`causal_logits` (what training the demo preset differentiates) computes what serving computes."""
    engine = make_engine()
    model = engine._model
    ids = torch.tensor(engine.tokenizer.encode("abcdefgh"))
    with torch.no_grad():
        every = model.causal_logits(torch.stack([ids, ids.flip(0)]))
        whole = model.prefill(ids, slot=0)
        shorter = model.prefill(ids[:4], slot=1)
    assert every.shape == (2, len(ids), engine.config.vocab_size)
    torch.testing.assert_close(every[0, -1], whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(every[0, 3], shorter, rtol=1e-4, atol=1e-5)


def test_greedy_is_deterministic_and_streaming_matches(make_engine) -> None:
    engine = make_engine()
    first = engine.generate([greedy(ignore_eos=True)])[0]
    second = engine.generate([greedy(ignore_eos=True)])[0]
    assert first.token_ids == second.token_ids
    assert len(first.token_ids) == 24 and first.finish_reason == "length"
    deltas = list(engine.stream(greedy(ignore_eos=True)))
    assert "".join(delta.text for delta in deltas) == first.text
    assert deltas[-1].finish_reason == "length"
    assert all(delta.finish_reason is None for delta in deltas[:-1])


def test_seeded_sampling_is_reproducible(make_engine) -> None:
    engine = make_engine()

    def sampled(seed: int) -> tuple[int, ...]:
        request = greedy(max_tokens=32, temperature=1.0, seed=seed, ignore_eos=True)
        return engine.generate([request])[0].token_ids

    assert sampled(11) == sampled(11)
    assert sampled(11) != sampled(12)


def test_release_and_reacquire_keep_outputs(make_engine) -> None:
    engine = make_engine(release_weights=True)
    before = engine.generate([greedy(ignore_eos=True)])[0]
    assert engine.release() is True
    assert engine._memory.weights.released and engine._memory.kv.released
    with pytest.raises(EngineError, match="released"):
        engine.generate([greedy()])
    engine.reacquire()
    after = engine.generate([greedy(ignore_eos=True)])[0]
    assert after.token_ids == before.token_ids


def test_prefill_attention_never_uses_cudnn(make_engine, monkeypatch) -> None:
    """cuDNN's attention plans each new sequence length: the first request at every prompt length pays it."""
    engine = make_engine()
    attention = torch.nn.functional.scaled_dot_product_attention
    cudnn_allowed: list[bool] = []

    def recording(*args, **kwargs):
        cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled())
        return attention(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        engine._model.prefill(torch.tensor(engine.tokenizer.encode("abcdefgh")), slot=0)
    assert cudnn_allowed == [False] * engine.config.num_hidden_layers
    assert torch.backends.cuda.cudnn_sdp_enabled()  # only while prefill runs


def test_garbage_in_fresh_kv_memory_never_reaches_the_output(make_engine, monkeypatch) -> None:
    """Memory a KV arena gets back is undefined (here: all 0xFF bytes, NaN in every float format). A batch
    of prompts of other lengths attends over cache positions the shorter one never wrote."""
    engine = make_engine()
    batch = [greedy("Hi", ignore_eos=True), greedy(PROMPT * 3, ignore_eos=True)]
    before = [result.token_ids for result in engine.generate(batch)]
    arena = engine._memory.kv
    reacquire = arena.reacquire

    def reacquire_with_leftovers():
        tensor = reacquire()
        tensor.view(torch.uint8).fill_(0xFF)
        return tensor

    monkeypatch.setattr(arena, "reacquire", reacquire_with_leftovers)
    engine.release()
    engine.reacquire()
    assert [result.token_ids for result in engine.generate(batch)] == before


def test_a_reacquire_that_failed_refills_the_weights_when_retried(
    make_engine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The KV cache comes back while the weights refill: a refill that fails must not leave the engine
    looking reacquired (KV mapped) with its weights still released."""
    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model_dir)
    engine = make_engine(release_weights=True, model_dir=model_dir)
    before = engine.generate([greedy(ignore_eos=True)])[0]
    engine.release()
    weights = next(model_dir.glob("*.safetensors"))
    weights.rename(weights.with_suffix(".away"))
    with pytest.raises(OSError):
        engine.reacquire()
    weights.with_suffix(".away").rename(weights)
    engine.reacquire()
    after = engine.generate([greedy(ignore_eos=True)])[0]
    assert after.token_ids == before.token_ids


def test_release_keeps_weights_unless_asked(make_engine) -> None:
    engine = make_engine()
    assert engine.release() is False
    assert not engine._memory.weights.released and engine._memory.kv.released
    engine.reacquire()
    assert engine.generate([greedy(max_tokens=2)])[0].token_ids


def test_concurrent_callers_are_all_answered(make_engine) -> None:
    engine = make_engine(max_num_seqs=4)
    prompts = [f"request number {i}" for i in range(8)]
    results: dict[int, object] = {}

    def call(index: int) -> None:
        results[index] = engine.generate([greedy(prompts[index], max_tokens=10 + index, ignore_eos=True)])[0]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(results) == list(range(8))
    assert [len(results[i].token_ids) for i in range(8)] == [10 + i for i in range(8)]


def test_batched_results_come_back_in_request_order(make_engine) -> None:
    engine = make_engine()
    requests = [greedy(f"prompt {i}", max_tokens=3 + i, ignore_eos=True) for i in range(12)]
    results = engine.generate(requests)
    assert [len(result.token_ids) for result in results] == [3 + i for i in range(12)]
    assert [result.prompt_tokens for result in results] == [len(f"prompt {i}") + 1 for i in range(12)]


def test_stop_string_cuts_the_output(make_engine) -> None:
    engine = make_engine()
    full = engine.generate([greedy(max_tokens=40, ignore_eos=True)])[0].text
    stop = full[5:7]
    cut = engine.generate([greedy(max_tokens=40, ignore_eos=True, stop=(stop,))])[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.find(stop)]
    streamed = "".join(d.text for d in engine.stream(greedy(max_tokens=40, ignore_eos=True, stop=(stop,))))
    assert streamed == cut.text


def test_invalid_requests_name_the_field(make_engine) -> None:
    engine = make_engine(max_model_len=64)
    with pytest.raises(RequestError, match="max_tokens") as error:
        engine.generate([greedy(max_tokens=100)])
    assert error.value.param == "max_tokens"
    with pytest.raises(RequestError, match="empty") as error:
        engine.generate([greedy(prompt="")])
    assert error.value.param == "prompt"
    with pytest.raises(RequestError, match="prompt has"):
        engine.generate([greedy(prompt="x" * 80)])
    with pytest.raises(RequestError, match=r"token id 260 is outside 0\.\.259") as error:
        engine.generate([GenerationRequest(prompt_token_ids=(1, 260))])
    assert error.value.param == "prompt"


def test_identity_describes_what_a_snapshot_depends_on(make_engine, tiny_model_dir: Path) -> None:
    engine = make_engine()
    identity = engine.identity()
    assert identity.engine == "builtin"
    assert identity.model_digest == model_digest(tiny_model_dir)
    assert identity.device == "cpu" and identity.dtype == "float32"
    other = make_engine(max_model_len=128).identity()
    assert other.digest() != identity.digest()
    assert any(line.startswith("engine_args") for line in identity.mismatches(other))


def test_identity_records_the_image_named_by_the_environment(
    make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WARMSTART_IMAGE", raising=False)
    assert make_engine().identity().image.startswith("python-")
    monkeypatch.setenv("WARMSTART_IMAGE", "registry.example/worker:1.2")
    assert make_engine().identity().image == "registry.example/worker:1.2"


def test_bad_options_are_clear_errors(tiny_model_dir: Path) -> None:
    with pytest.raises(EngineError, match="--device"):
        create_engine("builtin", model="tiny", model_dir=tiny_model_dir, device="tpu")
    with pytest.raises(EngineError, match="neither a preset"):
        create_engine("builtin", model="no-such-model")
    engine = create_engine("builtin", model="tiny", model_dir=tiny_model_dir, max_model_len=100_000)
    with pytest.raises(EngineError, match="max_model_len"):
        engine.load()


def test_matches_the_reference_qwen3_implementation(make_engine, tiny_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the reference Qwen3 needs transformers")
    from safetensors.torch import load_file

    engine = make_engine()
    reference = transformers.Qwen3ForCausalLM(transformers.Qwen3Config.from_pretrained(tiny_model_dir))
    reference.load_state_dict(load_file(tiny_model_dir / "model.safetensors"), strict=True)
    ids = torch.tensor([engine.tokenizer.encode("Reference check: does it agree?")])
    with torch.no_grad():
        expected = reference(ids).logits[0, -1].float()
        got = engine._model.prefill(ids[0], slot=0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.spawns
def test_compiled_decode_is_one_graph_for_every_layer_and_batch_above_one(make_engine) -> None:
    """torch.compile of the decode step: one graph serves all layers and batch sizes > 1 (a second one
    for batch 1, which torch specialises), with the same logits as the eager step."""
    import torch._dynamo

    model = make_engine()._model
    torch._dynamo.reset()
    batches = {}
    for size in (6, 3, 2, 1):
        tokens = torch.arange(size) + 40
        positions = torch.arange(size) + 2
        slots = torch.arange(size)
        with torch.no_grad():
            batches[size] = (tokens, positions, slots, model.decode(tokens, positions, slots))
    model.compile_decode()
    torch._dynamo.utils.counters.clear()
    for tokens, positions, slots, eager in batches.values():
        with torch.no_grad():
            compiled = model.decode(tokens, positions, slots)
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2


def test_graphs_keep_torchs_pool_when_torch_has_no_mempool(monkeypatch, caplog) -> None:
    from warmstart.engines.builtin import memory as builtin_memory
    from warmstart.gpu.cuda_scratch import CudaScratchPool

    monkeypatch.setattr(CudaScratchPool, "supported", staticmethod(lambda: False))
    memory = builtin_memory.EngineMemory(
        torch.device("cpu"), "cuda-vmm", releases_weights=False, releases_graph_scratch=True, refill_threads=1
    )
    with caplog.at_level("WARNING"):
        assert memory.graph_pool() is None
    assert "scratch stays in checkpoints" in caplog.text


def test_kv_cache_is_cut_to_what_the_gpu_memory_budget_holds() -> None:
    from warmstart.engines.builtin.memory import kv_slots_that_fit

    gib = 1 << 30
    fit = kv_slots_that_fit(100 * gib, 20 * gib, 0.9, kv_bytes_per_slot=gib, scratch_per_slot=gib // 4)
    assert fit.budget_bytes == 70 * gib
    assert fit.slots == 56  # 70 GiB / 1.25 GiB per slot
    assert kv_slots_that_fit(100 * gib, 95 * gib, 0.9, gib, 0).slots == 0  # over budget already
    with pytest.raises(ValueError, match="utilization"):
        kv_slots_that_fit(100 * gib, 0, 1.5, gib, 0)


def test_graph_scratch_estimate_covers_the_measured_qwen3_8b_pool() -> None:
    from warmstart.engines.builtin.memory import graph_scratch_per_sequence
    from warmstart.engines.builtin.model import kv_nbytes

    config = preset("qwen3-8b")
    per_slot = kv_nbytes(config, 1, 1024)
    measured_pool = 2.68 * (1 << 30)  # an H200, 256 rows x 1024 tokens (BENCHMARKS.md)
    estimate = 256 * graph_scratch_per_sequence(per_slot, config.num_hidden_layers, config.vocab_size)
    assert measured_pool <= estimate <= 1.5 * measured_pool
