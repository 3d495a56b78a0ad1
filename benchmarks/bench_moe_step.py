"""A MoE model against the dense model of the same active size, through vllite on the same workload (not a test).

    python benchmarks/bench_moe_step.py                  # Mixtral-shaped (8 experts, top-2) vs dense, float32
    python benchmarks/bench_moe_step.py --dtype bfloat16 --num-prompts 64

Both models are random-weight checkpoints built here with the same hidden size, layers and attention: the MoE one
has ``--num-experts`` experts of ``--expert-size`` with ``--top-k`` of them active per token (Mixtral's
``MixtralForCausalLM``), the dense one a Llama whose MLP is ``top_k x expert_size`` wide, the same active parameters
per token. The engines alternate for ``--repeats`` rounds on the same prompts; the medians and their ratio are
reported. vllite runs transformers' own MoE block (its experts batched per expert, as transformers implements them),
so the ratio is what routing and the per-expert batching cost over one dense matmul per layer.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import _common as common


def _build(folder: Path, model_type: str, args: argparse.Namespace) -> str:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllite.testing.models import copy_demo_tokenizer

    copy_demo_tokenizer(folder)
    shape = {"hidden_size": args.hidden_size, "num_hidden_layers": args.num_layers, "num_attention_heads": 8}
    shape |= {"num_key_value_heads": 4, "vocab_size": 4096, "max_position_embeddings": 1024}
    if model_type == "mixtral":
        extra = {"num_local_experts": args.num_experts, "num_experts_per_tok": args.top_k}
        config = AutoConfig.for_model("mixtral", intermediate_size=args.expert_size, **shape, **extra)
    else:
        config = AutoConfig.for_model("llama", intermediate_size=args.expert_size * args.top_k, **shape)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_plain_args(parser, hidden_size=512, num_layers=8, num_experts=8, top_k=2, expert_size=1024)
    common.add_workload_args(parser, num_prompts=64, input_len=64, output_len=64)
    common.add_engine_args(parser)
    common.add_repeat_args(parser)
    args = parser.parse_args()

    from vllite import LLM

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 4000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    workload = [(prompt, args.output_len) for prompt in prompts]
    total = sum(n for _, n in workload)
    with tempfile.TemporaryDirectory() as tmp:
        kwargs = common.engine_kwargs(args)
        llms = {kind: LLM(_build(Path(tmp) / kind, kind, args), **kwargs) for kind in ("mixtral", "llama")}
        for llm in llms.values():
            common.warm_up(llm)
        runners = {kind: (lambda llm=llm: common.timed_generate(llm, workload)[0]) for kind, llm in llms.items()}
        rates = common.alternate(runners, args.repeats, total)
    results: dict = {}
    moe = common.report_rates(results, "moe", "MoE  ", rates["mixtral"])
    dense = common.report_rates(results, "dense", "dense", rates["llama"])
    print(f"MoE / dense of the same active size: {moe / dense:.2f}x")


if __name__ == "__main__":
    main()
