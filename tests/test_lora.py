"""LoRA adapters end to end: greedy outputs equal Hugging Face ``PeftModel.generate()`` per request.

One batch mixes several adapters (different ranks and target modules) and the base model, in-process and in the
engine-core process, with chunked prefill, with preemptions, and with fewer adapter slots than adapters in flight.
Also: the prefix cache never shares blocks across adapters, and a bad adapter fails only its own request.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from vllite import LLM, SamplingParams
from vllite.lora import LoRARequest
from vllite.testing import make_tiny_model_dir_cached

peft = pytest.importorskip("peft")

MAX_TOKENS = 10
# name -> (rank, alpha, target modules); ids follow the order.
ADAPTERS = {
    "attn-r8": (8, 16, ["q_proj", "v_proj"]),
    "all-r16": (16, 32, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp-emb-r8": (8, 8, ["gate_proj", "down_proj", "embed_tokens"]),
    "o-up-r16": (16, 16, ["o_proj", "up_proj"]),
}


def _base_dir() -> str:
    return str(make_tiny_model_dir_cached("llama", intermediate_size=96))


def _make_adapter(base_dir: str, out: Path, seed: int, rank: int, alpha: int, targets: list[str]) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    base = _base_dir()
    requests = {}
    for i, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items()):
        path = _make_adapter(base, root / name, seed=100 + i, rank=rank, alpha=alpha, targets=targets)
        requests[name] = LoRARequest(name, i + 1, str(path))
    return requests


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 900) for _ in range(rng.randint(4, 40))] for _ in range(n)]


def _hf_greedy(prompt: list[int], lora: LoRARequest | None) -> list[int]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(_base_dir(), dtype=torch.float32, attn_implementation="eager")
    if lora is not None:
        model = peft.PeftModel.from_pretrained(model, lora.lora_path)
    model.eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=MAX_TOKENS, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def workload(adapters: dict[str, LoRARequest]) -> tuple[list[list[int]], list[LoRARequest | None], list[list[int]]]:
    """Twelve prompts over the four adapters and the base model, with Hugging Face's greedy tokens for each."""
    prompts = _prompts(12)
    choices: list[LoRARequest | None] = [None, *adapters.values()]
    loras = [choices[i % len(choices)] for i in range(len(prompts))]
    expected = [_hf_greedy(p, lora) for p, lora in zip(prompts, loras)]
    return prompts, loras, expected


def _generate(prompts, loras, **engine_kwargs):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine_kwargs = {
        "max_model_len": 128,
        "dtype": "float32",
        "enable_lora": True,
        "max_lora_rank": 16,
        **engine_kwargs,
    }
    with LLM(_base_dir(), **engine_kwargs) as llm:
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)


