"""Build the control-plane binaries from their published Go modules and fetch third-party CRDs.

Everything lands in the cache directory (outside the repository) and a stamp records the versions, so a
second `build` only compares the stamp and returns.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from . import versions

LDFLAGS = "-s -w"
# Where Kubernetes keeps the version a binary reports (server and client side).
VERSION_PACKAGES = ("component-base/version", "client-go/pkg/version")
PACKAGES_PER_PROGRESS_LINE = 250


def kubernetes_ldflags() -> str:
    """Stamp the release into the binaries; without it they report v0.0.0-master, and tools that check
    the server version (helm's kubeVersion constraints, kubectl's skew warning) misbehave."""
    major, minor, _patch = versions.KUBERNETES.split(".")
    stamped = {
        "gitVersion": f"v{versions.KUBERNETES}",
        "gitMajor": major,
        "gitMinor": minor,
        "gitTreeState": "clean",
        "buildDate": "1970-01-01T00:00:00Z",
    }
    flags = [
        f"-X k8s.io/{package}.{name}={value}"
        for package in VERSION_PACKAGES
        for name, value in stamped.items()
    ]
    return " ".join([LDFLAGS, *flags])


# (Go module, version, file inside the module) for each third-party CRD our objects must satisfy.
CRD_SOURCES: tuple[tuple[str, str, str], ...] = (
    ("github.com/kedacore/keda/v2", versions.KEDA, "config/crd/bases/keda.sh_scaledobjects.yaml"),
    ("github.com/kedacore/keda/v2", versions.KEDA, "config/crd/bases/keda.sh_triggerauthentications.yaml"),
    (
        "github.com/kedacore/keda/v2",
        versions.KEDA,
        "config/crd/bases/keda.sh_clustertriggerauthentications.yaml",
    ),
    (
        "github.com/kedacore/http-add-on",
        versions.KEDA_HTTP_ADDON,
        "config/crd/bases/http.keda.sh_httpscaledobjects.yaml",
    ),
    (
        "github.com/prometheus-operator/prometheus-operator",
        versions.PROMETHEUS_OPERATOR,
        "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",
    ),
    (
        "github.com/prometheus-operator/prometheus-operator",
        versions.PROMETHEUS_OPERATOR,
        "example/prometheus-operator-crd/monitoring.coreos.com_podmonitors.yaml",
    ),
)

# kwok simulates nothing without stages; these are the "fast" node and pod lifecycles kwok publishes.
KWOK_STAGES = (
    "kustomize/stage/node/fast/node-initialize.yaml",
    "kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "kustomize/stage/pod/fast/pod-ready.yaml",
    "kustomize/stage/pod/fast/pod-complete.yaml",
    "kustomize/stage/pod/fast/pod-delete.yaml",
)

ETCD_MAIN = """\
// Command etcd runs the etcd server from its published Go module.
package main

