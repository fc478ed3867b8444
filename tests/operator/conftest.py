from __future__ import annotations

from pathlib import Path

import pytest

CRDS = Path(__file__).resolve().parents[2] / "crds"


@pytest.fixture(scope="session")
def crds(kube) -> None:
    """The project's CRDs installed and Established on the local control plane."""
    kube.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRDS))
    kube.kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f", str(CRDS))
