"""The allowed range of each setting, written once, as attrs validators on the class that holds
the setting (ServerConfig, TimingModel, StoreRetention, Launch).

A value out of range raises `InvalidSetting`, which names the field, so the command line can
name its flag; a bad setting is refused at start-up instead of misbehaving later (a queue of
`0` read as unlimited, `-1` crashing every WebSocket after its 101). Each range also says what
it allows in words (`Range.says`), which the flag reference prints beside the flag.
"""

from __future__ import annotations

import math
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


@attrs.frozen
class Range:
    """An attrs validator that can say what it allows; None (a setting that is off) passes."""

    #: What is allowed, to follow "must be" ("at least 1", "between 0 and 65535").
    says: str
    allows: Callable[[Any], bool]
    #: For a range over names: the names, so a flag can offer them.
    choices: tuple[str, ...] | None = None

    def __call__(self, _: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is not None and not self.allows(value):
            got = repr(value) if isinstance(value, str) else value
            raise InvalidSetting(attribute.name, f"must be {self.says}, got {got}")


def at_least(low: float) -> Range:
    """`low` or more (NaN is refused: it compares false with everything)."""
    return Range(f"at least {_number(low)}", lambda value: value >= low)


positive = Range("positive", lambda value: value > 0)
positive_finite = Range("positive and finite", lambda value: 0 < value < math.inf)


def between(low: float, high: float) -> Range:
    """From `low` to `high`, both included."""
    return Range(f"between {_number(low)} and {_number(high)}", lambda value: low <= value <= high)


def one_of(choices: tuple[str, ...]) -> Range:
    """One of `choices`."""
    return Range(f"one of {', '.join(choices)}", lambda value: value in choices, choices)
