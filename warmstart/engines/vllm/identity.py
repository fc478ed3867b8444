"""What a snapshot of a vLLM engine is valid for: its options, the model files' digest, vLLM, the GPU."""

from __future__ import annotations

from pathlib import Path

from warmstart.api.identity import SnapshotIdentity
from warmstart.engines.base import EngineError
from warmstart.engines.digest import files_digest
from warmstart.engines.machine import runtime_image
from warmstart.engines.vllm.options import VllmOptions

ENGINE_KIND = "vllm"
# Besides the weights, the files that change what a model computes or how its text is tokenized.
DIGESTED_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def snapshot_identity(
    options: VllmOptions,
    model_digest: str,
    vllm_version: str,
    max_model_len: int,
    dtype: str,
    gpu: tuple[str, str, int],
) -> SnapshotIdentity:
    gpu_product, capability, driver = gpu
    return SnapshotIdentity(
        model_digest=model_digest,
        engine=ENGINE_KIND,
        engine_version=vllm_version,
        engine_args=options.identity_args(max_model_len),
        dtype=dtype,
        parallelism=options.tensor_parallel_size,
        device="cuda",
        gpu_product=gpu_product,
        compute_capability=capability,
        driver_major=driver,
        image=runtime_image(),
    )


def model_files(model_dir: Path) -> list[Path]:
    """A model directory's weights plus its config and tokenizer files: what its digest covers."""
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    if not weights:
        raise EngineError(f"{model_dir} holds no *.safetensors or *.bin weight files to digest")
    return weights + [model_dir / name for name in DIGESTED_SIDE_FILES if (model_dir / name).is_file()]


def model_files_digest(model_dir: Path) -> str:
    return files_digest(model_dir, model_files(model_dir))


def resolve_model_dir(source: str, revision: str | None) -> Path:
    """A model directory, or the local copy of a Hugging Face model id (never downloaded here)."""
    if Path(source).is_dir():
        return Path(source)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, revision=revision, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 (any failure means the same: no local copy to digest)
        raise EngineError(
            f"cannot find the local files of {source!r} to digest them ({exc}); pass a model directory"
        ) from exc
