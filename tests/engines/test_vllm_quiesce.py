"""The vLLM engine's capture glue against a fake vLLM shaped like vLLM 0.26's interface (no vLLM, no GPU):
the environment and file rendezvous set before the engine is built, the sleep/wake sequence around a
checkpoint, the weights image written at release and preferred at resume (or reload_weights when told), the
weights read back from the model's files when there is no image, and the report of what the process holds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from warmstart.engines.vllm import engine as engine_module
from warmstart.engines.vllm import quiesce, weights_image
from warmstart.engines.vllm.engine import REFILL_CHOICE_FILE, WEIGHTS_IMAGE_ENV, VllmEngine

torch = pytest.importorskip("torch")


class FakeExecutor:
    def _distributed_args(self) -> tuple[str, int, int]:
        return "tcp://10.0.0.1:29500", 0, 0


class FakeModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.qkv = torch.nn.Parameter(torch.randn(8, 6, generator=generator).to(torch.bfloat16))
        self.norm = torch.nn.Parameter(torch.randn(6, generator=generator))


class FakeRunner:
    def __init__(self) -> None:
        self.model = FakeModel()

    def get_model(self) -> FakeModel:
        return self.model


class FakeWorker:
    def __init__(self, calls: list[str]) -> None:
        self.model_runner = FakeRunner()
        self.calls = calls
        self.saved: dict[str, Any] = {}

    def reload_weights(self) -> None:
        self.calls.append("reload_weights")
        for name, value in self.saved.items():
            dict(self.model_runner.model.named_parameters())[name].data.copy_(value)


class FakeLLM:
    """vLLM's LLM: sleep(level), wake_up(tags), collective_rpc(name | callable), an in-process engine."""

    instances: list[FakeLLM] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.calls: list[str] = []
        self.worker = FakeWorker(self.calls)
        executor = sys.modules["vllm.v1.executor.uniproc_executor"].UniProcExecutor()
        self.init_method = executor._distributed_args()[0]
        self.llm_engine = types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=256, dtype="torch.bfloat16")
        )
        FakeLLM.instances.append(self)

    def get_tokenizer(self) -> Any:
        return types.SimpleNamespace(encode=lambda text, add_special_tokens=True: [1, 2], bos_token=None)

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep:{level}")
        if level == 2:  # the bytes are gone, the tensors (addresses) stay
            self.worker.saved = {
                n: p.data.clone() for n, p in self.worker.model_runner.model.named_parameters()
            }
            for parameter in self.worker.model_runner.model.parameters():
                parameter.data.fill_(float("nan"))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append("wake_up:" + ",".join(tags or ["all"]))

    def collective_rpc(self, method: Any, args: tuple = ()) -> list[Any]:
        if isinstance(method, str):
            return [getattr(self.worker, method)(*args)]
        return [method(self.worker, *args)]

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")


class FakeFrontend(FakeLLM):
    """vLLM's server in front of the engine (frontend.VllmFrontend): the same calls around a checkpoint."""

    def __init__(self, options: Any, served_model_name: str, server_args: tuple[str, ...]) -> None:
        super().__init__(**options.llm_kwargs())
        self.server_args = server_args
        self.timings: dict[str, float] = {}
        self.warm_up_answer: dict[str, Any] = {}

    def load(self) -> None:
        self.calls.append("load")

    @property
    def model_config(self) -> Any:
        return self.llm_engine.model_config

    def warm_up(self) -> None:
        self.calls.append("warm_up")
        self.warm_up_answer = {"token_ids": [5, 6], "text": " w5 w6"}


API = {"api": "warmstart"}  # which server the engines of the running test are built with


@pytest.fixture(params=["warmstart", "vllm"])
def fake_vllm(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> types.ModuleType:
    monkeypatch.setitem(API, "api", request.param)
    monkeypatch.setattr(engine_module, "VllmFrontend", FakeFrontend)
    vllm = types.ModuleType("vllm")
    vllm.__version__ = "0.26.0"
    vllm.LLM = FakeLLM
    executor_module = types.ModuleType("vllm.v1.executor.uniproc_executor")

    class UniProcExecutor(FakeExecutor):
        pass

    executor_module.UniProcExecutor = UniProcExecutor
    v1 = types.ModuleType("vllm.v1")
    executor_package = types.ModuleType("vllm.v1.executor")
    executor_package.uniproc_executor = executor_module
    v1.executor = executor_package
    vllm.v1 = v1
    for name, module in {
        "vllm": vllm, "vllm.v1": v1, "vllm.v1.executor": executor_package,
        "vllm.v1.executor.uniproc_executor": executor_module,
    }.items():  # fmt: skip
        monkeypatch.setitem(sys.modules, name, module)
    for key in quiesce.ENV_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(engine_module.VllmEngine, "_gpu_facts", lambda self: ("NVIDIA H200", "9.0", 580))
    FakeLLM.instances.clear()
    return vllm


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"weights")
    (directory / "config.json").write_text("{}")
    return directory


