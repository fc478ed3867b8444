"""The cluster's snapshot store: an S3-compatible bucket holding the local store's layout, signed manifests
and content-addressed blobs, with each node's local store as its cache (`RemoteStore`).

The bucket is untrusted like any transport: a pull checks the signature before it fetches a blob and every
byte against its signed digest before the local store publishes anything. See `push`, `pull`, `collect`
(listing, delete, GC) and `cache` (the node cache's bound).

The client library is obstore (Rust's `object_store` behind a Python wheel with no Python dependencies):
transfers run with the GIL released, with per-request connect, total and stall timeouts and bounded retries.
Measured on loopback against the tests' S3 gateway (versitygw 1.8.0; 4 files of 100 MiB, 4 at a time, 16
MiB parts; client and server on 2 shared cores; BENCHMARKS.md has the table): uploads 254-276 MiB/s with
signed payloads and 315-329 MiB/s unsigned, boto3 1.44 + s3transfer's TransferConfig 304-325 MiB/s at more
client CPU; downloads by ranged GETs in parallel 742-816 MiB/s, boto3 560-590 MiB/s. boto3 was ruled out
regardless: botocore requires python-dateutil < 3, the kubernetes client 37 (a dependency) >= 3.
"""

from warmstart.snapshot.remote.cache import TrimReport, mark_used, trim_cache
from warmstart.snapshot.remote.config import Credentials, RemoteConfig, RemoteConfigError
from warmstart.snapshot.remote.objects import RemoteAccessDenied, RemoteError, RemoteUnavailable
from warmstart.snapshot.remote.stats import Progress
from warmstart.snapshot.remote.store import RemoteStore

__all__ = [
    "Credentials",
    "Progress",
    "RemoteAccessDenied",
    "RemoteConfig",
    "RemoteConfigError",
    "RemoteError",
    "RemoteStore",
    "RemoteUnavailable",
    "TrimReport",
    "mark_used",
    "trim_cache",
]
