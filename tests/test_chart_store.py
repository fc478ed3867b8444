"""The chart's snapshot store, one of three: node-local (hostPath), a shared volume, an object store. Each
renders into the agent's DaemonSet as the agent reads it (its flags, RemoteConfig's variables) and tells the
operator its kind; incoherent choices fail the render with a message naming the values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from control_plane import cluster_stores, network, shared_volume
from support import container_settings, helm_template

from warmstart.agent.settings import AgentSettings
from warmstart.operator.placement import NODE_LOCAL, OBJECT_STORE, SHARED_VOLUME
from warmstart.operator.settings import OperatorSettings
from warmstart.snapshot.remote import RemoteConfig

pytestmark = pytest.mark.spawns

CHART = Path(__file__).resolve().parents[1] / "charts" / "warmstart"
OBJECT_STORE_VALUES = (
    "--set", "agent.objectStore.bucket=snapshots",
    "--set", "agent.objectStore.endpoint=http://minio.storage:9000",
    "--set", "agent.objectStore.prefix=cluster-a",
    "--set", "agent.objectStore.region=eu-west-1",
    "--set", "agent.objectStore.credentialsSecret=s3-keys",
)  # fmt: skip


class Rendered:
    def __init__(self, *flags: str) -> None:
        docs = [d for d in yaml.safe_load_all(helm_template(CHART, *flags).stdout) if d]
        self.docs = {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}
        self.pod = self.docs["DaemonSet/t-warmstart-agent"]["spec"]["template"]["spec"]
        (self.container,) = self.pod["containers"]

    @property
    def env(self) -> dict[str, Any]:
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in self.container["env"]}

    @property
    def store_env(self) -> dict[str, Any]:
        return {name: value for name, value in self.env.items() if name.startswith(("WARMSTART_S3_", "AWS_"))}

    @property
    def volumes(self) -> dict[str, dict[str, Any]]:
        return {v["name"]: v for v in self.pod["volumes"]}

    @property
    def mounts(self) -> dict[str, dict[str, Any]]:
        return {m["name"]: m for m in self.container["volumeMounts"]}

    def agent_settings(self) -> AgentSettings:
        """The agent's settings as it reads them from its arguments and environment."""
        return container_settings(self.container, "agent", AgentSettings)

    def operator_store(self) -> str:
        operator = self.docs["Deployment/t-warmstart-operator"]["spec"]["template"]["spec"]["containers"][0]
        return container_settings(operator, "operator", OperatorSettings).snapshot_store


def test_node_local_is_the_default_and_has_no_object_store():
    chart = Rendered()
    assert chart.volumes["store"]["hostPath"] == {
        "path": "/var/lib/warmstart/store",
        "type": "DirectoryOrCreate",
    }
    assert chart.store_env == {} and "object-store-credentials" not in chart.volumes
    assert not any(arg.startswith(("--pull-timeout", "--cache-max")) for arg in chart.container["args"])
    assert chart.operator_store() == NODE_LOCAL  # restore pods prefer the node holding their snapshot


def test_a_shared_volume_is_the_one_store_of_every_agent():
    chart = Rendered("--set", "agent.store.claimName=snapshots")
    assert chart.volumes["store"]["persistentVolumeClaim"] == {"claimName": "snapshots"}
    assert chart.mounts["store"]["mountPath"] == chart.env["WARMSTART_STORE"]
    assert chart.store_env == {}
    assert chart.operator_store() == SHARED_VOLUME


def test_an_object_store_is_configured_as_the_agent_reads_it_with_the_node_store_as_its_cache():
    chart = Rendered(
        *OBJECT_STORE_VALUES,
        "--set", "agent.objectStore.virtualHostedStyle=true",
        "--set", "agent.objectStore.concurrency=16",
        "--set", "agent.objectStore.pullTimeoutSeconds=45",
        "--set", "agent.objectStore.cacheMaxBytes=214748364800",
        "--set-json", "agent.objectStore.cacheMaxAgeSeconds=31536000.0",
    )  # fmt: skip
    assert chart.volumes["store"]["hostPath"]["path"] == "/var/lib/warmstart/store"  # the node's cache
    credentials = chart.volumes["object-store-credentials"]["secret"]
    assert credentials == {"secretName": "s3-keys", "defaultMode": 0o400}
    mount = chart.mounts["object-store-credentials"]
    assert mount["readOnly"] is True and "subPath" not in mount  # a whole Secret: rotations reach it
    config = RemoteConfig.from_env(chart.store_env)
    assert (config.bucket, config.endpoint, config.prefix, config.region) == (
        "snapshots", "http://minio.storage:9000", "cluster-a", "eu-west-1",
    )  # fmt: skip
    assert config.credentials_dir == Path(mount["mountPath"]) and config.credentials is None
    assert config.virtual_hosted_style and config.concurrency == 16
    flags = chart.agent_settings()
    assert (flags.pull_timeout, flags.cache_max_bytes, flags.cache_max_age) == (45.0, 200 << 30, 31536000.0)
    assert "--cache-max-age=31536000" in chart.container["args"]
    assert chart.operator_store() == OBJECT_STORE