def test_the_adapters_change_the_output(workload) -> None:
    """Guards the oracle: every adapter's output differs from the base model's on the same prompt."""
    prompts, loras, _ = workload
    for prompt, lora in zip(prompts, loras):
        if lora is not None:
            assert _hf_greedy(prompt, lora) != _hf_greedy(prompt, None), lora.lora_name


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        pytest.param({"max_loras": 4}, id="in-process"),
        pytest.param({"max_loras": 4, "max_num_batched_tokens": 32}, id="chunked-prefill"),
        pytest.param({"max_loras": 2, "max_cpu_loras": 2}, id="two-slots-four-adapters"),
        pytest.param(
            {"max_loras": 4, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}, id="ngram-drafts"
        ),
        pytest.param(
            {"max_loras": 4, "num_gpu_blocks_override": 20, "block_size": 4, "max_model_len": 64}, id="preemption"
        ),
    ],
)
def test_mixed_batch_equals_peft(workload, engine_kwargs, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    prompts, loras, expected = workload
    outputs = _generate(prompts, loras, **engine_kwargs)
    for i, (output, want) in enumerate(zip(outputs, expected)):
        name = loras[i].lora_name if loras[i] is not None else "base"
        assert output.outputs[0].token_ids == want, f"prompt {i} ({name})"
        assert output.lora_request == loras[i]


def test_mixed_batch_equals_peft_in_engine_process(workload, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")
    prompts, loras, expected = workload
    outputs = _generate(prompts, loras, max_loras=2, max_num_batched_tokens=48)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_prefix_cache_is_never_shared_across_adapters(adapters, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    prompt = {"prompt_token_ids": _prompts(1, seed=5)[0] * 2}  # 8-80 tokens: at least two full blocks
    a, b = adapters["attn-r8"], adapters["all-r16"]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with LLM(_base_dir(), dtype="float32", enable_lora=True, max_loras=2, block_size=4, max_model_len=128) as llm:
        first = llm.generate(prompt, params, lora_request=a, use_tqdm=False)[0]
        other_adapter = llm.generate(prompt, params, lora_request=b, use_tqdm=False)[0]
        base = llm.generate(prompt, params, use_tqdm=False)[0]
        same_adapter = llm.generate(prompt, params, lora_request=a, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert other_adapter.num_cached_tokens == 0
    assert base.num_cached_tokens == 0
    assert same_adapter.num_cached_tokens >= 8


def _broken_adapter(adapters: dict[str, LoRARequest], root: Path, name: str, how: str) -> LoRARequest:
    source = Path(adapters["attn-r8"].lora_path)
    folder = root / name
    folder.mkdir()
    config = json.loads((source / "adapter_config.json").read_text())
    weights = (source / "adapter_model.safetensors").read_bytes()
    if how == "rank":
        source = Path(adapters["all-r16"].lora_path)
        config = json.loads((source / "adapter_config.json").read_text())
        weights = (source / "adapter_model.safetensors").read_bytes()
    elif how == "target":
        config["target_modules"] = ["q_proj", "v_proj", "c_attn"]
        weights = weights.replace(b"q_proj", b"c_attn")
    elif how == "corrupt":
        weights = weights[: len(weights) // 3]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return LoRARequest(name, 50 + len(name), str(folder))


@pytest.mark.parametrize(
    ("how", "message"),
    [("missing", "does-not-exist"), ("rank", "rank"), ("target", "c_attn"), ("corrupt", "safetensors")],
)
def test_a_bad_adapter_fails_its_request_alone(adapters, tmp_path, monkeypatch, how, message) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    if how == "missing":
        bad = LoRARequest("missing", 99, str(tmp_path / "does-not-exist"))
    else:
        bad = _broken_adapter(adapters, tmp_path, f"bad-{how}", how)
    good = adapters["attn-r8"]
    prompts = [{"prompt_token_ids": p} for p in _prompts(3, seed=9)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with LLM(_base_dir(), dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=128) as llm:
        outputs = llm.generate(prompts, params, lora_request=[good, bad, None], use_tqdm=False)
        again = llm.generate(prompts[0], params, lora_request=good, use_tqdm=False)[0]
    assert outputs[1].outputs[0].finish_reason == "error"
    assert bad.lora_name in outputs[1].outputs[0].error and message in outputs[1].outputs[0].error
    assert [len(outputs[i].outputs[0].token_ids) for i in (0, 2)] == [4, 4]
    assert again.outputs[0].token_ids == outputs[0].outputs[0].token_ids


def test_adapter_utilities(adapters, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")
    a, b, c = adapters["attn-r8"], adapters["all-r16"], adapters["o-up-r16"]
    with LLM(_base_dir(), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2, max_model_len=64) as llm:
        assert llm.add_lora(a) is True
        assert llm.add_lora(a) is False  # already loaded
        assert llm.pin_lora(a.lora_int_id) is True
        assert llm.add_lora(b) is True and llm.list_loras() == {a.lora_int_id, b.lora_int_id}
        assert llm.add_lora(c) is True  # evicts b, the least recently used unpinned adapter
        assert llm.list_loras() == {a.lora_int_id, c.lora_int_id}
        assert llm.remove_lora(c.lora_int_id) is True and llm.list_loras() == {a.lora_int_id}
        assert llm.remove_lora(c.lora_int_id) is False
        # A request naming an unloaded adapter loads it.
        out = llm.generate([1, 2, 3], SamplingParams(max_tokens=2), lora_request=b, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 2 and b.lora_int_id in llm.list_loras()


def test_removing_an_adapter_in_use_is_refused_until_its_requests_finish(adapters, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    a = adapters["attn-r8"]
    with LLM(_base_dir(), dtype="float32", enable_lora=True, max_model_len=64) as llm:
        engine = llm.llm_engine
        engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3), lora_request=a)
        engine.step()
        with pytest.raises(ValueError, match="in use by 1 unfinished request"):
            llm.remove_lora(a.lora_int_id)
        while engine.has_unfinished_requests():
            engine.step()
        assert llm.remove_lora(a.lora_int_id) is True


def test_lora_request_errors(adapters, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    a = adapters["attn-r8"]
    with LLM(_base_dir(), dtype="float32", max_model_len=64) as llm:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            llm.generate([1, 2, 3], lora_request=a, use_tqdm=False)
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            llm.list_loras()
    lengths = r"lengths of prompts \(2\) and lora_request \(3\)"
    with (
        LLM(_base_dir(), dtype="float32", enable_lora=True, max_model_len=64) as llm,
        pytest.raises(ValueError, match=lengths),
    ):
        llm.generate([[1, 2], [3, 4]], lora_request=[a, a, None], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id must be > 0"):
        LoRARequest("x", 0, "/adapters/x")
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(_base_dir(), enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_adapters_survive_a_deep_sleep(adapters, workload, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    prompts, loras, expected = workload
    a = adapters["all-r16"]
    index = loras.index(a)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(
        _base_dir(), dtype="float32", enable_lora=True, max_lora_rank=16, max_model_len=128, enable_sleep_mode=True
    ) as llm:
        llm.add_lora(a)
        llm.sleep(level=2)
        llm.wake_up()
        assert llm.list_loras() == {a.lora_int_id}
        out = llm.generate({"prompt_token_ids": prompts[index]}, params, lora_request=a, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected[index]
