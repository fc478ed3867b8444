#!/usr/bin/env python3
"""vLLM on one GPU, one run: `warmstart serve --engine vllm` (cold + capture, then restores) against vLLM's
own cold start and its wake from sleep levels 1 and 2 in a live process; page cache hot, dropped, and
dropped then pre-staged as a node's agent and the endpoint's stager DaemonSet do; every restore against its
floor (`floor`: every byte it reads and puts on the GPU, measured in the same run).

    python3 benchmarks/vllm_bench.py --criu "DIR/ld-linux-x86-64.so.2 --library-path DIR DIR/criu" \\
        --model /var/tmp/qwen3-8b-shapes --work /var/tmp/warmstart-vllm --out results/

The model is Qwen3-8B's configuration with seeded random bf16 weights (written once), and a byte-level
tokenizer trained on the spot whose vocabulary is filled up to the model's, so that every token id the
model can emit decodes to non-empty text. Every start is timed from the command's launch to the first
token of a greedy completion received over HTTP. After it, a fixed prompt set is completed greedily, one
prompt at a time (the same batch shape every time), and the token ids and their logprobs are recorded; every
start is compared with the captured process and with the first separate cold start of each kind (`cold`
steps: `warmstart worker --mode cold`, the same engine arguments; `cold-eager`: the same without CUDA graphs
or compiled kernels): where the token ids first differ, the largest
logprob difference before that, and how far apart the two tokens were where they differ. Needs root, vLLM,
CRIU >= 4.2.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["hello world the snapshot", "the worker restores in seconds", "snapshot hello", "world"]
TOKENS = 16
TOP_LOGPROBS = 2  # per generated token: its own logprob and the best alternatives (how close a tie was)
SPECIAL_TOKENS = ["<unk>", "<|endoftext|>"]
# Separate cold starts (no snapshot) by step, and the label of each (numbered: cold-1, eager-1, ...); every
# start is compared with the first of each kind.
SEPARATE_COLDS = {"cold": "cold", "cold-eager": "eager"}
FILLER_PREFIX = "\u0120w"  # byte-level for " w": filler token i decodes to " w<i>"
# A ChatML template, so vLLM's chat route has one to apply (the tokenizer is trained here, without one).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN3_COMMON = dict(
    vocab_size=151936, head_dim=128, num_key_value_heads=8, max_position_embeddings=40960,
    rope_theta=1000000.0, rms_norm_eps=1e-6,
)  # fmt: skip
SHAPES = {  # the published Qwen3 configurations' shapes
    "qwen3-0.6b": dict(QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, tie_word_embeddings=True),
    "qwen3-8b": dict(QWEN3_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, tie_word_embeddings=False),
    "qwen3-14b": dict(QWEN3_COMMON, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                      num_attention_heads=40, tie_word_embeddings=False),
    # Not a published model: small enough for the writer's own test on CPU.
    "qwen3-tiny": dict(QWEN3_COMMON, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=8, tie_word_embeddings=False),
}  # fmt: skip


# What the refill file says for each restore from the weights image (read by the resumed engine): the
# current defaults (16 MiB chunks, the KV cache mapped beside the refill) or the 2026-12-01 way ("-old").
REFILLS = {
    "restore-image": "image",
    "restore-image-old": "image threads=8 chunk=64 overlap=0",
    "restore-reload": "reload",
}
# The stores: "store" is captured as a user's worker is (a weight stager fills the weights into the KV
# cache's own allocations while CRIU restores the process), "store-staged-kv" the same, asked for
# explicitly, "store-staged" with the stager's block apart from the KV cache (the default until 2026-12-05),
# "store-image" with a weights image, "store-notrim" with cached memory kept.
# `restore-staged-off` restores a staged snapshot with no stager: the weights from the model's files.
CAPTURES = {
    "capture": ("store", {}),
    "capture-staged": (
        "store-staged",
        {"WARMSTART_VLLM_STAGED_WEIGHTS": "1", "WARMSTART_VLLM_KV_STAGED": "0"},
    ),
    "capture-staged-kv": (
        "store-staged-kv",
        {"WARMSTART_VLLM_STAGED_WEIGHTS": "1", "WARMSTART_VLLM_KV_STAGED": "1"},
    ),
    "capture-image": ("store-image", {}),
    "capture-notrim": ("store-notrim", {"WARMSTART_VLLM_TRIM": "0"}),
    # the GPU's local-memory reserve left in the checkpoint (`warmstart/gpu/local_memory.py`)
    "capture-localmem-kept": ("store-localmem-kept", {"WARMSTART_SHRINK_LOCAL_MEMORY": "0"}),
}
RESTORES = {  # store, environment of the restoring side
    "restore": ("store", {}),
    "restore-staged": ("store-staged", {}),
    "restore-staged-off": ("store-staged", {"WARMSTART_WEIGHT_STAGER": "0"}),  # no stager: the files
    "restore-staged-rehash": ("store-staged", {"WARMSTART_VERIFIED_RECORDS": "0"}),  # every blob hashed
    "restore-staged-kv": ("store-staged-kv", {}),  # the KV cache woken on the stager's memory
    "restore-notrim": ("store-notrim", {}),
    "restore-localmem-kept": ("store-localmem-kept", {}),
    # fewer stager threads: less of the host's memory bandwidth taken from the CUDA restore running beside it
    "restore-stager-4": ("store", {"WARMSTART_STAGER_THREADS": "4"}),
    **{kind: ("store-image", {}) for kind in REFILLS},
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@contextlib.contextmanager
def transparent_hugepages(mode: str | None) -> Any:
    """The kernel's THP mode for one step (`always` lets CRIU's restore fault the image in 2 MiB pages)."""
    if mode is None:
        yield
        return
    text = THP.read_text()
    before = text[text.index("[") + 1 : text.index("]")]
    THP.write_text(mode)
    try:
        yield
    finally:
        THP.write_text(before)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


# --- the model -----------------------------------------------------------------------------------------


def full_vocabulary_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE trained on the prompts, its vocabulary filled up to `vocab_size` with distinct words
    (" w0", " w1", ...): a random-weight model emits ids from all of its vocabulary, and each must decode to
    text of its own, or comparing texts compares nothing."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([" ".join(PROMPTS) * 40] * 20, trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    if len(vocab) > vocab_size:
        raise ValueError(f"the trained vocabulary ({len(vocab)}) outgrew the model's ({vocab_size})")
    words = (f"{FILLER_PREFIX}{index}" for index in itertools.count())
    while len(vocab) < vocab_size:
        vocab.setdefault(next(words), len(vocab))  # ids stay 0..n-1: a word already there is skipped
    return Tokenizer.from_str(json.dumps(spec))


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(
        tokenizer_object=full_vocabulary_tokenizer(vocab_size),
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(directory)


def tokenizer_covers(directory: Path, vocab_size: int) -> bool:
    """Whether the directory's tokenizer has a token for every id of the model's vocabulary."""
    try:
        vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
    except (OSError, ValueError, KeyError):
        return False
    return len(vocab) == vocab_size


def write_model(directory: Path, shape: str = "qwen3-8b", seed: int = 0) -> None:
    """A Qwen3 model's shapes (SHAPES), seeded random bf16 weights in 4 GiB safetensors shards, and the
    tokenizer above (rewritten in a model written before it covered the vocabulary)."""
    vocab_size = QWEN3_COMMON["vocab_size"]
    if (directory / "complete").exists():
        if not tokenizer_covers(directory, vocab_size):
            write_tokenizer(directory, vocab_size)
            log(f"tokenizer of {directory} rewritten to cover the vocabulary")
        return
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    started = time.time()
    directory.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(**SHAPES[shape], torch_dtype="bfloat16", architectures=["Qwen3ForCausalLM"])
    config.save_pretrained(directory)
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in Qwen3ForCausalLM(config).state_dict().items()}
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the same seed draws other weights on each
    generator = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, Any] = {}
    weight_map: dict[str, str] = {}
    size, index = 0, 0

    def flush() -> None:
        nonlocal shard, size, index
        name = f"model-{index:05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, size, index = {}, 0, index + 1

    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, device=device, generator=generator) * 0.02).to(torch.bfloat16).cpu()
        shard[name] = tensor
        size += tensor.numel() * 2
        if size >= 4 << 30:
            flush()
    if shard:
        flush()
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    write_tokenizer(directory, vocab_size)
    (directory / "complete").write_text("1")
    log(f"model written to {directory} in {time.time() - started:.1f} s")


# --- HTTP ----------------------------------------------------------------------------------------------


def post(url: str, body: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def first_token(base: str, model: str, deadline: float, alive: Any) -> float:
    """Poll until a one-token greedy completion comes back; returns when it did (epoch seconds)."""
    while time.time() < deadline:
        if not alive():
            raise RuntimeError("the server exited before it served")
        try:
            post(f"{base}/v1/completions", {"model": model, "prompt": PROMPTS[0], "max_tokens": 1,
                                            "temperature": 0}, timeout=30)  # fmt: skip
            return time.time()
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            time.sleep(0.02)
    raise TimeoutError("no first token before the deadline")


def get(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def api_checks(base: str, model: str) -> dict[str, Any]:
    """What users of vLLM's server expect beyond plain completions: each check's outcome or its error."""

    def chat(**extra: Any) -> dict[str, Any]:
        messages = [{"role": "user", "content": PROMPTS[1]}]
        body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
        return post(f"{base}/v1/chat/completions", body)["choices"][0]

    def logprobs() -> bool:
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "logprobs": 2}
        top = post(f"{base}/v1/completions", body)["choices"][0]["logprobs"]["top_logprobs"]
        return len(top) == 2 and all(len(alternatives) >= 1 for alternatives in top)

    def json_object() -> bool:  # structured output: the grammar forces an object, however the weights
        content = chat(max_tokens=24, response_format={"type": "json_object"})["message"]["content"]
        return content.lstrip().startswith("{")

    def metrics() -> bool:
        text = get(f"{base}/metrics")
        return all(name in text for name in ("vllm:num_requests_running", "vllm:generation_tokens"))

    checks = {
        "chat": lambda: chat()["message"]["content"] is not None,
        "logprobs": logprobs,
        "json_object": json_object,
        "tokenize": lambda: len(post(f"{base}/tokenize", {"model": model, "prompt": PROMPTS[0]})["tokens"]),
        "vllm_metrics": metrics,
    }
    outcome: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            outcome[name] = bool(check())
        except (urllib.error.URLError, OSError, KeyError, IndexError, TypeError, ValueError) as exc:
            http_error = isinstance(exc, urllib.error.HTTPError)
            detail = exc.read().decode(errors="replace")[:300] if http_error else ""
            outcome[name] = f"error: {exc} {detail}".strip()
    return outcome


# --- outputs: token ids and logprobs, the oracle ---------------------------------------------------------


def completion_body(model: str, prompt: str) -> dict[str, Any]:
    """A greedy completion that answers its token ids and each token's logprob with the best alternatives'
    (tokens named by id, `token_id:N`; special tokens not skipped, so every token has text)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": TOP_LOGPROBS,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }


