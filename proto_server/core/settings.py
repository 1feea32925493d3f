"""A setting is declared once: its field on the class that holds it (`ServerConfig`,
`TimingModel`, `StoreRetention`, `Launch`), with its default, its range (`core/ranges.py`)
and, in the field's metadata, its command-line flag and help. The CLI's flags are derived
from the fields (`add_flags`), and the values read back into the class (`from_flags`), so a
new setting is written in one place and no default is written twice.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs

from proto_server.core.ranges import Range, Validator

T = TypeVar("T")
FLAG = "proto_server.flag"


@attrs.frozen
class Flag:
    help: str
    #: The flag; None: `--` and the field's name, `_s` dropped, `_` as `-` (`suspend_timeout_s`
    #: is `--suspend-timeout`).
    name: str | None = None
    metavar: str | tuple[str, ...] | None = None
    #: How many of the field's unit one of the flag's is (MiB for a field in bytes).
    unit: float = 1
    #: Reads one value of the flag where the field's type cannot (a pair, a list of names).
    parse: Callable[[str], Any] | None = None
    #: Values the flag takes at once (a pair given as `MIN MAX`); None: one.
    nargs: int | None = None
    #: The flag must be given (the field's default, None, stands for no value yet).
    required: bool = False


def setting(
    default: Any,
    validator: Validator | None = None,
    *,
    help: str,
    flag: str | None = None,
    metavar: str | tuple[str, ...] | None = None,
    unit: float = 1,
    parse: Callable[[str], Any] | None = None,
    nargs: int | None = None,
    required: bool = False,
) -> Any:
    """An attrs field that is also a command-line flag (of `serve`, or of a benchmark)."""
    return attrs.field(
        default=default,
        validator=validator,
        metadata={FLAG: Flag(help, flag, metavar, unit, parse, nargs, required)},
    )


def flag_name(field: attrs.Attribute[Any]) -> str | None:
    flag = field.metadata.get(FLAG)
    if flag is None:
        return None
    return flag.name or "--" + field.name.removesuffix("_s").replace("_", "-")


def flag_of(classes: tuple[type, ...], name: str) -> str:
    """The flag that sets the field `name` of one of `classes` (for errors that name it)."""
    for cls in classes:
        for field in attrs.fields(cls):
            if field.name == name and (flag := flag_name(field)) is not None:
                return flag
    return name


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field of `cls` that declares one: its type from the field's, its default
    the field's (in the flag's unit); a bool is `--x` / `--no-x`, a tuple a repeatable flag, a
    range over names offers them. Ranges are the class's own: they are checked when
    `from_flags` builds it, and the error names the flag."""
    defaults = cls()
    for field in attrs.fields(cls):
        flag = field.metadata.get(FLAG)
        if flag is None:
            continue
        default = getattr(defaults, field.name)
        options: dict[str, Any] = {"dest": field.name, "help": flag.help}
        if flag.required:
            options["required"] = True
        kind = _kind(str(field.type))
        if flag.parse is not None or flag.nargs is not None:  # read as the field declares
            shown = default if default is None or flag.unit == 1 else default / flag.unit
            options.update(
                type=flag.parse or float, default=shown, metavar=flag.metavar, nargs=flag.nargs
            )
        elif kind is bool:
            options.update(action=argparse.BooleanOptionalAction, default=default)
        elif kind is tuple:  # given again, another value; none given: the field's default
            options.update(action="append", default=None, metavar=flag.metavar)
        else:
            shown = default if default is None or flag.unit == 1 else kind(default / flag.unit)
            choices = field.validator.choices if isinstance(field.validator, Range) else None
            metavar = flag.metavar or _metavar(field.name, kind, choices)
            # a flag in another unit than its field says its range in its own: positive
            parse = kind if flag.unit == 1 else _positive(kind)
            options.update(type=parse, default=shown, metavar=metavar)
        parser.add_argument(flag_name(field), **options)  # type: ignore[arg-type]


def range_of(field: attrs.Attribute[Any]) -> str | None:
    """What the field's range allows, in words (None: any value of its type)."""
    return field.validator.says if isinstance(field.validator, Range) else None


def _kind(annotation: str) -> type:
    """The flag's type from the field's annotation (a string: the modules postpone them)."""
    bare = annotation.removesuffix(" | None")
    kinds: dict[str, type] = {"bool": bool, "int": int, "float": float, "Path": Path}
    return tuple if bare.startswith("tuple[") else kinds.get(bare, str)


def _metavar(name: str, kind: type, choices: tuple[str, ...] | None) -> str | None:
    if choices is not None:
        return "{" + ",".join(choices) + "}"
    if name.endswith("_s"):
        return "SECONDS"
    return "N" if kind is int else None


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def from_flags(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """`cls` from the parsed flags (each in its field's unit) and `given` values; raises
    `InvalidSetting` naming the field of a value out of range."""
    values = dict(given)
    for field in attrs.fields(cls):  # type: ignore[arg-type]
        flag = field.metadata.get(FLAG)
        if flag is not None and field.name not in values:
            value = getattr(args, field.name)
            if isinstance(value, list):  # a repeatable flag, or one of several values
                value = tuple(value)
            elif value is None and _kind(str(field.type)) is tuple:
                continue  # not given: the field's default
            if value is not None and flag.unit != 1:  # into the field's unit, and its type
                value = _kind(str(field.type))(value * flag.unit)
            values[field.name] = value
    return cls(**values)
