"""Training the `demo` preset: a character-level model (the byte tokenizer) fitted to `demo_text.txt`.

Random weights answer with byte noise, and noise cannot show whether a worker came back whole. A model trained
for a few hundred steps on five kilobytes of plain English answers in words: greedy decoding of a prompt that
opens sentences of the text ("The snapshot") continues one of them. The text is written for this package;
nothing is downloaded.

Training is repeatable on one machine: a fixed seed for the initial weights (the generated model's, so the
seed still names the model) and for the batches, a fixed number of steps and a fixed thread count. The files,
not this recipe, define the model: its digest is the weights' bytes, as for every other model. About half a
minute on two CPU cores (a few hundred thousand tokens, some eighty passes over the text).

`python -m warmstart.engines.builtin.train DIR SEED` trains the model that DIR/config.json describes and
writes DIR/model.safetensors (`model_dir.ensure_model` runs it in a child process).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from warmstart.engines.builtin.model import Transformer
from warmstart.engines.builtin.model_dir import WEIGHTS_FILE, initial_tensor
from warmstart.engines.builtin.shapes import ModelConfig, tensor_shapes
from warmstart.engines.builtin.tokenizer import ByteTokenizer
from warmstart.gpu.weights_io import dtype_code, write_safetensors

TEXT_FILE = Path(__file__).with_name("demo_text.txt")
STEPS = 400
BATCH = 8  # sequences per step: half start at a paragraph, half anywhere
SEQUENCE = 128  # tokens per sequence, BOS included: enough for a prompt and a few dozen generated characters
LEARNING_RATE = 5e-3
WARMUP_STEPS = 30
THREADS = 2


def train(config: ModelConfig, seed: int, text: str) -> tuple[dict[str, torch.Tensor], float]:
    """(the trained float32 weights, the last step's loss)."""
    torch.manual_seed(seed)
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    if len(data) <= SEQUENCE:
        raise ValueError(f"the training text has {len(data)} bytes; it needs more than {SEQUENCE}")
    # Paragraph starts: a prompt is read after BOS, as the text's paragraphs are here.
    starts = torch.tensor([0, *(i + 1 for i, byte in enumerate(data.tolist()[:-1]) if byte == ord("\n"))])
    starts = starts.clamp(max=len(data) - SEQUENCE)
    weights = {
        name: initial_tensor(name, shape, seed, torch.float32).requires_grad_()
        for name, shape in tensor_shapes(config)
    }
    model = Transformer(config.with_overrides(torch_dtype="float32"), torch.device("cpu"), SEQUENCE)
    model.bind(weights)
    optimizer = torch.optim.Adam(weights.values(), lr=LEARNING_RATE, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    anywhere = torch.arange(BATCH) % 2 == 1
    loss = torch.tensor(float("nan"))
    for step in range(STEPS):
        warmup = min(1.0, (step + 1) / WARMUP_STEPS)
        for group in optimizer.param_groups:
            group["lr"] = LEARNING_RATE * warmup * 0.5 * (1 + math.cos(math.pi * step / STEPS))
        offsets = torch.where(
            anywhere,
            torch.randint(0, len(data) - SEQUENCE + 1, (BATCH,), generator=generator),
            starts[torch.randint(0, len(starts), (BATCH,), generator=generator)],
        )
        targets = torch.stack([data[offset : offset + SEQUENCE] for offset in offsets.tolist()])
        inputs = torch.cat((torch.full((BATCH, 1), ByteTokenizer.bos_id), targets[:, :-1]), dim=1)
        logits = model.causal_logits(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(weights.values(), 1.0)
        optimizer.step()
    return {name: tensor.detach() for name, tensor in weights.items()}, float(loss.detach())


def write_trained_model(model_dir: Path, seed: int) -> None:
    config = ModelConfig.load(model_dir)
    torch.set_num_threads(THREADS)
    started = time.perf_counter()
    weights, loss = train(config, seed, TEXT_FILE.read_text(encoding="utf-8"))
    dtype = getattr(torch, config.torch_dtype)
    sources = [
        (name, dtype_code(dtype), shape, lambda name=name: weights[name].to(dtype))
        for name, shape in tensor_shapes(config)
    ]
    metadata = {"format": "pt", "seed": str(seed), "trained_on": TEXT_FILE.name, "steps": str(STEPS)}
    write_safetensors(model_dir / WEIGHTS_FILE, sources, metadata=metadata)
    print(f"{STEPS} steps in {time.perf_counter() - started:.1f} s, final loss {loss:.3f}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m warmstart.engines.builtin.train MODEL_DIR SEED")
    write_trained_model(Path(sys.argv[1]), int(sys.argv[2]))
