"""What the GPU end-to-end tests (`test_gpu_e2e.py`) do before they need a GPU, run everywhere: so that a GPU
machine's few minutes are never the first to find them broken (both GPU tests once failed as shipped, one on
a GPU name it forged, one importing the vLLM benchmark). Their module imports, the endpoints they apply are
specs the operator takes, the model they write for vLLM loads, the GPU a forged snapshot names is never the
node's own, and their report renders every kind of row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import test_gpu_e2e as scenario
from node_plugin import HostPython

from warmstart.engines.builtin.shapes import PRESETS
from warmstart.operator.spec import parse_spec

# Products a node may report, the lent machines' cards among them.
NODE_PRODUCTS = ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA A100-SXM4-80GB", "NVIDIA L4", "")


@pytest.mark.parametrize("product", NODE_PRODUCTS)
def test_the_forged_snapshot_names_a_real_gpu_other_than_the_nodes(product: str) -> None:
    other = scenario.another_gpu(product)
    assert other != product and other in scenario.OTHER_GPUS


@pytest.mark.parametrize("shape", ["qwen3-8b", "qwen3-0.6b"])
def test_both_rounds_shapes_are_known_to_both_engines(shape: str) -> None:
    """The full round (8B) and the quick one (0.6B): the builtin engine's preset and the vLLM model writer's
    shapes, the same published configuration."""
    bench = scenario.vllm_bench()
    config, shapes = PRESETS[shape], bench.SHAPES[shape]
    for name in ("hidden_size", "num_hidden_layers", "intermediate_size", "tie_word_embeddings"):
        assert getattr(config, name) == shapes[name], name


@dataclass
class Node:
    """What the endpoint's body reads of the real node: whether it has a GPU, and its pod placement."""

    gpu: bool
    labels: list[str] = field(default_factory=lambda: ["warmstart.dev/test-node"])

    def pod_placement(self) -> dict[str, Any]:
        return {"nodeSelector": dict.fromkeys(self.labels, "true")}


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu-node", "rehearsal"])
@pytest.mark.parametrize("engine", ["builtin", "vllm"])
def test_the_endpoints_the_round_applies_are_valid_specs(gpu: bool, engine: str) -> None:
    node = Node(gpu)
    python = HostPython("/usr/bin/python3", env=[{"name": "PYTHONPATH", "value": "/src"}])
    if engine == "builtin":
        model, args = scenario.builtin_shapes(node)  # type: ignore[arg-type]
    else:
        model, args = "/cache/models/m", scenario.vllm_args()
    body = scenario.gpu_endpoint("e", "ns", "image:1", node, python, True, engine, model, args)  # type: ignore[arg-type]
    spec = parse_spec(body["spec"])
    assert spec.replicas == 0 and spec.engine.kind == engine and spec.resources.gpus == (1 if gpu else 0)
    assert list(spec.engine.args) == args


@pytest.mark.spawns  # transformers asks ldconfig where its libraries are
def test_the_vllm_model_is_written_and_loads(tmp_path: Path) -> None:
    """The writer the vLLM test calls, at a shape small enough for CPU: config, shards and tokenizer load as
    a Qwen3 model that computes (finite logits that differ across the vocabulary)."""
    transformers = pytest.importorskip("transformers", reason="the model writer needs the dev extra")
    import torch

    directory = tmp_path / "model"
    scenario.vllm_model(directory, "qwen3-tiny")
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (128, 2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    assert len(tokenizer) == model.config.vocab_size
    with torch.no_grad():
        logits = model(torch.tensor([tokenizer.encode("the snapshot")])).logits
    assert torch.isfinite(logits).all() and logits[0, -1].std() > 0


def test_the_report_renders_every_kind_of_row() -> None:
    start = scenario.Start("builtin", "restore", 1.25, [1, 2], "a b", {"criu_restore": 0.5}, {"OSError": 2})
    rows = [
        {"engine": "builtin", "kind": "capture", "seconds": 7.9, "phases": {"criu_dump": 1.6}},
        {"engine": "builtin", **scenario.dataclasses.asdict(start), "differs_from_cold_at": None},
        {"engine": "vllm", "kind": "captured", "seconds": 0, "phases": {},
         "captured_answer": {"token_ids": [1]}, "restored_answers": [[1]]},
        {"engine": "-", "kind": "step", "step": "test_x", "seconds": 61.0},
        {"engine": "-", "kind": "node", "step": "transparent huge pages madvise", "seconds": 0},
    ]  # fmt: skip
    table = scenario.markdown(rows)
    assert "| builtin | restore | 1.25 | same | criu_restore 0.50; refused before: 2x OSError |" in table
    assert "step: test_x | 61.0" in table and "| node: transparent huge pages madvise |" in table
    assert table.count("\n") == 7


def test_the_round_selects_a_transparent_huge_pages_mode_the_chart_takes() -> None:
    """The agent's values the round installs with are ones the chart's schema names."""
    schema = json.loads((scenario.ROOT / "charts/warmstart/values.schema.json").read_text())
    agent = schema["properties"]["agent"]["properties"]
    for name, value in scenario.GPU_AGENT_VALUES.items():
        assert value in agent[name]["enum"], (name, agent[name])


def test_the_engines_wake_phases_are_read_from_its_log() -> None:
    log = "x\nawake: weights_staged_s 0.04, wake_kv_s 0.10, weights_plan_s 0.2, reacquire_s 0.3\n"
    phases = scenario.engine_wake_phases(log)
    assert phases == {"engine_weights_staged": 0.04, "engine_wake_kv": 0.10, "engine_reacquire": 0.3}
