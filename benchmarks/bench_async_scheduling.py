"""Async scheduling on and off: offline throughput of the same engine, alternating, medians of several rounds.

    python benchmarks/bench_async_scheduling.py                         # demo model, uniform and mixed workloads
    python benchmarks/bench_async_scheduling.py --model-preset 30m --num-prompts 64
    VLLITE_ENABLE_MULTIPROCESSING=0 python benchmarks/bench_async_scheduling.py   # in-process engine

The workloads are ``bench_throughput.make_workload``'s (random token ids, EOS ignored, greedy): ``uniform``
(``--num-prompts`` prompts of ``--input-len``/2 to ``--input-len`` tokens, ``--output-len`` new tokens each) and
``mixed`` (prompts of 8 to 400 tokens, outputs of 16 to 384). Each round builds a fresh engine per mode (engine
start-up is not timed; the order of the modes rotates from round to round), checks that every mode generated exactly
the same tokens, and prints the medians and the ratios per workload. The modes: ``sync`` (the default step),
``pipelined`` (``batch_queue_depth=2`` without async scheduling: the model runs on the executor's worker thread
too, but a request waits for its token before it is scheduled again) and ``async`` (``async_scheduling=True``), so
async / pipelined isolates what scheduling ahead on output placeholders brings from the effect of the worker thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as common
from bench_throughput import make_workload

MODES: dict[str, dict[str, object]] = {
    "sync": {},
    "pipelined": {"batch_queue_depth": 2},
    "async": {"async_scheduling": True},
}


def run_once(model: str, workload: common.Workload, args: argparse.Namespace, mode: str) -> tuple[float, list]:
    """One engine in ``mode``, one pass over ``workload``: (seconds, generated token ids per request)."""
    from vllite import LLM

    with LLM(model, **common.engine_kwargs(args), **MODES[mode]) as llm:
        common.warm_up(llm)
        elapsed, outputs = common.timed_generate(llm, workload)
    return elapsed, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    """Parses the options, runs the alternating rounds per workload and prints the figures."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(parser, "Build a random-weight model (e.g. 30m).")
    parser.add_argument("--workloads", default="uniform,mixed", help="Comma-separated: uniform, mixed.")
    common.add_workload_args(parser, num_prompts=64, uniform_help=True)
    common.add_engine_args(parser)
    common.add_repeat_args(parser, "Alternating rounds (medians reported).")
    args = parser.parse_args()

    from vllite.engine.tokenizer import get_tokenizer

    model = common.resolve_model(args.model, args.model_preset)
    tokenizer = get_tokenizer(model)
    mode = (
        "multiprocess" if os.environ.get("VLLITE_ENABLE_MULTIPROCESSING", "1") not in ("0", "false") else "in-process"
    )
    print(f"model={model} engine={mode} prompts={args.num_prompts} repeats={args.repeats}")
    for name in args.workloads.split(","):
        args.workload = name
        workload = make_workload(tokenizer, args)
        total = sum(n for _, n in workload)
        rates: dict[str, list[float]] = {mode: [] for mode in MODES}
        reference = None
        for round_index in range(args.repeats):
            order = list(MODES)[round_index % len(MODES) :] + list(MODES)[: round_index % len(MODES)]
            for mode in order:
                elapsed, tokens = run_once(model, workload, args, mode)
                if reference is None:
                    reference = tokens
                elif tokens != reference:
                    raise SystemExit(f"{name}: {mode} generated other tokens than the first engine")
                rates[mode].append(total / elapsed)
                print(f"  {name} {mode}: {total / elapsed:.1f} tokens/s", file=sys.stderr, flush=True)
        medians = {mode: statistics.median(r) for mode, r in rates.items()}
        print(
            f"{name:8s} "
            + "  ".join(f"{mode} {rate:.1f} tok/s" for mode, rate in medians.items())
            + f"  async/sync {medians['async'] / medians['sync']:.3f}"
            + f"  async/pipelined {medians['async'] / medians['pipelined']:.3f}"
            + f"  (medians of {args.repeats}; {total} new tokens; outputs identical)"
        )


if __name__ == "__main__":
    main()
