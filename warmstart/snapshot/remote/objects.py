"""The object store's client: the few S3 calls the store makes, each bounded, errors translated.

Built on obstore (Python bindings of the Rust `object_store` crate): every request runs in Rust with the
GIL released, so many threads keep many requests in flight; one wheel with no Python dependencies (boto3's
botocore requires python-dateutil < 3, the kubernetes client 37 >= 3: they do not install together). The
package's docstring has the throughput measured against boto3 + s3transfer.

Every call is bounded by the configuration's connect, request and read timeouts, and a failed one is
retried at most `max_retries` times within `retry_timeout`: an unreachable store raises RemoteUnavailable
within that bound, never hangs.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import S3Store

from warmstart.snapshot.manifest import SnapshotError
from warmstart.snapshot.remote.config import RemoteConfig

if TYPE_CHECKING:
    from obstore.store import S3Credential

STREAM_CHUNK = 4 << 20
MAX_ERROR_CHARS = 600
_STATUS = re.compile(r"status code: (\d{3})")
# What S3 servers answer for credentials they do not take, whatever the status: AWS answers an unknown key
# with 403 InvalidAccessKeyId, Versity's gateway with 404 XAdminUserNotFound, which must never read as "no
# such object" (a missing copy counts against its snapshot; refused credentials are the node's trouble).
CREDENTIAL_CODES = frozenset({
    "AccessDenied", "ExpiredToken", "InvalidAccessKeyId", "InvalidToken", "SignatureDoesNotMatch",
    "TokenRefreshRequired", "XAdminUserNotFound",
})  # fmt: skip
NO_SUCH_KEY = "NoSuchKey"


class RemoteError(SnapshotError):
    """The object store refused or failed a request."""


class RemoteUnavailable(RemoteError):
    """The object store could not be reached or did not answer within the configured bounds."""


class RemoteAccessDenied(RemoteError):
    """The object store refused the credentials (check the Secret holding them)."""


class ObjectMissing(RemoteError, LookupError):
    """No object under that key."""


class ObjectTooLarge(RemoteError):
    """An object is larger than the bound its reader allows."""


class ObjectShorter(RemoteError):
    """A range was asked for that starts past the object's end (HTTP 416): the object is shorter."""


