"""Float linear layers at decode batch sizes through the compiled CPU kernel: the same answer as ``nn.Linear`` on
every path, only the layers the kernel takes converted, and a loaded CPU model's layers converted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.kernel_support import kernel_switch
from vllite import LLM, SamplingParams
from vllite.kernels import cpu_linear
from vllite.kernels.cpu_decode_step import decode_step_kernel
from vllite.plugins.transformers_executor import decode_linear
from vllite.plugins.transformers_executor.decode_linear import DecodeLinear, use_decode_linears
from vllite.testing import make_tiny_model

needs_kernel = pytest.mark.skipif(cpu_linear.linear_kernel() is None, reason="the kernel could not be built here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_a_decode_linear_equals_nn_linear_at_every_batch_size(monkeypatch, dtype, bias):
    monkeypatch.setenv("VLLITE_CPU_PACKED_LINEAR", "0")  # bfloat16 through the compiled kernel, not oneDNN's
    torch.manual_seed(0)
    reference = nn.Linear(96, 40, bias=bias).to(dtype)
    model = nn.Sequential(nn.Linear(96, 40, bias=bias).to(dtype))
    model[0].load_state_dict(reference.state_dict())
    assert use_decode_linears(model) == 1 and type(model[0]) is DecodeLinear
    assert model[0].max_rows == (decode_linear.BF16_MAX_ROWS if dtype == torch.bfloat16 else cpu_linear.MAX_ROWS)
    calls = []
    original = cpu_linear.dense_linear
    monkeypatch.setattr(cpu_linear, "dense_linear", lambda *a: calls.append(1) or original(*a))
    for shape in [(1, 96), (3, 96), (2, 2, 96), (1, 16, 96), (1, 40, 96)]:
        x = torch.randn(shape).to(dtype)
        got, expected = model(x), reference(x)
        assert got.shape == expected.shape and got.dtype == dtype
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        torch.testing.assert_close(got.float(), expected.float(), **tol)
    rows = [1, 3, 4, 16, 40]
    assert len(calls) == sum(r <= model[0].max_rows for r in rows)  # prefill-sized inputs stay with torch


@needs_kernel
def test_only_the_layers_the_kernel_takes_are_converted(monkeypatch):
    monkeypatch.setenv("VLLITE_CPU_PACKED_LINEAR", "0")
    model = nn.Sequential(
        nn.Linear(64, 8),  # converted
        nn.Linear(40, 8),  # input width not a multiple of 32
        nn.Linear(64, 8).to(torch.bfloat16),  # converted, up to BF16_MAX_ROWS rows
        nn.Linear(64, 8).to(torch.float16),  # not a dtype the kernel reads
    )
    assert use_decode_linears(model) == 2
    assert [type(m) for m in model] == [DecodeLinear, nn.Linear, DecodeLinear, nn.Linear]
    assert isinstance(model[0], nn.Linear) and set(model[0].state_dict()) == {"weight", "bias"}


def test_without_the_kernel_nothing_is_converted(monkeypatch):
    monkeypatch.setenv("VLLITE_CPU_PACKED_LINEAR", "0")
    with kernel_switch(monkeypatch, cpu_linear.linear_kernel, "VLLITE_CPU_LINEAR_KERNEL", on=False):
        assert use_decode_linears(nn.Sequential(nn.Linear(64, 8))) == 0


needs_onednn_bf16 = pytest.mark.skipif(
    not decode_linear.onednn_bf16_linear_available(), reason="no oneDNN bfloat16 kernels on this CPU"
)


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_a_packed_bf16_linear_equals_nn_linear_at_every_batch_size(bias):
    """bfloat16 weights reordered once for oneDNN give what ``F.linear`` gives, at decode and prefill sizes, keep
    the plain weight (the state dict is the layer's); a float32 layer is not packed."""
    torch.manual_seed(0)
    reference = nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
    model = nn.Sequential(nn.Linear(96, 40, bias=bias).to(torch.bfloat16), nn.Linear(96, 40))
    model[0].load_state_dict(reference.state_dict())
    assert use_decode_linears(model) == 2
    assert type(model[0]) is decode_linear.PackedLinear and type(model[1]) is not decode_linear.PackedLinear
    assert set(model[0].state_dict()) == set(reference.state_dict())
    for shape in [(1, 96), (3, 96), (2, 2, 96), (1, 16, 96), (1, 300, 96)]:
        x = torch.randn(shape).to(torch.bfloat16)
        got, expected = model[0](x), reference(x)
        assert got.shape == expected.shape and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=2e-2)


@needs_kernel
def test_a_cpu_engine_decodes_through_the_kernel(tmp_path, monkeypatch):
    """The loaded model's projections and head are DecodeLinear, and its decode steps call the kernel (greedy
    equality with Hugging Face is tests/test_generation_equivalence.py's, on the same path). The fused decode step,
    which serves a Llama's decode steps without these modules, is off here."""
    folder = make_tiny_model("llama", tmp_path / "m", seed=4)
    with (
        kernel_switch(monkeypatch, decode_step_kernel, "VLLITE_CPU_DECODE_STEP", on=False),
        LLM(str(folder), max_model_len=128, device="cpu") as llm,
    ):
        model = llm.llm_engine.engine_core.engine_core.model_executor.runner.model  # in-process
        converted = [name for name, m in model.named_modules() if isinstance(m, DecodeLinear)]
        assert converted and all(type(m) is not nn.Linear for m in model.modules())
        calls = []
        original = cpu_linear.dense_linear
        monkeypatch.setattr(cpu_linear, "dense_linear", lambda *a: calls.append(1) or original(*a))
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert len(calls) >= 3 * len(converted)  # every converted layer at each of the three decode steps
