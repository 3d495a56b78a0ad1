"""Throwaway plugin distributions for tests: a ``*.dist-info`` with ``entry_points.txt`` on ``sys.path``."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path


def make_distribution(
    root: Path,
    dist_name: str,
    entry_points: dict[str, dict[str, str]],
    modules: dict[str, str],
    version: str = "1.0",
) -> Path:
    """Writes modules and a dist-info into ``root`` (which the caller puts on ``sys.path``)."""
    root.mkdir(parents=True, exist_ok=True)
    for module_name, source in modules.items():
        (root / f"{module_name}.py").write_text(textwrap.dedent(source))
    dist_info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    lines = []
    for group, eps in entry_points.items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {value}" for name, value in eps.items())
        lines.append("")
    (dist_info / "entry_points.txt").write_text("\n".join(lines))
    importlib.invalidate_caches()
    return root


def forget_modules(*names: str) -> None:
    for name in names:
        sys.modules.pop(name, None)