def token_id(name: str) -> int:
    """`token_id:N`, vLLM's name of a token under return_tokens_as_token_ids -> N."""
    prefix, _, number = name.partition(":")
    if prefix != "token_id" or not number.isdigit():
        raise ValueError(f"not a token named by its id: {name!r}")
    return int(number)


def completion_record(choice: dict[str, Any]) -> dict[str, Any]:
    """What is compared of one completion: its text, token ids, each token's logprob and the top ones
    (token id -> logprob, as strings: what JSON keeps)."""
    ids = choice.get("token_ids")
    logprobs = choice.get("logprobs") or {}
    if ids is None or not logprobs.get("tokens"):
        raise ValueError(f"the server answered no token ids or logprobs: {sorted(choice)}")
    named = [token_id(name) for name in logprobs["tokens"]]
    if named != list(ids):
        raise ValueError(f"token_ids {ids} and the logprobs' tokens {named} differ")
    steps = logprobs["top_logprobs"]
    top = [{str(token_id(name)): lp for name, lp in (step or {}).items()} for step in steps]
    chosen = logprobs["token_logprobs"]
    return {"text": choice["text"], "token_ids": list(ids), "logprobs": chosen, "top": top}


def greedy(base: str, model: str) -> tuple[list[dict[str, Any]], list[float]]:
    """The prompt set, one prompt at a time (the batch shape of every start alike), and each request's
    seconds (the first of a restore paying for anything its captured process never ran, a kernel compiled)."""
    records, seconds = [], []
    for prompt in PROMPTS:
        started = time.perf_counter()
        answer = post(f"{base}/v1/completions", completion_body(model, prompt))
        seconds.append(round(time.perf_counter() - started, 3))
        records.append(completion_record(answer["choices"][0]))
    return records, seconds


