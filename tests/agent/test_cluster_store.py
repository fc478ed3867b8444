"""The agent's cluster store against a real S3 server (Versity's gateway on loopback): node A's capture is
pushed, node B pulls it into its cache for a restore or ahead of one, a stopped server or a tampered object is
a refusal that leaves B's cache clean, the cache trim spares what is being restored, and a deleted
InferenceSnapshot is unpublished from the bucket only when the bucket's manifest names it."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest
from control_plane.s3 import S3Server
from kubernetes import client
from s3_plugin import BUCKET
from support import agent_settings

from warmstart.agent.agent import Agent
from warmstart.agent.cluster_store import ClusterStore, PullFailed, PullRefused
from warmstart.agent.kube_status import KubeStatus
from warmstart.agent.metrics import AgentMetrics
from warmstart.api.identity import SnapshotIdentity
from warmstart.snapshot import SnapshotStore, generate_hmac_key, load_signer, load_verifier
from warmstart.snapshot.remote import Credentials, RemoteAccessDenied, RemoteConfig, RemoteStore
from warmstart.snapshot.remote.object_keys import Keys
from warmstart.snapshot.store import Snapshot

pytestmark = pytest.mark.spawns

MIB = 1 << 20
PREFIX = "cluster/"
PAGES = os.urandom(3 * MIB + 17)


def remote_config(server: S3Server) -> RemoteConfig:
    return RemoteConfig(
        bucket=BUCKET, endpoint=server.endpoint, prefix=PREFIX,
        credentials=Credentials(server.access_key_id, server.secret_access_key), concurrency=4,
    )  # fmt: skip


def capture(store: SnapshotStore, key: Path, pages: bytes = PAGES, name: str = "snap") -> Snapshot:
    identity = SnapshotIdentity(model_digest="sha256:" + "ab" * 32, engine="builtin", engine_version="1")
    meta = {"namespace": "ml", "inferenceSnapshot": name, "node": "node-a"}
    with store.stage(identity, meta=meta) as staging:
        (staging.dir / "criu").mkdir()
        (staging.dir / "criu" / "pages-1.img").write_bytes(pages)
        (staging.dir / "criu" / "core-1.img").write_bytes(b"core" * 100)
        return staging.publish(load_signer(key))


def node(tmp_path: Path, name: str, server: S3Server, key: Path, **bounds: float) -> ClusterStore:
    local = SnapshotStore(tmp_path / name, chunk_size=MIB)
    return ClusterStore(
        local=local, remote=RemoteStore(local, remote_config(server)), verifier=load_verifier(key),
        metrics=AgentMetrics(), **bounds,  # type: ignore[arg-type]
    )  # fmt: skip


def pulled_bytes(cluster_store: ClusterStore, reason: str) -> float:
    labels = {"direction": "pull", "reason": reason}
    return cluster_store.metrics.value("warmstart_agent_object_store_bytes_total", labels)


def assert_cache_clean(store: SnapshotStore) -> None:
    """Nothing listed, nothing half-written: no snapshot, no staging directory left."""
    assert store.list() == []
    for directory in (store.snapshots_dir, store.staging_dir):
        assert not directory.exists() or list(directory.iterdir()) == []


@pytest.fixture
def key(tmp_path: Path) -> Path:
    return generate_hmac_key(tmp_path / "key")


def test_a_capture_on_node_a_restores_from_node_bs_cache_after_one_pull(
    s3_server: S3Server, tmp_path: Path, key: Path
) -> None:
    node_a, node_b = node(tmp_path, "a", s3_server, key), node(tmp_path, "b", s3_server, key)
    snapshot = capture(node_a.local, key)

    node_a.publish(snapshot.id)
    pushed = node_a.metrics.value("warmstart_agent_object_store_bytes_total",
                                  {"direction": "push", "reason": "capture"})  # fmt: skip
    assert pushed == len(PAGES) + 400

    restored = node_b.local_copy(snapshot.id, "restore")
    assert restored.id == snapshot.id and pulled_bytes(node_b, "restore") == pushed
    node_b.local.verify(snapshot.id, node_b.verifier, snapshot.identity)
    assert node_b.local.blob_path(snapshot.files["criu/pages-1.img"].digest).read_bytes() == PAGES

    node_b.local_copy(snapshot.id, "restore")  # the cache has it: nothing more read
    assert pulled_bytes(node_b, "restore") == pushed


def test_prestaging_pulls_ahead_so_the_restore_reads_nothing_remote(
    s3_server: S3Server, tmp_path: Path, key: Path
) -> None:
    node_a, node_b = node(tmp_path, "a", s3_server, key), node(tmp_path, "b", s3_server, key)
    snapshot = capture(node_a.local, key)
    node_a.publish(snapshot.id)

    node_b.local_copy(snapshot.id, "prestage")
    node_b.local_copy(snapshot.id, "restore")

    assert pulled_bytes(node_b, "prestage") == len(PAGES) + 400
    assert pulled_bytes(node_b, "restore") == 0


def test_a_stopped_server_is_a_bounded_refusal_and_a_clean_cache_then_the_next_pull_works(
    s3_server: S3Server, tmp_path: Path, key: Path
) -> None:
    node_a = node(tmp_path, "a", s3_server, key)
    node_b = node(tmp_path, "b", s3_server, key, pull_timeout=5.0)
    snapshot = capture(node_a.local, key)
    node_a.publish(snapshot.id)
    s3_server.stop()

    started = time.monotonic()
    with pytest.raises(
        PullFailed, match=f"pulling snapshot {snapshot.id} from the object store failed"
    ) as raised:
        node_b.local_copy(snapshot.id, "restore")
    assert not isinstance(raised.value, PullRefused)  # the node's trouble, not the snapshot's: never counted
    assert time.monotonic() - started < 60  # bounded by the pull timeout and the client's own deadlines
    failures = node_b.metrics.value("warmstart_agent_object_store_failures_total",
                                    {"direction": "pull", "reason": "restore"})  # fmt: skip
    assert failures == 1
    assert_cache_clean(node_b.local)

    s3_server.start()
    assert node_b.local_copy(snapshot.id, "restore").id == snapshot.id


def test_an_unknown_access_key_is_refused_credentials_never_a_missing_snapshot(
    s3_server: S3Server, tmp_path: Path, key: Path
) -> None:
    """Versity's gateway answers a key it does not know with 404 (XAdminUserNotFound), bodiless for a HEAD:
    read as "no such object", every pull would count against a sound snapshot and turn it Invalid."""
    node_a = node(tmp_path, "a", s3_server, key)
    snapshot = capture(node_a.local, key)
    node_a.publish(snapshot.id)
    local = SnapshotStore(tmp_path / "b", chunk_size=MIB)
    unknown = Credentials("AKIDNOSUCHUSER", s3_server.secret_access_key)
    config = dataclasses.replace(remote_config(s3_server), credentials=unknown)
    remote = RemoteStore(local, config)
    node_b = ClusterStore(local=local, remote=remote, verifier=load_verifier(key), metrics=AgentMetrics())

    with pytest.raises(PullFailed, match="check the credentials") as raised:
        node_b.local_copy(snapshot.id, "restore")
    assert not isinstance(raised.value, PullRefused)  # the node's trouble: counted against nothing
    with pytest.raises(RemoteAccessDenied, match="check the credentials"):
        remote.client.head(Keys(PREFIX).manifest(snapshot.id))  # a HEAD's 404 has no body to say why
    assert_cache_clean(local)
    assert RemoteStore(local, remote_config(s3_server)).client.head("cluster/no-such-object") is None


@pytest.mark.parametrize(
    ("damage", "words"),
    [("overwritten", "tampered"), ("truncated", "truncated"), ("blob deleted", "missing"),
     ("manifest deleted", "no snapshot")],
)  # fmt: skip
def test_a_damaged_or_missing_bucket_copy_is_refused_as_the_snapshots_fault_and_nothing_reaches_the_cache(
    s3_server: S3Server, tmp_path: Path, key: Path, damage: str, words: str
) -> None:
    node_a, node_b = node(tmp_path, "a", s3_server, key), node(tmp_path, "b", s3_server, key)
    snapshot = capture(node_a.local, key)
    node_a.publish(snapshot.id)
    keys, bucket = Keys(PREFIX), s3_server.data_dir / BUCKET
    blob = bucket / keys.blob(snapshot.files["criu/pages-1.img"].digest)
    if damage == "overwritten":  # in place, the same size
        tampered = bytearray(blob.read_bytes())
        tampered[MIB] ^= 0xFF
        blob.write_bytes(bytes(tampered))
    elif damage == "truncated":
        blob.write_bytes(blob.read_bytes()[: MIB + 5])
    elif damage == "blob deleted":
        blob.unlink()
    else:
        (bucket / keys.manifest(snapshot.id)).unlink()

    with pytest.raises(PullRefused, match=f"pulling snapshot .*{words}"):
        node_b.local_copy(snapshot.id, "restore")
    assert_cache_clean(node_b.local)


def test_the_cache_trim_spares_a_snapshot_being_restored_and_the_bucket_keeps_what_is_named(
    s3_server: S3Server, tmp_path: Path, key: Path
) -> None:
    node_a = node(tmp_path, "a", s3_server, key)
    node_b = node(tmp_path, "b", s3_server, key, cache_max_bytes=1.0, gc_grace=0.0)
    first, second = (capture(node_a.local, key, os.urandom(MIB), name=f"s{i}") for i in range(2))
    for snapshot in (first, second):
        node_a.publish(snapshot.id)
        node_b.local_copy(snapshot.id, "restore")

    with node_b.in_use(second.id):
        node_b.maintain(referenced=[second.id])

    assert [snapshot.id for snapshot in node_b.local.list()] == [second.id]
    assert [listed.id for listed in node_b.remote.list()] == [second.id]  # the unnamed one collected


def cache_gauges(cluster_store: ClusterStore) -> tuple[float, float]:
    metrics = cluster_store.metrics
    return metrics.value("warmstart_agent_cache_bytes"), metrics.value("warmstart_agent_cache_max_bytes")


def test_a_pull_or_a_push_trims_the_cache_at_once_and_the_gauges_show_it_against_its_bound(
    s3_server: S3Server, tmp_path: Path, key: Path
) -> None:
    node_a = node(tmp_path, "a", s3_server, key, cache_max_bytes=2 * MIB)
    node_b = node(tmp_path, "b", s3_server, key, cache_max_bytes=2 * MIB)
    first = capture(node_a.local, key, os.urandom(MIB), name="s0")
    node_a.publish(first.id)
    second = capture(node_a.local, key, os.urandom(MIB), name="s1")
    node_a.publish(second.id)  # over the bound once pushed: the capturing node's cache keeps the newest
    assert [snapshot.id for snapshot in node_a.local.list()] == [second.id]
    one_snapshot = MIB + 400  # its pages and the core both share

    node_b.local_copy(first.id, "restore")
    assert cache_gauges(node_b) == (one_snapshot, 2 * MIB)
    node_b.local_copy(second.id, "prestage")  # over the bound: the least recently used goes, no cleanup loop

    assert [snapshot.id for snapshot in node_b.local.list()] == [second.id]
    assert cache_gauges(node_b) == (one_snapshot, 2 * MIB)
    node_b.cache_max_bytes = MIB
    with node_b.in_use(second.id):
        report = node_b.trim()
    assert report is not None and report.over_limit and report.kept_busy == [second.id]
    assert cache_gauges(node_b) == (one_snapshot, MIB)  # over the bound, and the metrics say so


def test_a_deleted_inference_snapshot_unpublishes_only_the_snapshot_captured_for_it(
    s3_server: S3Server, tmp_path: Path, key: Path
) -> None:
    config = agent_settings(node="node-b", store=tmp_path / "b", criu=tmp_path / "no-criu")
    kube = KubeStatus(client.ApiClient(client.Configuration()), "node-b")
    agent = Agent(config, kube, load_signer(key), load_verifier(key), remote=remote_config(s3_server))
    node_a = node(tmp_path, "a", s3_server, key)
    snapshot = capture(node_a.local, key)
    node_a.publish(snapshot.id)
    assert agent.node.cluster_store is not None

    def isnap(namespace: str, name: str) -> dict:
        return {"metadata": {"namespace": namespace, "name": name}, "status": {"snapshotId": snapshot.id}}

    agent.cleanup.forget_deleted(isnap("other", "snap"))  # a copy elsewhere names the same snapshot
    agent.cleanup.forget_deleted(isnap("ml", "copy"))
    assert [listed.id for listed in agent.node.cluster_store.remote.list()] == [snapshot.id]
    agent.cleanup.forget_deleted(isnap("ml", "snap"))
    assert agent.node.cluster_store.remote.list() == []


def test_a_capture_whose_push_fails_leaves_nothing_in_the_nodes_store(
    s3_server: S3Server, tmp_path: Path, key: Path
) -> None:
    """With the object store down, the capture fails and takes back its snapshot and the blobs only it
    named: no unpublished capture is left to fill the node's disk until the cleanup's grace runs out."""
    from warmstart.agent.capture import CaptureError

    fast = dataclasses.replace(
        remote_config(s3_server), connect_timeout=1.0, retry_timeout=1.0, max_retries=0
    )
    config = agent_settings(node="node-a", store=tmp_path / "a", criu=tmp_path / "no-criu")
    kube = KubeStatus(client.ApiClient(client.Configuration()), "node-a")
    agent = Agent(config, kube, load_signer(key), load_verifier(key), remote=fast)
    store = agent.node.store
    kept = capture(store, key, os.urandom(MIB), name="earlier")  # another snapshot's blobs stay
    snapshot = capture(store, key)
    s3_server.stop()

    with pytest.raises(CaptureError, match="pushing to the object store failed"):
        agent.capture._push(snapshot.id)

    left = sorted(path.name for path in store.blobs_dir.iterdir())
    print(f"failed push: snapshots left {[s.id for s in store.list()]}, blobs left {len(left)}")
    assert [s.id for s in store.list()] == [kept.id]
    assert left == sorted(digest.removeprefix("sha256:") for digest in kept.manifest.digests())
    assert list(store.staging_dir.iterdir()) == []
    store.verify(kept.id, load_verifier(key))