def loaded(model_dir: Path) -> tuple[VllmEngine, FakeLLM]:
    engine = VllmEngine("m", model_dir=model_dir, api=API["api"])
    engine.load()
    llm = FakeLLM.instances[-1]
    assert isinstance(llm, FakeFrontend) == (API["api"] == "vllm")
    if API["api"] == "vllm":
        assert engine.describe()["warm_up"] == {}
        engine.warm_up()
        assert llm.calls == ["load", "warm_up"]
        warm_up = engine.describe()["warm_up"]  # travels in the snapshot: a restore is asked the same
        assert warm_up["token_ids"] == [5, 6] and warm_up["request"]["return_token_ids"] is True
        assert engine.serving_app(lambda: True, None) is not None
        llm.calls.clear()
    return engine, llm


def test_load_sets_the_dumpable_environment_and_a_file_rendezvous(fake_vllm: Any, model_dir: Path) -> None:
    _engine, llm = loaded(model_dir)
    assert os.environ["USE_LIBUV"] == "0"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert llm.init_method.startswith("file://")  # no TCPStore, so no socket and no io_uring
    assert llm.kwargs["enable_sleep_mode"] is True
    again = quiesce.use_file_rendezvous(fake_vllm)
    assert again == llm.init_method  # idempotent


RENDEZVOUS_THEN_EXIT = """
import sys, types
from warmstart.engines.vllm import quiesce
executor = types.ModuleType("vllm.v1.executor.uniproc_executor")
executor.UniProcExecutor = type("UniProcExecutor", (), {"_distributed_args": lambda self: ("tcp://x", 0, 0)})
sys.modules["vllm.v1.executor.uniproc_executor"] = executor
sys.modules["vllm.v1.executor"] = types.SimpleNamespace(uniproc_executor=executor)
method = quiesce.use_file_rendezvous(types.ModuleType("vllm"))
print(method.removeprefix("file://"))
"""


