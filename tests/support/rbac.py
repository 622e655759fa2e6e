"""The API permissions the operator's code asks for, read from the code itself.

Every request the operator makes goes through `KubeClient` (`rt.kube.get/create/patch/...`) with
a path built by a path helper (`jobs_path`, `core_path`, `custom_path`, ...). `code_permissions`
reads each such call in the operator's modules (their syntax tree, not a list kept by hand),
builds the path it asks for with placeholders where the namespace or a name goes, and turns the
path into (API group, resource) and the method into a verb. A path held in a variable is
followed to its assignment in the same function, or, when it is a parameter, to the calls of that
function in the module. A call whose path cannot be followed is reported, so nothing escapes.

kopf's own requests (watching the kinds it handles, patching them, posting Events, reading CRDs,
peering) are what kopf does, not what this code writes: `kopf_permissions` lists them from the
handlers registered in the operator's registry.
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator" / "kernelfleet" / "operator"
VERBS = {"get": "get", "get_or_none": "get", "create": "create", "patch": "patch", "delete": "delete"}
VERBS["list_all"] = "list"
PLACEHOLDER = "x"

Permission = tuple[str, str, str]  # (verb, API group, resource[/subresource])


def _resource_of(path: str) -> tuple[str, str]:
    """/api/v1/namespaces/x/secrets/x -> ("", "secrets"); /apis/g/v/namespaces/x/p/x/status ->
    ("g", "p/status")."""
    parts = [p for p in path.split("/") if p]
    if parts[0] == "api":
        group, rest = "", parts[2:]
    else:
        group, rest = parts[1], parts[3:]
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0]
    if len(rest) > 2:
        resource += "/" + rest[2]
    return group, resource


def _value(node: ast.expr, module: ModuleType) -> Any:
    """A constant or an expression of the module's globals; anything else is a placeholder."""
    try:
        return eval(compile(ast.Expression(node), "<rbac>", "eval"), vars(module))
    except Exception:
        return PLACEHOLDER


def _path_of(node: ast.expr, module: ModuleType) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):  # an f-string: its fields become placeholders
        return "".join(
            str(part.value) if isinstance(part, ast.Constant) else PLACEHOLDER for part in node.values
        )
    if not isinstance(node, ast.Call):
        raise LookupError(ast.unparse(node))
    builder = _value(node.func, module)
    if not callable(builder):
        raise LookupError(ast.unparse(node))
    args: list[Any] = []
    for arg in node.args:
        if isinstance(arg, ast.Starred):
            value = _value(arg.value, module)
            args += list(value) if isinstance(value, list | tuple) else [PLACEHOLDER]
        else:
            args.append(_value(arg, module))
    kwargs = {k.arg: _value(k.value, module) for k in node.keywords if k.arg}
    return str(builder(*args, **kwargs))


class _Calls(ast.NodeVisitor):
    def __init__(self) -> None:
        self.found: list[tuple[str, ast.expr, ast.FunctionDef | ast.AsyncFunctionDef | None]] = []
        self._function: ast.FunctionDef | ast.AsyncFunctionDef | None = None

    def _enter(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer, self._function = self._function, node
        self.generic_visit(node)
        self._function = outer

    visit_FunctionDef = _enter
    visit_AsyncFunctionDef = _enter

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in VERBS
            and isinstance(func.value, ast.Attribute)
            and func.value.attr == "kube"
            and node.args
        ):
            self.found.append((VERBS[func.attr], node.args[0], self._function))
        self.generic_visit(node)


def _paths(
    node: ast.expr,
    function: ast.FunctionDef | ast.AsyncFunctionDef | None,
    tree: ast.Module,
    module: ModuleType,
) -> Iterator[str]:
    if not isinstance(node, ast.Name) or function is None:
        yield _path_of(node, module)
        return
    values = _assigned(node.id, function)
    if values:
        for value in values:
            yield from _elements(value, function, module)
        return
    names = [a.arg for a in function.args.args]
    if node.id not in names:
        raise LookupError(f"{function.name}: {node.id}")
    position = names.index(node.id)
    callers = [
        call
        for call in ast.walk(tree)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == function.name
    ]
    if not callers:
        raise LookupError(f"{function.name}: {node.id} (no caller in the module)")
    for call in callers:
        yield _path_of(call.args[position], module)


