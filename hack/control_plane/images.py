"""Build the chart's images from the repository's Dockerfile, without a registry or a Docker daemon.

- BuildKit (buildkitd + buildctl) is built from its Go module into the cache and runs only while building,
  as root with its OCI (runc) worker, in a mount namespace and a cgroup of its own (nothing stays mounted).
- The Dockerfile's base, `debian:trixie-slim`, comes from `debootstrap --variant=minbase trixie` written as an
  OCI layout and handed to BuildKit as a named context: nothing is pulled. RUN steps download Debian packages
  and Python wheels from the registries this machine reaches, trusting the machine's CA bundle (a build
  secret; it is not copied into the image).
- The result is a docker-archive tarball per image, named by a hash of everything that went into it, so a
  second `images` with the same inputs does nothing; the real node imports it into containerd.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import archive, build, host_state, versions
from .cluster import Component, wait_for

REPO = Path(__file__).resolve().parents[2]
BUILDKIT_MODULE = "github.com/moby/buildkit"
# buildkit's go.mod excludes these; a module that requires it must exclude them too or `go mod tidy` picks
# versions buildkit was never built with.
BUILDKIT_EXCLUDES = (
    "github.com/davecgh/go-spew v1.1.2-0.20180830191138-d8f796af33cc",
    "github.com/pmezard/go-difflib v1.0.1-0.20181226105442-5d4384ee4fb2",
)
BASE_REFERENCE = "debian:trixie-slim"
BASE_SUITE = "trixie"
DEBIAN_MIRROR = os.environ.get("WARMSTART_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_EXCLUDES = (
    "dev/*",
    "proc/*",
    "sys/*",
    "run/*",
    "tmp/*",
    "var/cache/apt/archives/*.deb",
    "var/lib/apt/lists/*",
)
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
BUILD_CGROUP = "warmstart-images"
IGNORED_PARTS = ("__pycache__", ".pytest_cache", ".ruff_cache")
IGNORED_SUFFIXES = (".pyc", ".egg-info")


@dataclass(frozen=True)
class ImageSpec:
    reference: str
    build_args: dict[str, str]
    dockerfile: str = "Dockerfile"
    # Layers left uncompressed travel better compressed whole (hack/device-kube-gpu.sh packs the chart's
    # image in one xz stream; gzip'd layers would not shrink).
    compression: str = "gzip"


def chart_app_version() -> str:
    text = (REPO / "charts" / "warmstart" / "Chart.yaml").read_text()
    match = re.search(r'^appVersion:\s*"?([^"\s]+)"?', text, re.M)
    if match is None:
        raise build.BuildError("charts/warmstart/Chart.yaml has no appVersion")
    return match.group(1)


def chart_images() -> list[ImageSpec]:
    """The images the chart runs (operator and agent share one)."""
    reference = f"ghcr.io/warmstart/warmstart:{chart_app_version()}"
    return [ImageSpec(reference, {"EXTRAS": "gpu"}, compression="uncompressed")]


def worker_images() -> list[ImageSpec]:
    """The worker images the examples name that a machine without a GPU can run: the builtin engine on
    Debian's PyTorch (the GPU worker image carries several GB of CUDA libraries and vLLM)."""
    cpu = {
        "EXTRAS": "engine",
        "APT_PACKAGES": "python3-torch python3-numpy",
        "VENV_OPTIONS": "--system-site-packages",
    }
    return [ImageSpec(f"ghcr.io/warmstart/warmstart-worker:{chart_app_version()}-cpu", cpu)]


def project_images() -> list[ImageSpec]:
    return chart_images() + worker_images()


# -- paths ---------------------------------------------------------------------------------------------------


def buildkit_bin() -> Path:
    return versions.images_cache_dir() / "bin"


def buildkit_stamp() -> Path:
    return versions.images_cache_dir() / "buildkit-stamp.json"


def base_layout() -> Path:
    return versions.images_cache_dir() / "base" / "debian-trixie-slim"


def base_stamp() -> Path:
    return versions.images_cache_dir() / "base" / "stamp.json"


def archives_dir() -> Path:
    return versions.images_cache_dir() / "archives"


