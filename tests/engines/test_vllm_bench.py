"""The vLLM benchmark's oracle, on CPU: the random-weight model's tokenizer gives every token id text of its
own, and outputs are compared by token ids and logprobs (where they part, by how much), never by text alone.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from warmstart.api.capture_record import CaptureRecord, WorkerRecord

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "benchmarks"))
        return importlib.import_module("vllm_bench")


@pytest.fixture(scope="module")
def tokenizer_dir(bench: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tokenizers", reason="the benchmark's tokenizer needs `tokenizers` (the dev extra)")
    pytest.importorskip(
        "transformers", reason="the benchmark's tokenizer needs `transformers` (the dev extra)"
    )
    directory = tmp_path_factory.mktemp("qwen3-8b-tokenizer")
    bench.write_tokenizer(directory, bench.QWEN3_COMMON["vocab_size"])
    return directory


def test_every_token_id_of_the_model_decodes_to_non_empty_text(
    bench: ModuleType, tokenizer_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)  # as vLLM loads it
    vocab_size = bench.QWEN3_COMMON["vocab_size"]
    assert len(tokenizer) == vocab_size
    texts = tokenizer.batch_decode([[token] for token in range(vocab_size)], skip_special_tokens=False)
    empty = [token for token, text in enumerate(texts) if not text]
    assert empty == [], f"{len(empty)} token ids decode to no text, the first {empty[:10]}"
    # Skipped only where special tokens are skipped (vLLM's default; the benchmark asks not to):
    assert sorted(tokenizer.all_special_ids) == [0, 1]
    # After the special tokens and the 256 byte-level characters (128 of which alone are no UTF-8 and
    # decode to U+FFFD), every token's text is its own.
    beyond_bytes = texts[len(bench.SPECIAL_TOKENS) + 256 :]
    assert len(set(beyond_bytes)) == len(beyond_bytes)
    assert texts[-1].startswith(" w") and texts[-1][2:].isdigit()  # the last filler word


def test_the_prompts_and_the_chat_template_still_tokenize_as_text(
    bench: ModuleType, tokenizer_dir: Path
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    for prompt in bench.PROMPTS:
        ids = tokenizer.encode(prompt)
        assert max(ids) < 1000, "a prompt encoded to filler tokens: the trained merges were lost"
        assert tokenizer.decode(ids) == prompt
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")


def test_a_model_written_with_a_partial_tokenizer_gets_a_full_one(bench: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip(
        "transformers", reason="the benchmark's tokenizer needs `transformers` (the dev extra)"
    )
    (tmp_path / "complete").write_text("1")
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}))
    assert not bench.tokenizer_covers(tmp_path, bench.QWEN3_COMMON["vocab_size"])
    bench.write_model(tmp_path)  # the weights are there ("complete"): only the tokenizer is rewritten
    assert bench.tokenizer_covers(tmp_path, bench.QWEN3_COMMON["vocab_size"])


# --- comparing outputs ------------------------------------------------------------------------------------


def record(ids: list[int], logprobs: list[float], text: str = " w1 w2") -> dict[str, Any]:
    """A completion as the benchmark records it; the runner-up of each token 0.5 below it."""
    top = [
        {str(token): value, str(token + 1): value - 0.5} for token, value in zip(ids, logprobs, strict=True)
    ]
    return {"text": text, "token_ids": ids, "logprobs": logprobs, "top": top}


REFERENCE = [record([5, 6, 7, 8], [-1.0, -2.0, -3.0, -4.0]), record([9, 10], [-0.5, -0.25])]


def test_the_same_ids_and_logprobs_with_text_are_identical(bench: ModuleType) -> None:
    found = bench.compare(REFERENCE, copy.deepcopy(REFERENCE))
    assert found["identical"] and found["token_ids_identical"]
    assert found["first_diff"] == [None, None] and found["max_logprob_diff"] == 0.0


def test_a_differing_token_is_located_with_the_logprob_drift_before_it_and_the_margin(
    bench: ModuleType,
) -> None:
    other = copy.deepcopy(REFERENCE)
    other[0] = record([5, 6, 8, 1], [-1.0, -2.03, -3.1, -9.0])  # token 2 is the reference's runner-up
    found = bench.compare(REFERENCE, other)
    assert not found["identical"] and not found["token_ids_identical"]
    assert found["first_diff"] == [2, None]
    assert found["max_logprob_diff"] == pytest.approx(0.03)  # before the divergence only
    assert found["margin_at_diff"] == [0.5, None]


def test_a_token_outside_the_reference_top_has_no_margin(bench: ModuleType) -> None:
    other = copy.deepcopy(REFERENCE)
    other[1] = record([42, 10], [-0.5, -0.25])
    assert bench.compare(REFERENCE, other)["margin_at_diff"] == [None, None]
    assert bench.compare(REFERENCE, other)["first_diff"] == [None, 0]


def test_logprobs_that_drift_under_the_same_ids_are_not_identical(bench: ModuleType) -> None:
    other = copy.deepcopy(REFERENCE)
    other[1]["logprobs"] = [-0.5, -0.2501]
    found = bench.compare(REFERENCE, other)
    assert found["token_ids_identical"] and not found["identical"]
    assert found["max_logprob_diff"] == pytest.approx(1e-4)


def test_empty_texts_are_never_identical(bench: ModuleType) -> None:
    empty = [dict(row, text="") for row in REFERENCE]
    found = bench.compare(empty, copy.deepcopy(empty))
    assert found["token_ids_identical"] and not found["identical"] and found["empty_texts"] == 2


def test_a_completion_is_read_by_token_ids_and_its_logprobs_must_name_the_same_tokens(
    bench: ModuleType,
) -> None:
    choice = {
        "text": " w7 w8",
        "token_ids": [7, 8],
        "logprobs": {
            "tokens": ["token_id:7", "token_id:8"],
            "token_logprobs": [-1.5, -0.25],
            "top_logprobs": [{"token_id:7": -1.5, "token_id:3": -1.75}, {"token_id:8": -0.25}],
        },
    }
    got = bench.completion_record(choice)
    assert got == {
        "text": " w7 w8",
        "token_ids": [7, 8],
        "logprobs": [-1.5, -0.25],
        "top": [{"7": -1.5, "3": -1.75}, {"8": -0.25}],
    }
    with pytest.raises(ValueError, match="differ"):
        bench.completion_record(dict(choice, token_ids=[7, 9]))
    with pytest.raises(ValueError, match="no token ids"):
        bench.completion_record({k: v for k, v in choice.items() if k != "token_ids"})
    with pytest.raises(ValueError, match="not a token named by its id"):
        bench.token_id("w7")


def test_every_start_is_compared_with_the_capture_and_the_first_cold_start(bench: ModuleType) -> None:
    drifted = copy.deepcopy(REFERENCE)
    drifted[0] = record([5, 6, 7, 3], [-1.0, -2.0, -3.0, -4.2])
    results = [
        {"run": "capture", "outputs": REFERENCE},
        {"run": "restore-image", "outputs": copy.deepcopy(REFERENCE)},
        {"run": "cold-1", "outputs": drifted},
        {"run": "cold-2", "outputs": copy.deepcopy(drifted)},
        {"run": "vllm-serve", "error": "no outputs"},
    ]
    lines = bench.agreement(results)
    capture, restore, cold_1, cold_2, failed = results
    assert "vs_capture" not in capture and capture["vs_cold"]["first_diff"] == [3, None]
    assert restore["vs_capture"]["identical"] and not restore["vs_cold"]["identical"]
    assert "vs_cold" not in cold_1 and cold_2["vs_cold"]["identical"]
    assert "vs_capture" not in failed
    assert len(lines) == 4 and lines[2].startswith("cold-1: vs capture: token ids identical False")


def test_a_run_without_a_capture_compares_every_start_with_the_stored_one(bench: ModuleType) -> None:
    """A call that only restores and cold-starts: every start is put against what the capture on its work
    folder recorded, never left as "the reference"."""
    drifted = copy.deepcopy(REFERENCE)
    drifted[0] = record([5, 6, 7, 3], [-1.0, -2.0, -3.0, -4.2])
    results = [
        {"run": "restore", "outputs": copy.deepcopy(REFERENCE)},
        {"run": "vllm-serve", "outputs": drifted},
    ]
    lines = bench.agreement(results, stored=REFERENCE)
    restore, serve = results
    assert restore["vs_stored_capture"]["identical"] and not serve["vs_stored_capture"]["identical"]
    assert serve["vs_stored_capture"]["first_diff"][0] == 3
    assert not any(line.endswith("the reference") for line in lines), lines
    with_capture = [{"run": "capture", "outputs": drifted}, {"run": "restore", "outputs": REFERENCE}]
    bench.agreement(with_capture, stored=REFERENCE)  # this run's capture is the one compared with
    assert "vs_stored_capture" not in with_capture[1] and not with_capture[1]["vs_capture"]["identical"]


def test_the_stored_capture_is_the_plain_captures_outputs(bench: ModuleType, tmp_path: Path) -> None:
    assert bench.stored_capture(tmp_path) is None
    path = bench.captured_outputs(tmp_path, "store")
    path.parent.mkdir()
    path.write_text(json.dumps(REFERENCE))
    assert bench.stored_capture(tmp_path) == REFERENCE


def test_eager_cold_starts_are_a_reference_of_their_own(bench: ModuleType) -> None:
    drifted = copy.deepcopy(REFERENCE)
    drifted[1] = record([11, 10], [-0.5, -0.25])
    results = [
        {"run": "capture", "outputs": REFERENCE},
        {"run": "cold-1", "outputs": copy.deepcopy(REFERENCE)},
        {"run": "eager-1", "outputs": drifted},
        {"run": "eager-2", "outputs": copy.deepcopy(drifted)},
    ]
    bench.agreement(results)
    capture, cold, eager_1, eager_2 = results
    assert cold["vs_eager"]["first_diff"][1] == 0 and "vs_eager" not in eager_1
    assert eager_2["vs_eager"]["identical"] and not eager_2["vs_cold"]["identical"]
    assert capture["vs_cold"]["identical"] and not capture["vs_eager"]["identical"]


@pytest.mark.parametrize(("shape", "billions"), [("qwen3-0.6b", 0.6), ("qwen3-8b", 8.2), ("qwen3-14b", 14.8)])
def test_each_shape_has_its_published_model_size(bench: ModuleType, shape: str, billions: float) -> None:
    """Parameters of the configuration the bench writes, against the size Qwen publishes for that model."""
    torch = pytest.importorskip("torch", reason="the model's shapes are checked with torch (the dev extra)")
    transformers = pytest.importorskip("transformers", reason="Qwen3's model class (the dev extra)")
    config = transformers.Qwen3Config(**bench.SHAPES[shape])
    with torch.device("meta"):
        model = transformers.Qwen3ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.02)


@pytest.mark.parametrize(
    ("step", "kind", "thp", "cache"),
    [
        ("restore", "restore", False, "hot"),
        ("restore-thp-dropped", "restore", True, "dropped"),
        ("restore-thp-prestaged", "restore", True, "prestaged"),
        ("restore-thp-prestaged-snapshot", "restore", True, "prestaged-snapshot"),
        ("restore-localmem-kept-thp", "restore-localmem-kept", True, "hot"),
        ("restore-image-old-dropped", "restore-image-old", False, "dropped"),
    ],
)
def test_a_restore_step_names_its_store_its_pages_and_its_page_cache(
    bench: ModuleType, step: str, kind: str, thp: bool, cache: str
) -> None:
    assert bench.restore_step(step) == bench.RestoreStep(kind, thp, cache)


@pytest.mark.parametrize("step", ["cold", "capture", "floor", "restore-bogus", "restore-prestaged-weights"])
def test_other_steps_are_not_restores(bench: ModuleType, step: str) -> None:
    assert bench.restore_step(step) is None


def test_each_restore_is_put_against_the_newest_floor_of_its_store_for_the_cache_it_found(
    bench: ModuleType,
) -> None:
    results: list[dict[str, Any]] = [
        {"run": "floor", "store": "store", "hot": {"seconds": 9.0}, "dropped": {"seconds": 90.0}},
        {"run": "floor", "store": "store", "hot": {"seconds": 1.0}, "dropped": {"seconds": 10.0}},
        {"run": "floor", "store": "store-localmem-kept", "hot": {"seconds": 2.0}},
        {"run": "restore-thp", "to_first_token_s": 1.5},
        {"run": "restore-thp-dropped", "to_first_token_s": 12.0},
        {"run": "restore-thp-prestaged", "to_first_token_s": 1.6},
        {"run": "restore-localmem-kept-thp", "to_first_token_s": 1.0},
        {"run": "restore-localmem-kept-thp-dropped", "to_first_token_s": 11.0},  # no dropped floor there
        {"run": "restore-staged", "to_first_token_s": 1.0},  # no floor of its store
        {"run": "restore-thp", "error": "timed out"},
        {"run": "cold-1", "to_first_token_s": 30.0},
    ]
    lines = bench.against_floors(results)
    assert [(row.get("floor_s"), row.get("vs_floor")) for row in results[3:]] == [
        (1.0, 1.5), (10.0, 1.2), (1.0, 1.6), (2.0, 0.5), (None, None), (None, None), (None, None),
        (None, None),
    ]  # fmt: skip
    assert len(lines) == 4 and lines[1] == "restore-thp-dropped: 12.00 s, 1.20x the floor (10.00 s)"


def test_the_floor_counts_the_device_memory_each_engine_checkpointed() -> None:
    from restore_bench import checkpointed_gpu_bytes

    def snapshot(engine: dict[str, Any]) -> Any:  # only the capture record is read
        return SimpleNamespace(record=CaptureRecord(worker=WorkerRecord(engine=engine)))

    asleep = {"gpu_processes_gib": [1.707]}
    assert checkpointed_gpu_bytes(snapshot({"at_release": {"gpu_used_bytes": 5 << 30}})) == 5 << 30
    vllm = {"memory_at_release": {"asleep": asleep, "after_trim": {"gpu_processes_gib": [1.5]}}}
    assert checkpointed_gpu_bytes(snapshot(vllm)) == int(1.5 * 2**30)
    assert checkpointed_gpu_bytes(snapshot({"memory_at_release": {"asleep": asleep}})) == int(1.707 * 2**30)
    assert checkpointed_gpu_bytes(snapshot({})) == 0