def _assigned(name: str, function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.expr]:
    """What `name` is set to in `function`: assignments, and the iterables of for loops over it."""
    values: list[ast.expr] = []
    for statement in ast.walk(function):
        if isinstance(statement, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in statement.targets
        ):
            values.append(statement.value)
        if (
            isinstance(statement, ast.For | ast.AsyncFor)
            and isinstance(statement.target, ast.Name)
            and statement.target.id == name
        ):
            values.append(ast.Starred(value=statement.iter))
    return values


def _elements(
    value: ast.expr, function: ast.FunctionDef | ast.AsyncFunctionDef, module: ModuleType
) -> Iterator[str]:
    """The paths a value gives; a Starred one stands for each element of a loop's iterable."""
    if not isinstance(value, ast.Starred):
        yield _path_of(value, module)
        return
    iterable = value.value
    if isinstance(iterable, ast.Name):
        for assigned in _assigned(iterable.id, function):
            yield from _elements(ast.Starred(value=assigned), function, module)
    elif isinstance(iterable, ast.List | ast.Tuple):
        for element in iterable.elts:
            yield _path_of(element, module)
    elif isinstance(iterable, ast.ListComp):
        yield _path_of(iterable.elt, module)
    else:
        raise LookupError(ast.unparse(iterable))


def code_permissions() -> tuple[set[Permission], list[str]]:
    """(verb, group, resource) of every request in the operator's modules, and the calls whose
    path could not be followed."""
    found: set[Permission] = set()
    unresolved: list[str] = []
    for source in sorted(OPERATOR.glob("*.py")):
        tree = ast.parse(source.read_text())
        module = importlib.import_module(f"kernelfleet.operator.{source.stem}")
        visitor = _Calls()
        visitor.visit(tree)
        for verb, node, function in visitor.found:
            try:
                for path in _paths(node, function, tree, module):
                    group, resource = _resource_of(path)
                    found.add((verb, group, resource))
            except LookupError as error:
                unresolved.append(f"{source.name}:{node.lineno}: {error}")
    return found, unresolved


def kopf_permissions() -> set[Permission]:
    """What kopf itself asks for, for the handlers of the operator's registry."""
    from kernelfleet.operator._app import REGISTRY, register_kinds
    from kernelfleet.operator._settings import OperatorSettings

    register_kinds(OperatorSettings())
    found: set[Permission] = set()
    handlers: list[Any] = [*REGISTRY._spawning.get_all_handlers(), *REGISTRY._changing.get_all_handlers()]
    for handler in handlers:
        selector = handler.selector
        if selector is None:
            continue
        group, plural = selector.group or "", str(selector.plural or selector.any_name or "")
        # It lists and watches the kinds it handles, and patches them (its finalizer, its
        # progress annotations) and their status (what the handlers return in `patch`).
        found |= {(v, group, plural) for v in ("list", "watch", "patch")}
        found.add(("patch", group, f"{plural}/status"))
    for handler in REGISTRY._indexing.get_all_handlers():
        selector = handler.selector
        if selector is not None:
            plural = str(selector.plural or selector.any_name or "")
            found |= {(v, selector.group or "", plural) for v in ("list", "watch")}
    found |= {
        ("create", "", "events"),  # kopf posts Events (and the operator its transitions)
        ("list", "apiextensions.k8s.io", "customresourcedefinitions"),  # kopf finds its kinds
        ("watch", "apiextensions.k8s.io", "customresourcedefinitions"),
        ("list", "", "namespaces"),  # kopf with --all-namespaces
        ("watch", "", "namespaces"),
    }
    for plural in ("clusterkopfpeerings", "kopfpeerings"):  # kopf's peering keep-alives
        found |= {(v, "kopf.dev", plural) for v in ("list", "watch", "patch", "create")}
    return found
