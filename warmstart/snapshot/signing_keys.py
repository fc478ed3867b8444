"""The signing key a store gets when none is given (`warmstart serve`, the agent, the snapshot CLI).

The key is the trust anchor of everything restored as root, so it never lives inside the store it
protects: whoever can write a store's snapshots could otherwise replace the key and sign a snapshot of
their own. A store given no key gets an HMAC key generated once in this user's key directory
(`$WARMSTART_KEY_DIR`, else `$XDG_CONFIG_HOME/warmstart/keys`, else `~/.config/warmstart/keys`), named
after the store's resolved path. It is used only while that directory is a real directory of this user
that no one else may write, and the key a regular file of this user that no one else may read or write
(no symbolic link is followed): anything else is refused, saying what to fix, never trusted.

A key file given (`--key`, WARMSTART_SIGNING_KEY) passes the same check before it signs anything: a regular
file (a Kubernetes Secret's symbolic links are followed to it) owned by root or this user that no one else
may read or write. A key only verified (a public key) may be read by anyone, never written.

Two processes creating a store's key at once both end up with the one that was written first, whole.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from warmstart.host.fileio import READ_FLAGS

if TYPE_CHECKING:
    from warmstart.snapshot.signing import Signer, Verifier

KEY_DIR_ENV = "WARMSTART_KEY_DIR"


def key_dir() -> Path:
    """This user's directory of generated store keys."""
    configured = os.environ.get(KEY_DIR_ENV)
    if configured:
        return Path(configured)
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "warmstart" / "keys"


def default_key_path(store_root: Path) -> Path:
    """Where the key of the store at `store_root` is generated when it is given none."""
    digest = hashlib.sha256(os.fsencode(Path(store_root).resolve())).hexdigest()[:16]
    return key_dir() / f"store-{digest}.hmac"


def signing_keys(store_root: Path, key: str | None) -> tuple[Signer, Verifier, str]:
    """Signer and verifier from `key`, or from the store's default key (generated once when missing).

    The third value is a note for the user when a key was generated, else "".
    """
    from warmstart.snapshot.signing import KeyExists, generate_hmac_key, keys_from_content

    if key is not None:
        return (*keys_from_content(Path(key), _read_key(Path(key), follow_symlinks=True)), "")
    path = default_key_path(store_root)
    _private_directory(path.parent)
    try:
        generate_hmac_key(path)
        note = f"generated a signing key for this store at {path} (mode 0600); pass --key to use your own"
    except KeyExists:
        note = ""
    return (*keys_from_content(path, read_private_key(path)), note)


def verification_key(store_root: Path, key: str | None) -> Verifier:
    """The verifier of `key`, else of the store's default key; SigningKeyError when there is neither."""
    from warmstart.snapshot.signing import SigningKeyError, keys_from_content, load_verifier

    if key:
        _read_key(Path(key), follow_symlinks=True, forbidden=0o022)  # no one else may have written it
        return load_verifier(key)
    path = default_key_path(store_root)
    if not os.path.lexists(path):
        raise SigningKeyError(
            f"no key: pass --key PATH or set WARMSTART_SIGNING_KEY (no key was generated for {store_root}; "
            f"it would be {path})"
        )
    return keys_from_content(path, read_private_key(path))[1]


def _private_directory(directory: Path) -> None:
    """Create `directory` (0700) where missing; SigningKeyError unless it is a real directory of this user
    that no one else may write."""
    from warmstart.snapshot.signing import SigningKeyError

    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.lstat()
    except OSError as exc:
        raise SigningKeyError(f"the key directory {directory} cannot be made: {exc.strerror}") from exc
    problem = _not_private(info, stat.S_ISDIR, 0o022)
    if problem:
        raise SigningKeyError(f"the key directory {directory} is refused: {problem}")


def read_private_key(path: Path) -> bytes:
    """The bytes of a key file only this user may have written or read, in a directory no one else may
    write, no symbolic link followed; SigningKeyError otherwise."""
    _private_directory(path.parent)
    return _read_key(path, follow_symlinks=False)


def _read_key(path: Path, *, follow_symlinks: bool, forbidden: int = 0o077) -> bytes:
    """The bytes of the key file at `path`, checked as it is open (`_not_private`: a regular file of root or
    this user, none of the `forbidden` mode bits set); SigningKeyError saying what to fix otherwise."""
    from warmstart.snapshot.signing import MAX_KEY_FILE_BYTES, SigningKeyError

    try:
        fd = os.open(path, READ_FLAGS if follow_symlinks else READ_FLAGS | os.O_NOFOLLOW)
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP and not follow_symlinks else exc.strerror
        raise SigningKeyError(f"the key file {path} is refused: {why}") from exc
    try:
        problem = _not_private(os.fstat(fd), stat.S_ISREG, forbidden)
        if problem:
            raise SigningKeyError(f"the key file {path} is refused: {problem}")
        content = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if not content or len(content) > MAX_KEY_FILE_BYTES:
        raise SigningKeyError(f"the key file {path} is empty or larger than {MAX_KEY_FILE_BYTES} bytes")
    return content


def _not_private(info: os.stat_result, is_kind: Callable[[int], bool], forbidden: int) -> str:
    """Why a file or directory is not private to this user (owned by it or by root, who may write anything
    anyway, with none of the `forbidden` mode bits), or ""."""
    if not is_kind(info.st_mode):
        return "not a real " + ("directory" if is_kind is stat.S_ISDIR else "regular file")
    if info.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {info.st_uid}, not by this user (uid {os.geteuid()}) nor root"
    if stat.S_IMODE(info.st_mode) & forbidden:
        how = "go-w" if forbidden == 0o022 else "go-rwx"
        return f"mode {stat.S_IMODE(info.st_mode):04o} lets others in (chmod {how} it)"
    return ""
