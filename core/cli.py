"""The ``vllite`` console script and ``python -m vllite.cli``: forwards to the builtin command line,
:mod:`vllite.plugins.commands.main`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``vllite`` command (see :func:`vllite.plugins.commands.main.main`); returns the exit code."""
    from vllite.plugins.commands.main import main as run

    return run(argv)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``vllite`` parser (see :func:`vllite.plugins.commands.main.build_parser`)."""
    from vllite.plugins.commands.main import build_parser as build

    return build(argv)


if __name__ == "__main__":
    raise SystemExit(main())