@pytest.mark.spawns
def test_the_file_rendezvous_directory_is_removed_when_the_process_exits(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-c", RENDEZVOUS_THEN_EXIT]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=True)
    store = Path(result.stdout.strip())
    assert store.parent.parent == tmp_path and store.parent.name.startswith("warmstart-vllm-rdzv-"), store
    assert not store.parent.exists(), f"{store.parent} outlived its process"


def test_jit_caches_go_under_the_control_directory_unless_the_user_set_them(tmp_path: Path) -> None:
    """The shared objects Triton and Inductor build are mapped by the engine: under the control directory
    they travel with the snapshot to a new pod (a pod's own files do not)."""
    environ = {"WARMSTART_CONTROL_DIR": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": "/mine"}
    applied = quiesce.apply_env_defaults(environ)
    triton = str(tmp_path / "jit-cache" / "triton")
    assert applied["TRITON_CACHE_DIR"] == environ["TRITON_CACHE_DIR"] == triton
    assert applied["VLLM_CACHE_ROOT"] == str(tmp_path / "jit-cache" / "vllm")  # vLLM moves both there
    assert "TORCHINDUCTOR_CACHE_DIR" not in applied and environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine"
    assert "TRITON_CACHE_DIR" not in quiesce.apply_env_defaults({})  # no control directory: no agent


def test_a_user_setting_is_kept(fake_vllm: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USE_LIBUV", "1")
    loaded(model_dir)
    assert os.environ["USE_LIBUV"] == "1"


def test_release_and_reacquire_reload_weights_without_an_image(fake_vllm: Any, model_dir: Path) -> None:
    engine, llm = loaded(model_dir)
    before = {n: p.data.clone() for n, p in llm.worker.model_runner.model.named_parameters()}
    assert engine.release() is True
    assert "sleep_s" in engine.timings
    assert isinstance(engine.describe()["held_at_release"], dict)
    engine.reacquire()
    assert llm.calls == [
        "sleep:2",
        "wake_up:weights",
        "reload_weights",
        "wake_up:kv_cache",
        "reset_prefix_cache",
    ]
    for name, parameter in llm.worker.model_runner.model.named_parameters():
        assert torch.equal(parameter.data, before[name])
    assert "weights_reload_s" in engine.timings


def test_weights_image_is_written_at_release_and_refills_the_same_tensors(
    fake_vllm: Any, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WEIGHTS_IMAGE_ENV, str(tmp_path / "images"))
    refills: list[Path] = []

    def cpu_refill(model: Any, path: Path, **_kwargs: Any) -> dict[str, float]:
        refills.append(path)
        entries = weights_image.read_entries(path)
        tensors = weights_image.parameters(model)
        assert weights_image.matches(entries, tensors) is None
        with open(path, "rb") as file:
            for entry, (_name, tensor) in zip(entries, tensors, strict=True):
                file.seek(entry.offset)
                tensor.reshape(-1).view(torch.uint8).copy_(
                    torch.frombuffer(bytearray(file.read(entry.nbytes)), dtype=torch.uint8)
                )
        return {"bytes": 1.0, "seconds": 1.0, "gb_per_s": 1.0}

    monkeypatch.setattr(weights_image, "refill", cpu_refill)
    engine, llm = loaded(model_dir)
    model = llm.worker.model_runner.model
    before = {n: p.data.clone() for n, p in model.named_parameters()}
    pointers = {n: p.data.data_ptr() for n, p in model.named_parameters()}
    engine.release()
    image = Path(engine.describe()["weights_image"])
    assert image.exists() and image.parent == tmp_path / "images"
    engine.reacquire()
    assert refills == [image]
    assert "reload_weights" not in llm.calls
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.data, before[name])
        assert parameter.data.data_ptr() == pointers[name]  # same addresses: CUDA graphs stay valid
    assert "weights_image_s" in engine.timings

    # told to reload (how the benchmark measures both paths from one snapshot)
    (image.parent / REFILL_CHOICE_FILE).write_text("reload\n")
    engine.release()
    engine.reacquire()
    assert llm.calls.count("reload_weights") == 1


def test_without_an_image_the_weights_come_back_from_the_model_files(
    fake_vllm: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default: the parameters are the safetensors files' bytes, so the wake reads them from there, at
    the same addresses, and vLLM's loader is not run; told to reload, it is."""
    from safetensors.torch import save_file

    (model_dir / "model.safetensors").unlink()
    save_file({n: p.data for n, p in FakeModel().named_parameters()}, str(model_dir / "model.safetensors"))
    engine, llm = loaded(model_dir)
    model = llm.worker.model_runner.model
    before = {n: p.data.clone() for n, p in model.named_parameters()}
    pointers = {n: p.data.data_ptr() for n, p in model.named_parameters()}
    engine.release()
    planned = engine.describe()["weights_from_files"]
    assert planned == sum(t.numel() * t.element_size() for t in before.values())
    engine.reacquire()
    assert "reload_weights" not in llm.calls
    assert "weights_files_s" in engine.timings and "wake_kv_cache_s" in engine.timings
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.data, before[name])
        assert parameter.data.data_ptr() == pointers[name]


def test_an_image_that_does_not_match_the_model_falls_back_to_reload(
    fake_vllm: Any, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WEIGHTS_IMAGE_ENV, str(tmp_path / "images"))
    engine, llm = loaded(model_dir)
    engine.release()
    with torch.no_grad():
        llm.worker.model_runner.model.extra = torch.nn.Parameter(torch.zeros(3))
    engine.reacquire()  # the real refill checks the header before touching a byte
    assert "reload_weights" in llm.calls


def test_open_resources_counts_inet_sockets_by_state() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    try:
        held = quiesce.open_resources()
    finally:
        server.close()
    assert held.get("tcp:listen", 0) >= 1
    assert quiesce.undumpable(held) == []
    assert quiesce.undumpable({"anon_inode:[io_uring]": 1, "map:anon_inode:[io_uring]": 1}) == [
        "anon_inode:[io_uring]", "map:anon_inode:[io_uring]",
    ]  # fmt: skip


def test_weights_image_layout_round_trips(tmp_path: Path) -> None:
    model = FakeModel()
    tensors = weights_image.parameters(model)
    path = tmp_path / "w.weights"
    weights_image.save(model, path)
    entries = weights_image.read_entries(path)
    assert [e.name for e in entries] == ["qkv", "norm"]
    assert all(e.offset % weights_image.ALIGN == 0 for e in entries)
    assert weights_image.matches(entries, tensors) is None
    assert "tensors in the image" in (weights_image.matches(entries, tensors[:1]) or "")


def test_the_kv_cache_is_mapped_beside_the_refill_and_options_come_from_the_refill_file(
    fake_vllm: Any, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(WEIGHTS_IMAGE_ENV, str(tmp_path / "images"))
    seen: list[dict[str, Any]] = []

    def fake_refill(model: Any, path: Path, **kwargs: Any) -> dict[str, float]:
        seen.append(kwargs)
        return {"bytes": 1.0, "seconds": 1.0, "gb_per_s": 1.0}

    monkeypatch.setattr(weights_image, "refill", fake_refill)
    engine, llm = loaded(model_dir)
    engine.release()
    engine.reacquire()
    assert seen[-1] == {
        "threads": engine_module.REFILL_THREADS,
        "chunk_bytes": engine_module.REFILL_CHUNK_MIB << 20,
    }
    assert "wake_up:kv_cache" in llm.calls and "wake_kv_cache_s" in engine.timings
    image = Path(engine.describe()["weights_image"])
    (image.parent / REFILL_CHOICE_FILE).write_text("image threads=3 chunk=64 overlap=0\n")
    engine.release()
    assert engine.timings["weights_image_write_s"] == 0.0  # the same identity: the image is kept
    engine.reacquire()
    assert seen[-1] == {"threads": 3, "chunk_bytes": 64 << 20}
    assert llm.calls[-3:] == ["wake_up:weights", "wake_up:kv_cache", "reset_prefix_cache"]


def test_refill_choice_parsing() -> None:
    parse = engine_module.RefillChoice.parse
    assert parse("reload\n").how == "reload"
    assert parse("").how == "image" and parse("").overlap
    choice = parse("image threads=12 chunk=8 overlap=0")
    assert (choice.threads, choice.chunk_bytes, choice.overlap) == (12, 8 << 20, False)
    assert parse("image threads=x").threads == engine_module.REFILL_THREADS


def test_release_reports_memory_and_trims_unless_told_not_to(
    fake_vllm: Any, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _llm = loaded(model_dir)
    engine.release()
    report = engine.describe()["memory_at_release"]
    assert {"awake", "asleep", "trimmed", "after_trim"} <= set(report)
    assert "RssAnon" in report["asleep"]["host"]
    engine.reacquire()
    monkeypatch.setenv(engine_module.TRIM_ENV, "0")
    engine.release()
    assert "trimmed" not in engine.describe()["memory_at_release"]


def test_memory_pools_and_cumem_tags_are_summed() -> None:
    from warmstart.engines.vllm import memory

    gib = 1 << 30
    segments = [
        {"segment_pool_id": (0, 0), "total_size": 2 * gib, "allocated_size": gib},
        {"segment_pool_id": (1, 0), "total_size": gib, "allocated_size": gib},
        {"segment_pool_id": (0, 5), "total_size": 4 * gib, "allocated_size": 4 * gib},
    ]
    pools = memory.pools(segments, {(0, 5): "cumem:weights"})
    assert pools["default"] == {"reserved_gib": 2.0, "allocated_gib": 1.0, "segments": 1}
    assert pools["pool1.0"]["reserved_gib"] == 1.0 and pools["cumem:weights"]["allocated_gib"] == 4.0

    data = types.SimpleNamespace
    allocator = data(pointer_to_data={
        1: data(handle=(0, gib, 1, None), tag="weights", is_asleep=True),
        2: data(handle=(0, 2 * gib, 2, None), tag="kv_cache", is_asleep=False),
    })  # fmt: skip
    tags = memory.cumem_tags(allocator)
    assert tags == {"weights": {"gib": 1.0, "asleep_gib": 1.0}, "kv_cache": {"gib": 2.0, "asleep_gib": 0.0}}


def test_reusable_weights_image(tmp_path: Path) -> None:
    model = FakeModel()
    path = tmp_path / "w.weights"
    assert not weights_image.reusable(model, path)
    weights_image.save(model, path)
    assert weights_image.reusable(model, path)
    with open(path, "r+b") as file:
        file.truncate(path.stat().st_size - 1)
    assert not weights_image.reusable(model, path)
