"""KEDA and the KEDA HTTP add-on in the local cluster, built from their published Go modules (no registry).

- `build()`: KEDA's operator and metrics apiserver, the add-on's operator, interceptor and scaler, compiled
  static from copies of the module sources (KEDA's go.mod has a `replace`, so `go install mod@version` cannot
  build it) into the cache, each written as a one-binary image archive the real node imports. Its own stamp:
  the control plane and the node are never rebuilt for it. Its Go build cache is its own and removed after.
- `manifests()`: what the two projects ship to install themselves, KEDA's `config/minimal` (everything but
  the admission webhooks) and the add-on's `config/default`, rendered by `kubectl kustomize` from the module
  sources when they are built (kept beside the images, so that a machine without Go's module proxy can
  install them from a copy of the cache), with our images, the pods placed on the real node, one replica
  each and their resource requests dropped (the node is a small machine). The add-on's ScaledObject for
  its own interceptor is left out: it scales on CPU, which needs a metrics-server this cluster does not run.
- `install()`: apply them and wait until KEDA serves the external metrics API and the interceptor is Ready.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from . import archive, build, versions
from .cluster import ControlPlane, ControlPlaneError, wait_for

KEDA_MODULE = "github.com/kedacore/keda/v2"
HTTP_ADDON_MODULE = "github.com/kedacore/http-add-on"
NAMESPACE = "keda"
INTERCEPTOR_PROXY_SERVICE = "keda-add-ons-http-interceptor-proxy"
INTERCEPTOR_PROXY_PORT = 8080
EXTERNAL_METRICS_API = "v1beta1.external.metrics.k8s.io"
# The images of KEDA's and the add-on's releases run as this user; the manifests insist on a non-root one.
NONROOT_USER = "65532:65532"
RECIPE = 3
INSTALL_TIMEOUT = 240.0


@dataclass(frozen=True)
class AddonBinary:
    name: str  # the image's name and the binary's
    module: str
    version: str
    package: str  # inside the module
    path: str  # where the shipped manifests expect it in the image
    upstream_image: str  # the image the shipped manifests name, replaced by ours
    ldflags: str = ""

    @property
    def reference(self) -> str:
        return f"localhost/warmstart/{self.name}:{self.version}"


BINARIES = (
    AddonBinary(
        "keda-operator", KEDA_MODULE, versions.KEDA, "./cmd/operator", "/keda", "ghcr.io/kedacore/keda",
        f"-X={KEDA_MODULE}/version.Version={versions.KEDA}",
    ),
    AddonBinary(
        "keda-metrics-apiserver", KEDA_MODULE, versions.KEDA, "./cmd/adapter", "/keda-adapter",
        "ghcr.io/kedacore/keda-metrics-apiserver", f"-X={KEDA_MODULE}/version.Version={versions.KEDA}",
    ),
    AddonBinary(
        "http-add-on-operator", HTTP_ADDON_MODULE, versions.KEDA_HTTP_ADDON, "./operator", "/operator",
        "ghcr.io/kedacore/http-add-on-operator",
    ),
    AddonBinary(
        "http-add-on-interceptor", HTTP_ADDON_MODULE, versions.KEDA_HTTP_ADDON, "./interceptor",
        "/interceptor", "ghcr.io/kedacore/http-add-on-interceptor",
    ),
    AddonBinary(
        "http-add-on-scaler", HTTP_ADDON_MODULE, versions.KEDA_HTTP_ADDON, "./scaler", "/scaler",
        "ghcr.io/kedacore/http-add-on-scaler",
    ),
)  # fmt: skip
MANIFEST_SOURCES = (
    (KEDA_MODULE, versions.KEDA, "config/minimal"),
    (HTTP_ADDON_MODULE, versions.KEDA_HTTP_ADDON, "config/default"),
)


def addons_dir() -> Path:
    return versions.cache_root() / "addons"


def stamp_path() -> Path:
    return addons_dir() / "stamp.json"


def manifests_path() -> Path:
    return addons_dir() / "manifests.yaml"


def archive_path(binary: AddonBinary) -> Path:
    return addons_dir() / "images" / f"{binary.name}.tar"


def wanted_stamp() -> dict[str, object]:
    return {
        "recipe": RECIPE,
        "keda": versions.KEDA,
        "keda-http-add-on": versions.KEDA_HTTP_ADDON,
        "binaries": [binary.name for binary in BINARIES],
    }


def build_is_current(
    stamp: Path, wanted: dict[str, object], binaries: tuple[AddonBinary, ...], manifests: Path
) -> bool:
    """Whether a build recorded `wanted` in `stamp` and its images and manifests are all there."""
    try:
        recorded = json.loads(stamp.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    built = all(archive_path(binary).is_file() for binary in binaries) and manifests.is_file()
    return recorded == wanted and built


def is_cached() -> bool:
    return build_is_current(stamp_path(), wanted_stamp(), BINARIES, manifests_path())


def missing_reason() -> str | None:
    if is_cached():
        return None
    return f"KEDA and its HTTP add-on are not built in {addons_dir()}: run `hack/control-plane addons`"


def built_images() -> dict[str, Path]:
    """Image reference -> archive, for the real node to import; empty until `build()` ran."""
    if not is_cached():
        return {}
    return {binary.reference: archive_path(binary) for binary in BINARIES}


# -- build ---------------------------------------------------------------------------------------------------


def module_source(module: str, version: str) -> Path:
    """A writable copy of the module's source (the module cache is read-only and go.mod's `replace` must
    apply, which only happens where the module is the main one)."""
    target = addons_dir() / "src" / f"{module.replace('/', '_')}@v{version}"
    if not (target / "go.mod").is_file():
        source = Path(build.download_module(module, f"v{version}")["Dir"])
        partial = target.with_suffix(".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.copytree(source, partial)
        for root, dirs, files in os.walk(partial):
            for name in [*dirs, *files]:
                path = Path(root, name)
                path.chmod(path.stat().st_mode | 0o200)
        partial.replace(target)
    return target


def compile_binary(progress: build.Progress, binary: AddonBinary, out: Path, go_cache: Path) -> None:
    progress.step(f"compiling {binary.module}@v{binary.version} {binary.package}")
    env = build.go_env()
    env["CGO_ENABLED"] = "0"
    env["GOCACHE"] = str(go_cache)
    ldflags = f"{build.LDFLAGS} {binary.ldflags}".strip()
    build.run_go(
        ["build", "-trimpath", f"-ldflags={ldflags}", "-o", str(out), binary.package],
        cwd=module_source(binary.module, binary.version),
        env=env,
    )


def write_image(binary: AddonBinary, executable: Path) -> None:
    out = archive_path(binary)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        layer = Path(scratch) / "layer.tar"
        archive.layer_from_files({binary.path: executable}, layer)
        # An entrypoint, not a command: the add-on's manifests give only `args`.
        config = archive.ImageConfig(
            command=[],
            entrypoint=[binary.path],
            env=[],
            created_by=f"go build {binary.module}",
            user=NONROOT_USER,
        )
        archive.write_docker_archive(layer, config, binary.reference, out)


def build_images(progress: build.Progress, binaries: tuple[AddonBinary, ...], scratch: Path) -> None:
    """Each binary compiled and written as its image. The Go build cache is one of its own under `scratch`,
    removed afterwards with the binaries (the images hold them): KEDA's thousands of packages leave gigabytes
    in Go's shared one, and the stamps make a rebuild rare."""
    try:
        for binary in binaries:
            executable = scratch / "bin" / binary.name
            compile_binary(progress, binary, executable, scratch / "go-cache")
            write_image(binary, executable)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def build_addons(force: bool = False) -> None:
    if is_cached() and not force:
        print(f"addons: cached in {addons_dir()} (KEDA {versions.KEDA}, add-on {versions.KEDA_HTTP_ADDON})")
        return
    progress = build.Progress("addons")
    stamp_path().unlink(missing_ok=True)
    build_images(progress, BINARIES, addons_dir() / "build")
    render_shipped_manifests(progress)
    stamp_path().write_text(json.dumps(wanted_stamp(), indent=2) + "\n")
    progress.step(f"done: images in {addons_dir() / 'images'}")


