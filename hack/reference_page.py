"""The command line both reference-page generators share (hack/crd_reference.py, hack/cli_reference.py):
write the page, or with --check exit 1, saying so, when the committed page is not what would be written."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def write_or_check(page: Path, render: Callable[[], str], description: str, argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--check", action="store_true", help="fail if the committed page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not page.exists() or page.read_text() != text:
            print(f"{page.relative_to(ROOT)} is stale: run hack/{Path(sys.argv[0]).name}", file=sys.stderr)
            return 1
        return 0
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    print(f"wrote {page.relative_to(ROOT)}")
    return 0