def built_index() -> Path:
    return versions.images_cache_dir() / "built.json"


# -- what is built -------------------------------------------------------------------------------------------


def built_images() -> dict[str, Path]:
    """reference -> docker-archive of every image built so far whose archive is still there."""
    try:
        index = json.loads(built_index().read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {ref: Path(entry["archive"]) for ref, entry in index.items() if Path(entry["archive"]).is_file()}


def current_images() -> dict[str, Path]:
    """The project's images built from the working tree as it is now; missing or stale ones are left out."""
    index = _read_index()
    base = _read_json(base_stamp())
    current = {}
    for spec in project_images():
        entry = index.get(spec.reference)
        if entry and base and entry.get("inputs") == input_hash(spec, base["digest"]):
            current[spec.reference] = Path(entry["archive"])
    return {ref: path for ref, path in current.items() if path.is_file()}


def _read_json(path: Path) -> dict[str, object] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _read_index() -> dict[str, dict[str, str]]:
    return _read_json(built_index()) or {}  # type: ignore[return-value]


# -- BuildKit itself -----------------------------------------------------------------------------------------


def buildkit_go_mod() -> str:
    excludes = "\n".join(f"\t{line}" for line in BUILDKIT_EXCLUDES)
    return (
        "// Generated by hack/control-plane images. Do not edit.\n"
        "module warmstart.invalid/buildkit\n\n"
        "go 1.26\n\n"
        f"require {BUILDKIT_MODULE} v{versions.BUILDKIT}\n\n"
        f"exclude (\n{excludes}\n)\n"
    )


BUILDKIT_TOOLS = """\
//go:build tools

// Package tools pins the BuildKit commands this module builds.
package tools

import (
\t_ "github.com/moby/buildkit/cmd/buildctl"
\t_ "github.com/moby/buildkit/cmd/buildkitd"
)
"""


def ensure_buildkit(progress: build.Progress) -> None:
    wanted = {"buildkit": versions.BUILDKIT, "recipe": versions.IMAGES_RECIPE}
    binaries = [buildkit_bin() / name for name in ("buildkitd", "buildctl")]
    if _read_json(buildkit_stamp()) == wanted and all(path.is_file() for path in binaries):
        return
    module_dir = versions.images_cache_dir() / "src" / "buildkit"
    template = module_dir / "go.mod.in"
    if not template.is_file() or template.read_text() != buildkit_go_mod():
        build.write_if_changed(module_dir / "go.mod", buildkit_go_mod())
        (module_dir / "go.sum").unlink(missing_ok=True)
        build.write_if_changed(template, buildkit_go_mod())
    build.write_if_changed(module_dir / "tools.go", BUILDKIT_TOOLS)
    progress.step(f"building BuildKit v{versions.BUILDKIT} (buildkitd, buildctl) from its Go module")
    build.run_go(["mod", "tidy"], cwd=module_dir)
    packages = [f"{BUILDKIT_MODULE}/cmd/buildkitd", f"{BUILDKIT_MODULE}/cmd/buildctl"]
    build.run_go_with_progress(
        ["build", "-v", "-trimpath", f"-ldflags={build.LDFLAGS}", "-o", f"{buildkit_bin()}/", *packages],
        cwd=module_dir,
        progress=progress,
    )
    buildkit_stamp().write_text(json.dumps(wanted) + "\n")


# -- the base image ------------------------------------------------------------------------------------------


def ensure_base_image(progress: build.Progress) -> str:
    """debian:trixie-slim as an OCI layout, made with debootstrap once; returns its manifest digest."""
    wanted = {"suite": BASE_SUITE, "variant": "minbase", "recipe": versions.IMAGES_RECIPE}
    stamp = _read_json(base_stamp())
    if stamp and {k: stamp.get(k) for k in wanted} == wanted and (base_layout() / "index.json").is_file():
        return str(stamp["digest"])
    if shutil.which("debootstrap") is None:
        raise build.BuildError(
            "debootstrap is needed to make the base image (Debian: apt-get install debootstrap)"
        )
    progress.step(
        f"making {BASE_REFERENCE} with debootstrap --variant=minbase {BASE_SUITE} (a minute or two)"
    )
    base_layout().parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=base_layout().parent) as scratch:
        rootfs = Path(scratch) / "rootfs"
        result = subprocess.run(
            ["debootstrap", "--variant=minbase", BASE_SUITE, str(rootfs), DEBIAN_MIRROR],
            capture_output=True,
            text=True,
        )
        if result.returncode != 0:
            raise build.BuildError(f"debootstrap failed:\n{result.stdout[-3000:]}{result.stderr[-2000:]}")
        layer = Path(scratch) / "layer.tar"
        archive.layer_from_directory(rootfs, layer, exclude=BASE_EXCLUDES)
        config = archive.ImageConfig(
            command=["bash"], created_by=f"debootstrap --variant=minbase {BASE_SUITE}"
        )
        digest = archive.write_oci_layout(layer, config, BASE_REFERENCE, base_layout())
    base_stamp().write_text(json.dumps({**wanted, "digest": digest}) + "\n")
    return digest


