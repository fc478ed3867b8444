"""Where the object store is and how to talk to it: endpoint, bucket, key prefix, credentials, bounds.

From explicit arguments or the environment (`RemoteConfig.from_env`):

    WARMSTART_S3_BUCKET            the bucket (required)
    WARMSTART_S3_ENDPOINT          e.g. http://minio.storage:9000; unset: AWS S3 in the region
    WARMSTART_S3_PREFIX            keys live under this prefix (one bucket, several stores)
    WARMSTART_S3_REGION            default us-east-1
    WARMSTART_S3_CREDENTIALS_DIR   a directory holding `access-key-id` and `secret-access-key` (and optionally
                                   `session-token`), e.g. a mounted Secret: re-read every 5 minutes, so a
                                   rotated Secret is picked up without a restart
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN
                                   the credentials, when no directory is given
    WARMSTART_S3_CONNECT_TIMEOUT, WARMSTART_S3_REQUEST_TIMEOUT, WARMSTART_S3_READ_TIMEOUT,
    WARMSTART_S3_RETRY_TIMEOUT (seconds), WARMSTART_S3_MAX_RETRIES, WARMSTART_S3_CONCURRENCY (parallel
    requests), WARMSTART_S3_VIRTUAL_HOSTED (1: bucket.host addressing; default path style)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from warmstart.host.env import checked_seconds
from warmstart.host.fileio import UnsafeInput, read_regular_file

MAX_CREDENTIAL_BYTES = 4096
CREDENTIAL_FILES = ("access-key-id", "secret-access-key", "session-token")
# The variable of each bound, as its problems name it.
DURATION_VARIABLES = {
    "connect_timeout": "WARMSTART_S3_CONNECT_TIMEOUT",
    "request_timeout": "WARMSTART_S3_REQUEST_TIMEOUT",
    "read_timeout": "WARMSTART_S3_READ_TIMEOUT",
    "retry_timeout": "WARMSTART_S3_RETRY_TIMEOUT",
}
# (variable, smallest, largest) of each count.
COUNT_VARIABLES = {
    "max_retries": ("WARMSTART_S3_MAX_RETRIES", 0, 100),
    "concurrency": ("WARMSTART_S3_CONCURRENCY", 1, 1024),
}


class RemoteConfigError(ValueError):
    """The object store's configuration is incomplete or malformed; the message names the setting."""