def divergence(reference: dict[str, Any], output: dict[str, Any]) -> dict[str, Any]:
    """Where one completion parts from the reference: the first token index whose id differs (None: none),
    the largest logprob difference before it (same context, same token), and at it how much more likely the
    reference's token was than the other one in the reference's own distribution (None: the other token
    was not among the reference's top logprobs there)."""
    expected, got = reference["token_ids"], output["token_ids"]
    first = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
    if first is None and len(expected) != len(got):
        first = min(len(expected), len(got))
    end = len(expected) if first is None else first
    pairs = zip(reference["logprobs"][:end], output["logprobs"][:end], strict=False)
    gaps = [abs(a - b) for a, b in pairs if a is not None and b is not None]
    margin = None
    if first is not None and first < min(len(got), len(reference["top"])):
        top = reference["top"][first]
        mine, theirs = top.get(str(expected[first])), top.get(str(got[first]))
        if mine is not None and theirs is not None:
            margin = round(mine - theirs, 6)
    return {"first_diff": first, "max_logprob_diff": max(gaps, default=0.0), "margin": margin}


def compare(reference: list[dict[str, Any]], outputs: list[dict[str, Any]]) -> dict[str, Any]:
    """`outputs` against `reference`, prompt by prompt. Identical: the same token ids with the same logprobs,
    and every text non-empty (an empty text means the tokenizer hid the tokens: nothing was compared)."""
    parts = [divergence(expected, got) for expected, got in zip(reference, outputs, strict=True)]
    same_ids = all(part["first_diff"] is None for part in parts)
    largest = max((part["max_logprob_diff"] for part in parts), default=0.0)
    empty = sum(1 for output in outputs if not output["text"])
    return {
        "identical": same_ids and largest == 0.0 and empty == 0,
        "token_ids_identical": same_ids,
        "first_diff": [part["first_diff"] for part in parts],
        "max_logprob_diff": largest,
        "margin_at_diff": [part["margin"] for part in parts],
        "empty_texts": empty,
    }


