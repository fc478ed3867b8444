"""The vLLM engine's weights back from the model's own safetensors files (`weights_files`), on the CPU:
the plan finds each parameter's bytes (fused ones across several stored tensors), proves them byte for byte
and refuses what is not there; the refill writes the same bytes at the same addresses."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmstart.engines.vllm import weights_files, weights_staged
from warmstart.engines.vllm.weights_files import NoPlan
from warmstart.gpu.weight_stager.plan import MAX_SEGMENTS, StagingPlan

torch = pytest.importorskip("torch")
save_file = pytest.importorskip("safetensors.torch").save_file


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Linear(6, 12, bias=False, dtype=torch.bfloat16)


class Fused(torch.nn.Module):
    """Shaped like a vLLM model: q/k/v fused into one parameter, as `packed_modules_mapping` says."""

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention()
        self.norm = torch.nn.Parameter(torch.randn(6))


def stored(model: Fused) -> dict[str, torch.Tensor]:
    """The checkpoint the model was loaded from: q, k, v apart, in two files."""
    q, k, v = model.attn.qkv_proj.weight.data.split([4, 4, 4])
    parts = {"attn.q_proj.weight": q, "attn.k_proj.weight": k, "attn.v_proj.weight": v}
    return {**parts, "norm": model.norm.data}


def write(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    names = sorted(tensors)
    save_file({n: tensors[n].clone() for n in names[:2]}, str(directory / "model-00000.safetensors"))
    save_file({n: tensors[n].clone() for n in names[2:]}, str(directory / "model-00001.safetensors"))


def test_the_weights_are_planned_from_the_files_and_refilled_in_place(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Fused()
    write(tmp_path, stored(model))
    plan = weights_files.plan(model, tmp_path)
    assert plan.names == ("norm", "attn.qkv_proj.weight")
    assert [len(pieces) for pieces in plan.pieces] == [1, 3]  # qkv from three stored tensors
    assert plan.nbytes == 6 * 4 + 12 * 6 * 2
    before = {name: p.data.clone() for name, p in model.named_parameters()}
    pointers = {name: p.data.data_ptr() for name, p in model.named_parameters()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float("nan"))  # what a level-2 sleep leaves
    stats = weights_files.refill(model, tmp_path, plan, threads=3, chunk_bytes=16)  # many small chunks
    assert stats["bytes"] == plan.nbytes
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.data, before[name]), name
        assert parameter.data.data_ptr() == pointers[name]


def test_a_parameter_whose_bytes_are_not_stored_leaves_no_plan(tmp_path: Path) -> None:
    model = Fused()
    tensors = stored(model)
    tensors["attn.k_proj.weight"] = tensors["attn.k_proj.weight"] + 1  # same shape, other bytes
    write(tmp_path, tensors)
    with pytest.raises(NoPlan, match="1 parameters differ from their stored bytes, attn.qkv_proj.weight"):
        weights_files.plan(model, tmp_path)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda t: t.pop("attn.v_proj.weight"), "attn.qkv_proj.weight .* is no stored tensor's bytes"),
        (lambda t: t.update(norm=t["norm"].to(torch.float16)), "norm .* is no stored tensor's bytes"),
    ],
)
def test_missing_or_converted_tensors_leave_no_plan(tmp_path: Path, change, why: str) -> None:
    model = Fused()
    tensors = stored(model)
    change(tensors)
    write(tmp_path, tensors)
    with pytest.raises(NoPlan, match=why):
        weights_files.plan(model, tmp_path)


def test_files_changed_after_the_plan_are_refused_before_a_byte_is_copied(tmp_path: Path) -> None:
    model = Fused()
    tensors = stored(model)
    write(tmp_path, tensors)
    plan = weights_files.plan(model, tmp_path)
    tensors["norm"] = torch.randn(7)  # another layout in the second file
    write(tmp_path, tensors)
    with torch.no_grad():
        model.norm.fill_(3.0)
    with pytest.raises(NoPlan, match="model-00001.safetensors changed since the plan"):
        weights_files.refill(model, tmp_path, plan, threads=2, chunk_bytes=1 << 20)
    assert torch.all(model.norm.data == 3.0)


def test_what_is_not_a_safetensors_file_leaves_no_plan(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(NoPlan, match="not a safetensors file"):
        weights_files.plan(Fused(), tmp_path)
    (tmp_path / "model.safetensors").write_bytes((12).to_bytes(8, "little") + b'{"x": {"a":1}')
    with pytest.raises(NoPlan, match="header"):
        weights_files.plan(Fused(), tmp_path)


def test_the_staged_block_holds_every_range_and_puts_each_back_in_place(tmp_path: Path) -> None:
    """The stager's plan (`weights_staged`), followed as the stager does (each copy from its file into the
    block), then the woken engine's copies out of the block: the parameters' own bytes at their addresses."""
    torch.manual_seed(1)
    model = Fused()
    write(tmp_path, stored(model))
    planned = weights_files.plan(model, tmp_path)
    staged = weights_staged.staging(planned, tmp_path, 0, "GPU-test", granularity=2 << 20)
    plan = StagingPlan.from_dict(staged.plan.to_dict())  # what the stager is given, checked as it checks it
    assert plan.range_bytes == 2 << 20 and len(plan.copies) == 4 and plan.device_uuid == "GPU-test"
    assert all(offset % weights_staged.BLOCK_ALIGNMENT == 0 for _path, _at, offset, _n in plan.copies)
    block = torch.full((plan.range_bytes,), 0xFF, dtype=torch.uint8)
    for path, file_offset, offset, nbytes in plan.copies:
        with open(path, "rb") as file:
            file.seek(file_offset)
            read = bytearray(file.read(nbytes))
        block[offset : offset + nbytes] = torch.frombuffer(read, dtype=torch.uint8)
    before = {name: p.data.clone() for name, p in model.named_parameters()}
    pointers = {name: p.data.data_ptr() for name, p in model.named_parameters()}
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(float("nan"))
    assert weights_staged.place(model, planned, staged, block) == planned.nbytes
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter.data, before[name]), name
        assert parameter.data.data_ptr() == pointers[name]


def test_the_kv_caches_allocations_are_the_block_where_they_hold_the_weights(tmp_path: Path) -> None:
    model = Fused()
    write(tmp_path, stored(model))
    planned = weights_files.plan(model, tmp_path)
    own = weights_staged.staging(planned, tmp_path, 0, "GPU-test", granularity=2 << 20)
    end = weights_staged.staged_end(own)
    assert own.plan.segments == () and end == max(at + n for _p, _f, at, n in own.plan.copies)
    kv = (2 << 20, 4 << 20)
    shared = weights_staged.staging(planned, tmp_path, 0, "GPU-test", 2 << 20, kv_segments=kv)
    assert shared.plan.segments == kv and shared.plan.range_bytes == sum(kv)
    assert shared.placements == own.placements and shared.plan.copies == own.plan.copies
    StagingPlan.from_dict(shared.plan.to_dict())  # the stager takes it
    too_small = weights_staged.staging(planned, tmp_path, 0, "GPU-test", 2 << 20, kv_segments=(4096,))
    assert too_small.plan.segments == () and too_small.plan == own.plan
    assert weights_staged.holds((end,), end) and not weights_staged.holds((end - 1,), end)
    assert not weights_staged.holds((), 0)
    assert not weights_staged.holds((1 << 30,) * (MAX_SEGMENTS + 1), end)


def test_the_block_is_planned_only_where_the_gpu_holds_the_weights_twice() -> None:
    weights = 16 << 30
    assert weights_staged.fits(weights, 2 * weights + weights_staged.HEADROOM_BYTES)
    assert not weights_staged.fits(weights, 2 * weights + weights_staged.HEADROOM_BYTES - 1)


def test_a_staging_plan_is_offered_on_one_gpu_unless_the_worker_turns_it_off(monkeypatch) -> None:
    from warmstart.engines.vllm.engine import STAGED_WEIGHTS_ENV, staging_wanted

    monkeypatch.delenv(STAGED_WEIGHTS_ENV, raising=False)
    assert staging_wanted(1)
    assert not staging_wanted(2)
    monkeypatch.setenv(STAGED_WEIGHTS_ENV, "0")
    assert not staging_wanted(1)


def test_no_staging_plan_without_a_weights_plan(tmp_path: Path) -> None:
    from warmstart.engines.vllm.engine import VllmEngine

    write(tmp_path, stored(Fused()))
    engine = VllmEngine(model=str(tmp_path), device="cuda")
    assert engine._weights_plan is None
    assert engine.weight_staging_plan() is None
