"""Result caches: the same code is never evaluated twice on the same hardware.

`ResultCache` is the protocol that batch evaluation uses; the trainer adapts the store to it.
`DirectoryResultCache` keeps one JSON file per result key, written atomically (a temporary
file renamed into place), so a run killed at any moment resumes with every finished result and
never reads a half-written one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Protocol, runtime_checkable

from pydantic import ValidationError

from kernelfleet.core.models import EvaluationResult, ResultKey

_TEMPORARY = ".tmp-"  # the prefix of a result being written; renamed into place when whole


@runtime_checkable
class ResultCache(Protocol):
    def get(self, key: ResultKey) -> EvaluationResult | None: ...

    def put(self, result: EvaluationResult) -> None: ...


class DirectoryResultCache:
    """Results as `<root>/<key.path()>` JSON files."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def _path(self, key: ResultKey) -> Path:
        return self.root / key.path()

    def get(self, key: ResultKey) -> EvaluationResult | None:
        path = self._path(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            return EvaluationResult.model_validate_json(text)
        except ValidationError:
            # Unreadable entries (an older format) count as missing and are re-evaluated.
            return None

    def put(self, result: EvaluationResult) -> None:
        path = self._path(result.key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(prefix=_TEMPORARY, suffix=".json", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(result.model_dump_json(indent=1))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temp, path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise

    def __len__(self) -> int:
        """Finished results only: a temporary file being written (or left by a killed run) is
        not one, and counting it would report a result that a resume cannot read."""
        if not self.root.exists():
            return 0
        return sum(1 for path in self.root.rglob("*.json") if not path.name.startswith(_TEMPORARY))