def agreement(results: list[dict[str, Any]], stored: list[dict[str, Any]] | None = None) -> list[str]:
    """Every start against every captured process of the run and against its first separate cold start
    (`vs_<capture step>`, `vs_cold` in its row, beside `vs_own_capture`, which the start wrote itself); one
    line each. Two captures are two cold starts too. A run without a capture step compares every start with
    `stored`, what the last capture on its work folder recorded (`vs_stored_capture`)."""
    references = {row["run"]: row for row in results if row["run"] in CAPTURES and row.get("outputs")}
    if not references and stored:
        references["stored_capture"] = {"run": "stored_capture", "outputs": stored}
    for kind in SEPARATE_COLDS.values():  # the first of each kind of separate cold start
        references[kind] = next(
            (row for row in results if row["run"].startswith(f"{kind}-") and row.get("outputs")), None
        )
    lines = []
    for row in results:
        if not row.get("outputs"):
            continue
        said = []
        for name, reference in references.items():
            if reference is not None and reference is not row:
                row[f"vs_{name}"] = found = compare(reference["outputs"], row["outputs"])
                said.append(f"vs {name}: {summary(found)}")
        lines.append(f"{row['run']}: " + ("; ".join(said) or "the reference"))
    return lines


def summary(found: dict[str, Any]) -> str:
    if found["identical"]:
        return "identical (token ids, logprobs, non-empty texts)"
    return (
        f"token ids identical {found['token_ids_identical']}, first differing token per prompt "
        f"{found['first_diff']}, max logprob difference before it {found['max_logprob_diff']:.6g}, "
        f"margin there {found['margin_at_diff']}, empty texts {found['empty_texts']}"
    )


# --- warmstart serve -----------------------------------------------------------------------------------