def test_object_store_defaults_and_credentials_the_agent_finds_itself():
    chart = Rendered(
        "--set", "agent.objectStore.bucket=snapshots",
        "--set", "agent.objectStore.credentialsFromEnvironment=true",
    )  # fmt: skip
    assert chart.store_env == {"WARMSTART_S3_BUCKET": "snapshots", "WARMSTART_S3_CONCURRENCY": "8"}
    assert "object-store-credentials" not in chart.volumes and "object-store-credentials" not in chart.mounts
    config = RemoteConfig.from_env(chart.store_env)
    assert (config.endpoint, config.region, config.credentials_dir) == (None, "us-east-1", None)
    flags = chart.agent_settings()
    assert (flags.pull_timeout, flags.cache_max_bytes, flags.cache_max_age) == (120.0, 0, 0.0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ("--set", "agent.objectStore.bucket=snapshots"),
            "agent.objectStore.bucket needs agent.objectStore.credentialsSecret",
        ),
        (
            (*OBJECT_STORE_VALUES, "--set", "agent.store.claimName=snapshots"),
            "agent.store.claimName and agent.objectStore.bucket are two stores for the whole cluster",
        ),
        (
            (*OBJECT_STORE_VALUES, "--set", "agent.objectStore.credentialsFromEnvironment=true"),
            "credentialsSecret and agent.objectStore.credentialsFromEnvironment exclude each other",
        ),
        (
            ("--set", "agent.objectStore.credentialsSecret=s3-keys"),
            "agent.objectStore.credentialsSecret is set but agent.objectStore.bucket is not",
        ),
        (
            ("--set", "agent.objectStore.endpoint=http://minio:9000", "--set", "agent.store.claimName=s"),
            "agent.objectStore.endpoint is set but agent.objectStore.bucket is not",
        ),
        ((*OBJECT_STORE_VALUES, "--set", "agent.objectStore.prefix=a/../b"), "must not hold a .. segment"),
    ],
)
def test_an_incoherent_store_choice_fails_naming_the_values(flags, message):
    result = helm_template(CHART, *flags, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_the_operator_is_told_the_store_even_without_the_agent():
    chart = yaml.safe_load_all(helm_template(CHART, "--set", "agent.enabled=false").stdout)
    (operator,) = [d for d in chart if d and d["kind"] == "Deployment"]
    env = {e["name"]: e.get("value") for e in operator["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["WARMSTART_OPERATOR_SNAPSHOT_STORE"] == NODE_LOCAL


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ("agent.objectStore.endpoint=minio:9000", "endpoint"),
        ("agent.objectStore.bucket=a/b", "bucket"),
        ("agent.objectStore.prefix=/abs", "prefix"),
        ("agent.objectStore.concurrency=0", "concurrency"),
        ("agent.objectStore.pullTimeoutSeconds=0", "pullTimeoutSeconds"),
        ("agent.objectStore.buckets=x", "buckets"),
    ],
)
def test_the_values_schema_refuses_a_malformed_object_store_setting(value, field):
    result = helm_template(CHART, "--set", value, check=False)
    assert result.returncode != 0 and field in result.stderr, result.stderr


@pytest.mark.parametrize("store", ["object-store", "shared-volume"])
def test_the_values_the_testbed_writes_for_each_cluster_store_select_it_with_an_agent_on_both_nodes(
    store: str, tmp_path: Path
) -> None:
    """`hack/control-plane up --object-store --shared-volume` writes these files for users to add."""
    if store == "object-store":
        values = cluster_stores.object_store_values("http://198.51.100.1:9000")
    else:
        values = cluster_stores.shared_volume_values()
    chart = Rendered("-f", str(cluster_stores.write_values(tmp_path, store, values)))
    assert chart.operator_store() == {"object-store": OBJECT_STORE, "shared-volume": SHARED_VOLUME}[store]
    if store == "object-store":
        config = RemoteConfig.from_env(chart.store_env)
        assert (config.bucket, config.endpoint) == (cluster_stores.BUCKET, "http://198.51.100.1:9000")
        secret = chart.volumes["object-store-credentials"]["secret"]["secretName"]
        assert secret == cluster_stores.CREDENTIALS_SECRET
    else:
        claim = chart.volumes["store"]["persistentVolumeClaim"]["claimName"]
        assert claim == shared_volume.CLAIM_NAME
    assert chart.pod["nodeSelector"] == {network.REAL_NODE_LABEL: "true"}
    tolerated = {toleration["key"] for toleration in chart.pod["tolerations"]}
    assert {network.REAL_NODE_LABEL, network.SECOND_NODE_LABEL} <= tolerated
