"""Multiprocess (ZMQ engine process) vs in-process engine: per-request overhead and generation tokens/s.

    python benchmarks/bench_multiprocess.py [--model DIR] [--requests 32] [--max-tokens 64]

* overhead: sequential one-token requests on a model-free executor, so the figure is pure engine/IPC cost;
* throughput: a batch of greedy requests on the demo model (or a tiny random llama when the demo model is not
  there yet), in-process, multiprocess, and multiprocess with the pipelined step (``batch_queue_depth=2``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from vllite.engine_args import EngineArgs
from vllite.protocol import EngineCoreRequest
from vllite.sampling_params import SamplingParams

FAKE_EXECUTOR = "vllite.testing.executors:PositionTokenExecutor"


def _client(multiprocess: bool, **engine_kwargs: Any) -> Any:
    config = EngineArgs(skip_tokenizer_init=True, **engine_kwargs).create_engine_config()
    if multiprocess:
        from vllite.plugins.engine_proc.client import SyncMPClient

        return SyncMPClient(config)
    from vllite.plugins.inprocess_client.client import InprocClient

    return InprocClient(config)


def _run(client: Any, requests: list[EngineCoreRequest]) -> int:
    remaining = {r.request_id for r in requests}
    for r in requests:
        client.add_request(r)
    tokens = 0
    while remaining:
        for out in client.get_output().outputs:
            tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                remaining.discard(out.request_id)
    return tokens


def _request(request_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineCoreRequest(request_id, prompt, params, None, time.time())


def bench_overhead(n: int = 300) -> dict[str, float]:
    """Median and mean wall time of one ``max_tokens=1`` request, submitted and collected one at a time."""
    results = {}
    for mode in ("inprocess", "multiprocess"):
        client = _client(mode == "multiprocess", executor=FAKE_EXECUTOR, max_model_len=256)
        try:
            times = []
            for i in range(n + 20):
                start = time.perf_counter()
                _run(client, [_request(f"o{i}", [1, 2, 3, 4], 1)])
                if i >= 20:  # warm-up excluded
                    times.append(time.perf_counter() - start)
            results[mode] = statistics.median(times) * 1e6
            results[mode + "_mean"] = statistics.mean(times) * 1e6
        finally:
            client.shutdown()
    return results


def _tiny_model() -> str:
    try:
        from vllite.testing import make_tiny_model_dir_cached  # type: ignore[import-not-found]

        return str(make_tiny_model_dir_cached("llama"))
    except (ImportError, FileNotFoundError):  # not there yet, or needs the demo tokenizer
        pass
    import torch
    import transformers

    path = Path(tempfile.gettempdir()) / "vllite-bench-tiny-llama"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=False,
        )
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def _model_path(explicit: str | None) -> tuple[str, str]:
    if explicit:
        return explicit, "given"
    from vllite.assets import default_model_path

    demo = default_model_path()
    if (Path(demo) / "config.json").exists():
        return demo, "demo model"
    return _tiny_model(), "tiny random llama (demo model not trained yet)"


def bench_throughput(model: str, num_requests: int, max_tokens: int) -> dict[str, float]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 48))] for _ in range(num_requests)]
    results = {}
    for label, mp, depth in (("inprocess", False, 1), ("multiprocess", True, 1), ("multiprocess_bq2", True, 2)):
        client = _client(mp, model=model, dtype="float32", device="cpu", max_model_len=256, batch_queue_depth=depth)
        try:
            _run(client, [_request(f"w{i}", p, 4) for i, p in enumerate(prompts[:4])])  # warm-up
            start = time.perf_counter()
            tokens = _run(client, [_request(f"t{i}", p, max_tokens) for i, p in enumerate(prompts)])
            results[label] = tokens / (time.perf_counter() - start)
        finally:
            client.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--overhead-requests", type=int, default=300)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    overhead = bench_overhead(args.overhead_requests)
    print("per-request overhead (one-token request, model-free executor), median / mean:")
    for mode in ("inprocess", "multiprocess"):
        print(f"  {mode:>14}: {overhead[mode]:8.0f} us / {overhead[mode + '_mean']:8.0f} us")
    print(f"  IPC adds about {overhead['multiprocess'] - overhead['inprocess']:.0f} us per request (median)")

    model, what = _model_path(args.model)
    throughput = bench_throughput(model, args.requests, args.max_tokens)
    print(f"generation throughput, {args.requests} requests x {args.max_tokens} tokens, {what}:")
    for label, value in throughput.items():
        print(f"  {label:>16}: {value:8.1f} tokens/s")


if __name__ == "__main__":
    main()
