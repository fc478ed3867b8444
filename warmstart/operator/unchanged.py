"""Whether the server holds a child as the operator wants it, so that applying it would change nothing.

Two checks, each catching what the other cannot:
- every field the operator sets has the wanted value on the server (a hand edit of one of them, a deleted
  child): the wanted object is contained in the server's, which adds defaults and other managers' fields;
- the server's copy carries the digest of the whole wanted object as last applied: a field the operator
  stopped setting (containment cannot see a removal) changes the digest.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from warmstart.api import labels as L

APPLIED_ANNOTATION = f"{L.GROUP}/applied-digest"


def digest(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:20]


def stamped(obj: dict[str, Any]) -> dict[str, Any]:
    """The wanted object with its own digest among its annotations (what gets applied)."""
    out = copy.deepcopy(obj)
    annotations = out["metadata"].setdefault("annotations", {})
    annotations[APPLIED_ANNOTATION] = digest(obj)
    return out


def contains(server: Any, wanted: Any) -> bool:
    """Every field of `wanted` has its value in `server`; lists match item by item. A number the server
    returns as a string (a resource quantity) matches, and so does an empty map or list the server left
    out (it stores none)."""
    if isinstance(wanted, dict):
        server = {} if server is None else server
        return isinstance(server, dict) and all(contains(server.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        server = [] if server is None else server
        return (
            isinstance(server, list)
            and len(server) == len(wanted)
            and all(contains(s, w) for s, w in zip(server, wanted, strict=True))
        )
    if server == wanted:
        return True
    return isinstance(wanted, int | float) and not isinstance(wanted, bool) and str(server) == str(wanted)


def held(server: dict[str, Any] | None, applied: dict[str, Any]) -> bool:
    """The server's copy already is `applied` (a `stamped` object) as far as the operator's fields go."""
    return server is not None and contains(server, applied)
