"""What the benchmark scripts share: their common options, the model and engine set-up, timing and reporting.

Not a benchmark itself: the scripts import it (``import _common as common``; a script's own folder is on
``sys.path`` when it runs as ``python benchmarks/bench_x.py``). Only the standard library is imported at module
level, so a script may import it in a child process that runs vLLM's python too; vllite is imported where used.

The ``add_*`` functions add one block of options each, in a fixed order; the defaults and help texts that differ
between the scripts are their parameters, so every script's ``--help`` reads as it always has.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

Workload = list[tuple[list[int], int]]  # (prompt token ids, new tokens) per request
K = TypeVar("K")


# ---------------------------------------------------------------------------------------------------- options
def add_model_args(parser: argparse.ArgumentParser, preset_help: str | None = None) -> None:
    """``--model`` and, given its help text, ``--model-preset`` (see ``resolve_model``)."""
    parser.add_argument("--model", default=None, help="Model folder (default: the demo model).")
    if preset_help is not None:
        parser.add_argument("--model-preset", default=None, help=preset_help)


def add_workload_args(
    parser: argparse.ArgumentParser,
    *,
    num_prompts: int = 256,
    input_len: int = 64,
    output_len: int = 128,
    workload: str | None = None,
    uniform_help: bool = False,
) -> None:
    """The random-prompt workload (``bench_throughput.make_workload``): ``--workload`` (given its default),
    ``--num-prompts``, ``--input-len`` and ``--output-len`` (with their help texts of the uniform workload)."""
    if workload is not None:
        parser.add_argument("--workload", choices=["uniform", "mixed"], default=workload)
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument(
        "--input-len", type=int, default=input_len, help="uniform: the longest prompt." if uniform_help else None
    )
    parser.add_argument(
        "--output-len", type=int, default=output_len, help="uniform: new tokens per prompt." if uniform_help else None
    )


def add_engine_args(parser: argparse.ArgumentParser, *, max_model_len: bool = True) -> None:
    """The engine's size: ``--dtype``, ``--max-num-seqs``, ``--max-num-batched-tokens`` and ``--max-model-len``
    (see ``engine_kwargs``)."""
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    if max_model_len:
        parser.add_argument("--max-model-len", type=int, default=1024)


def add_repeat_args(parser: argparse.ArgumentParser, repeats_help: str | None = None) -> None:
    """``--seed`` and ``--repeats`` (timed rounds, 3)."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help=repeats_help)


def add_vllm_args(
    parser: argparse.ArgumentParser,
    *,
    python_help: str = "A python with vLLM installed: also run vLLM.",
    log_help: str = "Show the vLLM child's log.",
    kv_fraction: bool = False,
) -> None:
    """The vLLM peer in a child process: ``--vllm-python``, optionally ``--vllm-kv-fraction``, ``--verbose-peers``."""
    parser.add_argument("--vllm-python", default=None, help=python_help)
    if kv_fraction:
        parser.add_argument(
            "--vllm-kv-fraction",
            type=float,
            default=0.25,
            help="vLLM's gpu_memory_utilization: its KV cache's RAM share.",
        )
    parser.add_argument("--verbose-peers", action="store_true", help=log_help)


def add_json_arg(parser: argparse.ArgumentParser) -> None:
    """``--json PATH`` (see ``write_json``)."""
    parser.add_argument("--json", default=None, help="Also write the results to this JSON file.")


def add_plain_args(parser: argparse.ArgumentParser, **defaults: int | float | str) -> None:
    """One option per keyword, without help text: ``block_size=16`` adds ``--block-size`` (an int, 16)."""
    for name, default in defaults.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)


# ---------------------------------------------------------------------------------------------------- set-up
def resolve_model(model: str | None, preset: str | None) -> str:
    """A fresh random-weight model of ``preset`` (``vllite.testing.make_model``) if given, else ``model``, else
    the demo model."""
    if preset:
        import tempfile

        from vllite.testing import make_model

        return str(make_model(preset=preset, path=tempfile.mkdtemp(prefix="vllite-bench-")))
    if model:
        return model
    from vllite.assets import default_model_path

    return str(default_model_path())


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``add_engine_args``' options as ``LLM`` keyword arguments (``max_model_len`` only where there is one)."""
    kwargs = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs}
    kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if hasattr(args, "max_model_len"):
        kwargs["max_model_len"] = args.max_model_len
    return kwargs


