"""torch's extension loaders, made to serve every process of a candidate from one build.

The evaluator's build pool compiles a candidate's C++/CUDA extensions in the candidate's build
directory (keyed by its source); the evaluation and a re-check are later processes that call
the same `load_inline` again. Two things made those processes compile again, each for up to
minutes while holding a device slot (seen with the published kernels):

- **Names after the process id.** Some candidates name an extension `f"ext_{os.getpid()}"`
  (4 of the 227 published kernels), so every process asked for a new one. Here the process id in
  such a name becomes `pid`: the name stays unique within the source's own directory.
- **Failing builds.** Many published kernels catch a failed build and fall back to PyTorch
  (a `functions=` entry that the C++ never declares, a second `PYBIND11_MODULE`); ninja keeps
  nothing of a failed build, so each process spent the compile again only to fail again. A
  build that failed with a compiler diagnostic is remembered in the build directory, keyed by
  everything the build depends on (name, sources and their files' contents, flags), and the same
  call fails at once with the same error. Failures that may not repeat (killed, out of memory or
  disk, interrupted) are not remembered.

Both are conveniences, not walls: a candidate that undoes them only compiles again, and a
verdict never depends on them (the same call fails or loads as it would have).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

_LOADERS = ("load_inline", "load")
_FAILURES = ".kf-failed-builds"
# Signs of a compiler's verdict on the source, and of a failure that may not repeat.
_DIAGNOSTIC = re.compile(r"\berror\b[: ]|error #\d+|undefined reference|multiple definition", re.IGNORECASE)
_TRANSIENT = re.compile(
    r"killed signal|signal terminated|no space left|cannot allocate memory|out of memory|"
    r"resource temporarily unavailable|interrupted|timed? ?out|segmentation fault|internal compiler error",
    re.IGNORECASE,
)


def stable_name(name: str, pid: int | None = None) -> str:
    """`name` with this process's id (a whole number in it) replaced by `pid`."""
    number = str(os.getpid() if pid is None else pid)
    return re.sub(rf"(?<!\d){number}(?!\d)", "pid", name)


def repeatable_failure(message: str) -> bool:
    """Whether a build error is the compiler's verdict on the source (it fails the same way
    every time) rather than something the machine did to the build."""
    return bool(_DIAGNOSTIC.search(message)) and not _TRANSIENT.search(message)


def _files(value: Any) -> Iterable[str]:
    items = [value] if isinstance(value, str) else value if isinstance(value, list | tuple) else []
    for item in items:
        if isinstance(item, str) and os.path.isfile(item):
            yield Path(item).read_text(encoding="utf-8", errors="replace")


def build_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """Everything a build depends on: the call's arguments, and the contents of source files
    named in it (`load(sources=[...])`)."""
    digest = hashlib.sha256(json.dumps([args, kwargs], sort_keys=True, default=repr).encode())
    sources = kwargs.get("sources", args[1] if len(args) > 1 else None)
    for text in _files(sources):
        digest.update(text.encode())
    return digest.hexdigest()[:32]


def _record_dir() -> Path | None:
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) / _FAILURES if root else None


def _shared_build_loader(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def loader(*args: Any, **kwargs: Any) -> Any:
        if isinstance(kwargs.get("name"), str):
            kwargs["name"] = stable_name(kwargs["name"])
        elif args and isinstance(args[0], str):
            args = (stable_name(args[0]), *args[1:])
        records = _record_dir()
        record = records / build_key(args, kwargs) if records is not None else None
        if record is not None and record.is_file():
            raise RuntimeError(record.read_text(encoding="utf-8", errors="replace"))
        try:
            return load(*args, **kwargs)
        except RuntimeError as error:
            message = str(error)
            if record is not None and "Error building extension" in message and repeatable_failure(message):
                record.parent.mkdir(parents=True, exist_ok=True)
                temporary = record.with_suffix(f".{os.getpid()}")
                temporary.write_text(message, encoding="utf-8")
                temporary.replace(record)
            raise

    loader.__kf_shared_builds__ = True  # type: ignore[attr-defined]
    return loader


def share_builds_across_processes() -> None:
    """Wrap torch's extension loaders in this process (before candidate code imports them)."""
    from torch.utils import cpp_extension

    for attribute in _LOADERS:
        load = getattr(cpp_extension, attribute)
        if not getattr(load, "__kf_shared_builds__", False):
            setattr(cpp_extension, attribute, _shared_build_loader(load))
