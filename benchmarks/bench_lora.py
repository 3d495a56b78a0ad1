"""What serving LoRA adapters costs: the mixed workload with 4 adapters spread over the requests vs the base model.

    python benchmarks/bench_lora.py --model-preset 30m                 # ~30M Llama, 4 rank-16 adapters
    python benchmarks/bench_lora.py --model-preset 30m --rank 8 --num-adapters 2

Makes ``--num-adapters`` random PEFT adapters (``peft``, every attention and MLP projection, rank ``--rank``) on
the model, then alternates rounds of the same requests between a plain engine (no LoRA) and an engine with
``--enable-lora --max-loras N`` where request ``i`` runs adapter ``i % N`` (every step mixes all adapters); the
medians and their ratio are reported. With ``--base-share F`` a fraction of the requests runs the base model.
With ``--vllm-python PY`` (a python with vLLM's CPU build), vLLM's offline ``LLM`` with ``enable_lora`` runs the same
requests with the same adapters (and without any), alternating with vllite's rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import _common as common
from bench_throughput import VLLM_CHILD_PRELUDE, make_workload

_VLLM_LORA_CHILD = (
    VLLM_CHILD_PRELUDE
    + r"""
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_num_seqs=cfg["max_num_seqs"], seed=0,
          max_num_batched_tokens=cfg["max_num_batched_tokens"], max_model_len=cfg["max_model_len"],
          enable_lora=True, max_loras=cfg["max_loras"], max_lora_rank=cfg["max_lora_rank"],
          gpu_memory_utilization=cfg["kv_fraction"])  # on CPU: the share of RAM for the KV cache
llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=4), use_tqdm=False)
print("READY", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    loras = [LoRARequest(*a) if a else None for a in job["loras"]] if job["loras"] else None
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in job["workload"]]
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in job["workload"]], params, lora_request=loras,
                        use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [n for _, n in job["workload"]]
    print("TIME", elapsed, flush=True)
"""
)


class VllmLoRARunner(common.LineChild):
    """vLLM's offline ``LLM`` with ``enable_lora`` in a child process running ``--vllm-python``."""

    name = "vLLM's child"

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        cfg = {
            "model": model,
            **common.engine_kwargs(args),
            "max_loras": args.num_adapters,
            "max_lora_rank": args.rank,
            "kv_fraction": args.vllm_kv_fraction,
        }
        command = [args.vllm_python, "-c", _VLLM_LORA_CHILD, json.dumps(cfg)]
        super().__init__(command, stderr=None if args.verbose_peers else subprocess.DEVNULL)
        self.expect("READY")

    def __call__(self, workload: common.Workload, loras: list | None) -> float:
        wire = [[r.lora_name, r.lora_int_id, r.lora_path] if r else None for r in loras] if loras else None
        self.send(json.dumps({"workload": workload, "loras": wire}))
        return float(self.expect("TIME"))


def make_adapters(model: str, root: Path, count: int, rank: int) -> list:
    """``count`` PEFT adapters with random A and B on every projection of ``model``, as ``LoRARequest``s."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from vllite.lora import LoRARequest

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = []
    for i in range(count):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        peft.get_peft_model(base, config).save_pretrained(root / f"adapter-{i}")
        adapters.append(LoRARequest(f"adapter-{i}", i + 1, str(root / f"adapter-{i}")))
    return adapters


class Runner:
    """One engine, timed over rounds of the same requests (with one adapter per request, or none)."""

    def __init__(self, model: str, args: argparse.Namespace, loras: list | None) -> None:
        from vllite import LLM

        kwargs = common.engine_kwargs(args)
        if loras is not None:
            kwargs.update(enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank)
        self.llm = LLM(model, **kwargs)
        self.loras = loras
        common.warm_up(self.llm)

    def __call__(self, workload: common.Workload) -> float:
        import time

        from vllite import SamplingParams

        self.llm.reset_prefix_cache()
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
        prompts = [{"prompt_token_ids": p} for p, _ in workload]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, lora_request=self.loras, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in workload]
        return elapsed

    def close(self) -> None:
        self.llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(parser, preset_help="Random-weight model preset, e.g. 30m.")
    common.add_workload_args(parser, workload="mixed", num_prompts=256)
    common.add_engine_args(parser)
    common.add_repeat_args(parser)
    parser.add_argument("--num-adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--base-share", type=float, default=0.0, help="Fraction of requests without an adapter.")
    common.add_vllm_args(parser, kv_fraction=True)
    common.add_json_arg(parser)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model = common.resolve_model(args.model, args.model_preset)
    workload = make_workload(AutoTokenizer.from_pretrained(model), args)
    total = sum(n for _, n in workload)
    adapters = make_adapters(model, Path(tempfile.mkdtemp(prefix="vllite-lora-bench-")), args.num_adapters, args.rank)
    rng = random.Random(args.seed)
    loras = [None if rng.random() < args.base_share else adapters[i % len(adapters)] for i in range(len(workload))]
    print(
        f"{len(workload)} requests, {total} new tokens, {args.num_adapters} adapters of rank {args.rank}",
        file=sys.stderr,
    )

    base, lora = Runner(model, args, None), Runner(model, args, loras)
    runners = {"base": lambda: base(workload), "lora": lambda: lora(workload)}
    vllm = VllmLoRARunner(model, args) if args.vllm_python else None
    if vllm is not None:
        runners.update(vllm_base=lambda: vllm(workload, None), vllm_lora=lambda: vllm(workload, loras))
    try:
        rates = common.alternate(runners, args.repeats, total)
    finally:
        base.close()
        lora.close()
        if vllm is not None:
            vllm.close()
    results: dict = {"num_adapters": args.num_adapters, "rank": args.rank, "num_requests": len(workload)}
    base_rate = common.report_rates(results, "base", "base model   ", rates["base"])
    lora_rate = common.report_rates(results, "lora", "with adapters", rates["lora"])
    results["lora_over_base"] = lora_rate / base_rate
    print(f"LoRA / base: {lora_rate / base_rate:.3f} (cost {100 * (1 - lora_rate / base_rate):.1f}%)")
    if vllm is not None:
        vllm_base = common.report_rates(results, "vllm_base", "vLLM base    ", rates["vllm_base"])
        vllm_lora = common.report_rates(results, "vllm_lora", "vLLM adapters", rates["vllm_lora"])
        print(
            f"vLLM LoRA / base: {vllm_lora / vllm_base:.3f}; vllite / vLLM with adapters: {lora_rate / vllm_lora:.2f}"
        )
    common.write_json(args.json, results)


if __name__ == "__main__":
    main()