# -- the project's images ------------------------------------------------------------------------------------


def copied_sources(dockerfile: Path) -> list[str]:
    """Build-context paths the Dockerfile's COPY/ADD lines read (not --from= ones)."""
    sources: list[str] = []
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        if any(word.startswith("--from") for word in words):
            continue
        arguments = [word for word in words[1:] if not word.startswith("--")]
        sources += arguments[:-1]
    return sorted(set(sources))


def context_files(sources: list[str]) -> list[Path]:
    files: list[Path] = []
    for source in sources:
        path = REPO / source
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files += [p for p in candidates if not ignored(p)]
    return files


def ignored(path: Path) -> bool:
    return any(part in IGNORED_PARTS for part in path.parts) or path.name.endswith(IGNORED_SUFFIXES)


def input_hash(spec: ImageSpec, base_digest: str) -> str:
    """Everything that decides an image's content: recipe, BuildKit, base, Dockerfile, args, copied files."""
    digest = hashlib.sha256()
    dockerfile = REPO / spec.dockerfile
    header = {
        "recipe": versions.IMAGES_RECIPE,
        "buildkit": versions.BUILDKIT,
        "base": base_digest,
        "args": spec.build_args,
        "reference": spec.reference,
        "compression": spec.compression,
    }
    digest.update(json.dumps(header, sort_keys=True).encode())
    for path in [dockerfile, REPO / ".dockerignore", *context_files(copied_sources(dockerfile))]:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0")
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()


