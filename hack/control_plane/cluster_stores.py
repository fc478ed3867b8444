"""The two cluster-wide snapshot stores, beside the real nodes a detached `up` started, to try by hand: an
S3-compatible object store (`up --object-store`: Versity's gateway, the bucket `BUCKET`, its credentials in
the Secret `CREDENTIALS_SECRET` of the release's namespace) and a shared volume (`up --shared-volume`: the
claim `shared_volume.CLAIM_NAME` on a directory both nodes mount). Each writes the chart's values for it to
`values-<store>.yaml` in the `up` state directory, for `helm install -f`; `down` stops the server.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import network, s3, shared_volume
from .cluster import ControlPlane, process_alive, process_runs_binary, stop_process_group

if TYPE_CHECKING:
    from .node import RealNode

BUCKET = "snapshots"
CREDENTIALS_SECRET = "object-store"
SERVER_RECORD = "object-store.json"
# Either real node: the agent on both, and the pods that tolerate both nodes' taints.
ON_BOTH_NODES: dict[str, Any] = {
    "nodeSelector": {network.REAL_NODE_LABEL: "true"},
    "tolerations": [
        {"key": label, "operator": "Exists", "effect": "NoSchedule"}
        for label in (network.REAL_NODE_LABEL, network.SECOND_NODE_LABEL)
    ],
}


def object_store_values(endpoint: str) -> dict[str, Any]:
    return {"agent": {**ON_BOTH_NODES, "objectStore": {
        "bucket": BUCKET, "endpoint": endpoint, "credentialsSecret": CREDENTIALS_SECRET,
    }}}  # fmt: skip


def shared_volume_values() -> dict[str, Any]:
    return {"agent": {**ON_BOTH_NODES, "store": {"claimName": shared_volume.CLAIM_NAME}}}


def credentials_secret(namespace: str, server: s3.S3Server) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": CREDENTIALS_SECRET, "namespace": namespace},
        "stringData": {"access-key-id": server.access_key_id, "secret-access-key": server.secret_access_key},
    }


def write_values(state_dir: Path, store: str, values: dict[str, Any]) -> Path:
    """The values file (JSON, which is YAML), readable by this user only: it names where credentials are."""
    path = state_dir / f"values-{store}.yaml"
    path.write_text(json.dumps(values, indent=2) + "\n")
    path.chmod(0o600)
    return path


def ensure_namespace(plane: ControlPlane, namespace: str) -> None:
    body = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    plane.kubectl("apply", "-f", "-", input=json.dumps(body))


def start_object_store(plane: ControlPlane, node: RealNode, state_dir: Path, namespace: str) -> Path:
    """The server beside the nodes (it outlives this process), its credentials in a Secret of `namespace`;
    returns the values file."""
    root = state_dir / "object-store"
    server = s3.start_beside_nodes(node, root / "data", [BUCKET], log=root / "versitygw.log",
                                   die_with_parent=False)  # fmt: skip
    assert server.component is not None and server.component.process is not None
    record = {"pid": server.component.process.pid, "endpoint": server.endpoint, "bucket": BUCKET}
    (state_dir / SERVER_RECORD).write_text(json.dumps(record) + "\n")
    ensure_namespace(plane, namespace)
    plane.kubectl("apply", "-f", "-", input=json.dumps(credentials_secret(namespace, server)))
    return write_values(state_dir, "object-store", object_store_values(server.endpoint))


def object_store_endpoint(state_dir: Path) -> str | None:
    """The recorded server's endpoint while it runs; None when there is none."""
    record = _server_record(state_dir)
    return record["endpoint"] if record and _server_alive(record) else None


def stop_object_store(state_dir: Path) -> bool:
    """Stop the recorded server; returns whether one ran."""
    record = _server_record(state_dir)
    alive = record is not None and _server_alive(record)
    if alive:
        stop_process_group(record["pid"])  # type: ignore[index]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(state_dir / SERVER_RECORD)
    return alive


def create_shared_store(plane: ControlPlane, state_dir: Path, namespace: str) -> Path:
    """The shared volume's directory, the volume and its claim in `namespace`; returns the values file."""
    ensure_namespace(plane, namespace)
    directory = state_dir / "shared-store"
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    shared_volume.create_shared_volume(plane, namespace, directory)
    return write_values(state_dir, "shared-volume", shared_volume_values())


def _server_record(state_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((state_dir / SERVER_RECORD).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _server_alive(record: dict[str, Any]) -> bool:
    pid = record.get("pid")
    return isinstance(pid, int) and process_alive(pid) and process_runs_binary(pid, s3.server_path().parent)