def serve_once(
    args: argparse.Namespace,
    label: str,
    results: list[dict[str, Any]],
    reference: list[dict[str, Any]] | None,
    store: str = "store",
    env_extra: dict[str, str] | None = None,
):
    argv = [sys.executable, "-m", "warmstart", "serve", "--engine", "vllm", "--model", str(args.model),
            "--device", "cuda", "--store", str(args.work / store), "--work-dir", str(args.work / "pods"),
            "--port", str(args.port), "--criu", args.criu]  # fmt: skip
    argv += [f"--worker-arg={flag}" for flag in engine_flags(args)]
    env = dict(os.environ, **(env_extra or {}))
    if store == "store-image":
        env["WARMSTART_VLLM_WEIGHTS_IMAGE"] = str(args.work / "weights-image")
    return timed_server(args, argv, env, label, results, reference)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The worker's engine arguments: the same for the capture, every restore and every cold start."""
    return [
        "--dtype=bfloat16",
        f"--gpu-memory-utilization={args.gpu_util}",
        f"--max-model-len={args.max_model_len}",
        f"--max-num-seqs={args.max_num_seqs}",
    ]


def cold_worker(
    args: argparse.Namespace, label: str, results: list[dict[str, Any]], reference: Any, eager: bool = False
) -> None:
    """A separate cold start of the capture's engine spec: `warmstart worker --mode cold`, no snapshot;
    `eager`: without CUDA graphs or compiled kernels (`--enforce-eager`), to tell their part in how cold
    starts disagree."""
    argv = [sys.executable, "-m", "warmstart", "worker", "--engine", "vllm", "--model", str(args.model),
            "--device", "cuda", "--mode", "cold", "--host", "127.0.0.1", "--port", str(args.port),
            "--log-dir", str(args.work / "pods" / label), *engine_flags(args)]  # fmt: skip
    argv += ["--enforce-eager"] if eager else []
    timed_server(args, argv, dict(os.environ), label, results, reference)


def vllm_serve(args: argparse.Namespace, label: str, results: list[dict[str, Any]], reference: Any) -> None:
    """vLLM's own `vllm serve` (engine core in its own process, as users run it), the same engine args."""
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model),
            "--served-model-name", Path(args.model).name, "--host", "127.0.0.1", "--port", str(args.port),
            "--dtype", "bfloat16", "--gpu-memory-utilization", str(args.gpu_util),
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]  # fmt: skip
    timed_server(args, argv, dict(os.environ), label, results, reference)