class LocalWriteFailed(SnapshotError):
    """Writing what was read to a local file failed (the disk, not the object store)."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: datetime
    e_tag: str | None = None  # a multipart upload's ends in -<parts> on most servers


class ObjectClient:
    """One bucket of one S3-compatible store; thread-safe (share one across threads)."""

    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.where = f"{config.endpoint or 's3 ' + config.region}/{config.bucket}"
        self._store = _make_store(config)
        self._access_confirmed = False  # a request of these credentials was answered: a bodiless 404 is real

    # -- reads -------------------------------------------------------------------------------------------

    def head(self, key: str) -> ObjectInfo | None:
        """The object's size and time, None when there is none."""
        try:
            with self._translated(key):
                meta = obstore.head(self._store, key)
        except ObjectMissing:
            return None
        return ObjectInfo(meta["path"], meta["size"], meta["last_modified"], meta["e_tag"])

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix` (ListObjectsV2, page by page)."""
        with self._translated(prefix):
            for batch in obstore.list(self._store, prefix=prefix, chunk_size=1000):
                for meta in batch:
                    yield ObjectInfo(meta["path"], meta["size"], meta["last_modified"], meta["e_tag"])

    def get_bytes(self, key: str, limit: int) -> bytes:
        """The whole object, refused (ObjectTooLarge) past `limit` bytes: one GET of at most `limit` + 1
        bytes, so a huge object costs no more than that."""
        chunks: list[bytes] = []
        try:
            seen = self.read_into(key, lambda view: chunks.append(bytes(view)), limit, (0, limit + 1))
        except ObjectShorter:  # a range from byte 0 past the end: the object is empty
            return b""
        if seen > limit:
            raise ObjectTooLarge(f"{key} in {self.where} has more than the {limit} bytes allowed")
        return b"".join(chunks)

    def read_into(
        self,
        key: str,
        sink: Callable[[memoryview], None],
        expected: int,
        byte_range: tuple[int, int] | None = None,
    ) -> int:
        """Stream the object (or bytes [start, end) of it) into `sink` piece by piece; returns the bytes the
        server sent. Past `expected` bytes nothing more reaches `sink` (the count tells the caller)."""
        seen = 0
        options: dict[str, Any] = {"range": byte_range} if byte_range is not None else {}
        with self._translated(key):
            result = obstore.get(self._store, key, options=options)  # type: ignore[arg-type]
            for chunk in result.stream(min_chunk_size=STREAM_CHUNK):
                view = memoryview(chunk)
                room = expected - seen
                if len(view) > room:
                    if room > 0:
                        _deliver(sink, view[:room])
                    return seen + len(view)
                _deliver(sink, view)
                seen += len(view)
        return seen

    # -- writes ------------------------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes, *, create: bool = False) -> bool:
        """Store `data` in one atomic PUT; with `create`, only where no object is (If-None-Match: *):
        False when one is."""
        with self._translated(key):
            try:
                obstore.put(
                    self._store, key, data, mode="create" if create else "overwrite", use_multipart=False
                )
            except (AlreadyExistsError, PreconditionError):
                return False
        return True

    def put_file(self, key: str, path: Path, size: int) -> None:
        """Upload a file: one PUT from a read-only mapping below the multipart threshold, else a multipart
        upload of `part_size` parts, `concurrency` of them in flight (aborted on failure)."""
        config = self.config
        if size >= config.multipart_threshold:
            with path.open("rb") as reader, self._translated(key):
                obstore.put(
                    self._store, key, reader, use_multipart=True, chunk_size=config.part_size,
                    max_concurrency=config.concurrency,
                )  # fmt: skip
            return
        with _mapped(path, size) as view, self._translated(key):
            obstore.put(self._store, key, view, use_multipart=False)

    def delete(self, key: str) -> None:
        """Remove the object (no error when it is gone already)."""
        with contextlib.suppress(ObjectMissing), self._translated(key):
            obstore.delete(self._store, key)

    # -- errors ------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _translated(self, key: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        except FileNotFoundError as exc:  # obstore's "no such object"; local files are opened outside
            code = _s3_field(exc)
            if code not in (None, NO_SUCH_KEY):  # a 404 that names another cause (a user, a bucket)
                raise self._classified(exc, key, time.monotonic() - started) from exc
            if code is None:
                self._confirm_access(key)  # a HEAD's 404 has no body to say which
            raise ObjectMissing(f"no object {key} in {self.where}") from exc
        except (AlreadyExistsError, PreconditionError) as exc:
            raise RemoteError(f"{self.where}: {key} exists already") from exc
        except (BaseError, OSError, RuntimeError) as exc:
            raise self._classified(exc, key, time.monotonic() - started) from exc

    def _confirm_access(self, key: str) -> None:
        """Once per client, that these credentials are taken: a listing under `key`, whose refusal carries
        the server's reason, raised as such (RemoteAccessDenied for credentials it does not know)."""
        if self._access_confirmed:
            return
        started = time.monotonic()
        try:
            next(iter(obstore.list(self._store, prefix=key, chunk_size=1)), None)
        except (BaseError, OSError, RuntimeError) as exc:
            raise self._classified(exc, key, time.monotonic() - started) from exc
        self._access_confirmed = True

    def _classified(self, exc: BaseException, key: str, elapsed: float) -> RemoteError:
        """What a failure means for the caller: refused credentials, a missing bucket, another refusal by
        the server, or a store that cannot be reached or answered with a server error."""
        status = _http_status(exc)
        brief = _brief(exc)
        credentials_refused = status in (401, 403) or _s3_field(exc) in CREDENTIAL_CODES
        if isinstance(exc, PermissionDeniedError | UnauthenticatedError) or credentials_refused:
            return RemoteAccessDenied(f"{self.where} refused {key}: {brief} (check the credentials)")
        if status == 416:
            return ObjectShorter(f"{key} in {self.where} ends before the range asked for: {brief}")
        if "NoSuchBucket" in str(exc):
            return RemoteError(f"bucket {self.config.bucket} does not exist at {self.where}")
        if status is not None and 400 <= status < 500:
            return RemoteError(f"{self.where} refused {key}: {brief}")
        c = self.config
        return RemoteUnavailable(
            f"object store {self.where} failed on {key} after {elapsed:.1f}s (bounds: connect "
            f"{c.connect_timeout:g}s, request {c.request_timeout:g}s, stall {c.read_timeout:g}s, "
            f"{c.max_retries} retries within {c.retry_timeout:g}s): {brief}"
        )


def _deliver(sink: Callable[[memoryview], None], view: memoryview) -> None:
    try:
        sink(view)
    except OSError as exc:
        raise LocalWriteFailed(f"writing fetched bytes failed: {exc}") from exc


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status the server answered with, as obstore's message reports it; None when it did not."""
    found = _STATUS.search(str(exc))
    return int(found.group(1)) if found else None


def _s3_field(exc: BaseException, tag: str = "Code") -> str | None:
    """The S3 error code (`NoSuchKey`, `InvalidAccessKeyId`) or another field of the server's answer; None
    without a body."""
    found = re.search(f"<{tag}>(.*?)</{tag}>", str(exc))
    return found.group(1) if found else None


def _brief(exc: BaseException) -> str:
    """The first line of an error (obstore appends its whole debug trace), with the S3 error's code and
    message when the server sent one."""
    first = str(exc).strip().split("\n", 1)[0].removesuffix('<?xml version="1.0" encoding="UTF-8"?>').strip()
    said = [found for tag in ("Code", "Message") if (found := _s3_field(exc, tag)) is not None]
    return (first + (f" ({': '.join(said)})" if said else ""))[:MAX_ERROR_CHARS]


@contextlib.contextmanager
def _mapped(path: Path, size: int) -> Iterator[memoryview | bytes]:
    """The file's bytes as a read-only mapping (no copy into Python); b"" for an empty file."""
    if size == 0:
        yield b""
        return
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size != size:
            raise RemoteError(f"{path} is not {size} bytes long: it changed under the upload")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as mapping:
            view = memoryview(mapping)
            try:
                yield view
            finally:
                view.release()
    finally:
        os.close(fd)


def _make_store(config: RemoteConfig) -> S3Store:
    client_options: dict[str, Any] = {
        "connect_timeout": timedelta(seconds=config.connect_timeout),
        "timeout": timedelta(seconds=config.request_timeout),
        "read_timeout": timedelta(seconds=config.read_timeout),
        "allow_http": config.allow_http,
        "pool_max_idle_per_host": str(max(config.concurrency * 2, 8)),
    }
    retry_config: dict[str, Any] = {
        "max_retries": config.max_retries,
        "retry_timeout": timedelta(seconds=config.retry_timeout),
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=5),
            "base": 2,
        },
    }
    settings: dict[str, Any] = {
        "region": config.region,
        "virtual_hosted_style_request": config.virtual_hosted_style,
        "unsigned_payload": not config.sign_payload,
    }
    if config.endpoint:
        settings["endpoint"] = config.endpoint
    provider = _credential_provider(config)
    return S3Store(
        config.bucket, config=settings, client_options=client_options,  # type: ignore[arg-type]
        retry_config=retry_config, credential_provider=provider,  # type: ignore[arg-type]
    )  # fmt: skip


def _credential_provider(config: RemoteConfig) -> Callable[[], S3Credential] | None:
    """Credentials read from the configuration each time the client asks (every `credentials_refresh`
    seconds), so a rotated Secret is picked up without a restart; None lets obstore look for instance
    credentials."""
    if config.credentials is None and config.credentials_dir is None:
        return None

    def provide() -> S3Credential:
        credentials = config.resolve_credentials()
        assert credentials is not None
        return {
            "access_key_id": credentials.access_key_id,
            "secret_access_key": credentials.secret_access_key,
            "token": credentials.session_token,
            "expires_at": datetime.now(UTC) + timedelta(seconds=config.credentials_refresh),
        }

    return provide
