"""Weight-only quantized checkpoints on the CPU: compressed-tensors W8A16 / W4A16 and GPTQ 4-bit, kept packed.

Each checkpoint is made from a tiny Llama (or Qwen2, for biases) in the test (see ``tests/quant_checkpoints.py``);
the oracle is Hugging Face on the same weights dequantized by the test's own code: greedy tokens equal
``generate()``, logprobs within a stated tolerance, in float32 and bfloat16 activations. Corrupt or unsupported
configs fail at start-up naming the field.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.quant_checkpoints import dequantize_folder, make_llmcompressor, write_compressed_tensors, write_gptq
from vllite import LLM, SamplingParams
from vllite.exceptions import ModelLoadError, VlliteError
from vllite.kernels import cpu_linear
from vllite.model_files import load_hf_config
from vllite.plugins.transformers_executor.model_loader import load_model
from vllite.plugins.transformers_executor.quantization import Int4WeightLinear, Int8WeightLinear
from vllite.testing import make_tiny_model

HAS_LLMCOMPRESSOR = importlib.util.find_spec("llmcompressor") is not None
needs_llmcompressor = pytest.mark.skipif(not HAS_LLMCOMPRESSOR, reason="llm-compressor is not installed")
MAX_TOKENS = 8
# Logprob tolerance against HF on the dequantized weights: float32 kernels differ from a dense float32 matmul by
# summation order only (measured max 4.3e-6); bfloat16 rounds the scales (and int4 zeros) and activations to
# bfloat16 on both sides in different places (measured max 0.063 over the cases here).
LOGPROB_TOL = {torch.float32: 1e-4, torch.bfloat16: 0.15}
# Near-ties: in bfloat16 a greedy step whose HF top-2 margin is below this may flip; the sequence stops there.
TIE_MARGIN = 0.1

CASES = {
    "llmcompressor-W8A16": pytest.param("llmcompressor-W8A16", marks=needs_llmcompressor),
    "llmcompressor-W4A16": pytest.param("llmcompressor-W4A16", marks=needs_llmcompressor),
    "ct-w4-group64-pack": "ct-w4-group64-pack",
    "ct-w8-channel-int": "ct-w8-channel-int",
    "gptq-g32-desc_act-asym": "gptq-g32-desc_act-asym",
    "gptq-channel-sym-bias": "gptq-channel-sym-bias",
}


def _base(root: Path, arch: str) -> Path:
    return make_tiny_model(arch, root / f"base-{arch}", seed=3, hidden_size=128, num_layers=2, initializer_range=0.1)


def _make_case(name: str, root: Path) -> Path:
    out = root / name
    if name.startswith("llmcompressor-"):
        return make_llmcompressor(_base(root, "llama"), out, name.split("-")[1])
    if name == "ct-w4-group64-pack":
        return write_compressed_tensors(_base(root, "llama"), out, bits=4, group_size=64, fmt="pack-quantized")
    if name == "ct-w8-channel-int":
        return write_compressed_tensors(_base(root, "llama"), out, bits=8, group_size=None, fmt="int-quantized")
    if name == "gptq-g32-desc_act-asym":
        return write_gptq(_base(root, "llama"), out, group_size=32, desc_act=True, sym=False)
    return write_gptq(_base(root, "qwen2"), out, group_size=-1, desc_act=False, sym=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quant")


@pytest.fixture(scope="module", params=list(CASES.values()))
def case(request, root) -> tuple[str, Path, Path]:
    name = request.param
    quant = _make_case(name, root)
    return name, quant, dequantize_folder(quant, root / f"{name}-dequantized")


def _prompts(n: int = 6) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(10, 4000) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _hf_greedy(folder: Path, prompts, dtype) -> list[tuple[list[int], list[torch.Tensor]]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]), generation_config=config, output_scores=True, return_dict_in_generate=True
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            results.append((tokens, [torch.log_softmax(s[0].float(), -1) for s in out.scores]))
    return results


def _check_against_hf(outputs, expected, dtype) -> int:
    """Greedy tokens equal HF's up to the first near-tie (never in float32), logprobs within tolerance; returns the
    number of tokens compared."""
    compared = 0
    for i, (output, (hf_tokens, hf_logprobs)) in enumerate(zip(outputs, expected)):
        completion = output.outputs[0]
        for pos, (ours, theirs) in enumerate(zip(completion.token_ids, hf_tokens)):
            top2 = hf_logprobs[pos].topk(2).values
            if ours != theirs:
                near_tie = dtype != torch.float32 and float(top2[0] - top2[1]) < TIE_MARGIN
                assert near_tie, f"prompt {i} token {pos}: {completion.token_ids} != HF {hf_tokens}"
                break
            ours_lp = completion.logprobs[pos][ours].logprob
            assert ours_lp == pytest.approx(float(hf_logprobs[pos][theirs]), abs=LOGPROB_TOL[dtype]), (i, pos)
            compared += 1
    return compared


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_generation_matches_hf_on_dequantized_weights(case, dtype):
    _, quant, reference = case
    prompts = _prompts()
    expected = _hf_greedy(reference, prompts, dtype)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    dtype_name = "float32" if dtype == torch.float32 else "bfloat16"
    with LLM(str(quant), dtype=dtype_name, max_model_len=128, max_num_seqs=4) as llm:
        with _FusedCalls() as calls:  # the engine runs in this process and thread (VLLITE_ENABLE_MULTIPROCESSING=0)
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        model = llm.llm_engine.engine_core.engine_core.model_executor.runner.model
        assert sum(isinstance(m, (Int4WeightLinear, Int8WeightLinear)) for m in model.modules()) == 14
    assert calls.count >= 14 * MAX_TOKENS  # every packed layer, at every decode step
    compared = _check_against_hf(outputs, expected, dtype)
    assert compared >= (len(prompts) * MAX_TOKENS if dtype == torch.float32 else len(prompts) * MAX_TOKENS // 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_packed_layers_replace_the_float_weights_and_the_fused_kernels_run(case, dtype):
    name, quant, _ = case
    model = load_model(str(quant), load_hf_config(str(quant)), dtype, torch.device("cpu"))
    packed = {n: m for n, m in model.named_modules() if isinstance(m, (Int4WeightLinear, Int8WeightLinear))}
    assert len(packed) == 14  # 2 layers x (q, k, v, o, gate, up, down)
    expected_cls = Int8WeightLinear if ("W8" in name or "w8" in name) else Int4WeightLinear
    assert all(type(m) is expected_cls for m in packed.values())
    float_linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert float_linears == ["lm_head"]
    for module in packed.values():  # no full-precision weight anywhere in a packed layer
        assert not hasattr(module, "weight")
        assert module.qweight.dtype in (torch.int8, torch.uint8)
    assert all(p.device.type == "cpu" for p in model.state_dict().values())
    with _FusedCalls() as calls, torch.no_grad():
        for module in packed.values():
            reference = module(torch.randn(3, module.in_features, dtype=dtype))
            assert reference.shape == (3, module.out_features) and reference.dtype == dtype
    assert calls.count == len(packed)  # one fused call per layer at a decode batch size


class _FusedCalls:
    """Counts the fused weight-only kernel calls made inside its block: vllite's compiled kernels (through counting
    wrappers) and torch's int8 one (through the profiler; the layers use it where the compiled kernel is missing)."""

    def __init__(self) -> None:
        self.compiled = 0
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._patch = pytest.MonkeyPatch()

    def __enter__(self) -> _FusedCalls:
        for name in ("int8_linear", "int4_linear"):
            self._patch.setattr(cpu_linear, name, self._counting(getattr(cpu_linear, name)))
        self._profiler.__enter__()
        return self

    def _counting(self, kernel):
        def counting(*args, **kwargs):
            y = kernel(*args, **kwargs)
            self.compiled += y is not None
            return y

        return counting

    def __exit__(self, *exc) -> None:
        self._profiler.__exit__(*exc)
        self._patch.undo()

    @property
    def count(self) -> int:
        counts = {e.key: e.count for e in self._profiler.key_averages()}
        return self.compiled + counts.get("aten::_weight_int8pack_mm", 0)


