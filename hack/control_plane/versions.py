"""Pinned versions and cache locations of the local Kubernetes control plane."""

from __future__ import annotations

import os
from pathlib import Path

KUBERNETES = "1.35.4"
# The etcd release that k8s.io/kubernetes v1.35.4 itself requires (go.etcd.io/etcd/server/v3).
ETCD = "3.6.5"
KWOK = "0.8.0"
HELM = "3.20.2"
# The real node's cluster DNS (what pods resolve Service names with).
COREDNS = "1.15.0"

KEDA = "2.21.0"
KEDA_HTTP_ADDON = "0.12.0"
PROMETHEUS_OPERATOR = "0.85.0"
# The newest Prometheus that prometheus-operator 0.85 supports; its Go module tags 3.x releases v0.3xx.y.
PROMETHEUS = "3.5.0"
PROMETHEUS_MODULE_VERSION = "0.305.0"
PROMETHEUS_ADAPTER = "0.12.0"

# Bump when the way binaries are built changes (flags, patches), so existing caches are rebuilt.
BUILD_RECIPE = 3

KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
BINARIES = (*KUBERNETES_COMMANDS, "etcd", "kwok", "helm")

# The real node has its own stamp, so adding or changing it never rebuilds the control plane above.
NODE_BUILD_RECIPE = 2
NODE_COMMANDS = ("kubelet", "kube-proxy")
NODE_BINARIES = (*NODE_COMMANDS, "coredns")
# Debian's packages for the rest of the node; `nftables` gives kube-proxy its `nft`; gcc and libc6-dev build
# the static pause binary, debootstrap the images' base.
NODE_DEBIAN_COMMANDS = {
    "containerd": "containerd",
    "runc": "runc",
    "containernetworking-plugins": "/usr/lib/cni/bridge",
    "nftables": "nft",
    "conntrack": "conntrack",
    "gcc": "gcc",
    "libc6-dev": "/usr/include/stdio.h",
    "debootstrap": "debootstrap",
}
NODE_DEBIAN_PACKAGES = tuple(NODE_DEBIAN_COMMANDS)
# What a started node runs (the rest only builds): a machine given those as a folder (WARMSTART_NODE_TOOLS)
# needs no package manager.
NODE_RUNTIME_PACKAGES = ("containerd", "runc", "containernetworking-plugins", "nftables", "conntrack")

# A GPU node: NVIDIA's device plugin advertises nvidia.com/gpu to the kubelet (built only when asked for).
NVIDIA_DEVICE_PLUGIN = "0.18.1"
NVIDIA_DEVICE_PLUGIN_MODULE = "github.com/NVIDIA/k8s-device-plugin"
GPU_BUILD_RECIPE = 1
PAUSE_IMAGE = "localhost/warmstart/pause:1"

# The tests' S3-compatible object store: Versity's S3 gateway over a plain directory (Apache-2.0), built
# from its Go module without cgo (its RDMA and GPU-direct backends need vendor libraries); its own stamp too.
VERSITYGW = "1.8.0"
VERSITYGW_MODULE = "github.com/versity/versitygw"
S3_BUILD_RECIPE = 1

# BuildKit builds the project's images from the Dockerfile; its own stamp, too.
BUILDKIT = "0.34.2"
IMAGES_RECIPE = 2


def staging_version(kubernetes: str = KUBERNETES) -> str:
    """The v0.x tag that k8s.io staging modules carry for a given Kubernetes release (1.35.4 -> v0.35.4)."""
    _major, minor, patch = kubernetes.split(".")
    return f"v0.{minor}.{patch}"


def warmstart_cache() -> Path:
    return Path(os.environ.get("WARMSTART_CACHE") or Path.home() / ".cache" / "warmstart")


def cache_root() -> Path:
    return warmstart_cache() / "k8s"


def bin_dir() -> Path:
    return cache_root() / "bin"


def crd_dir() -> Path:
    return cache_root() / "crds"


def kwok_stage_dir() -> Path:
    return cache_root() / "kwok-stages"


def stamp_path() -> Path:
    return cache_root() / "stamp.json"


def wanted_stamp() -> dict[str, object]:
    """What a finished build records; any difference means the cache is stale and gets rebuilt."""
    return {
        "recipe": BUILD_RECIPE,
        "kubernetes": KUBERNETES,
        "etcd": ETCD,
        "kwok": KWOK,
        "helm": HELM,
        "crds": {
            "keda": KEDA,
            "keda-http-add-on": KEDA_HTTP_ADDON,
            "prometheus-operator": PROMETHEUS_OPERATOR,
        },
        "binaries": list(BINARIES),
    }


def node_stamp_path() -> Path:
    return cache_root() / "node-stamp.json"


def node_cache_dir() -> Path:
    """What the real node keeps between runs: the pause image and containerd's image store."""
    return cache_root() / "node"


def wanted_node_stamp(pause_source: str) -> dict[str, object]:
    return {
        "recipe": NODE_BUILD_RECIPE,
        "kubernetes": KUBERNETES,
        "coredns": COREDNS,
        "binaries": list(NODE_BINARIES),
        "pause": pause_source,
    }


def gpu_stamp_path() -> Path:
    return cache_root() / "gpu-stamp.json"


def s3_stamp_path() -> Path:
    return cache_root() / "s3-stamp.json"


def node_tools_root() -> Path | None:
    """A folder holding the node's runtime packages unpacked (bin/ on PATH, usr/lib/cni), for a machine
    without Debian's packages (the GPU machine); None: the machine's own."""
    value = os.environ.get("WARMSTART_NODE_TOOLS")
    return Path(value) if value else None


def images_cache_dir() -> Path:
    return warmstart_cache() / "images"
