"""The shared API client's loader and its request timeouts, against loopback servers (no cluster)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.config import kube_config

from warmstart.kube.client import Kube, TransientKubeError, load_configuration, with_timeout


def write_kubeconfig(path: Path, server: str, token: str) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": server, "insecure-skip-tls-verify": True}}],
        "users": [{"name": "u", "user": {"token": token}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_named_kubeconfig_wins_else_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a pod: no service account
    from_env = write_kubeconfig(tmp_path / "env", "https://10.0.0.1:6443", "env-token")
    named = write_kubeconfig(tmp_path / "named", "https://10.0.0.2:6443", "named-token")
    # KUBECONFIG (or ~/.kube/config), as the client library read it at import
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(from_env))
    assert load_configuration().host == "https://10.0.0.1:6443"
    configuration = load_configuration(str(named))
    assert configuration.host == "https://10.0.0.2:6443"
    assert configuration.get_api_key_with_prefix("BearerToken") == "Bearer named-token"


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A loopback server that accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        for connection in accepted:
            connection.close()
        listener.close()


def test_a_silent_api_server_fails_calls_in_their_timeout(silent_server: str) -> None:
    api_client = client.ApiClient(client.Configuration(host=silent_server))
    started = time.monotonic()
    with pytest.raises(TransientKubeError):
        Kube(api_client, timeout=0.5).get("Pod", "default", "p")
    with pytest.raises(ApiException) as raised:  # as the client's leader election expects a failure
        with_timeout(client.CoordinationV1Api(api_client), 0.5).read_namespaced_lease("lease", "default")
    assert raised.value.status == 0
    assert time.monotonic() - started < 10  # without a timeout, both would wait forever
