"""The compiled linear kernels (dense float32/bfloat16, int8, int4) against torch, and each packed layer's
paths (the kernel at decode batch sizes; without it or for prefill, torch's ``_weight_int8pack_mm`` or the weight
dequantized for torch's matmul) against the float reference."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_support import assert_kernel_builds
from vllite.kernels import cpu_linear
from vllite.plugins.transformers_executor.quantization.formats import QuantizedWeight
from vllite.plugins.transformers_executor.quantization.linear import Int4WeightLinear, Int8WeightLinear


def _dequantized(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out_f, groups = scales.shape
    return (q.view(out_f, groups, -1).float() * scales.unsqueeze(-1)).view(out_f, -1)


def _weight(out_f: int, in_f: int, group_size: int, seed: int, bits: int = 8, zeros: bool = False) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    groups = -(-in_f // group_size)
    if bits == 8:
        q = torch.randint(-127, 128, (out_f, in_f), generator=gen, dtype=torch.int8)
    else:
        q = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.int32)
    scales = torch.rand(out_f, groups, generator=gen) / (50 if bits == 8 else 4) + 1e-3
    zero = torch.randn(out_f, groups, generator=gen) / 10 if zeros else None
    return QuantizedWeight(bits, q, scales, zero, group_size, None)


def _float_weight(w: QuantizedWeight) -> torch.Tensor:
    """The float32 weight ``w`` stands for, ``[out, in]``."""
    group = torch.arange(w.shape[1]) // w.group_size
    scale = w.scales[:, group]
    if w.bits == 8:
        return w.q.float() * scale
    zero = 0 if w.zeros is None else w.zeros[:, group]
    return (w.q.float() - 8) * scale + zero


@pytest.fixture
def kernel_switched(monkeypatch):
    """``switch(on)`` turns the compiled kernel on or off for the rest of the test."""

    def switch(on: bool) -> None:
        monkeypatch.setenv("VLLITE_CPU_LINEAR_KERNEL", "1" if on else "0")
        cpu_linear.linear_kernel.cache_clear()

    yield switch
    monkeypatch.delenv("VLLITE_CPU_LINEAR_KERNEL")
    cpu_linear.linear_kernel.cache_clear()


#: The kernel-vs-reference tests need the kernel; the next test fails where a compiler is found but the build fails.
needs_kernel = pytest.mark.skipif(cpu_linear.linear_kernel() is None, reason="the kernel could not be built here")


def test_the_kernel_builds_where_a_compiler_is_found(monkeypatch):
    assert_kernel_builds(monkeypatch, cpu_linear.linear_kernel, "VLLITE_CPU_LINEAR_KERNEL")


@pytest.mark.parametrize(("out_f", "in_f", "group_size"), [(48, 32, 32), (96, 256, 256), (80, 512, 128), (33, 96, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 16])
@needs_kernel
def test_kernel_equals_the_dequantized_matmul(out_f, in_f, group_size, rows):
    """Every tile of activation rows (4, then 3, 2 or 1) and one or several groups per row."""
    w = _weight(out_f, in_f, group_size, seed=rows)
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(1))
    y = cpu_linear.int8_linear(x, w.q, w.scales, group_size)
    assert y is not None and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ _dequantized(w.q, w.scales).T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("out_f", "in_f", "group_size"), [(48, 32, 32), (96, 256, 256), (80, 512, 128), (33, 96, 32)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 16])
@needs_kernel
def test_int4_kernel_equals_the_dequantized_matmul(out_f, in_f, group_size, rows):
    w = _weight(out_f, in_f, group_size, seed=rows, bits=4, zeros=True)
    offsets = (w.zeros - 8 * w.scales).contiguous()
    x = torch.randn(rows, in_f, generator=torch.Generator().manual_seed(1))
    y = cpu_linear.int4_linear(x, cpu_linear.pack_int4(w.q), w.scales, offsets, group_size)
    assert y is not None and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ _float_weight(w).T, rtol=1e-5, atol=1e-4)


def test_int4_packing_round_trips():
    codes = torch.randint(0, 16, (5, 64), generator=torch.Generator().manual_seed(0))
    packed = cpu_linear.pack_int4(codes)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(codes[0, 0]) | int(codes[0, 8]) << 4  # byte j: columns j and j + 8
    assert torch.equal(cpu_linear.unpack_int4(packed), codes.to(torch.uint8))


def test_what_the_kernel_does_not_take_is_left_to_the_caller():
    w = _weight(16, 64, 32, seed=0)
    too_many_rows = torch.randn(cpu_linear.MAX_ROWS + 1, 64)
    assert cpu_linear.int8_linear(too_many_rows, w.q, w.scales, 32) is None
    odd_groups = _weight(16, 48, 16, seed=0)
    assert cpu_linear.int8_linear(torch.randn(1, 48), odd_groups.q, odd_groups.scales, 16) is None


@pytest.mark.parametrize(("in_f", "group_size"), [(72, 72), (128, 32), (48, 16)], ids=["channel", "groups", "odd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_layer_gives_one_answer_on_every_path(kernel_switched, in_f, group_size, dtype):
    """Per-channel scales (72 columns, padded to 96 for the kernel), group-wise scales, and groups of 16 (not the
    kernel's: dequantized); a decode batch and a prefill-sized one; kernel on and off; bias and activation dtype."""
    w = _weight(40, in_f, group_size, seed=in_f)
    bias = torch.randn(40)
    reference = _dequantized(w.q, w.scales)
    gen = torch.Generator().manual_seed(2)
    for on in (True, False):
        kernel_switched(on)
        layer = Int8WeightLinear(w, bias, dtype)
        for rows in (3, cpu_linear.MAX_ROWS + 5):
            x = torch.randn(2, rows, in_f, generator=gen).to(dtype)
            y = layer(x)
            assert y.shape == (2, rows, 40) and y.dtype == dtype
            expected = x.float() @ reference.T + bias
            # Outputs near 8 in bfloat16 are rounded by about 0.03.
            tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 0.15}
            torch.testing.assert_close(y.float(), expected, **tol)


