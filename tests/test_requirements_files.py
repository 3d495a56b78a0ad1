"""``requirements-llmcompressor.txt`` is installed with ``--no-deps`` (README's test command, docs/cpu.md): it must list
every dependency its packages need that vllite's own install does not bring. A missing one (pandas' python-dateutil)
failed the first ``import llmcompressor`` of a clean install. Read from the installed packages' metadata."""

from __future__ import annotations

import importlib.metadata as metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# llmcompressor's declared dependencies that its data-free oneshot path (what the file is for) never imports.
NOT_IMPORTED = {"auto-round", "nvidia-ml-py", "pillow"}


def _requires(name: str) -> list[str]:
    dist = metadata.distribution(name)
    names = []
    for line in dist.requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            names.append(canonicalize_name(requirement.name))
    return names


def _closure(roots: list[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            try:
                stack.extend(_requires(name))
            except metadata.PackageNotFoundError:
                pass
    return seen


def test_the_no_deps_llmcompressor_requirements_list_what_vllite_does_not_bring() -> None:
    lines = (ROOT / "requirements-llmcompressor.txt").read_text(encoding="utf-8").splitlines()
    listed = {canonicalize_name(line.split("==")[0]) for line in lines if line.strip() and not line.startswith("#")}
    try:
        brought = _closure(["vllite"]) | listed
        missing = {
            f"{dep} (needed by {name})"
            for name in sorted(listed)
            for dep in _requires(name)
            if dep not in brought and not (name == "llmcompressor" and dep in NOT_IMPORTED)
        }
    except metadata.PackageNotFoundError as exc:
        pytest.skip(f"requirements-llmcompressor.txt is not installed here ({exc})")
    assert not missing, sorted(missing)
