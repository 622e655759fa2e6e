"""Command-line options generated from settings models, so a default or a bound is declared once.

    budget = ModelOptions(Budget, Flag("samples_per_round", "--samples"), title="budget")
    budget.add_to(parser)
    ...
    args = parser.parse_args()
    settings = budget.build(args)          # a Budget; only the flags the user gave are passed

Every field of the model becomes a flag unless the fields are narrowed with `only=` or `skip=`;
a field that is itself a settings model (a group, kopf-style) contributes its fields, named by
their path: `timing.trials` is `--timing-trials`, as it is `evaluation.timing.trials` in a job
spec. A `Flag` renames one (by its path) or gives it a parser of its own (durations). The
help text is the field's description followed by its default. A
value is validated by the model itself as soon as argparse reads it, so `--timing-trials 2`
fails with "argument --timing-trials: 2: input should be greater than or equal to 3", naming
the option the user typed, never the internal field name. Values the model checks across
fields are checked by `build`, whose `UsageError` names the flags too.

A flag left out is not passed to the model, whose default then applies: the model stays the one
source of defaults, and a caller can tell "given" from "defaulted" (`given`).
"""

from __future__ import annotations

import argparse
import enum
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic.alias_generators import to_camel
from pydantic.fields import FieldInfo

from kernelfleet.core.errors import UsageError
from kernelfleet.core.settings import merged

M = TypeVar("M", bound=BaseModel)

