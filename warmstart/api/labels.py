"""Names shared by the operator, the agent and the worker pods: API group, labels, annotations."""

from __future__ import annotations

GROUP = "warmstart.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
ENDPOINT_KIND = "InferenceEndpoint"
ENDPOINT_PLURAL = "inferenceendpoints"
SNAPSHOT_KIND = "InferenceSnapshot"
SNAPSHOT_PLURAL = "inferencesnapshots"

FIELD_MANAGER = "warmstart-operator"

ENDPOINT_LABEL = f"{GROUP}/endpoint"
ROLE_LABEL = f"{GROUP}/role"
SNAPSHOT_LABEL = f"{GROUP}/snapshot"
REQUEST_KEY_LABEL = f"{GROUP}/request-key"
STATUS_ANNOTATION = f"{GROUP}/status"

ROLE_CAPTURE = "capture"
ROLE_RESTORE = "restore"
ROLE_COLD = "cold"

WORKER_CONTAINER = "worker"  # the worker pods' one container

COMPONENT_LABEL = "app.kubernetes.io/component"
WORKER_COMPONENT = "worker"
CAPTURE_COMPONENT = "capture"
PRESTAGE_COMPONENT = "prestage"

# Label values are limited to 63 characters, a SHA-256 hex digest has 64: labels carry this prefix and
# spec.requestKeyHash the full digest, which is what matching compares.
REQUEST_KEY_LABEL_LENGTH = 32

CONTROL_DIR_PATH = "/run/warmstart/control"
POD_UID_ENV = "WARMSTART_POD_UID"  # worker containers carry their pod uid (downward API)
STORE_MOUNT_PATH = "/var/lib/warmstart/store"


def request_key_label(request_hash: str) -> str:
    return request_hash[:REQUEST_KEY_LABEL_LENGTH]


def label_selector(labels: dict[str, str]) -> str:
    """`k1=v1,k2=v2` (keys sorted): the form of a list query's labelSelector and of status.selector."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
