"""The allowed range of each numeric setting, written once, as attrs validators on the class
that holds the setting (ServerConfig, TimingModel).

A value out of range raises `InvalidSetting`, which names the field, so the command line can
name its flag; a bad setting is refused at start-up instead of misbehaving later (a queue of
`0` read as unlimited, `-1` crashing every WebSocket after its 101).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


class InvalidSetting(ValueError):
    """A setting outside its range: `field` is the attribute, `why` says what is allowed."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field} {why}")
        self.field = field
        self.why = why


def at_least(low: float) -> Validator:
    """`low` or more (NaN is refused: it compares false with everything)."""

    def check(_: Any, attribute: attrs.Attribute[Any], value: float | None) -> None:
        if value is not None and not value >= low:
            raise InvalidSetting(attribute.name, f"must be at least {_number(low)}, got {value}")

    return check


def positive(_: Any, attribute: attrs.Attribute[Any], value: float | None) -> None:
    """More than 0; None (the setting is off) passes."""
    if value is not None and not value > 0:
        raise InvalidSetting(attribute.name, f"must be positive, got {value}")


def between(low: float, high: float) -> Validator:
    """From `low` to `high`, both included."""

    def check(_: Any, attribute: attrs.Attribute[Any], value: float) -> None:
        if not low <= value <= high:
            raise InvalidSetting(
                attribute.name, f"must be between {_number(low)} and {_number(high)}, got {value}"
            )

    return check


def one_of(choices: tuple[str, ...]) -> Validator:
    """One of `choices`."""

    def check(_: Any, attribute: attrs.Attribute[Any], value: str) -> None:
        if value not in choices:
            raise InvalidSetting(
                attribute.name, f"must be one of {', '.join(choices)}, got {value!r}"
            )

    return check
