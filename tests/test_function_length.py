"""The house's function-length rule: at most 60 lines in the kernel (``core/``), 80 in the rest of the package.

A function's length runs from its ``def`` line through the last line of its body (decorators excluded, its
docstring, comments and blank lines included), as ``scripts/house_report.py`` measures it. A longer function is
split into named steps; a long declarative table becomes data, not one function.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("house_report", ROOT / "scripts" / "house_report.py")
assert _spec is not None and _spec.loader is not None
house_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(house_report)

#: The longest a function may be, per top-level source folder; every other package folder gets ``DEFAULT_LIMIT``.
LIMITS = {"core": 60}
DEFAULT_LIMIT = 80


def limit_of(where: str) -> int:
    """The limit of the function at ``where`` (``"path:line name"``, path relative to the repository root)."""
    return LIMITS.get(Path(where.split(":")[0]).parts[0], DEFAULT_LIMIT)


def test_no_function_is_longer_than_its_limit() -> None:
    offenders = [
        f"{where} is {length} lines (limit {limit_of(where)})"
        for length, where in house_report.function_lengths()
        if length > limit_of(where)
    ]
    assert not offenders, "functions over the house limit; split them:\n" + "\n".join(offenders)


def test_the_measure_counts_def_through_body(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = '''import functools


@functools.cache
def decorated(x):
    """Doc."""

    # a comment
    return x


class Holder:
    def method(self):
        def inner():
            return 1
        return inner()

    async def coroutine(
        self,
    ):
        pass
'''
    (tmp_path / "core").mkdir()
    (tmp_path / "core" / "sample.py").write_text(source, encoding="utf-8")
    monkeypatch.setattr(house_report, "ROOT", tmp_path)
    monkeypatch.setattr(house_report, "PACKAGES", {"core": "vllite"})
    assert sorted(house_report.function_lengths()) == [
        (2, "core/sample.py:14 inner"),
        (4, "core/sample.py:13 method"),
        (4, "core/sample.py:18 coroutine"),
        (5, "core/sample.py:5 decorated"),
    ]


def test_the_measure_covers_every_package_folder() -> None:
    assert set(house_report.PACKAGES) >= {"core", "plugins", "schedulers", "builtin_logitsprocs", "vllite_kernels"}
    folders = {Path(where.split(":")[0]).parts[0] for _, where in house_report.function_lengths()}
    assert folders == set(house_report.PACKAGES)
    assert limit_of("core/engine/llm.py:1 f") == 60
    assert limit_of("plugins/x.py:1 f") == limit_of("vllite_kernels/x.py:1 f") == 80