def render_shipped_manifests(progress: build.Progress) -> None:
    progress.step("rendering the manifests KEDA and the add-on ship, with kubectl kustomize")
    kubectl = versions.bin_dir() / "kubectl"
    if not kubectl.is_file():
        raise build.BuildError(f"{kubectl} is missing: run `hack/control-plane build` first")
    documents = []
    for module, version, relative in MANIFEST_SOURCES:
        directory = Path(build.download_module(module, f"v{version}")["Dir"]) / relative
        result = subprocess.run([str(kubectl), "kustomize", str(directory)], capture_output=True, text=True,
                                timeout=120)  # fmt: skip
        if result.returncode != 0:
            raise build.BuildError(f"kubectl kustomize {directory}: {result.stderr.strip()}")
        documents.extend(document for document in yaml.safe_load_all(result.stdout) if document)
    manifests_path().write_text(yaml.safe_dump_all(documents))


def main_with(force: bool) -> int:
    try:
        build_addons(force=force)
    except build.BuildError as error:
        print(f"addons build failed: {error}", file=sys.stderr)
        return 1
    return 0


# -- install -------------------------------------------------------------------------------------------------


def placed(document: dict[str, Any], placement: dict[str, Any]) -> dict[str, Any]:
    """A Deployment of the shipped manifests with our image, on the real node, one replica (the add-on ships
    three of its interceptor and scaler), without resource requests."""
    images = {binary.upstream_image: binary.reference for binary in BINARIES}
    document["spec"]["replicas"] = 1
    pod = document["spec"]["template"]["spec"]
    pod.update(placement)
    for container in pod["containers"]:
        upstream = container["image"].split("@")[0].rsplit(":", 1)[0]
        if upstream not in images:
            raise ControlPlaneError(f"{document['metadata']['name']}: no build of {container['image']}")
        container["image"] = images[upstream]
        container["imagePullPolicy"] = "Never"
        container.pop("resources", None)
    return document


