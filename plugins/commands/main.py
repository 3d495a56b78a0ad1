"""The ``vllite`` command: ``--version`` and the subcommands plugins contribute through the commands hook.

The console script and ``python -m vllite.cli`` run :func:`main` here (``vllite.cli`` forwards to it): the command
line is a builtin like the commands it lists, outside the kernel.

A failure prints one line, ``vllite: error: <cause>``, and nothing else of note: the engine process's log records
lose their tracebacks too (``VLLITE_LOG_TRACEBACKS=0``), since its start-up failure or fatal error reaches this
process as a value naming the cause. ``--debug`` (before or after the command) prints every traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Sequence

from vllite.logging_utils import TRACEBACKS_ENV, OneLineExceptionFilter, tracebacks_enabled
from vllite.version import __version__


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``vllite`` parser. With ``argv``, only the command it names gets its arguments (building another's may
    import its heavy modules, e.g. FastAPI for ``serve``); without, every command does."""
    from vllite.plugin_manager import get_registry

    commands = get_registry("commands")
    chosen = next((arg for arg in argv if arg in commands), None) if argv is not None else None
    parser = argparse.ArgumentParser(prog="vllite", description="A small, plugin-centric LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"vllite {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="On failure, print the tracebacks (also the engine process's)."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in sorted(commands.items()):
        sub = subparsers.add_parser(
            name, help=getattr(command, "help", None), description=getattr(command, "help", None)
        )
        if argv is None or name == chosen:
            command.add_arguments(sub)
        sub.set_defaults(_run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``vllite`` console script; returns the process exit code (1 on a failure, 2 on bad input,
    130 on Ctrl-C)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--version"]:  # answer without loading any plugin
        print(f"vllite {__version__}")
        return 0
    debug = _pop_debug_flag(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    argv[:end] = [_dashed(arg) if arg.startswith("--") else arg for arg in argv[:end]]
    previous = os.environ.get(TRACEBACKS_ENV)
    if debug or previous is None:
        os.environ[TRACEBACKS_ENV] = "1" if debug else "0"  # inherited by the engine process
    # This process logs through logging's last-resort handler unless the caller configured logging.
    quiet = OneLineExceptionFilter()
    last_resort = logging.lastResort if not tracebacks_enabled() else None
    if last_resort is not None:
        last_resort.addFilter(quiet)
    try:
        return _run(argv, debug)
    finally:
        if last_resort is not None:
            last_resort.removeFilter(quiet)
        if previous is None:
            os.environ.pop(TRACEBACKS_ENV, None)
        else:
            os.environ[TRACEBACKS_ENV] = previous


def _pop_debug_flag(argv: list[str]) -> bool:
    """Removes every ``--debug`` before a ``--`` (so it works after the command name too); True if there was one."""
    end = argv.index("--") if "--" in argv else len(argv)
    found = "--debug" in argv[:end]
    argv[:end] = [arg for arg in argv[:end] if arg != "--debug"]
    return found


def _dashed(flag: str) -> str:
    """vLLM's underscore spelling of a flag (``--max_model_len=N``) as the dashed one; a value is left alone."""
    name, sep, value = flag.partition("=")
    return name.replace("_", "-") + sep + value


def _run(argv: list[str], debug: bool) -> int:
    from vllite.exceptions import VlliteError

    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if not getattr(args, "_run", None):
            parser.print_help()
            return 0
        return int(args._run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: the command has stopped its engine on the way out
        print("vllite: interrupted", file=sys.stderr)
        return 130
    except (VlliteError, ValueError) as exc:
        _report(exc, debug)
        return 1 if isinstance(exc, VlliteError) else 2
    except Exception as exc:  # a bug or an unforeseen failure: still one line, the traceback with --debug
        _report(exc, debug, unexpected=True)
        return 1


def _report(exc: BaseException, debug: bool, *, unexpected: bool = False) -> None:
    if debug:
        traceback.print_exc(file=sys.stderr)
    message = f"{type(exc).__name__}: {exc}" if unexpected else str(exc)
    hint = " (run with --debug for the traceback)" if unexpected and not debug else ""
    print(f"vllite: error: {message}{hint}", file=sys.stderr)
