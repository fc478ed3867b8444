"""Build what the real node needs beside the control plane: kubelet and kube-proxy from the same Go module
recipe, CoreDNS (the cluster's DNS) from its Go module, containerd, runc, the CNI plugins and nft from
Debian's packages, and a pause image from source.

Its stamp is separate from the control plane's, so a cached control plane is never rebuilt for the node.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import archive, build, versions

PAUSE_SOURCE = Path(__file__).with_name("pause.c")
PAUSE_ARCHIVE = "pause.tar"


def pause_archive() -> Path:
    return versions.node_cache_dir() / PAUSE_ARCHIVE


def pause_source_digest() -> str:
    return hashlib.sha256(PAUSE_SOURCE.read_bytes()).hexdigest()


def missing_debian_packages() -> list[str]:
    def present(command: str) -> bool:
        return Path(command).is_file() if command.startswith("/") else shutil.which(command) is not None

    return [
        package
        for package in versions.NODE_DEBIAN_PACKAGES
        if not present(versions.NODE_DEBIAN_COMMANDS[package])
    ]


def install_debian_packages(progress: build.Progress) -> None:
    missing = missing_debian_packages()
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise build.BuildError(f"install {', '.join(missing)} (Debian package names): no apt-get here")
    progress.step(f"installing Debian packages: {', '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
    ):
        result = subprocess.run(argv, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise build.BuildError(
                f"`{' '.join(argv)}` failed:\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )


def is_cached() -> bool:
    """kubelet, kube-proxy and the pause image are built for the pinned release (packages not checked)."""
    stamp = versions.node_stamp_path()
    try:
        recorded = json.loads(stamp.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    binaries = all((versions.bin_dir() / name).is_file() for name in versions.NODE_BINARIES)
    wanted = versions.wanted_node_stamp(pause_source_digest())
    return recorded == wanted and binaries and pause_archive().is_file()


def is_ready() -> bool:
    return is_cached() and not missing_debian_packages()


def build_node_binaries(progress: build.Progress, out: Path) -> None:
    # A module directory of its own: the control plane's go.mod stays as its build left it.
    module_dir = versions.cache_root() / "src" / "kubernetes-node"
    build.prepare_kubernetes_module(progress, module_dir, versions.NODE_COMMANDS)
    progress.step(f"compiling {', '.join(versions.NODE_COMMANDS)}")
    packages = [f"k8s.io/kubernetes/cmd/{name}" for name in versions.NODE_COMMANDS]
    build.compile_packages(progress, module_dir, packages, out)


def build_pause_image(progress: build.Progress, out: Path) -> None:
    if shutil.which("gcc") is None:
        raise build.BuildError("gcc is needed to build the pause image (Debian: gcc, libc6-dev)")
    progress.step(f"building the pause image {versions.PAUSE_IMAGE} from {PAUSE_SOURCE.name}")
    with tempfile.TemporaryDirectory() as scratch:
        binary = Path(scratch) / "pause"
        result = subprocess.run(
            ["gcc", "-static", "-O2", "-s", "-o", str(binary), str(PAUSE_SOURCE)],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise build.BuildError(f"gcc -static failed (libc6-dev installed?):\n{result.stderr[-2000:]}")
        layer = Path(scratch) / "layer.tar"
        archive.layer_from_files({"/pause": binary}, layer)
        config = archive.ImageConfig(command=["/pause"], env=[], created_by="gcc -static pause.c")
        out.parent.mkdir(parents=True, exist_ok=True)
        archive.write_docker_archive(layer, config, versions.PAUSE_IMAGE, out)


def build_node(force: bool = False) -> None:
    progress = build.Progress("node")
    install_debian_packages(progress)
    if is_cached() and not force:
        print(f"real node: cached in {versions.cache_root()} (kubelet, kube-proxy {versions.KUBERNETES})")
        return
    versions.node_stamp_path().unlink(missing_ok=True)
    out = versions.bin_dir()
    out.mkdir(parents=True, exist_ok=True)
    build_node_binaries(progress, out)
    build.go_install(progress, out, "github.com/coredns/coredns", versions.COREDNS)
    build_pause_image(progress, pause_archive())
    stamp = versions.wanted_node_stamp(pause_source_digest())
    versions.node_stamp_path().write_text(json.dumps(stamp, indent=2) + "\n")
    progress.step(f"done: kubelet, kube-proxy, coredns in {out}, pause image in {pause_archive()}")
