"""``zeros_on_huge_pages``: the CPU KV-cache buffer is zeroed and, where Linux offers transparent huge pages on
request, its mapping is marked eligible for them."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from vllite.plugins.transformers_executor.huge_pages import zeros_on_huge_pages

_THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_flags(address: int) -> dict[str, str]:
    """The smaps fields of the mapping of this process that contains ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(part, 16) for part in head.split("-"))
            inside = low <= address < high
        elif inside and ":" in head:
            fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


def test_the_buffer_is_zeroed_with_the_shape_and_dtype_asked_for():
    buffer = zeros_on_huge_pages((3, 2, 64, 16, 4, 64), torch.float32)
    assert buffer.shape == (3, 2, 64, 16, 4, 64) and buffer.dtype == torch.float32
    assert not buffer.any()
    small = zeros_on_huge_pages((2, 3), torch.bfloat16)  # below one huge page: a plain allocation
    assert small.dtype == torch.bfloat16 and not small.any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _THP.exists(), reason="needs Linux huge pages")
def test_the_mapping_asks_for_huge_pages_where_the_kernel_offers_them():
    if "[never]" in _THP.read_text():
        pytest.skip("transparent huge pages are switched off on this machine")
    buffer = zeros_on_huge_pages((16, 1 << 20), torch.float32)  # 64 MiB
    middle = buffer.data_ptr() + buffer.numel() * buffer.element_size() // 2
    assert _mapping_flags(middle).get("THPeligible") == "1"
