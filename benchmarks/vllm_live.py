#!/usr/bin/env python3
"""vLLM alone, in one process: cold start to the first greedy tokens, then (with --sleeps) sleep level 1 and
level 2 and the time from each wake call to the first token. Prints one JSON line per measurement.
Run by benchmarks/vllm_bench.py with the same engine arguments as the warmstart worker.

After the cold start and after each wake, `--prompts` are completed greedily one at a time (the batch shape
of the benchmark's HTTP requests) and recorded as the benchmark records them: text, token ids, each token's
logprob and the top ones; a wake is identical when its token ids and logprobs are the cold start's and no
text is empty."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

STARTED = time.time()
PROMPT_IDS = [101, 202, 303, 44, 5]


def record(completion: Any) -> dict[str, Any]:
    """One completion as the benchmark compares it (token ids as strings in `top`: what JSON keeps)."""
    ids = list(completion.token_ids)
    steps = list(completion.logprobs or [])
    if len(steps) != len(ids):
        raise RuntimeError(f"{len(ids)} tokens but logprobs for {len(steps)}")
    return {
        "text": completion.text,
        "token_ids": ids,
        "logprobs": [step[token].logprob for step, token in zip(steps, ids, strict=True)],
        "top": [{str(token): value.logprob for token, value in step.items()} for step in steps],
    }


def outputs(llm: Any, prompts: list[Any], params: Any) -> list[dict[str, Any]]:
    return [record(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]) for prompt in prompts]


def identical(reference: list[dict[str, Any]], got: list[dict[str, Any]]) -> bool:
    def key(rows: list[dict[str, Any]]) -> list[Any]:
        return [(row["token_ids"], row["logprobs"]) for row in rows]

    return key(got) == key(reference) and all(row["text"] for row in got)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--gpu-util", type=float, default=0.85)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--label", default="vllm")
    parser.add_argument("--sleeps", action="store_true")
    parser.add_argument("--prompts", default="[]", help="JSON list of prompts to record (the benchmark's)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--top-logprobs", type=int, default=2)
    args = parser.parse_args()
    prompts = json.loads(args.prompts) or [{"prompt_token_ids": PROMPT_IDS}]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    imported = time.time()
    llm = LLM(args.model, dtype="bfloat16", enable_sleep_mode=True, gpu_memory_utilization=args.gpu_util,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)  # fmt: skip
    up = time.time()
    prompt = [{"prompt_token_ids": PROMPT_IDS}]
    one = SamplingParams(temperature=0, max_tokens=1, detokenize=False)
    many = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=args.top_logprobs,
                          skip_special_tokens=False)  # fmt: skip
    llm.generate(prompt, one, use_tqdm=False)
    first = time.time()
    reference = outputs(llm, prompts, many)
    print(json.dumps({"run": args.label, "import_s": round(imported - STARTED, 2),
                      "llm_up_s": round(up - imported, 2), "to_first_token_s": round(first - STARTED, 2),
                      "outputs": reference}), flush=True)  # fmt: skip
    if not args.sleeps:
        return
    for level in (1, 2):
        llm.sleep(level=level)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        started = time.time()
        if level == 1:
            llm.wake_up()
        else:
            llm.wake_up(tags=["weights"])
            llm.collective_rpc("reload_weights")
            llm.wake_up(tags=["kv_cache"])
        llm.reset_prefix_cache()
        woken = time.time()
        llm.generate(prompt, one, use_tqdm=False)
        first = time.time()
        again = outputs(llm, prompts, many)
        print(json.dumps({"run": f"{args.label}-wake-level-{level}",
                          "gpu_gib_asleep": round((total - free) / 2**30, 2),
                          "wake_s": round(woken - started, 3), "to_first_token_s": round(first - started, 3),
                          "identical": identical(reference, again),
                          "outputs": again}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
