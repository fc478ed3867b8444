"""The manifests in examples/ are what users copy first: the real apiserver must accept every one."""

from __future__ import annotations

from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))


def test_there_are_examples() -> None:
    assert len(EXAMPLES) >= 3


@pytest.mark.spawns
@pytest.mark.integration
@pytest.mark.any_cluster
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_by_the_apiserver(kube, namespace, repo_root, example: Path) -> None:
    kube.kubectl("apply", "--server-side", "-f", str(repo_root / "crds"))
    crd = "crd/inferenceendpoints.warmstart.dev"
    kube.kubectl("wait", "--for=condition=Established", crd, "--timeout=60s")
    result = kube.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(example), check=False)
    assert result.returncode == 0, result.stderr
    assert "created (server dry run)" in result.stdout


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_is_accepted_by_the_operator(example: Path) -> None:
    """Past the schema, the operator's own checks (worker flags in engine.args among them) pass too."""
    import yaml

    from warmstart.operator.spec import parse_spec

    documents = yaml.safe_load_all(example.read_text())
    endpoints = [doc for doc in documents if doc and doc["kind"] == "InferenceEndpoint"]
    assert endpoints
    for endpoint in endpoints:
        parse_spec(endpoint["spec"])
