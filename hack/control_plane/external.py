"""A cluster the tests did not start, named by a kubeconfig (`WARMSTART_TEST_KUBECONFIG`): the tests marked
`any_cluster` run against it; the others need the local control plane's own parts and skip, saying which."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from . import versions
from .cluster import ClusterTools, ControlPlaneError

KUBECONFIG_ENV = "WARMSTART_TEST_KUBECONFIG"


@dataclass
class ExternalCluster(ClusterTools):
    kubeconfig_path: Path
    state_dir: Path  # helm's private homes
    nodes: int = 0  # no kwok nodes
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def kubeconfig(self) -> Path:
        return self.kubeconfig_path

    @property
    def server(self) -> str:
        """The API server of the kubeconfig's current context."""
        return str(self.api_client().configuration.host)

    @property
    def startup_seconds(self) -> float:
        return 0.0

    @property
    def bin_dir(self) -> Path:
        """The built kubectl and helm when there are, else those on PATH."""
        return self.binary("kubectl").parent

    def binary(self, name: str) -> Path:
        built = versions.bin_dir() / name
        if built.is_file():
            return built
        found = shutil.which(name)
        if found is None:
            raise ControlPlaneError(f"no {name}: run `hack/control-plane build` or put {name} on PATH")
        return Path(found)

    def pids(self) -> dict[str, int]:
        return {}

    def check_reachable(self) -> None:
        result = self.kubectl("get", "--raw", "/readyz", check=False, timeout=30)
        if result.returncode != 0:
            raise ControlPlaneError(
                f"{KUBECONFIG_ENV}={self.kubeconfig_path}: its API server {self.server} does not answer: "
                f"{result.stderr.strip()}"
            )
