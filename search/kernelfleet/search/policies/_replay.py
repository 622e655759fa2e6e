"""The `replay` policy: candidate codes from a JSONL file, so users can verify their own kernels.

Each row is `{"task": ..., "code": ..., "name": optional}`. The task is named the way users
have it at hand: the task's name, its file name, its hash (or a prefix of at least 8 hex
digits), or `LEVEL:TASK_ID` for KernelBench tasks. Rows are proposed in file order, each once;
the file is read whole at start so that a malformed line fails the run before any GPU time is
spent, with the line number in the message.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kernelfleet.core.errors import UsageError
from kernelfleet.core.hashing import source_hash
from kernelfleet.core.models import Task
from kernelfleet.search._answers import check_code
from kernelfleet.search.policies._base import Proposal, Request

_HEX = re.compile(r"^[0-9a-f]{8,64}$")


@dataclass(frozen=True)
class ReplayRow:
    task: str
    code: str
    name: str = ""

    def matches(self, task: Task) -> bool:
        key = self.task.strip()
        if key in (task.name, Path(task.source).stem if task.source else None):
            return True
        if _HEX.match(key.lower()) and task.hash.startswith(key.lower()):
            return True
        if task.level is not None and task.task_id is not None:
            return key.replace(" ", "") == f"{task.level}:{task.task_id}"
        return False


def parse_replay_lines(text: str, origin: str) -> list[ReplayRow]:
    """Rows of a replay JSONL text; `origin` names it in error messages."""
    rows = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(
                f"{origin}:{number}: not valid JSON ({error.msg}); each line must be one object"
            ) from None
        if (
            not isinstance(row, dict)
            or not isinstance(row.get("task"), str)
            or not isinstance(row.get("code"), str)
        ):
            raise UsageError(
                f'{origin}:{number}: each line must be an object with string fields "task" and "code" '
                '(and optionally "name")'
            )
        name = row.get("name", "")
        rows.append(ReplayRow(task=str(row["task"]), code=row["code"], name=str(name) if name else ""))
    return rows


class ReplayPolicy:
    """Proposes the rows that match each task, in file order, each once."""

    def __init__(self, rows: Sequence[ReplayRow], origin: str = "replay") -> None:
        self._rows = tuple(rows)
        self._origin = origin
        digest = hashlib.sha256()
        for row in self._rows:
            digest.update(f"{row.task}\0{source_hash(row.code)}\0".encode())
        # The id follows the content, not the path: the same candidates under another name are
        # the same policy, and an edited file is a different one.
        self._id = f"replay-{digest.hexdigest()[:12]}"

    @classmethod
    def from_file(cls, path: str | Path) -> ReplayPolicy:
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as error:
            raise UsageError(
                f"cannot read the replay file {file}: {error.strerror}; check the path"
            ) from None
        except UnicodeDecodeError as error:
            raise UsageError(
                f"cannot read the replay file {file}: byte {error.start} is not UTF-8 ({error.reason}); "
                "a replay file is JSON lines, which are UTF-8 text"
            ) from None
        rows = parse_replay_lines(text, str(file))
        if not rows:
            raise UsageError(
                f'the replay file {file} has no candidates; add lines like {{"task": "NAME", "code": "..."}}'
            )
        return cls(rows, origin=file.name)

    @property
    def name(self) -> str:
        return "replay"

    @property
    def id(self) -> str:
        return self._id

    @property
    def rows(self) -> tuple[ReplayRow, ...]:
        return self._rows

    def rows_for(self, task: Task) -> list[ReplayRow]:
        return [row for row in self._rows if row.matches(task)]

    def propose(self, requests: Sequence[Request]) -> list[Proposal]:
        handed_out: dict[str, set[str]] = {}
        proposals = []
        for request in requests:
            taken = handed_out.setdefault(request.task.hash, set(request.seen))
            proposal = Proposal.nothing_left()
            for position, row in enumerate(self.rows_for(request.task)):
                digest = source_hash(row.code)
                if digest not in taken:
                    taken.add(digest)
                    name = row.name or f"{self._origin}#{position + 1}"
                    text = f"replayed from {self._origin}"
                    error = check_code(row.code)
                    proposal = Proposal(
                        code=None if error else row.code, name=name, text=text, error=error, key=digest
                    )
                    break
            proposals.append(proposal)
        return proposals

    def close(self) -> None:
        return None
