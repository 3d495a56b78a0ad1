"""Builds vllite's C++ CPU kernels once per machine and loads them from torch's extension cache afterwards.

Each kernel module is compiled with ``torch.utils.cpp_extension.load_inline`` (the C++ compiler torch was built with,
``-march=native``) under a name that carries a hash of its source and flags, so a changed kernel is rebuilt, never
loaded stale. A build is announced (which kernel, that it happens once) and timed at INFO, shown also where logging
is not set up. When no compiler is found or the build fails, :func:`load_cpp_module` returns ``None`` (logged once
by its cached caller) and the caller serves the torch path.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import pathlib
import shutil
import time
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["CFLAGS", "load_cpp_module", "module_name"]

#: Compiler flags. -fopenmp: at::parallel_for's OpenMP loop (torch's thread pool) is compiled in only with it;
#: fast-math lets dot products and exp vectorize (the inputs are finite; -inf is never formed).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]


def module_name(prefix: str, source: str) -> str:
    """``prefix`` plus a hash of ``source`` and the flags."""
    return prefix + hashlib.sha256("\0".join([source, *CFLAGS]).encode()).hexdigest()[:12]


def load_cpp_module(
    source_file: str,
    declarations: str,
    functions: list[str] | None,
    what: str,
    switch: str,
    *,
    after: tuple[str, ...] = (),
) -> Any | None:
    """The compiled module of ``source_file`` (a C++ file beside this one; the module is ``vllite_<stem>_<hash>``),
    from an earlier build, else built now; ``None`` when it cannot be built or the environment variable ``switch`` is
    ``0``. ``what`` names the kernel in the log lines. ``after`` names C++ files beside this one compiled first in
    the same translation unit (``source_file`` uses their routines); ``functions=None`` means ``source_file`` binds
    itself (its own ``PYBIND11_MODULE``)."""
    if os.environ.get(switch, "1") == "0":
        return None
    here = pathlib.Path(__file__).parent
    path = here / source_file
    source = "\n".join([*((here / f).read_text() for f in after), path.read_text()])
    name = module_name(f"vllite_{path.stem}_", source)
    built = _load_built(name)
    if built is not None:
        return built
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        logger.warning("No C++ compiler found: %s uses the torch path.", what)
        return None
    from torch.utils.cpp_extension import _get_build_directory, load_inline

    log = _build_logger()
    log.info(
        "Compiling %s (%s) with the C++ compiler: this happens once per machine and can take a few minutes; later "
        "runs load it from %s.",
        what, name, _get_build_directory(name, verbose=False),
    )  # fmt: skip
    start = time.monotonic()
    try:
        module = load_inline(
            name=name,
            cpp_sources=[declarations, source] if declarations else [source],
            functions=functions,
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # a broken toolchain must not take the engine down: the torch path still works
        log.warning("Compiling %s failed after %.1f s (%s); using the torch path.", what, time.monotonic() - start, exc)
        return None
    log.info("Compiled %s in %.1f s.", what, time.monotonic() - start)
    return module


def _build_logger() -> logging.Logger:
    """This module's logger, made to show its INFO lines: a first build takes minutes, and a silent start-up looks
    like a hang. Its level becomes INFO unless one was set for it, and where no handler would print the lines
    (nothing configured logging, as under the ``vllite`` CLI) they go to standard error."""
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    if not logger.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [vllite.kernels] %(message)s"))
        logger.addHandler(handler)
    return logger


def _load_built(name: str) -> Any | None:
    """The module from an earlier build, imported directly (``load_inline`` would re-check the build, ~1 s)."""
    from torch.utils.cpp_extension import _get_build_directory

    path = os.path.join(_get_build_directory(name, verbose=False), f"{name}.so")
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:
        return None  # built for another torch: rebuild
    return module
