"""Pinned versions and cache locations of the local Kubernetes control plane."""

from __future__ import annotations

import os
from pathlib import Path

KUBERNETES = "1.35.4"
# The etcd release that k8s.io/kubernetes v1.35.4 itself requires (go.etcd.io/etcd/server/v3).
ETCD = "3.6.5"
KWOK = "0.8.0"
HELM = "3.20.2"

KEDA = "2.21.0"
KEDA_HTTP_ADDON = "0.12.0"
PROMETHEUS_OPERATOR = "0.85.0"

# Bump when the way binaries are built changes (flags, patches), so existing caches are rebuilt.
BUILD_RECIPE = 3

KUBERNETES_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
BINARIES = (*KUBERNETES_COMMANDS, "etcd", "kwok", "helm")


def staging_version(kubernetes: str = KUBERNETES) -> str:
    """The v0.x tag that k8s.io staging modules carry for a given Kubernetes release (1.35.4 -> v0.35.4)."""
    _major, minor, patch = kubernetes.split(".")
    return f"v0.{minor}.{patch}"


def cache_root() -> Path:
    return Path(os.environ.get("WARMSTART_CACHE") or Path.home() / ".cache" / "warmstart") / "k8s"


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
