"""Durable, race-free file writes and hostile-input-proof reads of small state files.

A file is written under a fresh random name in its target's directory (created with O_EXCL | O_NOFOLLOW,
so a planted symbolic link or file is never followed or reused), fsync'd, then renamed over the target:
a reader sees the old content or the new, never a part. Directories may be given as descriptors, so a
privileged writer never resolves a path a tenant can change between the check and the write.

A state or signed file is read only when it is a regular file (never a FIFO, a device or, unless asked, a
symbolic link), opened without blocking, and no larger than its bound; JSON in it is parsed with a bound on
its nesting, so no input can hang a reader, exhaust its memory or its stack.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import mmap
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
MAX_JSON_DEPTH = 32  # the deepest legitimate file (a manifest) nests 4 levels

SYS_OPENAT2 = 437  # the same number on x86_64 and arm64
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10


class UnsafeInput(ValueError):
    """A file that is not a bounded regular file, or JSON that is malformed or nested too deeply."""


class _OpenHow(ctypes.Structure):
    _fields_ = (("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64))


def openat2(dir_fd: int, path: str, flags: int, resolve: int, mode: int = 0) -> int:
    """openat2(2): a descriptor of `path`, resolved from `dir_fd` under the RESOLVE_* flags in `resolve`."""
    how = _OpenHow(flags, mode, resolve)
    fd = libc().syscall(SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        error = ctypes.get_errno()
        raise OSError(error, os.strerror(error), path)
    return fd


_MAP_FAILED = ctypes.c_void_p(-1).value


def libc() -> ctypes.CDLL:
    """The C library with errno kept and the prototypes of the calls made through it here."""
    library = ctypes.CDLL(None, use_errno=True)
    library.mmap.restype = ctypes.c_void_p
    library.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long)  # fmt: skip
    library.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    library.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    return library


@contextlib.contextmanager
def mapped_readonly(fd: int, offset: int, length: int) -> Iterator[int]:
    """The address of `length` bytes of file `fd` from `offset`, mapped shared and read-only (the page cache
    itself, no copy); `offset` may be any byte, the mapping starts at its page."""
    start = offset - offset % mmap.PAGESIZE
    size = offset + length - start
    library = libc()
    address = library.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, start)
    if address in (None, _MAP_FAILED):
        error = ctypes.get_errno()
        raise OSError(error, f"mmap: {os.strerror(error)}")
    try:
        yield address + offset - start
    finally:
        library.munmap(address, size)


def write_new_file(path: Path | str, content: bytes, mode: int = 0o644, *, dir_fd: int | None = None) -> None:
    """Create `path` (never overwrite, never through a symbolic link) with `content`, fsync'd."""
    fd = os.open(path, NEW_FILE_FLAGS, mode, dir_fd=dir_fd)
    try:
        write_all(fd, content)
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(target: Path, mode: int = 0o644, *, dir_fd: int | None = None) -> Iterator[BinaryIO]:
    """A binary handle whose content replaces `target` once the block ends without an exception.

    With `dir_fd`, `target` is a bare name inside that directory (no path is resolved at all).
    """
    if dir_fd is not None and Path(target).name != str(target):
        raise ValueError(f"with dir_fd the target must be a bare name, got {str(target)!r}")
    name = Path(target).name
    temporary = f".{name}.{secrets.token_hex(8)}.tmp"
    temporary_path = temporary if dir_fd is not None else str(Path(target).parent / temporary)
    fd = os.open(temporary_path, NEW_FILE_FLAGS, mode, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb", closefd=True) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.rename(temporary_path, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary_path, dir_fd=dir_fd)
        raise


def write_atomic(target: Path, content: bytes, mode: int = 0o644, *, dir_fd: int | None = None) -> None:
    """Replace `target` with `content` in one rename (see `atomic_file`)."""
    with atomic_file(target, mode, dir_fd=dir_fd) as handle:
        handle.write(content)


def write_exclusive(name: str, content: bytes, *, dir_fd: int, mode: int = 0o644) -> None:
    """Create `name` in `dir_fd` with `content`; FileExistsError when anything (a link included) is there.
    Written to an unguessable O_EXCL | O_NOFOLLOW temporary, then hard-linked to `name`: as exclusive as
    O_EXCL, and no reader sees the file half written."""
    if Path(name).name != name:
        raise ValueError(f"{name!r} is not a bare name")
    temporary = f".{name}.{secrets.token_hex(8)}.tmp"
    try:
        write_new_file(temporary, content, mode, dir_fd=dir_fd)
        os.link(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary, dir_fd=dir_fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, content: bytes) -> None:
    view = memoryview(content)
    while view:
        view = view[os.write(fd, view) :]


def read_regular_file(
    path: str | os.PathLike[str], limit: int, *, dir_fd: int | None = None, follow_symlinks: bool = False
) -> bytes:
    """The bytes of a regular file of at most `limit` bytes; UnsafeInput for anything else.

    OSError (FileNotFoundError and the like) passes through. A FIFO or device is refused from its lstat,
    before it is opened; the file is opened non-blocking and checked again through its descriptor, so a
    swap between the two checks is refused too.
    """
    before = os.stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    _check_regular(path, before, limit)
    flags = READ_FLAGS if follow_symlinks else READ_FLAGS | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeInput(f"{os.fspath(path)} is a symbolic link") from exc
        raise
    try:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise UnsafeInput(f"{os.fspath(path)} was replaced while it was opened")
        _check_regular(path, after, limit)
        return _read_at_most(fd, path, limit)
    finally:
        os.close(fd)


def loads_json(raw: bytes, what: str) -> Any:
    """Parse JSON with a bound on its nesting; UnsafeInput naming `what` when it is not acceptable."""
    try:
        value = json.loads(raw)
    except RecursionError as exc:
        raise UnsafeInput(f"{what} nests deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, integers of too many digits
        raise UnsafeInput(f"{what} is not valid JSON ({exc})") from exc
    if _depth(value) > MAX_JSON_DEPTH:
        raise UnsafeInput(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    return value


def read_json_file(
    path: str | os.PathLike[str], limit: int, *, dir_fd: int | None = None, follow_symlinks: bool = False
) -> Any:
    raw = read_regular_file(path, limit, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    return loads_json(raw, os.fspath(path))


@contextlib.contextmanager
def directory_fd(parent: Path, name: str, *, create: bool = False, mode: int = 0o755) -> Iterator[int]:
    """A descriptor of `parent/name`, a real directory (a symbolic link there is refused, never followed).

    `parent` itself is resolved as given (the operator chose it); `name` is one component inside it.
    """
    if Path(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not a single path component")
    parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=parent_fd)
        try:
            fd = os.open(name, DIRECTORY_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeInput(f"{parent / name} is not a directory (a symbolic link is refused)") from exc
            raise
    finally:
        os.close(parent_fd)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def directory_beneath(root_fd: int, parts: tuple[str, ...]) -> Iterator[int]:
    """A descriptor of root/parts..., each created where missing and opened without following a link."""
    fd = os.dup(root_fd)
    try:
        for part in parts:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o755, dir_fd=fd)
            child = openat2(fd, part, DIRECTORY_FLAGS, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def _check_regular(path: str | os.PathLike[str], info: os.stat_result, limit: int) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeInput(f"{os.fspath(path)} is not a regular file ({_kind(info.st_mode)})")
    if info.st_size > limit:
        raise UnsafeInput(f"{os.fspath(path)} has {info.st_size} bytes, more than the {limit} allowed")


def _read_at_most(fd: int, path: str | os.PathLike[str], limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, min(1 << 20, limit + 1 - total)):
        chunks.append(chunk)
        total += len(chunk)
        if total > limit:
            raise UnsafeInput(f"{os.fspath(path)} grew past the {limit} bytes allowed")
    return b"".join(chunks)


def _kind(mode: int) -> str:
    kinds = {
        stat.S_ISLNK: "a symbolic link", stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device", stat.S_ISSOCK: "a socket",
    }  # fmt: skip
    return next((name for test, name in kinds.items() if test(mode)), "not a regular file")


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value (iteratively: no recursion to exhaust)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest
