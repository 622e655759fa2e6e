"""Loading a reference or a candidate as its own module from its own file.

Never `exec` two sources into one dict: KernelBench's harness does, and a candidate that
redefines `N` then shrinks the inputs that the reference's `get_inputs` makes. Each source is
written to a file (Triton and `inspect` need one) and imported under a unique module name.
"""

from __future__ import annotations

import importlib.util
import secrets
import sys
import types
from pathlib import Path

from kernelfleet.core.tasks import source_encoding


def module_file(directory: Path, stem: str) -> Path:
    """A fresh, unique path for a module file; the name is unguessable by other code."""
    return directory / f"{stem}_{secrets.token_hex(4)}.py"


def load_module_at(source: str, path: Path) -> types.ModuleType:
    """Write `source` to `path` and import it as the module named after the file.

    The file is written in the encoding the source declares (PEP 263; UTF-8 without a
    declaration), so that a latin-1 task with its coding line imports as it was read.
    """
    try:
        path.write_bytes(source.encode(source_encoding(source)))
    except (LookupError, UnicodeEncodeError):
        path.write_text(source, encoding="utf-8")  # Python itself will say what is wrong
    name = path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot create a module from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def load_module(source: str, directory: Path, stem: str, *, hidden: bool = False) -> types.ModuleType:
    """Import `source` under a fresh name; `hidden` takes it out of `sys.modules` afterwards, so
    that other code (the candidate) cannot look it up by walking the loaded modules."""
    module = load_module_at(source, module_file(directory, stem))
    if hidden:
        sys.modules.pop(module.__name__, None)
    return module
