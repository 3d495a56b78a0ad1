"""The admission gates under KV pressure: eager admission vs vLLM's full-prompt gate (``scheduler_reserve_full_isl``)
and the watermark, on the mixed workload with a KV cache too small for it.

    python benchmarks/bench_admission_gate.py                          # demo model, 48 mixed requests, 96 blocks
    python benchmarks/bench_admission_gate.py --num-gpu-blocks 64 --repeats 3 --json gate.json

Every request is submitted at once (greedy, EOS ignored, every request generates exactly the tokens asked for), so
admission decides the order of work. One engine per mode, built once; the modes alternate for ``--repeats`` rounds
(prefix cache reset before each) and the medians are reported: generated tokens/s, preemptions per round, and the
time to first token (median and p90 over the requests, from submission). Modes: ``eager`` (gate off, today's
behaviour before issue 43), ``gate`` (vLLM's default), ``gate+wm`` (gate and ``--watermark``).
"""

from __future__ import annotations

import argparse
import os
import statistics

import _common as common
from bench_throughput import make_workload

os.environ.setdefault("VLLITE_ENABLE_MULTIPROCESSING", "0")  # the scheduler's preemption counter is read in-process


def modes(watermark: float) -> dict[str, dict]:
    return {
        "eager": {"scheduler_reserve_full_isl": False},
        "gate": {"scheduler_reserve_full_isl": True},
        "gate+wm": {"scheduler_reserve_full_isl": True, "watermark": watermark},
    }


class Runner:
    """One engine in one admission mode; each call generates the workload and returns its figures."""

    def __init__(self, model: str, args: argparse.Namespace, mode: dict) -> None:
        from vllite import LLM

        kwargs = {**common.engine_kwargs(args), **mode}
        self.llm = LLM(model, num_gpu_blocks_override=args.num_gpu_blocks, disable_log_stats=False, **kwargs)
        self.scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        common.warm_up(self.llm)

    def __call__(self, workload: common.Workload) -> dict[str, float]:
        self.llm.reset_prefix_cache()
        before = self.scheduler.num_preemptions_total
        elapsed, outputs = common.timed_generate(self.llm, workload)
        ttfts = sorted(o.metrics.first_token_latency for o in outputs)
        return {
            "tokens_per_s": sum(n for _, n in workload) / elapsed,
            "preemptions": self.scheduler.num_preemptions_total - before,
            "ttft_median_s": statistics.median(ttfts),
            "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
            "seconds": elapsed,
        }

    def close(self) -> None:
        self.llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(parser)
    common.add_workload_args(parser, workload="mixed", num_prompts=48)
    common.add_engine_args(parser)
    common.add_repeat_args(parser)
    parser.add_argument("--num-gpu-blocks", type=int, default=96, help="KV blocks (16 tokens each).")
    parser.add_argument("--watermark", type=float, default=0.05, help="The gate+wm mode's watermark.")
    common.add_json_arg(parser)
    args = parser.parse_args()
    args.quiet = True
    model = common.resolve_model(args.model, None)
    tokenizer = _tokenizer(model)
    workload = make_workload(tokenizer, args)
    runners = {name: Runner(model, args, mode) for name, mode in modes(args.watermark).items()}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in runners}
    try:
        for _ in range(args.repeats):
            for name, runner in runners.items():
                rounds[name].append(runner(workload))
                print(f"  {name}: {_line(rounds[name][-1])}", flush=True)
    finally:
        for runner in runners.values():
            runner.close()
    results = {"num_prompts": args.num_prompts, "num_gpu_blocks": args.num_gpu_blocks, "modes": {}}
    print(f"{len(workload)} mixed requests, {args.num_gpu_blocks} KV blocks, medians of {args.repeats} rounds:")
    for name, figures in rounds.items():
        medians = {key: statistics.median(f[key] for f in figures) for key in figures[0]}
        results["modes"][name] = {**medians, "all": figures}
        print(f"{name:>8}: {_line(medians)}")
    common.write_json(args.json, results)


def _line(figures: dict[str, float]) -> str:
    return (
        f"{figures['tokens_per_s']:7.1f} tokens/s, {figures['preemptions']:4.0f} preemptions, "
        f"TTFT median {figures['ttft_median_s']:6.2f} s, p90 {figures['ttft_p90_s']:6.2f} s"
    )


def _tokenizer(model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


if __name__ == "__main__":
    main()