class BuildKitDaemon:
    """buildkitd for the duration of one `images` run."""

    def __init__(self, progress: build.Progress) -> None:
        self.progress = progress
        self.root = versions.images_cache_dir() / "buildkit"
        self.socket = self.root / "buildkitd.sock"
        self.component: Component | None = None

    def __enter__(self) -> BuildKitDaemon:
        self.root.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        cgroups = tuple(host_state.make_cgroup(f"{BUILD_CGROUP}/daemon"))
        argv = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            str(buildkit_bin() / "buildkitd"),
            f"--root={self.root / 'state'}",
            f"--addr=unix://{self.socket}",
            f"--config={self.write_config()}",
        ]
        self.component = Component("buildkitd", argv, self.root / "buildkitd.log", cgroups=cgroups)
        self.component.start(die_with_parent=True)

        def answers() -> bool:
            assert self.component is not None
            self.component.check_running()
            return self.socket.exists() and self.buildctl(["debug", "workers"], check=False).returncode == 0

        wait_for(answers, timeout=60, interval=0.1, message="buildkitd")
        return self

    def write_config(self) -> Path:
        # RUN steps reach Debian's and PyPI's mirrors as this machine does (host network); their cgroups go
        # under ours, removed after the build.
        config = self.root / "buildkitd.toml"
        config.write_text(
            "[worker.oci]\n"
            "  enabled = true\n"
            '  networkMode = "host"\n'
            f'  defaultCgroupParent = "/{BUILD_CGROUP}/steps"\n'
            "[worker.containerd]\n"
            "  enabled = false\n"
        )
        return config

    def __exit__(self, *_exc: object) -> None:
        if self.component is not None:
            self.component.stop()
        host_state.kill_cgroup_tree(host_state.process_hierarchy() / BUILD_CGROUP)
        host_state.remove_cgroup_tree(BUILD_CGROUP)

    def buildctl(
        self, args: list[str], check: bool = True, log: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(buildkit_bin() / "buildctl"), f"--addr=unix://{self.socket}", *args]
        if log is None:
            result = subprocess.run(argv, capture_output=True, text=True)
        else:
            with log.open("w") as stream:
                result = subprocess.run(argv, stdout=stream, stderr=subprocess.STDOUT, text=True)
        if check and result.returncode != 0:
            tail = log.read_text()[-4000:] if log else result.stderr[-4000:]
            raise build.BuildError(f"buildctl {' '.join(args[:2])} failed:\n{tail}")
        return result

    def build_image(self, spec: ImageSpec, base_digest: str, out: Path) -> None:
        args = [
            "build",
            "--frontend=dockerfile.v0",
            f"--local=context={REPO}",
            f"--local=dockerfile={REPO}",
            f"--opt=filename={spec.dockerfile}",
            *(f"--opt=build-arg:{name}={value}" for name, value in spec.build_args.items()),
            f"--oci-layout=base={base_layout()}",
            f"--opt=context:{BASE_REFERENCE}=oci-layout://base@{base_digest}",
            f"--output=type=docker,name={spec.reference},dest={out},compression={spec.compression}"
            + (",force-compression=true" if spec.compression != "gzip" else ""),  # cached layers are gzip
            "--progress=plain",
        ]
        if CA_BUNDLE.is_file():
            args.append(f"--secret=id=extra-ca,src={CA_BUNDLE}")
        log = out.with_suffix(".log")
        self.buildctl(args, log=log)


def build_images(force: bool = False) -> dict[str, Path]:
    """Build every project image whose inputs changed; returns reference -> docker-archive."""
    progress = build.Progress("images")
    base_digest = ensure_base_image(progress)
    index = _read_index()
    todo = []
    for spec in project_images():
        inputs = input_hash(spec, base_digest)
        entry = index.get(spec.reference)
        if not force and entry and entry.get("inputs") == inputs and Path(entry["archive"]).is_file():
            print(f"images: {spec.reference} is current ({Path(entry['archive']).name})")
            continue
        todo.append((spec, inputs))
    if todo:
        ensure_buildkit(progress)
        archives_dir().mkdir(parents=True, exist_ok=True)
        with BuildKitDaemon(progress) as daemon:
            for spec, inputs in todo:
                index[spec.reference] = build_one(
                    daemon, progress, spec, inputs, base_digest, index.get(spec.reference)
                )
                built_index().write_text(json.dumps(index, indent=2) + "\n")
    return {ref: Path(entry["archive"]) for ref, entry in index.items()}


def build_one(
    daemon: BuildKitDaemon,
    progress: build.Progress,
    spec: ImageSpec,
    inputs: str,
    base_digest: str,
    previous: dict[str, str] | None,
) -> dict[str, str]:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec.reference)
    out = archives_dir() / f"{name}-{inputs[:16]}.tar"
    progress.step(
        f"building {spec.reference} from {spec.dockerfile} with BuildKit (log: {out.with_suffix('.log')})"
    )
    started = time.monotonic()
    daemon.build_image(spec, base_digest, out)
    progress.step(
        f"built {spec.reference} in {time.monotonic() - started:.0f}s: {out.stat().st_size >> 20} MiB"
    )
    if previous and previous.get("archive") != str(out):
        Path(previous["archive"]).unlink(missing_ok=True)
        Path(previous["archive"]).with_suffix(".log").unlink(missing_ok=True)
    return {"archive": str(out), "inputs": inputs, "built": time.strftime("%Y-%m-%dT%H:%M:%S")}


def main_with(force: bool) -> int:
    try:
        built = build_images(force=force)
    except build.BuildError as error:
        print(f"image build failed: {error}", file=sys.stderr)
        return 1
    for reference, path in built.items():
        print(f"{reference}: {path}")
    return 0
