"""Time to first token of a request whose long prefix was evicted from the engine's prefix cache (not a test).

Variants, each an in-process engine on a ~30M-parameter Llama (``vllite.testing.models.make_model``, preset
``30m``, float32, CPU unless a GPU is present): ``recompute`` (no connector: the whole prompt is prefilled again),
``shared-storage`` (the prefix comes back from the directory) and ``offload`` (from the host-memory tier, when
that builtin is registered). Each round uses a fresh prompt of ``--prompt-len`` tokens: it is run once (the
connector stores its blocks), the engine's prefix cache is reset (evicting every cached block), then the same
prompt is sent again with ``max_tokens=1`` and timed from ``add_request`` to its first token. The variants
alternate within each round (reversed every other round) after a warm-up round; the medians over ``--rounds``
rounds are printed, with the tokens the timed request found cached (local or loaded).

Run: ``python benchmarks/bench_kv_connectors.py [--rounds 3] [--prompt-len 1900]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as common

from vllite.engine.llm_engine import LLMEngine
from vllite.engine_args import EngineArgs
from vllite.plugin_manager import get_registry
from vllite.sampling_params import SamplingParams
from vllite.testing.models import make_model


def connector_configs(storage: Path) -> dict[str, dict[str, Any] | None]:
    """The variants: name -> ``kv_transfer_config`` (``None``: no connector)."""
    configs: dict[str, dict[str, Any] | None] = {
        "recompute": None,
        "shared-storage": {
            "kv_connector": "shared-storage",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)},
        },
    }
    if "offload" in get_registry("kv_connectors"):
        configs["offload"] = {"kv_connector": "offload", "kv_connector_extra_config": {"offload_size_gib": 2}}
    return configs


def make_engine(model: Path, kv: dict[str, Any] | None, args: argparse.Namespace) -> LLMEngine:
    engine_args = EngineArgs(
        model=str(model),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_model_len,
        kv_transfer_config=json.dumps(kv) if kv is not None else None,
    )
    return LLMEngine(engine_args.create_engine_config(), multiprocess=False)


def ttft(engine: LLMEngine, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from ``add_request`` to the first token, and the prompt tokens found cached."""
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    while True:
        for out in engine.step():
            if out.request_id == request_id and out.outputs[0].token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_unfinished_requests():
                    engine.step()
                return elapsed, out.num_cached_tokens or 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common.add_plain_args(parser, rounds=3, prompt_len=1900, max_model_len=2048, block_size=16, seed=0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-kv-connectors-") as tmp:
        model = make_model(Path(tmp) / "m30", preset="30m")
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        rng = random.Random(args.seed)
        engines = {name: make_engine(model, kv, args) for name, kv in connector_configs(Path(tmp) / "kv").items()}
        times: dict[str, list[float]] = {name: [] for name in engines}
        cached: dict[str, list[int]] = {name: [] for name in engines}
        try:
            for r in range(-1, args.rounds):  # round -1 warms up: first-call overheads stay out of the timings
                prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
                order = list(engines) if r % 2 == 0 else list(reversed(engines))
                for name in order:
                    engine = engines[name]
                    ttft(engine, f"store-{r}", prompt)  # computed once: the connector stores the blocks
                    engine.reset_prefix_cache()  # evicts every cached block from the engine
                    seconds, hit = ttft(engine, f"timed-{r}", prompt)
                    if r >= 0:
                        times[name].append(seconds)
                        cached[name].append(hit)
        finally:
            for engine in engines.values():
                engine.shutdown()

    print(f"TTFT of a {args.prompt_len}-token prompt whose prefix was evicted, median of {args.rounds} rounds")
    base = statistics.median(times["recompute"])
    for name in engines:
        median = statistics.median(times[name])
        print(
            f"  {name:15s} {median * 1000:9.1f} ms  x{base / median:5.2f} vs recompute  "
            f"cached tokens {cached[name]}  all {[round(t * 1000, 1) for t in times[name]]} ms"
        )


if __name__ == "__main__":
    main()
