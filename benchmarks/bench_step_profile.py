"""How much of a decode step is spent outside the model, in-process and with the engine-core process.

    python benchmarks/bench_step_profile.py                  # demo model, 256 prompts x 128 new tokens, both modes
    python benchmarks/bench_step_profile.py --mode inprocess --cprofile 25   # plus a cProfile of one round

The engine runs with a timing executor (``TimedExecutor``: the default executor whose model forward is timed;
it is loaded by class path, so it runs inside the engine-core process too) and reports, per round, from the
start of the first pure-decode forward (every scheduled request computes one token) to the moment
``generate()`` returns:

- ``step``: that window divided by the number of decode forwards in it (the wall-clock time of a decode step
  as the caller sees it, output processing and the final detokenization included);
- ``model``: the mean duration of those forwards (the transformers model call, logits included);
- ``outside``: ``1 - model / step``, the share of a decode step spent around the model;
- ``outside_cpu``: the CPU time the engine's thread spends per decode step outside the model (``thread_time``;
  in-process this thread also runs the frontend's output processing). Unlike the wall-clock figures it hardly
  moves when other processes compete for the cores, so it is the figure to compare on a shared machine.

Each mode runs ``--repeats`` rounds (prefix cache reset before each) and reports medians.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the engine process imports TimedExecutor from here

import _common as common

from vllite.plugins.transformers_executor.executor import DefaultExecutor

RECORDS_ENV = "VLLITE_STEP_PROFILE_FILE"


class TimedExecutor(DefaultExecutor):
    """The default executor, recording ``(start, end, cpu_start, cpu_end, max_query_len)`` of every model forward
    (monotonic clock, shared by the processes of one machine; the calling thread's CPU time) and writing them to
    ``$VLLITE_STEP_PROFILE_FILE`` at shutdown."""

    def _init_executor(self) -> Any:
        info = super()._init_executor()
        self.records: list[tuple[float, float, float, float, int]] = []
        forward = self.runner._forward

        def timed_forward(input_ids: Any, positions: Any, md: Any, logits_indices: Any, *args: Any, **kw: Any) -> Any:
            start, cpu_start = time.monotonic(), time.thread_time()
            logits = forward(input_ids, positions, md, logits_indices, *args, **kw)
            self.records.append((start, time.monotonic(), cpu_start, time.thread_time(), int(md.max_query_len)))
            return logits

        self.runner._forward = timed_forward  # type: ignore[method-assign]
        return info

    def shutdown(self) -> None:
        """Writes the forward records, then shuts down as the default executor does."""
        path = os.environ.get(RECORDS_ENV)
        records = getattr(self, "records", None)
        if path and records is not None:
            Path(path).write_text(json.dumps(records))
            records.clear()
        super().shutdown()


def make_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """Random token prompts of ``input_len / 2 .. input_len`` tokens (the throughput benchmark's workload)."""
    rng = random.Random(seed)
    return [
        [rng.randrange(10, vocab_size) for _ in range(rng.randint(input_len // 2, input_len))]
        for _ in range(num_prompts)
    ]


def round_figures(records: list[list[float]], window: tuple[float, float, float, float], mode: str) -> dict[str, float]:
    """One round's decode-step figures (see the module docstring) from the forwards within the round's
    ``window`` (wall start, wall end, and the main thread's CPU time at both)."""
    start, end, _, cpu_end = window
    inside = [r for r in records if start <= r[0] <= end]
    decode = [r for r in inside if r[4] == 1]
    if len(decode) < 2:
        nan = float("nan")
        return {"step_ms": nan, "model_ms": nan, "outside": nan, "outside_cpu_ms": nan, "decode_steps": len(decode)}
    n = len(decode)
    step = (end - decode[0][0]) / n
    model = statistics.fmean(r[1] - r[0] for r in decode)
    if mode == "inprocess":  # this thread ran everything: its CPU time since the first decode, less the forwards'
        after = [r for r in inside if r[0] >= decode[0][0]]
        outside_cpu = (cpu_end - decode[0][2] - sum(r[3] - r[2] for r in after)) / n
    else:  # the engine process's thread between consecutive decode forwards
        outside_cpu = statistics.fmean(b[2] - a[3] for a, b in itertools.pairwise(decode))
    return {
        "step_ms": step * 1e3,
        "model_ms": model * 1e3,
        "outside": 1 - model / step,
        "outside_cpu_ms": outside_cpu * 1e3,
        "decode_steps": n,
    }


def run_mode(mode: str, model: str, args: argparse.Namespace) -> list[dict[str, float]]:
    """Runs ``args.repeats`` rounds in one engine of ``mode`` and returns each round's figures."""
    from vllite import LLM, SamplingParams

    fd, records_file = tempfile.mkstemp(prefix="vllite-step-", suffix=".json")
    os.close(fd)
    os.environ[RECORDS_ENV] = records_file
    os.environ["VLLITE_ENABLE_MULTIPROCESSING"] = "1" if mode == "process" else "0"
    llm = LLM(model, **common.engine_kwargs(args), executor="bench_step_profile:TimedExecutor")
    vocab = llm.llm_engine.engine_info.vocab_size
    prompts = [{"prompt_token_ids": p} for p in make_prompts(vocab, args.num_prompts, args.input_len, args.seed)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    common.warm_up(llm)
    windows = []
    for i in range(args.repeats):
        llm.reset_prefix_cache()
        profiler = cProfile.Profile() if args.cprofile and mode == "inprocess" and i == args.repeats - 1 else None
        start, cpu_start = time.monotonic(), time.thread_time()
        if profiler is not None:
            profiler.enable()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if profiler is not None:
            profiler.disable()
        windows.append((start, time.monotonic(), cpu_start, time.thread_time()))
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == args.num_prompts * args.output_len
        if profiler is not None:
            print(f"--- cProfile of the last {mode} round (top {args.cprofile} by cumulative time) ---")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.cprofile)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    llm.shutdown()
    records = json.loads(Path(records_file).read_text())
    os.unlink(records_file)
    rounds = [round_figures(records, window, mode) for window in windows]
    if args.cprofile and mode == "inprocess":
        rounds = rounds[:-1] or rounds  # the profiled round is slower: keep it out of the medians when possible
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(parser)
    parser.add_argument("--mode", choices=("inprocess", "process", "both"), default="both")
    common.add_workload_args(parser)
    common.add_engine_args(parser, max_model_len=False)
    common.add_repeat_args(parser)
    parser.add_argument("--cprofile", type=int, default=0, help="Print this many cProfile rows (in-process).")
    common.add_json_arg(parser)
    args = parser.parse_args()
    common.print_cpu()

    model = common.resolve_model(args.model, None)
    modes = ("inprocess", "process") if args.mode == "both" else (args.mode,)
    results: dict[str, Any] = {}
    for mode in modes:
        rounds = run_mode(mode, model, args)
        keys = ("step_ms", "model_ms", "outside", "outside_cpu_ms")
        summary = {key: statistics.median(r[key] for r in rounds) for key in keys}
        results[mode] = {"median": summary, "rounds": rounds}
        print(
            f"{mode:10s} decode step {summary['step_ms']:6.2f} ms, model {summary['model_ms']:6.2f} ms, "
            f"outside the model {summary['outside_cpu_ms']:5.2f} ms of CPU: "
            f"{100 * summary['outside']:5.1f}% of step outside the model "
            f"(median of {len(rounds)}: " + ", ".join(f"{100 * r['outside']:.1f}%" for r in rounds) + ")"
        )
    common.write_json(args.json, results)


if __name__ == "__main__":
    main()
