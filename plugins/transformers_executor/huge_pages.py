"""Large CPU buffers backed by transparent huge pages.

The KV cache is read block by block in an order the block tables decide, so on the CPU its reads jump between
16-64 KiB pieces of a buffer of hundreds of megabytes; with 4 KiB pages nearly every piece costs TLB misses as
well as cache misses (a decode-attention pass over shuffled blocks ran 14% faster on 2 MiB pages here). Linux
gives huge pages to a range that asks for them with ``madvise(MADV_HUGEPAGE)`` before its pages are first touched
(the default ``madvise`` mode of transparent huge pages); elsewhere this is a plain ``torch.zeros``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["zeros_on_huge_pages"]

_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> Any:  # the libc function, or None off Linux
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose whole 2 MiB pages inside it are huge pages where the kernel allows (best effort:
    a refusal only costs the speed-up)."""
    buffer = torch.empty(shape, dtype=dtype)
    madvise = _madvise()
    nbytes = buffer.numel() * buffer.element_size()
    if madvise is not None and nbytes >= 2 * _HUGE_PAGE:
        start = -(-buffer.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
        end = (buffer.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end > start and madvise(start, end - start, _MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d): the KV cache uses 4 KiB pages", ctypes.get_errno())
    return buffer.zero_()
