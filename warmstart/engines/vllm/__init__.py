"""The vLLM engine (the optional `warmstart[vllm]` extra): options, identity, request driver, the adapter."""

from warmstart.engines.vllm.engine import VllmEngine
from warmstart.engines.vllm.identity import model_files_digest, snapshot_identity
from warmstart.engines.vllm.options import INSTALL_HINT, VllmOptions, sampling_kwargs

__all__ = [
    "INSTALL_HINT",
    "VllmEngine",
    "VllmOptions",
    "model_files_digest",
    "sampling_kwargs",
    "snapshot_identity",
]
