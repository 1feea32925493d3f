"""What the benchmarks' flags read beyond a number or a name (a pair, a comma-separated list),
and the ranges of such values, beside core/ranges.py's: each section's flags are the fields of
its settings class (core/settings.py's `setting`), as `serve`'s are."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from proto_server.core.ranges import Range


def _named(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    parse.__name__ = name  # argparse names the type in its error messages
    return parse


def _parts(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


#: Comma-separated numbers (`1000,4000`).
numbers = _named("numbers", lambda text: tuple(float(part) for part in _parts(text)))
#: Comma-separated whole numbers (`100,1000`).
counts = _named("counts", lambda text: tuple(int(part) for part in _parts(text)))
#: Comma-separated names (`http-stateless,ws-prototype`).
names = _named("names", lambda text: tuple(_parts(text)))


def _pair(text: str) -> tuple[float, float]:
    median, p99 = (float(part) for part in text.split(","))
    return median, p99


#: `MEDIAN,P99` of a log-normal (`1,15`).
median_p99 = _named("MEDIAN,P99", _pair)

#: A log-normal's median and 99th percentile: both positive and finite, the median no larger.
ordered_pair = Range(
    "MEDIAN,P99 with 0 < MEDIAN <= P99, finite", lambda pair: 0 < pair[0] <= pair[1] < math.inf
)
#: One or more rates (tokens/s), each positive and finite.
rates = Range(
    "one or more positive, finite rates", lambda values: bool(values) and all(
        0 < value < math.inf for value in values)
)  # fmt: skip
#: Whole numbers, one or more, each at least 1.
some_counts = Range(
    "one or more whole numbers of at least 1", lambda values: bool(values) and min(values) >= 1
)


def some_of(choices: tuple[str, ...]) -> Range:
    """One or more of `choices`, comma-separated."""
    return Range(
        f"a comma-separated subset of {','.join(choices)}",
        lambda values: bool(values) and all(value in choices for value in values),
    )


def checked(
    name: str, kind: Callable[[str], Any], ok: Callable[[Any], bool]
) -> Callable[[str], Any]:
    """A flag's reading for a value in another unit than its field's (so the field's range
    cannot say it): `kind(text)`, refused (argparse: exit 2) unless `ok`."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not ok(value):
            raise ValueError(text)
        return value

    return _named(name, parse)
