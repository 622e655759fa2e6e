"""Loading KernelBench-format tasks from files, directories and JSONL selections.

A task is a module that defines `Model`, `get_inputs` and `get_init_inputs`. They come from a
single file, a directory of such files, or a JSONL file of rows `{level, task_id, name, code}`
selected by level and ids. `kernelbench-<version>` names the JSONL files that ship with kernelfleet
(KernelBench's own, MIT-licensed), so that `kernelbench-v0:1:12` means level 1, task 12 of the v0 set.
Only the source is read here; nothing is imported or executed in this process.
"""

from __future__ import annotations

import ast
import codecs
import json
import os
import re
from pathlib import Path

from kernelfleet.core.errors import UsageError
from kernelfleet.core.models import Task

_KERNELBENCH = re.compile(
    r"^kernelbench-(?P<version>[A-Za-z0-9._-]+?)(?::(?P<level>[^:]*))?(?::(?P<ids>[^:]*))?$"
)
REQUIRED_NAMES = ("Model", "get_inputs", "get_init_inputs")
# KernelBench's task files (MIT, licence beside them) ship inside core, so that
# `kernelbench-v0:1:12` works on any install, in the operator's image too.
BUNDLED_KERNELBENCH = Path(__file__).resolve().parent / "kernelbench"


def kernelbench_dir() -> Path:
    """Where `kernelbench-*.jsonl` live: $KERNELFLEET_KERNELBENCH_DIR when set (a newer or
    patched copy), else the files shipped with kernelfleet."""
    env = os.environ.get("KERNELFLEET_KERNELBENCH_DIR")
    if not env:
        return BUNDLED_KERNELBENCH
    path = Path(env)
    if not path.is_dir():
        raise UsageError(
            f"KERNELFLEET_KERNELBENCH_DIR={env} is not a directory; point it at the folder "
            "that holds kernelbench-v0.jsonl, or unset it to use the bundled tasks"
        )
    return path


def missing_task_names(code: str) -> list[str]:
    """Which of Model, get_inputs, get_init_inputs the source does not define at top level."""
    tree = ast.parse(code)
    defined: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return [name for name in REQUIRED_NAMES if name not in defined]


# PEP 263: a coding declaration is a comment matching this in one of the first two lines.
_CODING = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)")


def read_source(path: Path) -> str:
    """A Python file's text, decoded as Python decodes it: UTF-8 unless a PEP 263 coding line
    (`# -*- coding: latin-1 -*-`) says otherwise. Unreadable: a UsageError naming the file."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise UsageError(
            f"cannot read {path}: {error.strerror or error}; check that the file exists"
        ) from None
    try:
        return data.decode(source_encoding(data))
    except (LookupError, UnicodeDecodeError, SyntaxError) as error:
        raise UsageError(
            f"cannot read {path} as Python source: {error}; save it as UTF-8, or declare its "
            "encoding in a coding line (PEP 263)"
        ) from None


def source_encoding(source: bytes | str) -> str:
    """The encoding a Python source declares (PEP 263), else 'utf-8'. Code kept as text is
    written back with it, so that the declaration stays true when the file is imported."""
    data = source.encode("utf-8", "surrogateescape") if isinstance(source, str) else source
    for line in data.splitlines()[:2]:
        match = _CODING.match(line)
        if match:
            name = match.group(1).decode("ascii", "replace")
            codecs.lookup(name)  # LookupError for an unknown encoding
            return name
        if line.strip() and not line.lstrip().startswith(b"#"):
            break  # the declaration must come before any code
    return "utf-8"


def _read(path: Path) -> str:
    """A JSONL file's text (JSON is UTF-8)."""
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(
            f"cannot read {path}: {error}; check that the file exists and is UTF-8 text"
        ) from None


def _task_from_file(path: Path, *, check: bool = True) -> Task | None:
    """The task in `path`. Without `check` (a file found in a directory), a file that is not a
    task (a helper module) is None, but a file that is not even valid Python is an error: it
    is most likely a task with a typo, and skipping it without a word would hide it."""
    code = read_source(path)
    try:
        missing = missing_task_names(code)
    except SyntaxError as error:
        raise UsageError(
            f"{path} is not valid Python ({error.msg}, line {error.lineno}); fix the task file"
            + ("" if check else ", or move it out of the task directory")
        ) from None
    if missing:
        if not check:
            return None
        raise UsageError(
            f"{path} is not a KernelBench-format task: it does not define {', '.join(missing)}; a task "
            "defines class Model, get_inputs() and get_init_inputs()"
        )
    return Task(name=path.stem, code=code, source=str(path))


