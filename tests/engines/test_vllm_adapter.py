"""The vLLM adapter: option and request translation, identity and the missing-vLLM error run everywhere;
the engine itself runs only where vLLM imports, on a GPU, with a local model (WARMSTART_VLLM_TEST_MODEL)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from warmstart.api.worker_options import WorkerOptions, add_worker_arguments, parse_engine_arg
from warmstart.engines import ENGINE_FACTORIES, create_engine
from warmstart.engines.base import EngineError, GenerationRequest, RequestError, SamplingParams, check_fits
from warmstart.engines.vllm.engine import VllmEngine
from warmstart.engines.vllm.identity import model_files_digest, snapshot_identity
from warmstart.engines.vllm.options import INSTALL_HINT, VllmOptions, sampling_kwargs

VLLM_INSTALLED = importlib.util.find_spec("vllm") is not None
TEST_MODEL_ENV = "WARMSTART_VLLM_TEST_MODEL"
GPU = ("NVIDIA H200", "9.0", 570)


def vllm_engine(**options: Any) -> VllmEngine:
    engine = create_engine("vllm", **{"model": "Qwen/Qwen3-0.6B", "device": "cuda", **options})
    assert isinstance(engine, VllmEngine)
    return engine


def worker_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "my-model"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"weights")
    (directory / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    (directory / "tokenizer.json").write_text("{}")
    return directory


# --- registry and the missing-vLLM error ---------------------------------------------------------------


def test_vllm_is_a_registered_engine_kind() -> None:
    assert "vllm" in ENGINE_FACTORIES


@pytest.mark.skipif(VLLM_INSTALLED, reason="vLLM is installed here, so loading does not fail for its absence")
def test_load_without_vllm_names_the_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # load() sets it; keep the test's env clean
    engine = vllm_engine()
    with pytest.raises(EngineError, match="vLLM, which is not installed") as raised:
        engine.load()
    assert INSTALL_HINT in str(raised.value)
    assert INSTALL_HINT == "pip install 'warmstart[vllm]'"


def test_using_the_engine_before_load_says_to_load_first() -> None:
    engine = vllm_engine()
    with pytest.raises(EngineError, match="call load"):
        engine.generate([GenerationRequest(prompt="hi")])
    with pytest.raises(EngineError, match="call load"):
        engine.release()


# --- engine args ---------------------------------------------------------------------------------------


def test_options_translate_into_llm_keyword_arguments(model_dir: Path) -> None:
    engine = vllm_engine(
        model="ignored-when-a-dir-is-given",
        model_dir=model_dir,
        dtype="bfloat16",
        tensor_parallel_size=2,
        max_model_len=2048,
        max_num_seqs=64,
        cuda_graph_sizes=[8, 1, 2, 8],
        seed=7,
        gpu_memory_utilization=0.5,
        enforce_eager=True,
        sleep_level=1,
        engine_args={"revision": "main", "compilation_config": {"level": 3}},
    )
    assert engine.options.llm_kwargs() == {
        "model": str(model_dir),
        "enable_sleep_mode": True,
        "dtype": "bfloat16",
        "tensor_parallel_size": 2,
        "max_model_len": 2048,
        "max_num_seqs": 64,
        "gpu_memory_utilization": 0.5,
        "enforce_eager": True,
        "seed": 7,
        "revision": "main",
        "compilation_config": {"level": 3, "cudagraph_capture_sizes": [1, 2, 8]},
    }
    assert engine.served_model_name == "my-model"
    assert engine.model_dir == model_dir
    assert engine.max_model_len == 2048


def test_defaults_leave_vllm_to_choose_and_always_enable_sleep_mode() -> None:
    engine = vllm_engine(model="Qwen/Qwen3-0.6B")
    assert engine.options.llm_kwargs() == {
        "model": "Qwen/Qwen3-0.6B",
        "enable_sleep_mode": True,
        "dtype": "auto",
        "tensor_parallel_size": 1,
        "gpu_memory_utilization": 0.9,
        "enforce_eager": False,
        "seed": 0,
    }
    assert engine.options.sleep_level == 2
    assert engine.served_model_name == "Qwen/Qwen3-0.6B"
    assert vllm_engine(served_model_name="qwen").served_model_name == "qwen"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"device": "cpu"}, "pass --device cuda"),
        ({"device": "cuda:1"}, "CUDA_VISIBLE_DEVICES"),
        ({"model": ""}, "--model must name"),
        ({"dtype": "int8"}, "--dtype must be one of"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
        ({"max_model_len": -1}, "max_model_len must be a positive integer"),
        ({"cuda_graph_sizes": [4, 0]}, "cuda_graph_sizes must be a positive integer"),
        ({"gpu_memory_utilization": 0.0}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"sleep_level": 3}, "sleep_level must be 1 or 2"),
        ({"engine_args": {"dtype": "half"}}, "use --dtype"),
        ({"engine_args": {"enable_sleep_mode": False}}, "always on"),
        ({"engine_args": {"model": "other"}}, "use --model or --model-dir"),
        ({"engine_args": {"hf_overrides": object()}}, "must be JSON values"),
        ({"api": "sglang"}, "api must be one of vllm, warmstart"),
        ({"api": "warmstart", "server_args": ["--enable-auto-tool-choice"]}, "server args need api 'vllm'"),
    ],
)
def test_bad_options_are_refused_naming_what_to_fix(options: dict[str, Any], message: str) -> None:
    with pytest.raises(EngineError, match=message):
        vllm_engine(**options)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max_num_batched_tokens=4096", ("max_num_batched_tokens", 4096)),
        ("kv-cache-dtype=fp8", ("kv_cache_dtype", "fp8")),
        ("enable_prefix_caching=false", ("enable_prefix_caching", False)),
        ('hf_overrides={"rope_theta": 1e6}', ("hf_overrides", {"rope_theta": 1e6})),
        ("revision=", ("revision", "")),
    ],
)
def test_engine_arg_values_are_json_where_they_parse(text: str, expected: tuple[str, Any]) -> None:
    assert parse_engine_arg(text) == expected


@pytest.mark.parametrize("text", ["no-equals-sign", "=value", "two words=1"])
def test_malformed_engine_args_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match="expected KEY=VALUE"):
        parse_engine_arg(text)


# --- worker options ------------------------------------------------------------------------------------


def test_worker_options_for_vllm_reach_the_engine_and_survive_the_engine_process_argv() -> None:
    args = worker_args(
        "--engine", "vllm", "--model", "Qwen/Qwen3-0.6B", "--device", "cuda", "--seed", "3",
        "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.8", "--enforce-eager",
        "--sleep-level", "1", "--engine-arg", "max_num_batched_tokens=4096", "--engine-arg", "revision=main",
        "--vllm-server-arg=--enable-auto-tool-choice", "--vllm-server-arg=--tool-call-parser=hermes",
    )  # fmt: skip
    options = WorkerOptions.of(args).engine_options()
    assert options == {
        "model": "Qwen/Qwen3-0.6B",
        "device": "cuda",
        "seed": 3,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.8,
        "enforce_eager": True,
        "sleep_level": 1,
        "engine_args": {"max_num_batched_tokens": 4096, "revision": "main"},
        "api": "vllm",
        "server_args": ["--enable-auto-tool-choice", "--tool-call-parser=hermes"],
    }
    relaunched = worker_args(*WorkerOptions.of(args).engine_argv("capture"))
    assert WorkerOptions.of(relaunched).engine_options() == options
    assert isinstance(create_engine("vllm", **options), VllmEngine)


def test_worker_options_for_builtin_carry_no_vllm_options() -> None:
    args = worker_args("--engine", "builtin", "--tensor-parallel-size", "2", "--engine-arg", "a=1")
    options = WorkerOptions.of(args).engine_options()
    assert not {"engine_args", "sleep_level", "api", "server_args"} & set(options)
    assert options["tensor_parallel_size"] == 2  # the builtin engine splits over ranks too
    argv = WorkerOptions.of(args).engine_argv("cold")
    assert not [arg for arg in argv if arg.startswith(("--engine-arg", "--api"))]
    assert WorkerOptions.of(worker_args(*argv)).engine_options() == options


def test_a_malformed_engine_arg_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        worker_args("--engine", "vllm", "--engine-arg", "no-equals-sign")
    assert "expected KEY=VALUE" in capsys.readouterr().err


# --- requests ------------------------------------------------------------------------------------------


def test_greedy_sampling_translates_to_temperature_zero_and_full_top_p() -> None:
    kwargs = sampling_kwargs(SamplingParams(max_tokens=5, temperature=1e-7, top_p=0.5, stop=("\n",)))
    assert kwargs == {
        "n": 1,
        "max_tokens": 5,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": None,
        "stop": ["\n"],
        "ignore_eos": False,
    }


def test_sampled_requests_keep_their_parameters_and_seed() -> None:
    kwargs = sampling_kwargs(
        SamplingParams(max_tokens=9, temperature=0.7, top_p=0.9, seed=42, ignore_eos=True)
    )
    assert (kwargs["temperature"], kwargs["top_p"], kwargs["seed"], kwargs["ignore_eos"]) == (
        0.7,
        0.9,
        42,
        True,
    )


@pytest.mark.parametrize(
    ("sampling", "param"),
    [
        (SamplingParams(max_tokens=0), "max_tokens"),
        (SamplingParams(temperature=-0.1), "temperature"),
        (SamplingParams(top_p=0.0), "top_p"),
        (SamplingParams(top_p=1.01), "top_p"),
        (SamplingParams(seed=-1), "seed"),
        (SamplingParams(stop=("ok", "")), "stop"),
    ],
)
def test_invalid_sampling_is_a_request_error_naming_the_field(sampling: SamplingParams, param: str) -> None:
    with pytest.raises(RequestError) as raised:
        sampling_kwargs(sampling)
    assert raised.value.param == param
    assert param in str(raised.value)


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "param", "message"),
    [
        (0, 4, "prompt", "the prompt is empty"),
        (100, 1, "prompt", "takes at most 99"),
        (90, 11, "max_tokens", "between 1 and 10"),
        (90, 0, "max_tokens", "between 1 and 10"),
    ],
)
def test_prompts_that_do_not_fit_are_request_errors(
    prompt_tokens: int, max_tokens: int, param: str, message: str
) -> None:
    with pytest.raises(RequestError, match=message) as raised:
        check_fits(prompt_tokens, max_tokens, max_model_len=100)
    assert raised.value.param == param


def test_a_prompt_that_exactly_fits_is_accepted() -> None:
    check_fits(90, 10, max_model_len=100)


# --- identity ------------------------------------------------------------------------------------------


def test_identity_records_engine_version_args_dtype_parallelism_and_gpu(model_dir: Path) -> None:
    options = VllmOptions(model=str(model_dir), tensor_parallel_size=2, sleep_level=2)
    identity = snapshot_identity(options, "sha256:abc", "0.11.0", 4096, "bfloat16", GPU)
    assert (identity.engine, identity.engine_version, identity.model_digest) == (
        "vllm",
        "0.11.0",
        "sha256:abc",
    )
    assert (identity.dtype, identity.parallelism, identity.device) == ("bfloat16", 2, "cuda")
    assert (identity.gpu_product, identity.compute_capability, identity.driver_major) == GPU
    assert identity.engine_args["max_model_len"] == 4096
    assert identity.engine_args["sleep_level"] == 2
    assert identity.engine_args["enable_sleep_mode"] is True
    assert "model" not in identity.engine_args  # the files' digest stands for the model, not its path
    assert identity.engine_args["api"] == "vllm"  # the server is inside the captured process


def test_identity_changes_with_the_server_and_its_args(model_dir: Path) -> None:
    def digest(**options: Any) -> str:
        options = VllmOptions(model=str(model_dir), **options)
        return snapshot_identity(options, "d", "0.26.0", 1024, "", GPU).digest()

    assert len({digest(), digest(api="warmstart"), digest(server_args=("--enable-auto-tool-choice",))}) == 3


def test_identity_follows_the_files_not_the_path_and_changes_with_engine_args(tmp_path: Path) -> None:
    def identity(path: str, **options: Any) -> str:
        return snapshot_identity(
            VllmOptions(model=path, **options), "sha256:abc", "0.11.0", 4096, "auto", GPU
        ).digest()

    assert identity(str(tmp_path / "a")) == identity(str(tmp_path / "b"))
    assert identity("m") != identity("m", gpu_memory_utilization=0.5)
    assert identity("m") != identity("m", sleep_level=1)
    assert identity("m") != identity("m", extra={"revision": "abc"})


def test_model_digest_covers_weights_config_and_tokenizer(model_dir: Path) -> None:
    before = model_files_digest(model_dir)
    assert before.startswith("sha256:")
    assert model_files_digest(model_dir) == before
    (model_dir / "tokenizer.json").write_text('{"changed": true}')
    after_tokenizer = model_files_digest(model_dir)
    assert after_tokenizer != before
    (model_dir / "model.safetensors").write_bytes(b"other weights")
    assert model_files_digest(model_dir) not in (before, after_tokenizer)


def test_a_model_dir_without_weights_cannot_be_digested(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="no \\*.safetensors or \\*.bin weight files"):
        model_files_digest(tmp_path)


# --- the real engine (vLLM, a GPU and a local model) ---------------------------------------------------


@pytest.fixture(scope="module")
def loaded_engine() -> Any:
    pytest.importorskip(
        "vllm", reason="vLLM is not installed here (pip install 'warmstart[vllm]', needs a GPU)"
    )
    model = os.environ.get(TEST_MODEL_ENV)
    if not model or not Path(model).is_dir():
        pytest.skip(f"set {TEST_MODEL_ENV} to a local model directory vLLM can load (e.g. Qwen3-0.6B)")
    engine = VllmEngine(model=model, device="cuda", max_model_len=1024, gpu_memory_utilization=0.5)
    engine.load()
    engine.warm_up()
    yield engine
    engine.close()


def greedy(prompt: str, max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens))


@pytest.mark.gpu
def test_vllm_generates_streams_and_counts_tokens(loaded_engine: VllmEngine) -> None:
    first, second = loaded_engine.generate([greedy("The capital of France is"), greedy("1, 2, 3,")])
    assert first.token_ids and second.token_ids
    assert first.finish_reason in ("stop", "length")
    assert first.prompt_tokens == loaded_engine.count_prompt_tokens(greedy("The capital of France is"))
    deltas = list(loaded_engine.stream(greedy("The capital of France is")))
    assert "".join(delta.text for delta in deltas) == first.text
    assert deltas[-1].finish_reason == first.finish_reason
    chat = loaded_engine.chat_prompt([{"role": "user", "content": "Say hi"}])
    assert "Say hi" in chat


@pytest.mark.gpu
@pytest.mark.parametrize("level", [2, 1])
def test_vllm_release_and_reacquire_keep_greedy_output(loaded_engine: VllmEngine, level: int) -> None:
    loaded_engine.options = dataclasses.replace(loaded_engine.options, sleep_level=level)
    before = loaded_engine.generate([greedy("Once upon a time", 16)])[0]
    assert loaded_engine.release() is (level == 2)
    with pytest.raises(EngineError, match="released"):
        loaded_engine.generate([greedy("Once upon a time")])
    loaded_engine.reacquire()
    after = loaded_engine.generate([greedy("Once upon a time", 16)])[0]
    assert after.token_ids == before.token_ids
    assert before.text and after.text == before.text  # text too: the ids must decode to something


@pytest.mark.gpu
def test_vllm_identity_describes_this_gpu_and_vllm(loaded_engine: VllmEngine) -> None:
    import vllm

    identity = loaded_engine.identity()
    assert identity.engine == "vllm"
    assert identity.engine_version == vllm.__version__
    assert identity.model_digest.startswith("sha256:")
    assert identity.gpu_product and identity.compute_capability and identity.driver_major > 0
    assert identity.engine_args["max_model_len"] == loaded_engine.max_model_len == 1024
