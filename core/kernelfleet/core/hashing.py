"""Content hashes for source code.

Variants are content-addressed: two answers that differ only in trailing whitespace, line
endings or blank lines are the same variant, evaluated once. Anything that could change
behaviour (indentation, comments inside strings, identifiers) is kept.
"""

from __future__ import annotations

import hashlib


def normalize_source(source: str) -> str:
    """Return `source` with line endings unified, trailing spaces and blank-line runs removed."""
    lines = [line.rstrip() for line in source.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    kept: list[str] = []
    for line in lines:
        if line or (kept and kept[-1]):
            kept.append(line)
    while kept and not kept[-1]:
        kept.pop()
    return "\n".join(kept) + "\n"


def source_hash(source: str) -> str:
    """The sha256 hex digest of the normalised source: the identity of a task or variant."""
    return hashlib.sha256(normalize_source(source).encode("utf-8")).hexdigest()
