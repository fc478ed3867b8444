"""Engine adapters behind one interface (`warmstart.engines.base.Engine`).

`create_engine(kind, **options)` builds one by name. Factories import lazily, so naming an engine costs
nothing until it is created (torch, vLLM and CUDA are heavy imports).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from warmstart.engines.base import Engine

# kind -> "module:factory"; the factory takes keyword options and returns an Engine.
ENGINE_FACTORIES: dict[str, str] = {
    "builtin": "warmstart.engines.builtin.engine:BuiltinEngine",
    "vllm": "warmstart.engines.vllm.engine:VllmEngine",  # needs the `vllm` extra only when loaded
}


def create_engine(kind: str, **options: Any) -> Engine:
    if kind not in ENGINE_FACTORIES:
        raise ValueError(f"unknown engine {kind!r}; choose one of: {', '.join(sorted(ENGINE_FACTORIES))}")
    module_name, _, factory_name = ENGINE_FACTORIES[kind].partition(":")
    factory = getattr(importlib.import_module(module_name), factory_name)
    return factory(**options)
