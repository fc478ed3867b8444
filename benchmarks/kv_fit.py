#!/usr/bin/env python3
"""The builtin engine asked for more KV cache than the GPU holds: it serves what fits instead of failing.

Loads Qwen3-8B shapes on CUDA with --max-num-seqs 256 x --max-model-len 4096 (about 145 GiB of KV cache
on its own, more than an H200 has), warms up (CUDA graphs up to the sequences that fit), generates a few
tokens and prints what was sized.

    python3 benchmarks/kv_fit.py [--max-num-seqs 256] [--max-model-len 4096]   # on a GPU host
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    args = parser.parse_args()

    import torch

    from warmstart.engines import create_engine
    from warmstart.engines.base import GenerationRequest, SamplingParams
    from warmstart.engines.builtin.model import kv_nbytes

    started = time.monotonic()
    engine = create_engine(
        "builtin", model=args.model, device="cuda", max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
    )  # fmt: skip
    engine.load()
    engine.warm_up()
    request = GenerationRequest(prompt="The quick brown fox", sampling=SamplingParams(max_tokens=8))
    tokens = list(engine.generate([request])[0].token_ids)
    free, total = torch.cuda.mem_get_info()
    facts = engine.describe()
    report = {
        "asked": {"max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len},
        "asked_kv_gib": round(kv_nbytes(engine.config, args.max_num_seqs + 1, args.max_model_len) / 2**30, 2),
        "serving_max_num_seqs": facts["max_num_seqs"],
        "kv_gib": round(facts["kv_bytes"] / 2**30, 2),
        "weights_gib": round(facts["weights_bytes"] / 2**30, 2),
        "graph_scratch_gib": round(facts["graph_scratch_bytes"] / 2**30, 2),
        "gpu_used_gib": round((total - free) / 2**30, 2),
        "gpu_total_gib": round(total / 2**30, 2),
        "tokens": tokens,
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(report, indent=1))
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
