"""kopf logs in with the credentials of the operator's own client loader."""

from __future__ import annotations

from pathlib import Path

import kopf
import pytest
import yaml
from kubernetes.config import kube_config

from warmstart.operator.login import login


def test_kopf_logs_in_with_the_kubeconfig_the_operator_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": "https://10.0.0.3:6443"}}],
        "users": [{"name": "u", "user": {"token": "s3cret"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(config))
    # KUBECONFIG (or ~/.kube/config), as the client library read it at import
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(tmp_path / "kubeconfig"))
    info = login(settings=kopf.OperatorSettings())
    assert (info.server, info.scheme, info.token) == ("https://10.0.0.3:6443", "Bearer", "s3cret")
    assert info.insecure is False
