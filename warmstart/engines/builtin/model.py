"""A decoder-only transformer (Qwen3 architecture) in plain PyTorch, over externally owned memory.

The model owns no parameters: `bind()` hands it typed views into the weight arena and `bind_kv()` views into
the KV-cache arena, so the engine can drop and re-create both around a checkpoint. Layers: RMSNorm, rotary
attention with grouped KV heads (per-head q/k RMSNorm as in Qwen3) over a preallocated KV cache with one
slot per running sequence, SwiGLU MLP.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from warmstart.engines.builtin.shapes import ModelConfig, tensor_shapes

# Prefill attention without cuDNN's kernel: cuDNN builds a plan for each new sequence length, and on an H200
# that made the first request at every new prompt length about 0.05 s slower. The others need no such set-up.
PREFILL_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class KVCache:
    """Keys and values for every layer and slot: views of one flat buffer, shape [2, L, S, KV, T, D]."""

    def __init__(self, buffer: torch.Tensor, config: ModelConfig, slots: int, max_len: int) -> None:
        shape = kv_shape(config, slots, max_len)
        data = buffer[: kv_nbytes(config, slots, max_len)].view(torch_dtype_of(config)).view(shape)
        self.keys, self.values = data[0], data[1]


def kv_shape(config: ModelConfig, slots: int, max_len: int) -> tuple[int, ...]:
    return (2, config.num_hidden_layers, slots, config.num_key_value_heads, max_len, config.head_dim)


def kv_nbytes(config: ModelConfig, slots: int, max_len: int) -> int:
    return math.prod(kv_shape(config, slots, max_len)) * torch.finfo(torch_dtype_of(config)).bits // 8


def torch_dtype_of(config: ModelConfig) -> torch.dtype:
    return getattr(torch, config.torch_dtype)


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        device: torch.device,
        max_len: int,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.config = config
        self._reduce = reduce  # sums a layer's partial outputs over tensor-parallel ranks (None: one rank)
        self.device = device
        self.max_len = max_len
        self.group = config.num_attention_heads // config.num_key_value_heads
        self.cos, self.sin = _rope_tables(config, max_len, device)
        self.positions = torch.arange(max_len, device=device)
        self.weights: dict[str, torch.Tensor] = {}
        self._layers: list[dict[str, torch.Tensor]] = []  # per layer: short name -> tensor
        self._compiled_step: Callable[..., torch.Tensor] | None = None  # see compile_decode()
        self.kv: KVCache | None = None

    def bind(self, weights: dict[str, torch.Tensor]) -> None:
        for name, shape in tensor_shapes(self.config):
            tensor = weights.get(name)
            if tensor is None:
                raise ValueError(f"the weights lack tensor {name}")
            if tuple(tensor.shape) != shape:
                found = list(tensor.shape)
                raise ValueError(f"tensor {name} has shape {found}, the config expects {list(shape)}")
        self.weights = weights
        self._layers = [_layer_weights(weights, layer) for layer in range(self.config.num_hidden_layers)]
        tied = self.config.tie_word_embeddings
        self._lm_head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]

    def unbind(self) -> None:
        self.weights = {}
        self._layers = []
        self._lm_head = None

    def bind_kv(self, kv: KVCache | None) -> None:
        self.kv = kv

    def prefill(self, token_ids: torch.Tensor, slot: int) -> torch.Tensor:
        """Run a whole prompt (1-D ids) for one sequence, fill its KV slot; logits of the last position."""
        return self._logits(self._causal(token_ids[None], slot)[0, -1:])[0]

    def causal_logits(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of a batch of whole sequences (ids [B, T]) without the KV cache: what
        training the `demo` preset differentiates (`train.py`), with the layers' own code."""
        return self._logits(self._causal(token_ids))

    def _causal(self, token_ids: torch.Tensor, slot: int | None = None) -> torch.Tensor:
        """Hidden states of whole sequences (ids [B, T]); with `slot`, the one sequence's keys and values
        fill that KV slot."""
        batch, count = token_ids.shape
        x = F.embedding(token_ids, self.weights["model.embed_tokens.weight"])
        cos, sin = self.cos[:count], self.sin[:count]
        with sdpa_kernel(PREFILL_ATTENTION):
            for layer, w in enumerate(self._layers):
                q, k, v = self._qkv(w, x, cos, sin)  # [B, heads, T, D]
                if slot is not None:
                    self.kv.keys[layer, slot, :, :count] = k[0]
                    self.kv.values[layer, slot, :, :count] = v[0]
                k = k.repeat_interleave(self.group, dim=1)
                v = v.repeat_interleave(self.group, dim=1)
                attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = self._finish_layer(w, x, attended.transpose(1, 2).reshape(batch, count, -1))
        return x

    def decode(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        context: int | None = None,
    ) -> torch.Tensor:
        """One step for a batch of sequences: token i sits at positions[i] of KV slot slots[i].

        Attends over the first `context` cache positions (all of them when None: static shapes for CUDA
        graphs); returns float32 logits [batch, vocab].
        """
        context = context or self.max_len
        x = F.embedding(token_ids, self.weights["model.embed_tokens.weight"])[:, None]  # [B, 1, H]
        cos, sin = self.cos[positions][:, None, None], self.sin[positions][:, None, None]  # [B, 1, 1, D]
        visible = (self.positions[:context][None] <= positions[:, None])[:, None, None]  # [B, 1, 1, C]
        step = self._compiled_step or self._decode_layer
        if self._compiled_step is not None and token_ids.shape[0] > 1:
            for batch_input in (x, cos, sin, visible, slots, positions):  # one graph for every batch > 1
                torch._dynamo.maybe_mark_dynamic(batch_input, 0)
        for layer in range(self.config.num_hidden_layers):
            keys, values = self.kv.keys[layer], self.kv.values[layer]
            x = step(self._layers[layer], x, cos, sin, visible, keys, values, slots, positions, context)
        return self._logits(x[:, 0])

    def compile_decode(self) -> None:
        """Compile the decode step of one layer with torch.compile: every layer runs the same code on its own
        weights, so one compiled graph serves them all (two with batch 1, which torch specialises)."""
        self._compiled_step = torch.compile(self._decode_layer)

    def _decode_layer(
        self,
        w: dict[str, torch.Tensor],
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        visible: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        context: int,
    ) -> torch.Tensor:
        batch = x.shape[0]
        q, k, v = self._qkv(w, x, cos, sin)  # [B, heads, 1, D]
        keys[slots, :, positions] = k[:, :, 0]
        values[slots, :, positions] = v[:, :, 0]
        # The query heads sharing a KV head go where the query length would be: no KV repeat needed.
        grouped = q.reshape(batch, self.config.num_key_value_heads, self.group, self.config.head_dim)
        attended = F.scaled_dot_product_attention(
            grouped, keys[slots, :, :context], values[slots, :, :context], attn_mask=visible
        )
        return self._finish_layer(w, x, attended.reshape(batch, 1, -1))

    def _qkv(
        self, w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, count, _ = x.shape
        head_dim = self.config.head_dim
        h = self._norm(x, w["input_layernorm.weight"])
        q = F.linear(h, w["self_attn.q_proj.weight"]).view(batch, count, -1, head_dim)
        k = F.linear(h, w["self_attn.k_proj.weight"]).view(batch, count, -1, head_dim)
        v = F.linear(h, w["self_attn.v_proj.weight"]).view(batch, count, -1, head_dim)
        q = self._norm(q, w["self_attn.q_norm.weight"]).transpose(1, 2)
        k = self._norm(k, w["self_attn.k_norm.weight"]).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v.transpose(1, 2)

    def _finish_layer(
        self, w: dict[str, torch.Tensor], x: torch.Tensor, attended: torch.Tensor
    ) -> torch.Tensor:
        x = x + self._summed(F.linear(attended, w["self_attn.o_proj.weight"]))
        h = self._norm(x, w["post_attention_layernorm.weight"])
        gate = F.silu(F.linear(h, w["mlp.gate_proj.weight"]))
        mlp = F.linear(gate * F.linear(h, w["mlp.up_proj.weight"]), w["mlp.down_proj.weight"])
        return x + self._summed(mlp)

    def _summed(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self._reduce is None else self._reduce(partial)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(x, self.weights["model.norm.weight"]), self._lm_head).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        as_float = x.float()
        scaled = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * scaled.to(x.dtype)


def _layer_weights(weights: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """One layer's tensors under names without the layer number (the same keys for every layer)."""
    prefix = f"model.layers.{layer}."
    return {name[len(prefix) :]: tensor for name, tensor in weights.items() if name.startswith(prefix)}


def _rope_tables(
    config: ModelConfig, max_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    half = torch.arange(0, config.head_dim, 2, dtype=torch.float32, device=device) / config.head_dim
    inverse_freq = 1.0 / (config.rope_theta**half)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inverse_freq)
    angles = torch.cat((angles, angles), dim=-1)
    dtype = torch_dtype_of(config)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
