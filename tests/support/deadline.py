"""The deadline every async test runs under (`conftest.py`), past which it fails naming itself."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing


def under_deadline(
    test: Callable[..., Awaitable[None]], seconds: float, name: str
) -> Callable[..., Awaitable[None]]:
    """`test` bounded: past `seconds` it fails saying so, rather than hang the suite."""
    if getattr(test, "deadline_s", None) is not None or not inspect.iscoroutinefunction(test):
        return test

    @functools.wraps(test)
    async def run(*args: Any, **kwargs: Any) -> None:
        with trio.move_on_after(seconds) as bounded:
            await test(*args, **kwargs)
        if bounded.cancelled_caught:
            pytest.fail(
                f"{name} ran past its {seconds:g} s deadline; whatever it awaited never came "
                "(give a slow test more with @pytest.mark.deadline(seconds))",
                pytrace=False,
            )

    run.deadline_s = seconds  # type: ignore[attr-defined]
    return run
