"""What the compiled-kernel test modules share."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import pytest


def assert_kernel_builds(monkeypatch: pytest.MonkeyPatch, loader: Callable[[], Any], switch: str) -> None:
    """A machine with a C++ compiler builds the kernel ``loader`` (a cached loader) returns, even where this run turned
    it off with the environment variable ``switch``; the loader's cache is cleared on the way in and out."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: the torch path is used")
    monkeypatch.delenv(switch, raising=False)
    loader.cache_clear()  # type: ignore[attr-defined]
    try:
        assert loader() is not None
    finally:
        monkeypatch.undo()
        loader.cache_clear()  # type: ignore[attr-defined]