import (
\t"os"

\t"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
"""


class BuildError(RuntimeError):
    pass


class Progress:
    """Prints one line per step with the time since the build began."""

    def __init__(self, label: str = "control-plane") -> None:
        self.label = label
        self.started = time.monotonic()

    def step(self, message: str) -> None:
        print(f"[{self.label} {time.monotonic() - self.started:6.1f}s] {message}", flush=True)


def go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("GOFLAGS", "-buildvcs=false")
    # k8s.io/kubernetes 1.35 needs go >= 1.25; anything newer that is installed will do.
    env.setdefault("GOTOOLCHAIN", "auto")
    return env


def run_go(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    if shutil.which("go") is None:
        raise BuildError("the Go toolchain is not on PATH: install Go >= 1.25 to build the control plane")
    result = subprocess.run(["go", *args], cwd=cwd, env=env or go_env(), capture_output=True, text=True)
    if result.returncode != 0:
        raise BuildError(f"`go {' '.join(args)}` failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout


def run_go_with_progress(args: list[str], cwd: Path, progress: Progress) -> None:
    """Run a `go build -v`-style command, turning its package-per-line output into occasional progress."""
    process = subprocess.Popen(
        ["go", *args], cwd=cwd, env=go_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    recent: deque[str] = deque(maxlen=40)
    for count, line in enumerate(process.stderr, start=1):
        recent.append(line.rstrip())
        if count % PACKAGES_PER_PROGRESS_LINE == 0:
            progress.step(f"  ... {count} packages compiled")
    if process.wait() != 0:
        raise BuildError(f"`go {' '.join(args)}` failed (exit {process.returncode}):\n" + "\n".join(recent))


def download_module(module: str, version: str) -> dict[str, str]:
    """`go mod download -json` one module version; returns its Dir and GoMod paths in the module cache."""
    info = json.loads(run_go(["mod", "download", "-json", f"{module}@{version}"], cwd=Path("/")))
    if info.get("Error"):
        raise BuildError(f"cannot download {module}@{version}: {info['Error']}")
    return info


def staging_modules(kubernetes_go_mod: str) -> list[str]:
    """The k8s.io/* modules that k8s.io/kubernetes replaces with its ./staging directories."""
    return sorted(set(re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", kubernetes_go_mod, re.M)))


def kubernetes_go_mod(kubernetes_go_mod_text: str) -> str:
    """Our own go.mod: requires k8s.io/kubernetes and pins each staging module to its published v0.x tag."""
    staging = versions.staging_version()
    pins = "\n".join(
        f"\t{module} => {module} {staging}" for module in staging_modules(kubernetes_go_mod_text)
    )
    return (
        "// Generated by hack/control-plane build. Do not edit.\n"
        "module warmstart.invalid/control-plane\n\n"
        "go 1.25.0\n\n"
        "require (\n"
        f"\tk8s.io/kubernetes v{versions.KUBERNETES}\n"
        f"\tgo.etcd.io/etcd/server/v3 v{versions.ETCD}\n"
        ")\n\n"
        f"replace (\n{pins}\n)\n"
    )


def tools_go(commands: tuple[str, ...] = versions.KUBERNETES_COMMANDS) -> str:
    imports = "\n".join(f'\t_ "k8s.io/kubernetes/cmd/{name}"' for name in commands)
    return (
        "//go:build tools\n\n"
        "// Package tools pins the Kubernetes commands this module builds.\n"
        f"package tools\n\nimport (\n{imports}\n)\n"
    )


def write_if_changed(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def prepare_kubernetes_module(progress: Progress, module_dir: Path, commands: tuple[str, ...]) -> None:
    """Write our go.mod (k8s.io/kubernetes at the pinned release) and resolve it for `commands`."""
    progress.step(f"fetching k8s.io/kubernetes v{versions.KUBERNETES} go.mod")
    upstream = Path(download_module("k8s.io/kubernetes", f"v{versions.KUBERNETES}")["GoMod"]).read_text()
    generated = kubernetes_go_mod(upstream)
    # `go mod tidy` rewrites go.mod, so the generated text is kept beside it to notice a version change.
    template = module_dir / "go.mod.in"
    if not template.is_file() or template.read_text() != generated:
        write_if_changed(module_dir / "go.mod", generated)
        (module_dir / "go.sum").unlink(missing_ok=True)
        write_if_changed(template, generated)
    write_if_changed(module_dir / "tools.go", tools_go(commands))
    progress.step("resolving modules (go mod tidy; downloads on first run)")
    run_go(["mod", "tidy"], cwd=module_dir)


def compile_packages(progress: Progress, module_dir: Path, packages: list[str], out: Path) -> None:
    run_go_with_progress(
        ["build", "-v", "-trimpath", f"-ldflags={kubernetes_ldflags()}", "-o", f"{out}/", *packages],
        cwd=module_dir,
        progress=progress,
    )


def build_kubernetes_and_etcd(progress: Progress, out: Path) -> None:
    module_dir = versions.cache_root() / "src" / "kubernetes"
    write_if_changed(module_dir / "cmd" / "etcd" / "main.go", ETCD_MAIN)
    prepare_kubernetes_module(progress, module_dir, versions.KUBERNETES_COMMANDS)
    progress.step(
        f"compiling {', '.join(versions.KUBERNETES_COMMANDS)}, etcd (the long step on a fresh machine)"
    )
    packages = [f"k8s.io/kubernetes/cmd/{name}" for name in versions.KUBERNETES_COMMANDS]
    compile_packages(progress, module_dir, [*packages, "./cmd/etcd"], out)


def go_install(progress: Progress, out: Path, package: str, version: str, ldflags: str = LDFLAGS) -> None:
    progress.step(f"building {package}@v{version}")
    env = go_env()
    env["GOBIN"] = str(out)
    run_go(["install", "-trimpath", f"-ldflags={ldflags}", f"{package}@v{version}"], cwd=Path("/"), env=env)


def copy_from_module(module: str, version: str, relative_paths: tuple[str, ...], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    module_dir = Path(download_module(module, f"v{version}")["Dir"])
    for relative in relative_paths:
        source = module_dir / relative
        if not source.is_file():
            raise BuildError(f"{module}@v{version} has no {relative}: update {__file__}")
        target = out / source.name
        shutil.copyfile(source, target)
        target.chmod(0o644)


def fetch_kwok_stages(progress: Progress, out: Path) -> None:
    progress.step("fetching kwok's node and pod stages from its Go module")
    copy_from_module("sigs.k8s.io/kwok", versions.KWOK, KWOK_STAGES, out)


def fetch_crds(progress: Progress, out: Path) -> None:
    progress.step("fetching KEDA and prometheus-operator CRDs from their Go modules")
    sources: dict[tuple[str, str], list[str]] = {}
    for module, version, relative in CRD_SOURCES:
        sources.setdefault((module, version), []).append(relative)
    for (module, version), relative_paths in sources.items():
        copy_from_module(module, version, tuple(relative_paths), out)


def is_cached() -> bool:
    stamp = versions.stamp_path()
    if not stamp.is_file():
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except json.JSONDecodeError:
        return False
    binaries_present = all((versions.bin_dir() / name).is_file() for name in versions.BINARIES)
    return recorded == versions.wanted_stamp() and binaries_present


def build(force: bool = False) -> Path:
    """Build everything into the cache unless the stamp says it is already there; returns the bin dir."""
    out = versions.bin_dir()
    if is_cached() and not force:
        print(f"control plane: cached in {versions.cache_root()} (Kubernetes {versions.KUBERNETES})")
        return out
    progress = Progress()
    versions.stamp_path().unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    build_kubernetes_and_etcd(progress, out)
    go_install(progress, out, "sigs.k8s.io/kwok/cmd/kwok", versions.KWOK)
    helm_version = f"-X helm.sh/helm/v3/internal/version.version=v{versions.HELM}"
    go_install(progress, out, "helm.sh/helm/v3/cmd/helm", versions.HELM, f"{LDFLAGS} {helm_version}")
    fetch_kwok_stages(progress, versions.kwok_stage_dir())
    fetch_crds(progress, versions.crd_dir())
    versions.stamp_path().write_text(json.dumps(versions.wanted_stamp(), indent=2) + "\n")
    progress.step(f"done: binaries in {out}, CRDs in {versions.crd_dir()}")
    return out


def main_with(force: bool) -> int:
    try:
        build(force=force)
    except BuildError as error:
        print(f"control plane build failed: {error}", file=sys.stderr)
        return 1
    return 0
