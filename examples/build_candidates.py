"""Write candidates.jsonl from the hand-written files in candidates/.

Each file is named `TASK__NAME.py`: TASK is a task's file name in tasks/ (its name when
loaded), NAME labels the candidate in reports. Code is easier to read and edit as files; the
replay policy reads JSONL. A unit test fails when the two disagree: run this script after
editing a candidate.

    python examples/build_candidates.py
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rows() -> list[dict[str, str]]:
    found = []
    for path in sorted((HERE / "candidates").glob("*__*.py")):
        task, _, name = path.stem.partition("__")
        found.append({"task": task, "name": name.replace("_", "-"), "code": path.read_text(encoding="utf-8")})
    return found


def render() -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows())


if __name__ == "__main__":
    (HERE / "candidates.jsonl").write_text(render(), encoding="utf-8")
    print(f"wrote {HERE / 'candidates.jsonl'} ({len(rows())} candidates)")