def warm_up(llm: Any) -> None:
    """One short request through a vllite ``LLM``, so that first-call costs stay out of the timings."""
    from vllite import SamplingParams

    llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=4), use_tqdm=False)


def timed_generate(llm: Any, workload: Workload, *, use_tqdm: bool = False) -> tuple[float, list]:
    """Seconds a vllite ``LLM`` takes to generate ``workload`` (greedy, EOS ignored), and the outputs; checks
    that every request got exactly the tokens it asked for."""
    from vllite import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in workload], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == [n for _, n in workload]
    return elapsed, outputs


class LineChild:
    """A child process driven by lines of text: ``send`` writes one to its stdin, ``expect`` reads its stdout up
    to the next line that starts with a tag, ``close`` ends it."""

    name = "the child"

    def __init__(self, command: list[str], **popen: Any) -> None:
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **popen)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, tag: str) -> str:
        """The rest of the next line that starts with ``tag``, stripped; ``exited`` raises if the child's output
        ends first."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag) :].strip()
        self.exited(tag)

    def exited(self, tag: str) -> NoReturn:
        raise RuntimeError(f"{self.name} exited (code {self.proc.wait()}) before answering {tag!r}")

    def close(self, timeout: float = 60) -> None:
        """Closes the child's stdin (its cue to finish) and waits ``timeout`` seconds for it, then kills it."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def best_of(repeat: int, fn: Callable[[], object], *, warmup: int = 0) -> float:
    """The fastest of ``repeat`` timed calls of ``fn``, in seconds, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# ---------------------------------------------------------------------------------------------------- the CPU
#: cpuinfo flags -> the instruction set they name, most capable first (what decides bfloat16 matmul speed).
_ISA_FLAGS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
_cpu_printed = False


def cpu_description() -> str:
    """This CPU as a figure must name it: its model and the instruction sets that decide matmul speed, e.g.
    ``AMD EPYC, 2 cores (AVX512-BF16, AVX-512, AVX2; no AMX)``."""
    import os

    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    isas = [name for flag, name in _ISA_FLAGS if flag in flags]
    amx = "" if "AMX" in isas else "; no AMX"
    return f"{model}, {os.cpu_count()} cores ({', '.join(isas) or 'no AVX2'}{amx})"


def print_cpu() -> None:
    """Prints :func:`cpu_description` once per process, before the first figure."""
    global _cpu_printed
    if not _cpu_printed:
        _cpu_printed = True
        print(f"CPU: {cpu_description()}")


# ---------------------------------------------------------------------------------------------------- rounds
def alternate(
    runners: Mapping[K, Callable[[], float]], repeats: int, total: int, label: Callable[[K], str] = str
) -> dict[K, list[float]]:
    """Runs every runner (it returns the seconds it took to generate ``total`` tokens) once per round, for
    ``repeats`` rounds, printing each round's tokens/s to stderr; returns the tokens/s per runner."""
    rates: dict[K, list[float]] = {key: [] for key in runners}
    for _ in range(repeats):
        for key, runner in runners.items():
            rates[key].append(total / runner())
            print(f"  {label(key)}: {rates[key][-1]:.1f} tokens/s", file=sys.stderr, flush=True)
    return rates


def report_rates(results: dict, key: str, label: str, rates: list[float]) -> float:
    """Prints the median of ``rates`` (tokens/s) after ``label`` and all of them, records both in ``results``
    (``{key}_tokens_per_s`` and ``{key}_tokens_per_s_all``) and returns the median."""
    print_cpu()
    rates = sorted(rates)
    median = statistics.median(rates)
    results[f"{key}_tokens_per_s"] = median
    results[f"{key}_tokens_per_s_all"] = rates
    listed = ", ".join(f"{r:.0f}" for r in rates)
    print(f"{label} {median:10.1f} generated tokens/s (median of {len(rates)}: {listed})")
    return median


def write_json(path: str | None, results: dict) -> None:
    """Writes ``results`` to ``path`` (``--json``), if given."""
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=2)