def timed_server(
    args: argparse.Namespace,
    argv: list[str],
    env: dict[str, str],
    label: str,
    results: list[dict[str, Any]],
    reference: list[dict[str, Any]] | None,
) -> list[dict[str, Any]] | None:
    """Start a server, time it to the first token over HTTP, record and compare its greedy outputs, check
    its API."""
    port = args.port
    log_path = args.out / f"serve-{len(results) + 1:02d}-{label}.log"  # one per start, in the run's order
    started = time.time()
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                   start_new_session=True)  # fmt: skip
    row: dict[str, Any] = {"run": label}
    try:
        model = Path(args.model).name
        got = first_token(
            f"http://127.0.0.1:{port}", model, started + args.start_timeout, lambda: process.poll() is None
        )
        row["to_first_token_s"] = round(got - started, 3)
        outputs, row["request_s"] = greedy(f"http://127.0.0.1:{port}", model)
        row["outputs"] = outputs
        # Against its own capture (the run's first, for a separate start); `agreement` writes `vs_<step>`.
        row["vs_own_capture"] = None if reference is None else compare(reference, outputs)
        row["api"] = api_checks(f"http://127.0.0.1:{port}", model)
        against = (
            "the reference" if reference is None else f"vs its capture: {summary(row['vs_own_capture'])}"
        )
        log(
            f"{label}: first token after {row['to_first_token_s']:.2f} s; requests {row['request_s']} s; "
            f"{against}; api {row['api']}"
        )
    except (RuntimeError, TimeoutError, urllib.error.URLError, KeyError, ValueError) as exc:
        row["error"] = str(exc)
        log(f"{label}: FAILED {exc}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    text = log_path.read_text(errors="replace")
    for line in text.splitlines():
        table_row = "│" in line and ("restore" in line or "cold" in line)
        if table_row or line.startswith("phases:") or "CUDA restore" in line:
            row.setdefault("report", []).append(line.strip())
    results.append(row)
    return row.get("outputs")


def engine_logs(work: Path, out: Path) -> None:
    logs = sorted((work / "pods").rglob("engine.log"), key=lambda p: p.stat().st_mtime)
    with open(out / "engine-logs.txt", "w") as sink:
        for path in logs:
            sink.write(f"===== {path}\n")
            for line in path.read_text(errors="replace").splitlines():
                if "it/s]" not in line:
                    sink.write(line + "\n")
    with open(out / "criu-logs.txt", "w") as sink:
        for path in sorted((work / "pods").rglob("*.log")):
            if path.name in ("dump.log", "restore.log"):
                lines = path.read_text(errors="replace").splitlines()
                sink.write(f"===== {path} ({len(lines)} lines)\n")
                bad = [line for line in lines if "Error" in line or "Warn" in line or "fail" in line.lower()]
                sink.write("\n".join(bad[:60] + lines[-15:]) + "\n")


def image_sizes(work: Path, store: str = "store") -> dict[str, Any]:
    """What the newest snapshot holds: how many files (a restore verifies and links each), CRIU page images
    (host memory) and everything else."""
    manifests = sorted((work / store / "snapshots").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    if not manifests:
        return {}
    manifest = json.loads(manifests[-1].read_text())
    files = manifest.get("files", {})
    pages = sum(f["size"] for name, f in files.items() if Path(name).name.startswith("pages-"))
    total = sum(f["size"] for f in files.values())
    biggest = sorted(((f["size"], name) for name, f in files.items()), reverse=True)[:8]
    return {"snapshot": manifests[-1].parent.name, "files": len(files), "total_bytes": total,
            "pages_bytes": pages, "other_bytes": total - pages,
            "largest": [[name, size] for size, name in biggest]}  # fmt: skip


# --- the floor: every byte a restore moves, and the page cache before a restore --------------------------


def newest_snapshot(work: Path, store: str) -> tuple[Any, Any]:
    from warmstart.snapshot.store import SnapshotStore

    snapshots = SnapshotStore(work / store)
    return snapshots, snapshots.list()[0]


def floor_step(args: argparse.Namespace, results: list[dict[str, Any]], store: str = "store") -> None:
    """The floors of a restore of `store`'s newest snapshot, measured as the builtin engine's benchmark
    measures them (`restore_bench.restore_floors`): its CRIU image and the weights read (page cache hot;
    dropped, the faster of 8 and 32 readers), the weights and the checkpointed device memory to the GPU at
    the pinned rate, and CRIU's cost for a trivial process. Each piece is counted one after the other. In a
    child process: its CUDA context is gone before the next start."""
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=spawn) as child:
        row = child.submit(measure_floors, args.criu, args.work, store).result()
    results.append(row)
    if "error" in row:
        log(f"floor: FAILED {row['error']}")
    for cache in ("hot", "dropped"):
        if cache in row:
            log(f"floor, page cache {cache}: {row[cache]['seconds']:.2f} s = {row[cache]['detail']}")


def measure_floors(criu_command: str, work: Path, store: str) -> dict[str, Any]:
    from restore_bench import restore_floors

    from warmstart.serve.local_node import usable_criu

    criu, why_not = usable_criu(criu_command)
    if criu is None:
        return {"run": "floor", "store": store, "error": why_not}
    snapshots, snapshot = newest_snapshot(work, store)
    scratch = Path(tempfile.mkdtemp(prefix="floor-", dir=work))
    try:
        floors = restore_floors(snapshots, snapshot, criu, scratch, can_drop=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    row: dict[str, Any] = {"run": "floor", "store": store, "snapshot": snapshot.id}
    for floor in floors:
        row[floor.cache] = {"seconds": round(floor.seconds, 3), "detail": floor.detail}
    return row


def prestage(args: argparse.Namespace, store: str, with_weights: bool) -> float:
    """After a dropped page cache: the snapshot's blobs read back as the node agent pre-stages them (and the
    model's files, as the endpoint's stager DaemonSet does, `with_weights`); the seconds it took."""
    from restore_bench import prestage as read_ahead

    drop_caches()
    return read_ahead(*newest_snapshot(args.work, store), with_weights)


def against_floors(results: list[dict[str, Any]]) -> list[str]:
    """Every restore put against the newest floor of its store measured in the run, for the page cache it
    found: dropped for `-dropped`, hot for the others (a pre-staged restore finds what it reads in memory)."""
    floors = {row["store"]: row for row in results if row.get("run") == "floor" and "error" not in row}
    lines = []
    for row in results:
        parsed = restore_step(row.get("run", ""))
        if parsed is None or "to_first_token_s" not in row:
            continue
        store = RESTORES[parsed.kind][0]
        floor = (floors.get(store) or {}).get("dropped" if parsed.cache == "dropped" else "hot")
        if floor is None:
            continue
        row["floor_s"] = floor["seconds"]
        row["vs_floor"] = round(row["to_first_token_s"] / floor["seconds"], 3)
        lines.append(f"{row['run']}: {row['to_first_token_s']:.2f} s, {row['vs_floor']:.2f}x the floor "
                     f"({floor['seconds']:.2f} s)")  # fmt: skip
    return lines


# --- vLLM alone ----------------------------------------------------------------------------------------


def vllm_alone(args: argparse.Namespace, label: str, sleeps: bool, results: list[dict[str, Any]]) -> None:
    argv = [sys.executable, str(REPO / "benchmarks" / "vllm_live.py"), "--model", str(args.model),
            "--gpu-util", str(args.gpu_util), "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(args.max_num_seqs), "--label", label, "--prompts", json.dumps(PROMPTS),
            "--tokens", str(TOKENS), "--top-logprobs", str(TOP_LOGPROBS)]  # fmt: skip
    argv += ["--sleeps"] if sleeps else []
    with open(args.out / f"vllm-{label}.log", "w") as log_file:
        code = subprocess.run(
            argv, stdout=subprocess.PIPE, stderr=log_file, text=True, timeout=args.start_timeout + 120
        )
    for line in code.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results.append(row)
            log(f"{label}: {json.dumps({key: value for key, value in row.items() if key != 'outputs'})}")
    if code.returncode:
        results.append({"run": label, "error": f"exit {code.returncode}"})


def captured_outputs(work: Path, store: str) -> Path:
    """Where a capture keeps its process's outputs: the reference of every restore of its store, also in a
    later run on the same work folder."""
    return work / store / "capture-outputs.json"


def stored_capture(work: Path) -> list[dict[str, Any]] | None:
    """What the plain capture on this work folder recorded, from an earlier run: None when there is none."""
    path = captured_outputs(work, CAPTURES["capture"][0])
    return json.loads(path.read_text()) if path.exists() else None


@dataclass(frozen=True)
class RestoreStep:
    kind: str  # a key of RESTORES
    thp: bool  # transparent huge pages `always` while it restores
    cache: str  # the page cache it finds: hot, or one of CACHE_STATES


# What a restore step's last suffix does to the page cache first (longest first: the first that matches).
CACHE_STATES = ("prestaged-snapshot", "prestaged", "dropped")


def restore_step(step: str) -> RestoreStep | None:
    """`restore[-<variant>][-thp][-<cache state>]`, or None for a step that is not a restore."""
    rest, cache = step, "hot"
    for state in CACHE_STATES:
        if rest.endswith(f"-{state}"):
            rest, cache = rest.removesuffix(f"-{state}"), state
            break
    kind = rest.removesuffix("-thp")
    return RestoreStep(kind, kind != rest, cache) if kind in RESTORES else None


def restore(args: argparse.Namespace, step: str, parsed: RestoreStep, results: list[dict[str, Any]]) -> None:
    if parsed.kind in REFILLS:
        refill = args.work / "weights-image" / "refill"
        refill.parent.mkdir(parents=True, exist_ok=True)
        refill.write_text(REFILLS[parsed.kind])
    store, env_extra = RESTORES[parsed.kind]
    read_ahead_s = None
    if parsed.cache == "dropped":
        drop_caches()
    elif parsed.cache.startswith("prestaged"):
        read_ahead_s = prestage(args, store, with_weights=parsed.cache == "prestaged")
        log(f"{step}: pre-staged after a dropped page cache in {read_ahead_s:.2f} s")
    own = captured_outputs(args.work, store)
    reference = json.loads(own.read_text()) if own.exists() else None
    with transparent_hugepages("always" if parsed.thp else None):
        serve_once(args, step, results, reference, store, env_extra)
    if read_ahead_s is not None:
        results[-1]["prestage_s"] = round(read_ahead_s, 3)


def run_step(
    args: argparse.Namespace, step: str, label: str, results: list[dict[str, Any]], reference: Any
) -> Any:
    """One step; returns the outputs a capture recorded (the first is the reference of every separate cold
    start; each restore is compared with its own store's capture)."""
    if step in CAPTURES:
        store, env_extra = CAPTURES[step]
        outputs = serve_once(args, step, results, reference, store, env_extra)
        results[-1]["image"] = image_sizes(args.work, store)
        if outputs is not None:
            captured_outputs(args.work, store).write_text(json.dumps(outputs))
        return outputs
    if (parsed := restore_step(step)) is not None:
        restore(args, step, parsed, results)
    elif step == "floor" or step.startswith("floor-"):  # floor-<store>: of another store's snapshot
        floor_step(args, results, step.removeprefix("floor-") if step != "floor" else "store")
    elif step in SEPARATE_COLDS:
        cold_worker(args, label, results, reference, eager=step == "cold-eager")
    elif step == "vllm-serve":
        vllm_serve(args, step, results, reference)
    elif step.startswith("vllm-"):
        if step.endswith("dropped"):
            drop_caches()
        vllm_alone(args, step, step == "vllm-hot", results)
    else:
        raise SystemExit(f"unknown step {step!r}")
    return None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--criu", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b", help="of a model written anew")
    parser.add_argument("--work", type=Path, default=Path("/var/tmp/warmstart-vllm"))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "local")
    parser.add_argument("--port", type=int, default=8130)
    parser.add_argument("--gpu-util", type=float, default=0.85)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument(
        "--steps",
        default="capture,restore,restore-dropped,vllm-serve,vllm-hot",
        help="comma-separated: capture (as a user's worker), capture-staged (a staging plan), capture-image "
        "(a weights image), capture-notrim, capture-localmem-kept (the GPU's local-memory reserve kept in "
        "the checkpoint); restore, restore-staged (a weight stager), restore-staged-off "
        "(the same snapshot, no stager), restore-staged-rehash (no verified records: every blob hashed), "
        "restore-image[-old], restore-reload, restore-notrim, restore-localmem-kept, restore-stager-4 (4 "
        "stager threads, not 8) (each from its "
        "capture; -thp: transparent huge pages always; -dropped: page cache dropped first; "
        "-prestaged-snapshot, -prestaged: dropped, then the snapshot's blobs read back as the node agent "
        "pre-stages them, and the model's files too); floor (every byte a restore of the newest snapshot "
        "moves, hot and dropped: each restore of its store is put against it; floor-<store> for another "
        "store's, e.g. floor-store-localmem-kept); cold (a "
        "separate `warmstart worker` cold start; repeatable: cold-1, cold-2, ...), cold-eager (the same with "
        "--enforce-eager: eager-1, eager-2, ...), vllm-serve, vllm-hot, vllm-dropped",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    write_model(args.model, args.shape)
    results: list[dict[str, Any]] = []
    reference = stored = stored_capture(args.work)
    counts = {step: itertools.count(1) for step in SEPARATE_COLDS}
    try:
        for step in args.steps.split(","):
            label = f"{SEPARATE_COLDS[step]}-{next(counts[step])}" if step in SEPARATE_COLDS else step
            outputs = run_step(args, step, label, results, reference)
            if step in CAPTURES and outputs is None:
                break
            reference = reference or outputs
            # after every step, so a run stopped at its time limit still leaves its results
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
    finally:
        engine_logs(args.work, args.out)
        lines = agreement(results, stored)
        lines += ["== restores against the floor (every byte)", *against_floors(results)]
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
    for row in results:
        row = {k: v for k, v in row.items() if k not in ("outputs",)}
        print(json.dumps(row))
    print("== outputs compared (token ids and logprobs)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