_METAVARS: dict[Any, str] = {int: "N", float: "X"}


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line, where the generated form does not fit.

    `names`: the option strings (default: `--field-name`; a boolean that defaults to True
    becomes `--no-field-name`); `parse`: turns the text into the value the model validates
    (e.g. "15m" into 900.0); `default_text`: how to describe the default in the help (for
    defaults decided at run time, such as the device); `dest`: the attribute on the parsed
    namespace (default: the field name).
    """

    field: str
    names: tuple[str, ...] | str = ()
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    default_text: str | None = None
    help: str | None = None
    dest: str | None = None


def _plain_type(annotation: Any) -> Any:
    """`X | None` -> X: a flag, when given, always has a value."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def _group(annotation: Any) -> type[BaseModel] | None:
    """The settings model a field holds, when it is a group of settings; else None."""
    kind = _plain_type(annotation)
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def leaf_fields(model: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    """Every setting of `model` by its path (`timing.trials`), groups opened, in declaration order."""
    out: dict[str, FieldInfo] = {}
    for name, info in model.model_fields.items():
        group = _group(info.annotation)
        if group is not None:
            out.update(leaf_fields(group, f"{prefix}{name}."))
        else:
            out[prefix + name] = info
    return out


def nest(path: str, value: Any) -> dict[str, Any]:
    """`("timing.trials", 7)` -> `{"timing": {"trials": 7}}`."""
    head, _, rest = path.partition(".")
    return {head: nest(rest, value) if rest else value}


def lookup(values: BaseModel, path: str) -> Any:
    """The value at `path` in a model (`lookup(config, "timing.trials")`)."""
    value: Any = values
    for part in path.split("."):
        value = getattr(value, part)
    return value


def _camel(path: str) -> str:
    return ".".join(to_camel(part) for part in path.split("."))


def _message(error: ValidationError) -> str:
    first = error.errors()[0]
    text = str(first["msg"])
    # pydantic prefixes the messages of custom validators with "Value error, ".
    text = text.removeprefix("Value error, ")
    return text[:1].lower() + text[1:]


class ModelOptions(Generic[M]):
    """The flags of one settings model's fields; see the module docstring."""

    def __init__(
        self,
        model: type[M],
        *flags: Flag,
        only: Iterable[str] | None = None,
        skip: Iterable[str] = (),
        title: str | None = None,
    ) -> None:
        self.model = model
        self.title = title
        overrides = {flag.field: flag for flag in flags}
        self._fields = leaf_fields(model)
        unknown = sorted((set(overrides) | set(only or ())) - set(self._fields))
        if unknown:
            raise ValueError(f"{model.__name__} has no field(s) {unknown}")
        chosen = list(only) if only is not None else [name for name in self._fields if name not in set(skip)]
        self._flags = {name: overrides.get(name, Flag(name)) for name in chosen}

    # ------------------------------------------------------------------ building the parser

    def names(self, field: str) -> tuple[str, ...]:
        """The option strings of `field`."""
        flag = self._flags[field]
        if flag.names:
            return (flag.names,) if isinstance(flag.names, str) else tuple(flag.names)
        info = self._fields[field]
        stem = field.replace(".", "-").replace("_", "-")
        if _plain_type(info.annotation) is bool and info.default is True:
            return (f"--no-{stem}",)
        return (f"--{stem}",)

    def dest(self, field: str) -> str:
        return self._flags[field].dest or field.replace(".", "__")

    def add_to(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        """Add one option per field (in a group named `title`, when given)."""
        target: Any = parser
        if self.title is not None and isinstance(parser, argparse.ArgumentParser):
            target = parser.add_argument_group(self.title)
        for field, flag in self._flags.items():
            info = self._fields[field]
            kind = _plain_type(info.annotation)
            help_text = self._help(field, flag, info)
            names = self.names(field)
            if kind is bool and flag.parse is None:
                target.add_argument(
                    *names,
                    dest=self.dest(field),
                    action="store_const",
                    const=not bool(info.default),
                    default=None,
                    help=help_text,
                )
                continue
            choices = None
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                choices = [member.value for member in kind]
            metavar = flag.metavar or _METAVARS.get(kind, field.rsplit(".", 1)[-1].upper())
            target.add_argument(
                *names,
                dest=self.dest(field),
                default=None,
                type=self._converter(field, flag),
                choices=choices,
                metavar="{" + ",".join(choices) + "}" if choices and not flag.metavar else metavar,
                help=help_text,
            )

    def _help(self, field: str, flag: Flag, info: FieldInfo) -> str:
        # A description may end with what None means ("... None: no limit."): on the command
        # line that is the default's description.
        described, _, none_means = (info.description or "").partition(" None: ")
        text = flag.help or described.rstrip(".")
        if _plain_type(info.annotation) is bool and flag.parse is None:
            if info.default is True and not flag.help:
                return f"turn off: {text[:1].lower() + text[1:]}".replace("%", "%%")
            return text.replace("%", "%%")
        if flag.default_text is not None:
            default = flag.default_text
        elif info.default is None:
            default = none_means.rstrip(".") or "none"
        elif isinstance(info.default, enum.Enum):
            default = str(info.default.value)
        else:
            default = str(info.default)
        # argparse formats help with %: a literal percent sign must be doubled.
        return f"{text} (default: {default})".replace("%", "%%")

    def _converter(self, field: str, flag: Flag) -> Callable[[str], Any]:
        """argparse's `type`: parse the text, then let the model validate it, alone."""
        model = self.model

        def convert(text: str) -> Any:
            value: Any = text
            if flag.parse is not None:
                value = flag.parse(text)
            try:
                checked = model.model_validate(nest(field, value))
            except ValidationError as error:
                raise argparse.ArgumentTypeError(f"{text}: {_message(error)}") from None
            return lookup(checked, field)

        convert.__name__ = field.rsplit(".", 1)[
            -1
        ]  # argparse names the type in "invalid <type> value" messages
        return convert

    def argv(self, values: M) -> list[str]:
        """The command line that gives `values` (a model of these fields) to a program reading
        these flags: every field with a value, so that a program with other defaults (a worker
        image of another version) still gets these; a flag-only boolean only when it differs
        from the default, since it can say one value."""
        words: list[str] = []
        for field, flag in self._flags.items():
            info = self._fields[field]
            value = lookup(values, field)
            if value is None:
                continue
            if _plain_type(info.annotation) is bool and flag.parse is None:
                words += [self.names(field)[0]] if value != info.default else []
                continue
            words += [self.names(field)[0], str(value.value if isinstance(value, enum.Enum) else value)]
        return words

    # ------------------------------------------------------------------ reading the parsed flags

    def given(self, args: argparse.Namespace) -> dict[str, Any]:
        """The fields the user set on the command line, nested as the model's groups are."""
        values: dict[str, Any] = {}
        for field in self._flags:
            value = getattr(args, self.dest(field), None)
            if value is not None:
                values = merged(values, nest(field, value))
        return values

    def build(self, args: argparse.Namespace, **extra: Any) -> M:
        """The model from the given flags (plus `extra` fields); errors name the flags."""
        return self.build_from(self.given(args), **extra)

    def build_from(self, values: Mapping[str, Any], **extra: Any) -> M:
        try:
            return self.model.model_validate(merged(dict(values), extra))
        except ValidationError as error:
            raise UsageError(self.explain(error)) from None

    def explain(self, error: ValidationError) -> str:
        """A validation error of this model, in terms of the flags."""
        problems = []
        for item in error.errors():
            # The path of the setting, by field name (the location may use camelCase aliases).
            names = {_camel(path): path for path in self._fields} | {path: path for path in self._fields}
            loc = [str(part) for part in item["loc"]]
            field = next(
                (names[".".join(loc[:n])] for n in range(len(loc), 0, -1) if ".".join(loc[:n]) in names),
                ".".join(loc),
            )
            where = "/".join(self.names(field)) if field in self._flags else field or self.model.__name__
            text = str(item["msg"]).removeprefix("Value error, ")
            problems.append(f"{where}: {text[:1].lower() + text[1:]}")
        return "bad option: " + "; ".join(problems)
