"""Container images written without a daemon or a registry: one layer from a directory, as a docker-archive
tarball (what `ctr images import` reads) or an OCI image layout (what BuildKit takes as a named context)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"


@dataclass(frozen=True)
class ImageConfig:
    command: list[str]
    env: list[str] = field(default_factory=lambda: [f"PATH={DEFAULT_PATH}"])
    created_by: str = "hack/control-plane"
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def layer_from_directory(root: Path, out: Path, exclude: tuple[str, ...] = ()) -> None:
    """An uncompressed, reproducible layer tar of `root` (GNU tar keeps hard links, devices and xattrs)."""
    argv = [
        "tar",
        "--create",
        f"--file={out}",
        f"--directory={root}",
        "--sort=name",
        "--numeric-owner",
        "--mtime=@0",
        "--xattrs",
        *(f"--exclude=./{pattern}" for pattern in exclude),
        ".",
    ]
    subprocess.run(argv, check=True)


def layer_from_files(files: dict[str, Path], out: Path) -> None:
    """A layer holding `files` (path in the image -> file on disk), root-owned, mtime 0."""
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as layer:
        for name, source in sorted(files.items()):
            info = layer.gettarinfo(str(source), arcname=name.lstrip("/"))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with source.open("rb") as stream:
                layer.addfile(info, stream)


def image_config(config: ImageConfig, diff_id: str) -> bytes:
    document = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": config.env, "Cmd": config.command}
        | ({"User": config.user} if config.user else {})
        | ({"Entrypoint": config.entrypoint} if config.entrypoint else {}),
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
        "history": [{"created_by": config.created_by}],
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()


def write_docker_archive(layer: Path, config: ImageConfig, reference: str, out: Path) -> None:
    """docker-archive format: manifest.json names the config, the layer and the tag."""
    diff_id = f"sha256:{sha256_file(layer)}"
    config_bytes = image_config(config, diff_id)
    config_name = f"{hashlib.sha256(config_bytes).hexdigest()}.json"
    layer_name = f"{diff_id.removeprefix('sha256:')}/layer.tar"
    manifest = [{"Config": config_name, "RepoTags": [reference], "Layers": [layer_name]}]
    partial = out.with_suffix(".partial")
    with tarfile.open(partial, "w") as archive:
        _add_bytes(archive, config_name, config_bytes)
        archive.add(str(layer), arcname=layer_name)
        _add_bytes(archive, "manifest.json", json.dumps(manifest).encode())
    partial.replace(out)


def write_oci_layout(layer: Path, config: ImageConfig, reference: str, out: Path) -> str:
    """An OCI image layout directory with one gzip-compressed layer; returns the manifest's digest."""
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    blobs = staging / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    diff_id = f"sha256:{sha256_file(layer)}"
    compressed = staging / "layer.tar.gz"
    with layer.open("rb") as source, gzip.GzipFile(compressed, "wb", compresslevel=1, mtime=0) as target:
        shutil.copyfileobj(source, target, 1 << 20)
    layer_digest = sha256_file(compressed)
    compressed.replace(blobs / layer_digest)
    config_bytes = image_config(config, diff_id)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": _descriptor(OCI_CONFIG, _put_blob(blobs, config_bytes), len(config_bytes)),
        "layers": [_descriptor(OCI_LAYER_GZIP, layer_digest, (blobs / layer_digest).stat().st_size)],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    manifest_digest = _put_blob(blobs, manifest_bytes)
    descriptor = _descriptor(OCI_MANIFEST, manifest_digest, len(manifest_bytes))
    descriptor["annotations"] = {"org.opencontainers.image.ref.name": reference}
    index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [descriptor]}
    (staging / "index.json").write_text(json.dumps(index, sort_keys=True))
    (staging / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    shutil.rmtree(out, ignore_errors=True)
    staging.replace(out)
    return f"sha256:{manifest_digest}"


def _put_blob(blobs: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return digest


def _descriptor(media_type: str, digest: str, size: int) -> dict[str, object]:
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": size}


def _add_bytes(archive: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    archive.addfile(info, io.BytesIO(data))