def manifests(placement: dict[str, Any]) -> list[dict[str, Any]]:
    documents = []
    for document in yaml.safe_load_all(manifests_path().read_text()):
        kind = document["kind"]
        if kind == "ScaledObject":
            continue
        documents.append(placed(document, placement) if kind == "Deployment" else document)
    return documents


def install(plane: ControlPlane, placement: dict[str, Any], timeout: float = INSTALL_TIMEOUT) -> None:
    """Install KEDA and the HTTP add-on; returns once both can scale (raises with their state if not)."""
    documents = manifests(placement)
    plane.kubectl(
        "apply", "--server-side", "--force-conflicts", "-f", "-",
        input="\n---\n".join(yaml.safe_dump(document) for document in documents),
        timeout=120,
    )  # fmt: skip
    deployments = [d["metadata"]["name"] for d in documents if d["kind"] == "Deployment"]
    try:
        for name in deployments:
            plane.kubectl(
                "rollout", "status", f"deployment/{name}", "-n", NAMESPACE, f"--timeout={int(timeout)}s",
                timeout=timeout + 10,
            )  # fmt: skip
        wait_for(lambda: api_service_available(plane), timeout=timeout, interval=1.0,
                 message=f"APIService {EXTERNAL_METRICS_API} Available")  # fmt: skip
    except (ControlPlaneError, TimeoutError, subprocess.TimeoutExpired) as error:
        raise ControlPlaneError(f"KEDA did not come up: {error}\n{state(plane)}") from error


def interceptor_address() -> str:
    """Where pods send requests for HTTP-scaled endpoints (with the endpoint's Host header)."""
    return f"{INTERCEPTOR_PROXY_SERVICE}.{NAMESPACE}:{INTERCEPTOR_PROXY_PORT}"


def api_service_available(plane: ControlPlane) -> bool:
    result = plane.kubectl("get", "apiservice", EXTERNAL_METRICS_API, "-o", "json", check=False)
    if result.returncode != 0:
        return False
    conditions = json.loads(result.stdout).get("status", {}).get("conditions", [])
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


def state(plane: ControlPlane) -> str:
    """The add-ons' pods, APIService and recent logs: what a failed install is diagnosed with."""
    parts = [
        plane.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide", check=False).stdout,
        plane.kubectl("get", "apiservice", EXTERNAL_METRICS_API, "-o", "yaml", check=False).stdout[-2000:],
    ]
    listed = plane.kubectl("get", "deployments", "-n", NAMESPACE, "-o", "name", check=False).stdout.split()
    for deployment in listed:
        logs = plane.kubectl("logs", "-n", NAMESPACE, deployment, "--tail=15", check=False)
        parts.append(f"--- {deployment}:\n{logs.stdout}{logs.stderr}")
    return "\n".join(parts)
