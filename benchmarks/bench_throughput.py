"""Offline throughput: vllite vs Hugging Face ``generate()`` on the same model, in the same run.

    python benchmarks/bench_throughput.py                       # demo model, 256 prompts x 128 new tokens
    python benchmarks/bench_throughput.py --model-preset 30m    # a ~30M-parameter random-weight Llama
    python benchmarks/bench_throughput.py --model PATH

Both engines generate exactly ``--output-len`` tokens per prompt (EOS ignored) from the same prompts. HF runs in
batches of ``--hf-batch-size`` with left padding and its KV cache. The two alternate for ``--repeats`` rounds
(vllite's prefix cache is reset before each round) and the medians are reported, since one run on a shared
machine can swing by 15%.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time


def make_prompts(tokenizer, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(vocab) if i not in special]
    return [[rng.choice(ids) for _ in range(rng.randint(input_len // 2, input_len))] for _ in range(num_prompts)]


class VlliteRunner:
    """One vllite engine, timed over repeated rounds of the same prompts."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        from vllite import LLM, SamplingParams

        self.llm = LLM(
            model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        )
        self.llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=4), use_tqdm=False)

    def __call__(self, prompts: list[list[int]], output_len: int, args: argparse.Namespace) -> float:
        from vllite import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        self.llm.reset_prefix_cache()  # every round computes every prompt
        start = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=not args.quiet)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert generated == len(prompts) * output_len, generated
        return elapsed


class HFRunner:
    """Hugging Face ``generate()`` on the same model, batched with left padding and its own KV cache."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        dtypes = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtypes[args.dtype] or "auto").eval()
        if args.dtype == "auto" and next(self.hf.parameters()).dtype in (torch.float16, torch.bfloat16):
            self.hf = self.hf.float()  # as vllite does on the CPU

    def __call__(self, prompts: list[list[int]], output_len: int, args: argparse.Namespace) -> float:
        import torch
        from transformers import GenerationConfig

        config = GenerationConfig(
            do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0, eos_token_id=None
        )
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(prompts), args.hf_batch_size):
                batch = prompts[i : i + args.hf_batch_size]
                width = max(len(p) for p in batch)
                input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
                out = self.hf.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
                assert out.shape[1] == width + output_len
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model folder (default: the demo model).")
    parser.add_argument(
        "--model-preset", default=None, help="Build a random-weight model with vllite.testing (e.g. 30m)."
    )
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="Alternating rounds per engine (medians reported).")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    args = parser.parse_args()

    from vllite.assets import default_model_path
    from vllite.engine.tokenizer import get_tokenizer

    model = args.model
    if args.model_preset:
        import tempfile

        from vllite.testing import make_model

        model = str(make_model(preset=args.model_preset, path=tempfile.mkdtemp(prefix="vllite-bench-")))
    model = model or default_model_path()
    prompts = make_prompts(get_tokenizer(model), args.num_prompts, args.input_len, args.seed)
    total = args.num_prompts * args.output_len

    results: dict = {"model": model, "num_prompts": args.num_prompts, "output_len": args.output_len}
    runners = {"vllite": VlliteRunner(model, args)}
    if not args.skip_hf:
        runners["hf"] = HFRunner(model, args)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, runner in runners.items():
            times[name].append(runner(prompts, args.output_len, args))
    for name, label in (("vllite", "vllite"), ("hf", "HF generate")):
        if name in times:
            rates = sorted(total / t for t in times[name])
            results[f"{name}_tokens_per_s"] = statistics.median(rates)
            results[f"{name}_tokens_per_s_all"] = rates
            print(
                f"{label:12s} {statistics.median(rates):10.1f} generated tokens/s (median of {len(rates)}: "
                + ", ".join(f"{r:.0f}" for r in rates)
                + ")"
            )
    if "hf" in times:
        results["ratio"] = results["vllite_tokens_per_s"] / results["hf_tokens_per_s"]
        print(f"ratio vllite / HF: {results['ratio']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