# ---------------------------------------------------------------------------------------------- config errors
@pytest.fixture(scope="module")
def ct_folder(root) -> Path:
    base = _base(root, "llama")
    return write_compressed_tensors(base, root / "ct-errors", bits=4, group_size=64, fmt="pack-quantized")


@pytest.fixture(scope="module")
def gptq_folder(root) -> Path:
    return write_gptq(_base(root, "llama"), root / "gptq-errors", group_size=32, desc_act=False, sym=True)


def _edited(folder: Path, tmp_path: Path, edit) -> Path:
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg["quantization_config"])
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _load(folder: Path, quantization: str | None = None):
    config = load_hf_config(str(folder))
    return load_model(str(folder), config, torch.float32, torch.device("cpu"), quantization=quantization)


def _weights(cfg):
    return cfg["config_groups"]["group_0"]["weights"]


CT_ERRORS = [
    (lambda c: c.update(quant_method="awq"), "quant_method='awq'"),
    (lambda c: _weights(c).update(type="float", num_bits=8), "config_groups.group_0.weights.type='float'"),
    (lambda c: c["config_groups"]["group_0"].update(input_activations={"num_bits": 8}), "input_activations"),
    (lambda c: _weights(c).update(symmetric=False), "config_groups.group_0.weights.symmetric=False"),
    (lambda c: _weights(c).update(num_bits=3), "config_groups.group_0.weights.num_bits=3"),
    (lambda c: _weights(c).pop("num_bits"), "config_groups.group_0.weights.num_bits is missing"),
    (lambda c: _weights(c).update(group_size=32), "group_size=32 does not fit"),
    (lambda c: _weights(c).update(strategy="block"), "strategy='block'"),
    (lambda c: c["config_groups"]["group_0"].update(format="float-quantized"), "format='float-quantized'"),
]
GPTQ_ERRORS = [
    (lambda c: c.update(bits=3), "quantization_config.bits=3"),
    (lambda c: c.pop("bits"), "quantization_config.bits is missing"),
    (lambda c: c.update(group_size=64), "group_size=64 does not fit"),
    (lambda c: c.update(checkpoint_format="marlin"), "checkpoint_format='marlin'"),
]


