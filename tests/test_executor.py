"""The default executor against Hugging Face: greedy ids, logprobs, prompt logprobs, batch changes, errors."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch
from test_executor_support import (
    VOCAB,
    ManualScheduler,
    hf_greedy,
    hf_logprobs,
    make_config,
    make_model,
    single_thread,  # noqa: F401  (autouse fixture)
)

from vllite.config import DeviceConfig
from vllite.exceptions import ExecutorAsleepError, ExecutorFailedError, KVCacheMemoryError, ModelLoadError
from vllite.executor import KVCacheInfo
from vllite.plugins.transformers_executor.executor import DefaultExecutor
from vllite.sampling_params import SamplingParams
from vllite.sched.output import SchedulerOutput

ARCHS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": 6},
    "gemma2": {"sliding_window": 6, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(arch, root / arch, **kw) for arch, kw in ARCHS.items()}


def _executor(path: Path, **kw: object) -> DefaultExecutor:
    ex = DefaultExecutor(make_config(path, **kw))
    ex.initialize_kv_cache()
    return ex


def _prompts(n: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 14))] for i in range(n)}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_mixed_batch_with_chunked_prefill_matches_hf(model_dirs: dict[str, Path], arch: str) -> None:
    path = model_dirs[arch]
    ex = _executor(path, num_blocks=128)
    # Prompts split over steps, budget shared; Gemma 2's sliding and global layers keep one block table each.
    sched = ManualScheduler(4, 128, chunk=5, budget=32, num_groups=ex.runner.layout.num_groups)
    assert ex.runner.layout.num_groups == (2 if arch == "gemma2" else 1)
    prompts = _prompts(16, seed=len(arch))
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, max_tokens=6)
    got = sched.run(ex)
    for req_id, prompt in prompts.items():
        assert got[req_id] == hf_greedy(path, prompt, 6), req_id
    # Partial prefill chunks returned no token.
    assert any([] in out.sampled_token_ids for out in sched.outputs)


def test_batch_size_one_matches_hf(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    ex = _executor(path)
    sched = ManualScheduler(4, 64)
    prompt = [5, 17, 33, 8, 91, 4, 4, 60]
    sched.add("only", prompt, max_tokens=12)
    assert sched.run(ex)["only"] == hf_greedy(path, prompt, 12)
    assert ex.runner.requests == {} and ex.runner.input_batch.num_reqs == 0  # finished ids were applied


def test_request_finished_mid_batch_condenses_and_others_match(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["qwen2"]
    ex = _executor(path)
    sched = ManualScheduler(4, 64)
    prompts = _prompts(5, seed=3)
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, max_tokens=7)
    for _ in range(3):
        sched.step(ex)
    sched.finish("r1")  # a hole in row 1: the last row moves into it
    sched.step(ex)
    batch = ex.runner.input_batch
    assert batch.num_reqs == 4 and "r1" not in batch.req_id_to_index
    assert batch.req_id_to_index["r4"] == 1
    got = sched.run(ex)
    for req_id, prompt in prompts.items():
        if req_id != "r1":
            assert got[req_id] == hf_greedy(path, prompt, 7), req_id


def test_preempted_request_resumes_with_its_output_tokens(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    ex = _executor(path)
    sched = ManualScheduler(4, 64, chunk=4)
    prompts = _prompts(3, seed=5)
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, max_tokens=8)
    for _ in range(6):
        sched.step(ex)
    victim = next(r for r in sched.running if r.output)
    sched.preempt(victim.req_id)
    sched.step(ex, skip={victim.req_id})  # preempted: not scheduled this step
    assert victim.req_id not in ex.runner.input_batch.req_id_to_index
    got = sched.run(ex)  # recomputes prompt + output tokens in chunks, then continues
    for req_id, prompt in prompts.items():
        assert got[req_id] == hf_greedy(path, prompt, 8), req_id


def test_unscheduled_request_leaves_and_rejoins_the_batch(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    ex = _executor(path)
    sched = ManualScheduler(4, 64)
    prompts = _prompts(3, seed=9)
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, max_tokens=6)
    sched.step(ex)
    sched.step(ex, skip={"r0"})
    assert "r0" not in ex.runner.input_batch.req_id_to_index
    got = sched.run(ex)
    for req_id, prompt in prompts.items():
        assert got[req_id] == hf_greedy(path, prompt, 6)


def test_logprobs_match_hf_log_softmax(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["qwen3"]
    ex = _executor(path)
    sched = ManualScheduler(4, 64, chunk=3)
    prompt = [7, 21, 44, 3, 9, 12, 80]
    # "c" is still in prefill (no token, so no logprobs row) while "a" already samples.
    sched.add("c", list(range(3, 30)), SamplingParams(temperature=0.0, logprobs=2, max_tokens=2), max_tokens=2)
    sched.add("a", prompt, SamplingParams(temperature=0.0, logprobs=5, max_tokens=5), max_tokens=5)
    sched.add("b", [4, 5, 6], SamplingParams(temperature=0.0, max_tokens=5), max_tokens=5)
    got = sched.run(ex)["a"]
    ref = hf_logprobs(path, prompt + got)
    rows = []
    skipped_c = False
    for out in sched.outputs:
        i = out.req_id_to_index.get("a")
        if i is not None and out.sampled_token_ids[i]:
            row = sum(len(tokens) for tokens in out.sampled_token_ids[:i])  # one row per sampled token
            assert len(out.logprobs.logprobs) == sum(len(tokens) for tokens in out.sampled_token_ids)
            rows.append((out.sampled_token_ids[i][0], out.logprobs, row))
            skipped_c |= row < i  # "c" sat before "a" without a row of its own
    assert skipped_c
    assert len(rows) == 5
    for k, (token, lp, i) in enumerate(rows):
        ids, values, rank = lp.logprob_token_ids[i], lp.logprobs[i], lp.sampled_token_ranks[i]
        expected = ref[len(prompt) - 1 + k]
        assert ids[0] == token and rank == 1  # greedy: the sampled token is the most likely
        assert len(ids) == 6
        top = torch.topk(expected, 5)
        assert ids[1:] == top.indices.tolist()
        assert torch.allclose(torch.tensor(values), expected[ids], atol=1e-4)


def test_prompt_logprobs_per_chunk_match_hf(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    ex = _executor(path)
    sched = ManualScheduler(4, 64, chunk=4)
    prompt = [9, 30, 31, 2, 77, 18, 18, 50, 61, 3]
    sched.add("p", prompt, SamplingParams(temperature=0.0, prompt_logprobs=3, max_tokens=2), max_tokens=2)
    sched.run(ex)
    chunks = [out.prompt_logprobs_dict["p"] for out in sched.outputs if "p" in out.prompt_logprobs_dict]
    assert [c.logprobs.shape[0] for c in chunks] == [4, 4, 1]  # 9 positions predict prompt tokens 1..9
    ids = torch.cat([c.logprob_token_ids for c in chunks])
    values = torch.cat([c.logprobs for c in chunks])
    ranks = torch.cat([c.selected_token_ranks for c in chunks])
    ref = hf_logprobs(path, prompt)[:-1]
    assert ids[:, 0].tolist() == prompt[1:]
    assert torch.allclose(values, ref.gather(1, ids), atol=1e-4)
    assert ids[:, 1:].tolist() == torch.topk(ref, 3).indices.tolist()
    expected_ranks = (ref >= ref.gather(1, ids[:, :1])).sum(-1)
    assert ranks.tolist() == expected_ranks.tolist()


def test_model_and_kv_cache_facts_are_reported_not_written(model_dirs: dict[str, Path]) -> None:
    cfg = make_config(model_dirs["llama"])
    ex = DefaultExecutor(cfg)
    assert ex.model_info.max_model_len == 256 and ex.model_info.vocab_size == cfg.model_config.hf_config.vocab_size
    assert cfg.model_config.hf_config.model_type == "llama"
    # 64 blocks of 4 tokens (one is the null block) hold 252 tokens: with no max_model_len given, the context shrinks.
    # Each block: 4 tokens x K+V x 2 layers x 2 KV heads x head dim 16 x float32 bytes.
    block_bytes = 4 * 2 * 2 * 2 * 16 * 4
    assert ex.initialize_kv_cache() == KVCacheInfo(num_blocks=64, max_model_len=252, num_bytes=64 * block_bytes)
    assert cfg.model_config.max_model_len is None and cfg.cache_config.num_gpu_blocks is None  # unchanged
    assert ex.max_concurrent_batches == 1
    assert DefaultExecutor(make_config(model_dirs["llama"], max_model_len=100)).model_info.max_model_len == 100
    with pytest.raises(ValueError, match="max_position_embeddings"):
        DefaultExecutor(make_config(model_dirs["llama"], max_model_len=257))


def test_kv_cache_sized_from_cpu_budget(model_dirs: dict[str, Path]) -> None:
    cfg = make_config(
        model_dirs["llama"], max_model_len=64, num_blocks=None, cpu_kvcache_space_gib=1 / 1024, device="cpu"
    )
    ex = DefaultExecutor(cfg)
    per_token = 2 * 2 * 2 * 16 * 4  # K+V, layers, kv heads, head dim, float32
    kv_cache = ex.initialize_kv_cache()
    assert kv_cache.num_blocks == (1 << 20) // (per_token * 4)
    key_cache, _ = ex.runner.kv_caches[0]
    assert key_cache.shape == (kv_cache.num_blocks, 4, 2, 16)
    # 8 KiB: 16 tokens, not one 256-token sequence. A length the user asked for is an error ...
    tiny = {"num_blocks": None, "cpu_kvcache_space_gib": 8 / 2**20, "device": "cpu"}
    with pytest.raises(KVCacheMemoryError, match="max_model_len=256"):
        DefaultExecutor(make_config(model_dirs["llama"], max_model_len=256, **tiny)).initialize_kv_cache()


def test_model_context_shrinks_to_a_small_kv_cache(model_dirs: dict[str, Path], caplog) -> None:
    # ... while the model's own limit shrinks to what fits (3 usable blocks of 4 tokens), naming both lengths.
    ex = DefaultExecutor(
        make_config(model_dirs["llama"], num_blocks=None, cpu_kvcache_space_gib=8 / 2**20, device="cpu")
    )
    with caplog.at_level("WARNING"):
        assert ex.initialize_kv_cache() == KVCacheInfo(num_blocks=4, max_model_len=12, num_bytes=8 * 2**10)
    assert "max_model_len=256" in caplog.text and "lowering max_model_len to 12" in caplog.text


def test_engine_reports_the_shrunk_context_and_the_frontend_enforces_it(model_dirs: dict[str, Path]) -> None:
    from vllite import LLM, SamplingParams

    nine_blocks = 9 * 4 * (2 * 2 * 2 * 16 * 4) / 2**30  # GiB: 9 blocks of 4 tokens, 8 usable
    llm = LLM(
        str(model_dirs["llama"]),
        cpu_kvcache_space=nine_blocks,
        block_size=4,
        dtype="float32",
        skip_tokenizer_init=True,
        device="cpu",
    )
    try:
        assert llm.llm_engine.engine_info.max_model_len == 32
        with pytest.raises(ValueError, match="maximum model length of 32"):
            llm.generate([list(range(1, 40))], SamplingParams(max_tokens=2), use_tqdm=False)
        out = llm.generate([list(range(1, 20))], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 32 - 19 and out[0].outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()


def test_model_load_errors(tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        DefaultExecutor(make_config(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        DefaultExecutor(make_config(tmp_path / "empty"))
    import transformers

    odd = tmp_path / "bert"
    transformers.BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        architectures=["BertForMaskedLM"],  # neither a causal LM nor a pooling model (BertModel runs as one)
    ).save_pretrained(odd)
    with pytest.raises(ModelLoadError, match="Unsupported model architecture BertForMaskedLM"):
        DefaultExecutor(make_config(odd))


def test_dtype_choices(model_dirs: dict[str, Path]) -> None:
    ex = DefaultExecutor(make_config(model_dirs["llama"], dtype="bfloat16"))
    assert next(ex.runner.model.parameters()).dtype == torch.bfloat16
    assert ex.initialize_kv_cache().num_blocks == 64
    assert ex.runner.kv_caches[0][0].dtype == torch.bfloat16
    sched = ManualScheduler(4, 64)
    sched.add("x", [3, 4, 5], max_tokens=3)
    assert len(sched.run(ex)["x"]) == 3
    ex = DefaultExecutor(make_config(model_dirs["llama"], dtype="auto"))
    assert ex.dtype == torch.float32


def test_scheduling_past_known_blocks_raises_and_empty_step(model_dirs: dict[str, Path]) -> None:
    ex = _executor(model_dirs["llama"])
    assert ex.execute_model(SchedulerOutput.make_empty()).req_ids == []
    sched = ManualScheduler(4, 64)
    sched.add("x", [3, 4, 5, 6, 7], max_tokens=3)
    so = sched.schedule()
    so.scheduled_new_reqs[0].block_ids = [1]  # 5 tokens need 2 blocks of 4
    with pytest.raises(ValueError, match="no KV block"):
        ex.execute_model(so)


def test_sleep_and_wake_up(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    ex = _executor(path)
    running = ManualScheduler(4, 64)
    running.add("y", [8, 9, 10], max_tokens=4)
    ex.execute_model(running.schedule())
    ex.sleep(1)
    assert ex.is_sleeping and not ex.runner.kv_caches
    ended = SchedulerOutput.make_empty()
    ended.finished_req_ids = {"y"}  # aborted while asleep: the engine's empty step hands it over, and nothing runs
    assert ex.execute_model(ended).req_ids == [] and "y" not in ex.runner.requests
    ended.total_num_scheduled_tokens = 1
    with pytest.raises(ExecutorAsleepError, match="sleeping"):
        ex.execute_model(ended)
    ex.wake_up(["kv_cache"])
    ex.wake_up(["weights"])
    assert not ex.is_sleeping and ex.runner.num_kv_blocks == 64
    ex.sleep(2)
    assert ex.runner.model is None
    ex.wake_up()
    sched = ManualScheduler(4, 64)
    sched.add("x", [8, 9, 10], max_tokens=4)
    assert sched.run(ex)["x"] == hf_greedy(path, [8, 9, 10], 4)
    ex.shutdown()
    ex.shutdown()


def test_failure_callbacks_and_health(model_dirs: dict[str, Path]) -> None:
    ex = _executor(model_dirs["llama"])
    calls: list[str] = []
    ex.register_failure_callback(lambda: calls.append("a"))
    ex.check_health()
    ex._report_failure()
    ex._report_failure()
    assert calls == ["a"]
    with pytest.raises(ExecutorFailedError, match="failed"):
        ex.check_health()
    ex.register_failure_callback(lambda: calls.append("late"))
    assert calls == ["a", "late"]


def test_registered_under_default_cpu_and_cuda() -> None:
    from vllite.plugin_manager import get_registry
    from vllite.plugins.transformers_executor.executor import CPUExecutor, CUDAExecutor

    registry = get_registry("executors")
    assert registry["default"] is DefaultExecutor
    assert registry["cpu"] is CPUExecutor and registry["cuda"] is CUDAExecutor


def test_import_vllite_executor_does_not_import_torch() -> None:
    import subprocess

    code = "import sys, vllite.executor, vllite.plugins.transformers_executor.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_transformers_builds_no_attention_mask_for_our_path(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AttentionInterface

    from vllite.plugins.transformers_executor import attention

    seen: list[object] = []

    def spy(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        seen.append(attention_mask)
        return attention.paged_attention_forward(module, query, key, value, attention_mask, **kwargs)

    for arch in ("llama", "gemma2"):  # gemma2 also has sliding-window layers
        ex = _executor(model_dirs[arch])
        ex.runner.fused_decoder = None  # the model's forward serves the decode steps too (see test_fused_decode.py)
        monkeypatch.setitem(AttentionInterface._global_mapping, attention.ATTN_IMPLEMENTATION, spy)
        sched = ManualScheduler(4, 64, num_groups=ex.runner.layout.num_groups)
        sched.add("a", list(range(3, 15)), max_tokens=2)
        sched.add("b", [4, 5], max_tokens=2)
        sched.run(ex)
    assert len(seen) == 2 * 2 * 2 and all(mask is None for mask in seen)


@pytest.mark.cuda
def test_cuda_executor_matches_hf_and_sizes_kv_from_gpu_memory(model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    cfg = dataclasses.replace(
        make_config(path, num_blocks=None, max_num_seqs=32, gpu_memory_utilization=0.05),  # 17 requests run at once
        device_config=DeviceConfig(device="cuda"),
    )
    ex = DefaultExecutor(cfg)
    num_blocks = ex.initialize_kv_cache().num_blocks
    assert num_blocks > 1000 and ex.runner.kv_caches[0][0].is_cuda
    sched = ManualScheduler(4, 256, chunk=5, budget=32)  # uses the first blocks only
    prompts = _prompts(16, seed=11)
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, max_tokens=6)
    sched.add("seeded", [11, 12, 13], SamplingParams(temperature=1.0, seed=3, max_tokens=6), max_tokens=6)
    got = sched.run(ex)
    for req_id, prompt in prompts.items():
        assert got[req_id] == hf_greedy(path, prompt, 6), req_id
    alone = ManualScheduler(4, 256)
    alone.add("seeded", [11, 12, 13], SamplingParams(temperature=1.0, seed=3, max_tokens=6), max_tokens=6)
    assert alone.run(ex)["seeded"] == got["seeded"]
    ex.sleep(1)
    ex.wake_up()
    ex.shutdown()