def parse_ids(text: str) -> list[int] | None:
    """'12' -> [12]; '1-10' -> 1..10; '1,3,5-7' -> [1, 3, 5, 6, 7]; '' or '*' -> None (all)."""
    text = text.strip()
    if text in ("", "*", "all"):
        return None
    ids: list[int] = []
    for part in text.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise UsageError(
                f"bad task ids {text!r}: use a number, a range like 1-10, or a list like 1,3,5-7"
            )
        first = int(match.group(1))
        last = int(match.group(2) or first)
        if last < first:
            raise UsageError(f"bad task id range {part!r}: the end is before the start")
        ids.extend(range(first, last + 1))
    return ids


def _load_jsonl(path: Path, level_text: str | None, ids_text: str | None, source: str) -> list[Task]:
    if not path.is_file():
        raise UsageError(f"task file {path} does not exist; check the path")
    level = None
    if level_text not in (None, "", "*", "all"):
        assert level_text is not None
        if not level_text.isdigit():
            raise UsageError(f"bad level {level_text!r} in {source!r}: use a number such as 1")
        level = int(level_text)
    ids = parse_ids(ids_text or "")
    rows = []
    for number, line in enumerate(_read(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            rows.append((int(row["level"]), int(row["task_id"]), str(row["name"]), str(row["code"])))
        except (ValueError, KeyError, TypeError) as error:
            raise UsageError(
                f"{path}:{number} is not a task row ({error}); each line must be a JSON object "
                "with level, task_id, name and code"
            ) from None
    chosen = [r for r in rows if (level is None or r[0] == level) and (ids is None or r[1] in ids)]
    if ids is not None and level is not None:
        found = {r[1] for r in chosen}
        absent = [i for i in ids if i not in found]
        if absent:
            have = sorted({r[1] for r in rows if r[0] == level})
            span = f"{have[0]}-{have[-1]}" if have else "none"
            raise UsageError(f"{source}: level {level} has no task ids {absent[:10]} (ids there: {span})")
    if not chosen:
        levels = sorted({r[0] for r in rows})
        raise UsageError(f"{source} selects no tasks; levels in {path.name}: {levels}")
    chosen.sort(key=lambda r: (r[0], r[1]))
    return [
        Task(name=f"{lv}_{tid}_{name}", code=code, level=lv, task_id=tid, source=source)
        for lv, tid, name, code in chosen
    ]


def load_tasks(spec: str | os.PathLike[str]) -> list[Task]:
    """Tasks named by `spec`: a .py file, a directory of them, `path.jsonl[:LEVEL[:IDS]]`, or
    `kernelbench-<version>[:LEVEL[:IDS]]` (IDS: `12`, `1-10`, `1,3,5-7`)."""
    text = os.fspath(spec)
    path = Path(text)
    if path.is_dir():
        tasks = [t for p in sorted(path.glob("*.py")) if (t := _task_from_file(p, check=False)) is not None]
        if not tasks:
            raise UsageError(
                f"{path} has no task files; a task file defines class Model, get_inputs() and "
                "get_init_inputs()"
            )
        return tasks
    if path.is_file() and path.suffix == ".py":
        task = _task_from_file(path)
        assert task is not None
        return [task]
    if path.is_file() and path.suffix == ".jsonl":
        return _load_jsonl(path, None, None, text)
    if ".jsonl:" in text:
        file_part, rest = text.split(".jsonl:", 1)
        level_text, _, ids_text = rest.partition(":")
        return _load_jsonl(Path(file_part + ".jsonl"), level_text, ids_text, text)
    match = _KERNELBENCH.match(text)
    if match:
        file = kernelbench_dir() / f"kernelbench-{match.group('version')}.jsonl"
        if not file.is_file():
            versions = sorted(
                p.stem.removeprefix("kernelbench-") for p in file.parent.glob("kernelbench-*.jsonl")
            )
            raise UsageError(
                f"no KernelBench version {match.group('version')!r} in {file.parent}; have {versions}"
            )
        return _load_jsonl(file, match.group("level"), match.group("ids"), text)
    if text.endswith(".py") or text.endswith(".jsonl") or os.sep in text:
        raise UsageError(f"task path {text} does not exist; check the path")
    raise UsageError(
        f"cannot read tasks from {text!r}: give a .py file, a directory, a .jsonl file (optionally "
        "path.jsonl:LEVEL:IDS) or a KernelBench selection such as kernelbench-v0:1:12"
    )