@pytest.mark.parametrize(
    ("in_f", "group_size", "zeros"),
    [(72, 72, False), (128, 32, True), (256, 128, False)],
    ids=["channel", "groups-zeros", "groups"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_int4_layer_gives_one_answer_on_every_path(kernel_switched, in_f, group_size, zeros, dtype):
    w = _weight(24, in_f, group_size, seed=in_f, bits=4, zeros=zeros)
    reference = _float_weight(w)
    gen = torch.Generator().manual_seed(3)
    for on in (True, False):
        kernel_switched(on)
        layer = Int4WeightLinear(w, None, dtype)
        for rows in (1, cpu_linear.MAX_ROWS + 5):
            x = torch.randn(rows, in_f, generator=gen).to(dtype)
            y = layer(x)
            assert y.shape == (rows, 24) and y.dtype == dtype
            tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 0.15}
            torch.testing.assert_close(y.float(), x.float() @ reference.T, **tol)


def test_an_int4_group_size_the_kernel_cannot_take_is_a_load_error():
    from vllite.exceptions import ModelLoadError

    with pytest.raises(ModelLoadError, match="groups of 16 input columns"):
        Int4WeightLinear(_weight(8, 64, 16, seed=0, bits=4), None, torch.float32)


@pytest.mark.parametrize(("out_f", "in_f"), [(40, 32), (33, 96), (128, 512)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@needs_kernel
def test_dense_kernel_equals_torch_linear(out_f, in_f, rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_f, in_f, generator=gen).to(dtype)
    x = torch.randn(rows, in_f, generator=gen)
    y = cpu_linear.dense_linear(x, weight)
    assert y is not None and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ weight.float().T, rtol=1e-5, atol=1e-4)  # float32 sums of the exact weights


def test_what_the_dense_kernel_does_not_take_is_left_to_the_caller():
    assert cpu_linear.dense_linear(torch.randn(1, 40), torch.randn(8, 40)) is None  # width not a multiple of 32
    assert cpu_linear.dense_linear(torch.randn(1, 64), torch.randn(8, 64).half()) is None
    assert cpu_linear.dense_linear(torch.randn(1, 64), torch.randn(64, 8).t()) is None  # not contiguous
    assert cpu_linear.dense_linear(torch.randn(cpu_linear.MAX_ROWS + 1, 64), torch.randn(8, 64)) is None
