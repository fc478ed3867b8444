"""`warmstart snapshot list|show|verify|gc|delete|keygen`: look after a snapshot store."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

STORE_ENV = "WARMSTART_STORE"
EXIT_INVALID = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad flags or configuration: exit code 2 with the message."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "snapshot",
        help="list, show, verify and garbage-collect snapshots",
        description=(
            "Inspect and maintain a snapshot store (a directory; WARMSTART_STORE) with its signing key "
            "(WARMSTART_SIGNING_KEY, else the key `warmstart serve` generated for that store)."
        ),
    )
    commands = parser.add_subparsers(dest="snapshot_command", metavar="ACTION", required=True)

    def add(
        name: str, help_text: str, handler: Callable[[argparse.Namespace], int]
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name, help=help_text, description=help_text[:1].upper() + help_text[1:] + "."
        )
        sub.set_defaults(func=lambda args: _run(handler, args))
        if name != "keygen":
            sub.add_argument(
                "--store", default=os.environ.get(STORE_ENV), help=f"store directory (default ${STORE_ENV})"
            )
        sub.add_argument("--json", action="store_true", help="print JSON instead of tables")
        return sub

    listing = add("list", "list the snapshots the key verifies, newest first", _cmd_list)
    listing.add_argument("--identity", help="only snapshots of this identity hash (or a prefix of it)")
    _add_key_argument(listing)

    show = add("show", "show one snapshot's manifest (once its signature checks out)", _cmd_show)
    show.add_argument("id", help="snapshot id")
    _add_key_argument(show)

    verify = add("verify", "check signature, identity and every blob's digest", _cmd_verify)
    verify.add_argument("id", help="snapshot id")
    _add_key_argument(verify)
    verify.add_argument(
        "--expect-identity", type=Path, help="JSON file of the identity the snapshot must match"
    )
    verify.add_argument("--prefix", help="hash only the files under this prefix (e.g. criu/)")

    gc = add("gc", "remove unreferenced blobs and stale staging directories", _cmd_gc)
    gc.add_argument("--dry-run", action="store_true", help="report what would be removed, remove nothing")
    gc.add_argument("--keep", type=int, help="first delete all but the N newest snapshots of each identity")
    gc.add_argument("--identity", help="with --keep: apply retention to this identity hash only")
    _add_key_argument(gc, "with --keep, and to tell forged snapshot directories (junk to gc) from others: ")
    gc.add_argument(
        "--staging-older-than", type=float, default=3600.0, help="seconds before orphan staging is stale"
    )
    gc.add_argument(
        "--blob-grace",
        type=float,
        help="keep unreferenced blobs younger than this many seconds (default: --staging-older-than)",
    )

    delete = add("delete", "unpublish one snapshot (its blobs go at the next gc)", _cmd_delete)
    delete.add_argument("id", help="snapshot id")

    keygen = add("keygen", "create a signing key", _cmd_keygen)
    kind = keygen.add_mutually_exclusive_group(required=True)
    kind.add_argument("--hmac", type=Path, metavar="PATH", help="write a new HMAC-SHA256 secret to PATH")
    kind.add_argument("--ed25519", type=Path, metavar="DIR", help="write an Ed25519 key pair into DIR")


def _add_key_argument(parser: argparse.ArgumentParser, when: str = "") -> None:
    parser.add_argument(
        "--key",
        default=os.environ.get("WARMSTART_SIGNING_KEY"),
        help=f"{when}verification key: HMAC secret or Ed25519 public key PEM "
        "(default $WARMSTART_SIGNING_KEY, else the key generated for this store, outside it)",
    )


def _run(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    from warmstart.snapshot import SigningKeyError, SnapshotError

    try:
        return handler(args)
    except (UsageError, SigningKeyError, SnapshotError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID if isinstance(exc, SnapshotError) else EXIT_USAGE


def _store(args: argparse.Namespace) -> Any:
    from warmstart.snapshot import SnapshotStore

    if not args.store:
        raise UsageError(f"no store: pass --store DIR or set {STORE_ENV}")
    root = Path(args.store)
    if not root.is_dir():
        raise UsageError(f"store directory {root} does not exist (check --store / {STORE_ENV})")
    return SnapshotStore(root)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True))


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def _console() -> Any:
    from rich.console import Console

    console = Console()
    # Piped output (logs, CI) would be squeezed into 80 columns: give tables room instead.
    return console if console.is_terminal else Console(width=160)


# --- commands --------------------------------------------------------------------------------------------


def _cmd_list(args: argparse.Namespace) -> int:
    store = _store(args)
    snapshots = store.list(args.identity, verifier=_verifier(args, store))
    if args.json:
        _print_json([snapshot.summary() for snapshot in snapshots])
        return 0
    from rich import box
    from rich.table import Table

    table = Table(title=f"snapshots in {args.store}", box=box.SIMPLE_HEAD)
    table.add_column("id", no_wrap=True)
    table.add_column("identity", no_wrap=True)
    for column in ("engine", "model", "size", "created (UTC)", "files"):
        table.add_column(column, justify="right" if column in ("size", "files") else "left")
    for snapshot in snapshots:
        summary = snapshot.summary()
        table.add_row(
            snapshot.id,
            snapshot.identity_hash[:12],
            f"{summary['engine']} {summary['engine_version']}".strip(),
            str(summary["model"] or summary["model_digest"][:19]),
            human_bytes(snapshot.size),
            snapshot.created.strftime("%Y-%m-%d %H:%M"),
            str(len(snapshot.files)),
        )
    _console().print(table if snapshots else "no snapshots")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    store = _store(args)
    snapshot = store.get(args.id, verifier=_verifier(args, store))
    if args.json:
        _print_json(snapshot.manifest.to_dict())
        return 0
    from rich.table import Table

    console = _console()
    overview = Table(title=f"snapshot {snapshot.id}", show_header=False)
    overview.add_column("field")
    overview.add_column("value")
    overview.add_row("identity hash", snapshot.identity_hash)
    for name, value in snapshot.identity.to_dict().items():
        overview.add_row(f"  {name}", json.dumps(value) if isinstance(value, dict) else str(value))
    overview.add_row("created (UTC)", snapshot.manifest.created)
    overview.add_row("size", f"{human_bytes(snapshot.size)} in {len(snapshot.files)} files")
    for section, values in (("node", snapshot.node), ("meta", snapshot.record.to_meta())):
        for name, value in values.items():
            overview.add_row(f"{section}.{name}", str(value))
    for name, seconds in snapshot.timings.items():
        overview.add_row(f"timings.{name}", f"{seconds:.3f} s")
    console.print(overview)
    files = Table(title="files")
    for column in ("path", "size", "mode", "digest"):
        files.add_column(column, justify="right" if column == "size" else "left")
    for path, entry in sorted(snapshot.files.items()):
        files.add_row(path, human_bytes(entry.size), f"{entry.mode:04o}", entry.digest[:19])
    console.print(files)
    return 0


def _load_expected_identity(path: Path | None) -> Any:
    if path is None:
        return None
    from warmstart.api.identity import SnapshotIdentity

    try:
        return SnapshotIdentity.from_dict(json.loads(path.read_text()))
    except FileNotFoundError as exc:
        raise UsageError(f"--expect-identity file {path} does not exist") from exc
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--expect-identity file {path} is not a valid identity: {exc}") from exc


def _check_prefix_flag(prefix: str | None) -> None:
    from warmstart.snapshot.manifest import check_prefix

    if prefix is not None:
        try:
            check_prefix(prefix)
        except ValueError as exc:
            raise UsageError(f"--prefix: {exc}") from exc


def _cmd_verify(args: argparse.Namespace) -> int:
    from warmstart.snapshot import SnapshotError

    store = _store(args)
    verifier = _verifier(args, store)
    expected = _load_expected_identity(args.expect_identity)
    _check_prefix_flag(args.prefix)
    try:
        snapshot = store.verify(args.id, verifier, expected, prefix=args.prefix)
    except SnapshotError as exc:  # invalid, or not there at all
        reason = getattr(exc, "reason", str(exc))
        if args.json:
            _print_json({"id": args.id, "valid": False, "reason": reason})
        else:
            print(f"INVALID {args.id}: {reason}", file=sys.stderr)
        return EXIT_INVALID
    if args.json:
        _print_json({"id": snapshot.id, "valid": True, "files": len(snapshot.files), "size": snapshot.size})
    else:
        _console().print(
            f"[green]valid[/green] {snapshot.id}: signature ({verifier.algorithm}, key {verifier.key_id}), "
            f"identity and {len(snapshot.files)} files ({human_bytes(snapshot.size)}) check out"
        )
    return 0


def _verifier(args: argparse.Namespace, store: Any) -> Any:
    """The verifier of --key, else of the key generated for this store (never one inside it)."""
    from warmstart.snapshot.signing_keys import verification_key

    return verification_key(store.root, args.key)


def _verifier_if_any(args: argparse.Namespace, store: Any) -> Any:
    """The verifier of --key, else of the store's generated key; None when there is neither (gc then
    cannot tell a forged snapshot directory from one signed with a key it does not have)."""
    from warmstart.snapshot import SigningKeyError

    try:
        return _verifier(args, store)
    except SigningKeyError:
        if args.key:
            raise
        return None


def _cmd_gc(args: argparse.Namespace) -> int:
    store = _store(args)
    if args.keep is not None and args.keep < 1:
        raise UsageError(f"--keep must be at least 1, got {args.keep} (use `snapshot delete` to remove all)")
    deleted = []
    if args.keep is not None:
        verifier = _verifier(args, store)
        deleted = store.apply_retention(args.keep, args.identity, verifier=verifier, dry_run=args.dry_run)
    report = store.gc(
        staging_older_than=args.staging_older_than, blob_grace=args.blob_grace, dry_run=args.dry_run,
        verifier=_verifier_if_any(args, store),
    )  # fmt: skip
    report.deleted_snapshots = deleted
    if args.json:
        _print_json(dataclasses.asdict(report))
    else:
        _print_gc_report(report)
    return EXIT_INVALID if report.errors else 0


def _print_gc_report(report: Any) -> None:
    console = _console()
    verb = "would remove" if report.dry_run else "removed"
    for snapshot_id in report.deleted_snapshots:
        console.print(f"{verb} snapshot {snapshot_id} (retention)")
    for staging in report.removed_staging:
        console.print(f"{verb} staging {staging}")
    for unsigned in report.removed_unsigned:
        console.print(f"{verb} {unsigned}")
    for digest in report.removed_blobs:
        console.print(f"{verb} blob {digest}")
    for error in report.errors:
        console.print(f"[red]error[/red] {error}")
    console.print(
        f"{verb} {len(report.removed_blobs)} blobs ({human_bytes(report.freed_bytes)}), "
        f"{len(report.removed_staging)} staging dirs, {len(report.deleted_snapshots)} snapshots; kept "
        f"{report.referenced_blobs} referenced and {len(report.young_blobs)} recent unreferenced blobs"
    )


def _cmd_delete(args: argparse.Namespace) -> int:
    _store(args).delete(args.id)
    if args.json:
        _print_json({"deleted": args.id})
    else:
        print(f"deleted {args.id}")
    return 0


def _cmd_keygen(args: argparse.Namespace) -> int:
    from warmstart.snapshot import generate_ed25519_keypair, generate_hmac_key

    if args.hmac:
        written = {"hmac": str(generate_hmac_key(args.hmac))}
    else:
        private, public = generate_ed25519_keypair(args.ed25519)
        written = {"private": str(private), "public": str(public)}
    if args.json:
        _print_json(written)
    else:
        for kind, path in written.items():
            print(f"wrote {kind} key {path}")
    return 0
