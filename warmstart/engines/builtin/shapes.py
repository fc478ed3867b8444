"""Model shapes for the builtin engine, in Hugging Face `config.json` terms (Qwen3 architecture).

Presets: `tiny` (a few MB, for CPU tests), `demo` (smaller still, its weights trained rather than drawn at
random: `make demo`) and the public shapes of Qwen3-0.6B and Qwen3-8B (for GPU benchmarks). Any field can be
overridden.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
ARCHITECTURE = "Qwen3ForCausalLM"


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model config {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.torch_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"torch_dtype must be float32, bfloat16 or float16, got {self.torch_dtype!r}")

    @property
    def parameter_count(self) -> int:
        return sum(math.prod(shape) for _, shape in tensor_shapes(self))

    def with_overrides(self, **overrides: Any) -> ModelConfig:
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            known = ", ".join(f.name for f in dataclasses.fields(self))
            raise ValueError(f"unknown model config field(s) {', '.join(unknown)}; known: {known}")
        return dataclasses.replace(self, **overrides)

    @classmethod
    def load(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / CONFIG_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path} is missing: a model directory needs a config.json") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        try:
            values.setdefault("head_dim", data["hidden_size"] // data["num_attention_heads"])
            values.setdefault("num_key_value_heads", data["num_attention_heads"])
        except KeyError as exc:
            raise ValueError(f"{path} lacks the field {exc.args[0]}") from None
        return cls(**values)

    def save(self, model_dir: str | Path) -> None:
        data = dataclasses.asdict(self)
        data.update(architectures=[ARCHITECTURE], model_type="qwen3", attention_bias=False, hidden_act="silu")
        Path(model_dir, CONFIG_FILE).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=384, vocab_size=260, max_position_embeddings=512, rope_theta=10_000.0,
        tie_word_embeddings=False, torch_dtype="float32",
    ),
    # Trained once on the text in demo_text.txt (train.py), so that it answers in words: a demo can show at a
    # glance that a restored worker answers as the original did. Small, to train in about half a minute.
    "demo": ModelConfig(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=256, vocab_size=260, max_position_embeddings=512, rope_theta=10_000.0,
        tie_word_embeddings=False, torch_dtype="float32",
    ),
    # Shapes from the public Qwen/Qwen3-0.6B and Qwen/Qwen3-8B config.json files.
    "qwen3-0.6b": ModelConfig(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "qwen3-8b": ModelConfig(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
}  # fmt: skip

# Presets whose weights are trained (train.py) where the others' are drawn from the seed.
TRAINED_PRESETS = frozenset({"demo"})


def preset(name: str, **overrides: Any) -> ModelConfig:
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}") from None
    return base.with_overrides(**overrides) if overrides else base


def tensor_shapes(config: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight tensor's name (Hugging Face Qwen3 naming) and shape, in storage order."""
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim, inter = config.head_dim, config.intermediate_size
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (config.vocab_size, hidden))]
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        shapes += [
            (f"{prefix}.input_layernorm.weight", (hidden,)),
            (f"{prefix}.self_attn.q_proj.weight", (heads * head_dim, hidden)),
            (f"{prefix}.self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{prefix}.self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            (f"{prefix}.self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (f"{prefix}.self_attn.q_norm.weight", (head_dim,)),
            (f"{prefix}.self_attn.k_norm.weight", (head_dim,)),
            (f"{prefix}.post_attention_layernorm.weight", (hidden,)),
            (f"{prefix}.mlp.gate_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.up_proj.weight", (inter, hidden)),
            (f"{prefix}.mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.tie_word_embeddings:
        shapes.append(("lm_head.weight", (config.vocab_size, hidden)))
    return shapes
