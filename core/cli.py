"""The ``vllite`` command: ``--version`` and the subcommands plugins contribute through the commands hook."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from vllite.version import __version__


def build_parser() -> argparse.ArgumentParser:
    from vllite.plugin_manager import get_registry

    parser = argparse.ArgumentParser(prog="vllite", description="A small, plugin-centric LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"vllite {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in sorted(get_registry("commands").items()):
        sub = subparsers.add_parser(
            name, help=getattr(command, "help", None), description=getattr(command, "help", None)
        )
        command.add_arguments(sub)
        sub.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vllite`` console script; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # answer without loading any plugin
        print(f"vllite {__version__}")
        return 0
    from vllite.exceptions import VlliteError

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 0
        return int(args._run(args) or 0)
    except VlliteError as exc:
        print(f"vllite: error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"vllite: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