@pytest.mark.parametrize(("edit", "named"), CT_ERRORS, ids=[n for _, n in CT_ERRORS])
def test_unsupported_or_corrupt_compressed_tensors_config_fails_naming_the_field(ct_folder, tmp_path, edit, named):
    with pytest.raises(ModelLoadError, match=re.escape(named)):
        _load(_edited(ct_folder, tmp_path, edit))


@pytest.mark.parametrize(("edit", "named"), GPTQ_ERRORS, ids=[n for _, n in GPTQ_ERRORS])
def test_unsupported_or_corrupt_gptq_config_fails_naming_the_field(gptq_folder, tmp_path, edit, named):
    with pytest.raises(ModelLoadError, match=re.escape(named)):
        _load(_edited(gptq_folder, tmp_path, edit))


def test_quantization_flag_contradicting_the_checkpoint_names_both(ct_folder, root):
    with pytest.raises(ModelLoadError, match=r"quantization='gptq' contradicts .*quant_method='compressed-tensors'"):
        _load(ct_folder, "gptq")
    with pytest.raises(ModelLoadError, match=re.escape("quantization='awq' is not supported")):
        _load(ct_folder, "awq")
    with pytest.raises(ModelLoadError, match=r"quantization='gptq' was requested but .* has no quantization_config"):
        _load(_base(root, "llama"), "gptq")
    assert isinstance(_load(ct_folder, "compressed-tensors").model.layers[0].mlp.up_proj, Int4WeightLinear)


def test_llm_start_up_fails_on_an_unsupported_config(gptq_folder, tmp_path):
    folder = _edited(gptq_folder, tmp_path, lambda c: c.update(bits=8))
    with pytest.raises(VlliteError, match=re.escape("quantization_config.bits=8")):
        LLM(str(folder), max_model_len=64)
    with pytest.raises(VlliteError, match=re.escape("quantization='awq'")):
        LLM(str(gptq_folder), quantization="awq", max_model_len=64)
