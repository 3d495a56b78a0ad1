"""Helpers for the executor tests: tiny random models and a hand-driven scheduler (no tests here).

``ManualScheduler`` builds ``SchedulerOutput``s the way the real scheduler would, in the simplest possible way:
blocks are handed out sequentially from a free list, every running request is scheduled each step (up to a
per-request chunk size and a step budget), and tests can finish or preempt requests explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from vllite.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from vllite.sampling_params import SamplingParams
from vllite.sched.output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput

VOCAB = 97


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    """Tiny matmuls on a shared, busy CPU are ~100x faster on one thread than fighting over many."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model(arch: str, path: Path, seed: int = 0, **overrides: object) -> Path:
    """A random-weight causal LM (hidden 64, 2 layers, float32) saved to ``path``; peaky logits so greedy
    decoding is not decided by rounding noise."""
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.25,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    common.update(overrides)
    configs = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    }
    config_cls, model_cls = configs[arch]
    if arch in ("qwen3", "gemma2"):
        common.setdefault("head_dim", 16)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).to(torch.float32)
    model.save_pretrained(path)
    return path


def make_config(
    model_path: Path,
    *,
    num_blocks: int | None = 64,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_model_len: int | None = None,
    dtype: str = "float32",
    device: str = "auto",
    **cache: Any,
) -> EngineConfig:
    """A config for executor tests; ``num_blocks=None`` sizes the KV cache from ``cache`` (e.g.
    ``cpu_kvcache_space_gib``, with ``device="cpu"``)."""
    return EngineConfig(
        model_config=ModelConfig(model=str(model_path), dtype=dtype, max_model_len=max_model_len, seed=0),
        device_config=DeviceConfig(device=device),
        cache_config=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks, **cache),
        scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs),
    )


def hf_greedy(model_path: Path, prompt: list[int], max_new_tokens: int, **kwargs: object) -> list[int]:
    """Hugging Face ``generate()`` greedy continuation (eager attention, float32, no EOS stop): the oracle.

    ``kwargs`` go to the generation config (e.g. ``repetition_penalty``)."""
    import copy

    model = _hf_model(model_path)
    ids = torch.tensor([prompt])
    config = copy.deepcopy(model.generation_config)
    config.update(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0, **kwargs)
    config.eos_token_id = []  # never stop, never suppress EOS (None falls back to the model's EOS)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    assert out.shape[1] == len(prompt) + max_new_tokens
    return out[0, len(prompt) :].tolist()


_HF_CACHE: dict[str, torch.nn.Module] = {}


def _hf_model(model_path: Path) -> torch.nn.Module:
    import transformers

    key = str(model_path)
    if key not in _HF_CACHE:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="eager"
        )
        _HF_CACHE[key] = model.eval()
    return _HF_CACHE[key]


def hf_logprobs(model_path: Path, tokens: list[int]) -> torch.Tensor:
    """``log_softmax`` of HF's logits at every position of ``tokens`` ([len, vocab])."""
    with torch.no_grad():
        logits = _hf_model(model_path)(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@dataclass
class _Req:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    sent: bool = False  # the executor knows it

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


class ManualScheduler:
    """Schedules every running request each step; blocks come sequentially from a free list (0 is null). With
    ``num_groups`` KV-cache groups (a model mixing sliding and full layers, ``runner.layout.num_groups``) each token
    position takes one block per group, interleaved as the engine's scheduler sends them; none is freed early."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        *,
        chunk: int | None = None,
        budget: int | None = None,
        num_groups: int = 1,
    ) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.free = list(range(1, num_blocks))
        self.chunk = chunk
        self.budget = budget
        self.running: list[_Req] = []
        self.done: dict[str, list[int]] = {}
        self._finished: set[str] = set()
        self._preempted: set[str] = set()
        self.outputs: list[ModelRunnerOutput] = []

    def add(self, req_id: str, prompt: list[int], params: SamplingParams | None = None, max_tokens: int = 8) -> None:
        params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.running.append(_Req(req_id, list(prompt), params, max_tokens))

    def finish(self, req_id: str) -> None:
        req = next(r for r in self.running if r.req_id == req_id)
        self.running.remove(req)
        self.free += req.blocks
        self.done[req_id] = req.output
        self._finished.add(req_id)

    def preempt(self, req_id: str) -> None:
        req = next(r for r in self.running if r.req_id == req_id)
        self.free += req.blocks
        req.blocks, req.num_computed = [], 0
        self._preempted.add(req_id)
        req.sent = False  # resumed as a new request, with its output tokens

    def schedule(self, skip: set[str] = frozenset()) -> SchedulerOutput:
        new, cached = [], CachedRequestData()
        num_scheduled: dict[str, int] = {}
        budget = self.budget if self.budget is not None else 1 << 30
        for req in self.running:
            if req.req_id in skip or budget == 0:
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            if self.chunk is not None:
                n = min(n, self.chunk)
            needed = -(-(req.num_computed + n) // self.block_size) - len(req.blocks) // self.num_groups
            new_blocks = [self.free.pop(0) for _ in range(max(0, needed) * self.num_groups)]
            req.blocks += new_blocks
            num_scheduled[req.req_id] = n
            budget -= n
            if not req.sent:
                new.append(
                    NewRequestData(
                        req.req_id, req.prompt, req.params, list(req.blocks), req.num_computed, list(req.output)
                    )
                )
                req.sent = True
            else:
                cached.req_ids.append(req.req_id)
                cached.new_block_ids.append(new_blocks or None)
                cached.new_token_ids.append([])
                cached.num_computed_tokens.append(req.num_computed)
                cached.num_output_tokens.append(len(req.output))
        out = SchedulerOutput(
            new,
            cached,
            num_scheduled,
            sum(num_scheduled.values()),
            finished_req_ids=self._finished,
            preempted_req_ids=self._preempted,
        )
        self._finished, self._preempted = set(), set()
        return out

    def update(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        self.outputs.append(out)
        for req in list(self.running):
            if req.req_id not in so.num_scheduled_tokens:
                continue
            req.num_computed += so.num_scheduled_tokens[req.req_id]
            tokens = out.sampled_token_ids[out.req_id_to_index[req.req_id]]
            req.output += tokens
            if len(req.output) >= req.max_tokens:
                self.finish(req.req_id)

    def step(self, executor: object, skip: set[str] = frozenset()) -> ModelRunnerOutput:
        so = self.schedule(skip)
        out = executor.execute_model(so)  # type: ignore[attr-defined]
        self.update(so, out)
        return out

    def run(self, executor: object, max_steps: int = 500) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.running:
                break
            self.step(executor)
        assert not self.running, "requests did not finish"
        if self._finished:  # tell the executor, as the engine does on its next step
            executor.execute_model(self.schedule())  # type: ignore[attr-defined]
        return self.done