@dataclass(frozen=True)
class Credentials:
    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class RemoteConfig:
    bucket: str
    endpoint: str | None = None
    prefix: str = ""
    region: str = "us-east-1"
    credentials: Credentials | None = None
    credentials_dir: Path | None = None
    # How long the client keeps credentials read from `credentials_dir` before it reads them again.
    credentials_refresh: float = 300.0
    virtual_hosted_style: bool = False
    # None: sign payloads over plain HTTP only (TLS already protects the bytes in transit; hashing every
    # uploaded byte for the signature costs a core's worth of SHA-256).
    unsigned_payload: bool | None = None
    # Every request gives up: connecting after connect_timeout, in full after request_timeout, when the
    # body stalls for read_timeout; retries of failed requests stop after max_retries or retry_timeout.
    connect_timeout: float = 5.0
    request_timeout: float = 120.0
    read_timeout: float = 30.0
    max_retries: int = 3
    retry_timeout: float = 30.0
    concurrency: int = 8
    part_size: int = 16 << 20
    multipart_threshold: int = 64 << 20

    def __post_init__(self) -> None:
        if not self.bucket or "/" in self.bucket:
            raise RemoteConfigError(f"bucket {self.bucket!r} must be a bucket name (set WARMSTART_S3_BUCKET)")
        if self.prefix and (self.prefix.startswith("/") or ".." in self.prefix.split("/")):
            raise RemoteConfigError(f"prefix {self.prefix!r} must be a relative key prefix")
        if self.endpoint is not None and not self.endpoint.startswith(("http://", "https://")):
            raise RemoteConfigError(f"endpoint {self.endpoint!r} must start with http:// or https://")
        if self.part_size < 5 << 20:
            raise RemoteConfigError("part_size must be at least 5 MiB (S3's smallest multipart part)")
        if self.multipart_threshold < self.part_size:
            raise RemoteConfigError("multipart_threshold must be at least part_size")
        for name, variable in DURATION_VARIABLES.items():
            try:
                checked_seconds(getattr(self, name))
            except ValueError as exc:
                raise RemoteConfigError(f"{variable}: {exc} (got {getattr(self, name)!r})") from None
        try:
            checked_seconds(self.credentials_refresh, zero=True)
        except ValueError as exc:
            raise RemoteConfigError(f"credentials_refresh: {exc}") from None
        for name, (variable, smallest, largest) in COUNT_VARIABLES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not smallest <= value <= largest:
                raise RemoteConfigError(
                    f"{variable}: must be an integer from {smallest} to {largest} (got {value!r})"
                )

    @property
    def key_prefix(self) -> str:
        """The prefix as keys start with it: empty, or ending in one slash."""
        stripped = self.prefix.strip("/")
        return f"{stripped}/" if stripped else ""

    @property
    def allow_http(self) -> bool:
        return bool(self.endpoint and self.endpoint.startswith("http://"))

    @property
    def sign_payload(self) -> bool:
        return not self.unsigned_payload if self.unsigned_payload is not None else self.allow_http

    def resolve_credentials(self) -> Credentials | None:
        """The credentials to use now: the directory's files when one is set (a rotated Secret is picked
        up), else those given; None lets the client find its own (instance metadata)."""
        if self.credentials_dir is None:
            return self.credentials
        values = {name: _read_credential(self.credentials_dir, name) for name in CREDENTIAL_FILES}
        if not values["access-key-id"] or not values["secret-access-key"]:
            raise RemoteConfigError(
                f"{self.credentials_dir} must hold non-empty access-key-id and secret-access-key files"
            )
        return Credentials(
            values["access-key-id"], values["secret-access-key"], values["session-token"] or None
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> RemoteConfig:
        """The configuration the environment describes (see the module's docstring); `overrides` win."""
        env = os.environ if environ is None else environ
        settings: dict[str, object] = {
            "bucket": env.get("WARMSTART_S3_BUCKET", ""),
            "endpoint": env.get("WARMSTART_S3_ENDPOINT") or None,
            "prefix": env.get("WARMSTART_S3_PREFIX", ""),
            "credentials_dir": Path(folder) if (folder := env.get("WARMSTART_S3_CREDENTIALS_DIR")) else None,
            "credentials": _env_credentials(env),
            "virtual_hosted_style": env.get("WARMSTART_S3_VIRTUAL_HOSTED", "").lower()
            in ("1", "true", "yes"),
        }
        if env.get("WARMSTART_S3_REGION"):
            settings["region"] = env["WARMSTART_S3_REGION"]
        for setting, name in DURATION_VARIABLES.items():
            if env.get(name, "").strip():
                settings[setting] = _number(env, name, float)
        for setting, (name, _, _) in COUNT_VARIABLES.items():
            if env.get(name, "").strip():
                settings[setting] = _number(env, name, int)
        settings.update(overrides)
        return cls(**settings)  # type: ignore[arg-type]


def _env_credentials(env: Mapping[str, str]) -> Credentials | None:
    access, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not access or not secret:
        return None
    return Credentials(access, secret, env.get("AWS_SESSION_TOKEN") or None)


def _number(env: Mapping[str, str], name: str, kind: type[float] | type[int]) -> float | int:
    """The variable's number, its bounds checked by RemoteConfig itself."""
    try:
        return kind(env[name].strip())
    except ValueError:
        what = "an integer" if kind is int else "a number of seconds"
        raise RemoteConfigError(f"{name}: must be {what} (got {env[name]!r})") from None


def _read_credential(directory: Path, name: str) -> str:
    try:  # a Secret's files are symbolic links into its current data: follow them
        raw = read_regular_file(directory / name, MAX_CREDENTIAL_BYTES, follow_symlinks=True)
    except FileNotFoundError:
        return ""
    except (OSError, UnsafeInput) as exc:
        raise RemoteConfigError(f"credential file {directory / name} cannot be read: {exc}") from exc
    return raw.decode("utf-8", "replace").strip()
