"""What the compiled-kernel test modules share."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest


@contextmanager
def kernel_switch(
    monkeypatch: pytest.MonkeyPatch, loader: Callable[[], Any], variable: str, on: bool
) -> Iterator[None]:
    """The kernel ``loader`` (a cached loader) returns, turned on or off with the environment variable ``variable``
    inside the block; the variable is restored and the loader's cache cleared on the way in and out."""
    try:
        with monkeypatch.context() as patch:
            patch.setenv(variable, "1" if on else "0")
            loader.cache_clear()  # type: ignore[attr-defined]
            yield
    finally:
        loader.cache_clear()  # type: ignore[attr-defined]


def assert_kernel_builds(monkeypatch: pytest.MonkeyPatch, loader: Callable[[], Any], variable: str) -> None:
    """A machine with a C++ compiler builds the kernel ``loader`` returns, even where this run turned it off with
    ``variable``."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler on this machine: the torch path is used")
    with kernel_switch(monkeypatch, loader, variable, on=True):
        assert loader() is not None


def count_fused_steps(runner: Any) -> list[int]:
    """The batch size of every decode step ``runner``'s compiled decode step serves from now on (a list that grows;
    empty when the runner has none)."""
    served: list[int] = []
    fused = runner.fused_decoder
    if fused is None:
        return served

    def counting(*args: Any) -> Any:
        logits = fused(*args)
        if logits is not None:
            served.append(int(logits.shape[0]))
        return logits

    runner.fused_decoder = counting
    return served
