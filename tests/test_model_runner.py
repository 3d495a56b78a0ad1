"""The model runner end to end: seeds, logits processors, penalties against HF, failures, model plugins."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_executor_support import (
    VOCAB,
    ManualScheduler,
    hf_greedy,
    make_config,
    make_model,
    single_thread,  # noqa: F401  (autouse fixture)
)

from vllite.exceptions import AttentionRoutingError, ModelLoadError
from vllite.plugins.transformers_executor.executor import DefaultExecutor
from vllite.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("llama", tmp_path_factory.mktemp("m") / "llama", seed=1, initializer_range=0.08)


def _executor(path: Path, **kw: object) -> DefaultExecutor:
    ex = DefaultExecutor(make_config(path, **kw))
    ex.initialize_kv_cache()
    return ex


SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=10)
PROMPT = [11, 12, 13, 14, 15, 16, 17]


def _others(n: int) -> dict[str, tuple[list[int], SamplingParams]]:
    rng = random.Random(n)
    out = {}
    for i in range(n):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5]), seed=rng.choice([None, i]), max_tokens=10
        )
        out[f"o{i}"] = ([rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 12))], params)
    return out


def test_seeded_sampling_is_reproducible_across_batch_compositions(model_dir: Path) -> None:
    def run(others: int, chunk: int | None) -> list[int]:
        ex = _executor(model_dir, num_blocks=128)
        sched = ManualScheduler(4, 128, chunk=chunk)
        for req_id, (prompt, params) in _others(others).items():
            sched.add(req_id, prompt, params, max_tokens=10)
        sched.add("seeded", PROMPT, SEEDED, max_tokens=10)
        return sched.run(ex)["seeded"]

    alone = run(0, None)
    assert len(set(alone)) > 2  # it really samples
    assert run(0, None) == alone  # across runs
    assert run(5, None) == alone  # in a batch
    assert run(9, 3) == alone  # in another batch, with chunked prefill (partial chunks draw nothing)


def test_unseeded_sampling_uses_the_engine_seed(model_dir: Path) -> None:
    def run() -> list[int]:
        sched = ManualScheduler(4, 64)
        sched.add("u", PROMPT, SamplingParams(temperature=1.0, max_tokens=12), max_tokens=12)
        return sched.run(_executor(model_dir))["u"]

    assert run() == run()


@pytest.mark.parametrize("keep_state", [True, False])
def test_seeded_request_continues_its_stream_after_preemption(model_dir: Path, keep_state: bool) -> None:
    reference = ManualScheduler(4, 64)
    reference.add("s", PROMPT, SEEDED, max_tokens=10)
    expected = reference.run(_executor(model_dir))["s"]

    ex = _executor(model_dir)
    sched = ManualScheduler(4, 64, chunk=4)
    sched.add("s", PROMPT, SEEDED, max_tokens=10)
    for _ in range(5):
        sched.step(ex)
    sched.preempt("s")
    if not keep_state:  # an executor that never saw it: the generator is re-seeded and fast-forwarded
        ex = _executor(model_dir)
    assert sched.run(ex)["s"] == expected


def test_logits_processors_and_allowed_tokens_are_applied(model_dir: Path) -> None:
    greedy = hf_greedy(model_dir, PROMPT, 6)
    ex = _executor(model_dir)
    sched = ManualScheduler(4, 64)
    sched.add("bias", PROMPT, SamplingParams(temperature=0.0, logit_bias={42: 100.0}, max_tokens=4), max_tokens=4)
    sched.add(
        "allowed", PROMPT, SamplingParams(temperature=1.0, allowed_token_ids=[5, 6, 7], max_tokens=6), max_tokens=6
    )
    stop = greedy[0]
    sched.add(
        "min_tokens",
        PROMPT,
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop], max_tokens=6),
        max_tokens=6,
    )
    sched.add("min_p", PROMPT, SamplingParams(temperature=1.5, min_p=1.0, max_tokens=6), max_tokens=6)
    sched.add("top_k_1", PROMPT, SamplingParams(temperature=2.0, top_k=1, max_tokens=6), max_tokens=6)
    got = sched.run(ex)
    assert got["bias"] == [42] * 4
    assert set(got["allowed"]) <= {5, 6, 7}
    assert stop not in got["min_tokens"][:3] and got["min_tokens"][0] != greedy[0]
    assert got["min_p"] == greedy  # min_p=1 keeps only the most likely token
    assert got["top_k_1"] == greedy


def test_repetition_penalty_matches_hf(model_dir: Path) -> None:
    prompt = [5, 6, 5, 6, 5, 6, 9]
    expected = hf_greedy(model_dir, prompt, 8, repetition_penalty=1.8)
    assert expected != hf_greedy(model_dir, prompt, 8)  # the penalty matters for this prompt
    sched = ManualScheduler(4, 64, chunk=3)
    sched.add("r", prompt, SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=8), max_tokens=8)
    assert sched.run(_executor(model_dir))["r"] == expected


def test_forward_failure_raises(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ex = _executor(model_dir)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("boom: device lost")

    monkeypatch.setattr(ex.runner.model, "forward", broken)
    sched = ManualScheduler(4, 64)
    sched.add("x", PROMPT)
    with pytest.raises(RuntimeError, match="boom"):
        sched.step(ex)


def test_model_that_bypasses_our_attention_is_rejected(model_dir: Path) -> None:
    ex = _executor(model_dir)
    ex.runner.spec.num_layers = 3  # the model will only make 2 attention calls
    sched = ManualScheduler(4, 64)
    sched.add("x", PROMPT)
    with pytest.raises(AttentionRoutingError, match="attention 2 times for 3 layers"):
        sched.step(ex)


def test_model_class_from_vllite_register_models(tmp_path: Path) -> None:
    import transformers

    from vllite.hookspecs import hookimpl
    from vllite.plugin_manager import get_plugin_manager

    class TinyCustomForCausalLM(transformers.LlamaForCausalLM):
        loaded = 0

        def __init__(self, config: object) -> None:
            super().__init__(config)
            type(self).loaded += 1

    class Plugin:
        @hookimpl
        def vllite_register_models(self, register: object) -> None:
            register("TinyCustomForCausalLM", TinyCustomForCausalLM)  # type: ignore[operator]

    import json

    path = make_model("llama", tmp_path / "custom")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["TinyCustomForCausalLM"]  # save_pretrained wrote LlamaForCausalLM
    (path / "config.json").write_text(json.dumps(config))
    manager = get_plugin_manager()
    name = manager.register(Plugin(), "tiny-custom-models")
    try:
        ex = _executor(path)
        assert type(ex.runner.model) is TinyCustomForCausalLM and TinyCustomForCausalLM.loaded == 1
        sched = ManualScheduler(4, 64)
        sched.add("x", PROMPT, max_tokens=4)
        assert sched.run(ex)["x"] == hf_greedy(path, PROMPT, 4)
    finally:
        manager.unregister(name)
    with pytest.raises(ModelLoadError, match="Unsupported model architecture TinyCustomForCausalLM"):
        DefaultExecutor(make_config(path))


def test_prompt_logprobs_are_not_returned_twice_after_preemption(model_dir: Path) -> None:
    prompt = [9, 30, 31, 2, 77, 18, 18, 50, 61, 3]
    params = SamplingParams(temperature=0.0, prompt_logprobs=2, max_tokens=4)

    def collect(sched: ManualScheduler) -> torch.Tensor:
        chunks = [out.prompt_logprobs_dict["p"] for out in sched.outputs if "p" in out.prompt_logprobs_dict]
        return torch.cat([c.logprobs for c in chunks])

    plain = ManualScheduler(4, 64, chunk=4)
    plain.add("p", prompt, params, max_tokens=4)
    plain.run(_executor(model_dir))

    ex = _executor(model_dir)
    sched = ManualScheduler(4, 64, chunk=4)
    sched.add("p", prompt, params, max_tokens=4)
    for _ in range(4):  # the prompt is done and one token sampled
        sched.step(ex)
    sched.preempt("p")
    assert sched.run(ex)["p"] == plain.done["p"]  # recomputed 11+ tokens in chunks of 4
    assert collect(sched).shape == (9, 3)
    assert torch.allclose(collect(sched), collect(plain))
