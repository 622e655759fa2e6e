"""Extension names that survive a new process, so the build cache serves every process.

torch builds a `load_inline` extension in `TORCH_EXTENSIONS_DIR/<name>`, and the evaluator's
build directory is keyed by the candidate's source: a rebuild is a no-op there when the name
is the one the build pool compiled. Some candidates name their extension after their process
(`f"ext_{os.getpid()}"`, 4 of the 227 published kernels) to dodge clashes, so every process
(the evaluation, and a re-check) compiled again, for up to minutes, while it held a device
slot. In the candidate's process the process id in such a name is replaced by `pid`: the name
stays unique within the source's own directory, and every process finds the pool's build.

This is a convenience, not a wall: a candidate that undoes it only compiles again.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

_LOADERS = ("load_inline", "load")


def stable_name(name: str, pid: int | None = None) -> str:
    """`name` with this process's id (a whole number in it) replaced by `pid`."""
    number = str(os.getpid() if pid is None else pid)
    return re.sub(rf"(?<!\d){number}(?!\d)", "pid", name)


def _stable_loader(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def loader(*args: Any, **kwargs: Any) -> Any:
        if isinstance(kwargs.get("name"), str):
            kwargs["name"] = stable_name(kwargs["name"])
        elif args and isinstance(args[0], str):
            args = (stable_name(args[0]), *args[1:])
        return load(*args, **kwargs)

    loader.__kf_stable__ = True  # type: ignore[attr-defined]
    return loader


def install_stable_names() -> None:
    """Wrap torch's extension loaders in this process (before candidate code imports them)."""
    from torch.utils import cpp_extension

    for attribute in _LOADERS:
        load = getattr(cpp_extension, attribute)
        if not getattr(load, "__kf_stable__", False):
            setattr(cpp_extension, attribute, _stable_loader(load))
