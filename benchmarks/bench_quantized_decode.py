"""Decode speed of weight-only quantized checkpoints against the same model unquantized, at small batch sizes.

    python benchmarks/bench_quantized_decode.py                        # ~100M Llama, float32, batch 1 and 8
    python benchmarks/bench_quantized_decode.py --dtype bfloat16 --schemes W8A16

Builds a random-weight Llama (hidden 1024, 8 layers: about 100M parameters with the demo tokenizer's vocabulary),
quantizes it with llm-compressor's data-free ``oneshot`` (``QuantizationModifier``, ``lm_head`` left unquantized,
saved compressed: what ``llm-compressor`` users deploy; install it with ``pip install --no-deps -r
requirements-llmcompressor.txt``), then times greedy decoding of each checkpoint at each batch size, rounds
alternating between the checkpoints, and reports median decode tokens/s and the ratio to the unquantized model.
Decode tokens/s: new tokens after the first of each request, divided by the time from the first token to the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import _common as common

os.environ.setdefault("VLLITE_ENABLE_MULTIPROCESSING", "0")  # the engine in this process: its own timing only


def build_checkpoints(root: Path, schemes: list[str]) -> dict[str, Path]:
    """The unquantized model and one llm-compressor checkpoint per scheme, under ``root``."""
    import shutil

    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    from vllite.testing import make_model

    base = make_model(root / "base", preset="100m")
    folders = {"unquantized": base}
    for scheme in schemes:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
        out = root / scheme
        shutil.copytree(base, out, ignore=shutil.ignore_patterns("*.safetensors"))
        model.save_pretrained(out, save_compressed=True)
        folders[scheme] = out
    return folders


def decode_tokens_per_s(llm, batch: int, input_len: int, output_len: int) -> float:
    """One greedy round of ``batch`` requests; decode tokens/s from the first token to the end."""
    from vllite import SamplingParams

    prompts = [{"prompt_token_ids": [10 + (i * 7 + j) % 900 for j in range(input_len)]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    first = max(o.metrics.first_token_time for o in outputs)  # time.monotonic() readings
    last = max(o.metrics.last_token_time for o in outputs)
    return batch * (output_len - 1) / (last - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--schemes", nargs="+", default=["W8A16", "W4A16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    common.print_cpu()

    from vllite import LLM

    with tempfile.TemporaryDirectory() as tmp:
        folders = build_checkpoints(Path(tmp), args.schemes)
        engines = {
            name: LLM(model=str(path), dtype=args.dtype, max_model_len=512, disable_log_stats=False)
            for name, path in folders.items()
        }
        results: dict[tuple[str, int], list[float]] = {}
        for batch in args.batches:
            for llm in engines.values():  # warm-up
                decode_tokens_per_s(llm, batch, args.input_len, 8)
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    rate = decode_tokens_per_s(llm, batch, args.input_len, args.output_len)
                    results.setdefault((name, batch), []).append(rate)
    print(f"dtype {args.dtype}, {args.input_len}-token prompts, {args.output_len} new tokens, medians of {args.rounds}")
    for batch in args.batches:
        baseline = statistics.median(results[("unquantized", batch)])
        for name in folders:
            rate = statistics.median(results[(name, batch)])
            print(f"batch {batch:3d}  {name:12s} {rate:9.1f} decode tok/s  {rate / baseline:5.2f}x")


if __name__ == "__main__":
    sys.exit(main())
