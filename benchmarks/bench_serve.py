"""Serving benchmarks, each side measured in the same run, alternating, medians reported.

``overhead``: the server's own cost. The same load (random-token prompts, ``ignore_eos``, all sent at once) runs
through ``AsyncLLM`` in-process and through ``vllite serve`` with HTTP streaming (``vllite bench serve``'s
client), the server once per ``--stream-intervals`` value (vLLM's ``--stream-interval``: one SSE event per N
tokens); output tokens/s of each, and their ratios to in-process.

``peer``: ``vllite serve`` against vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server`` run by
``--vllm-python``) on the same model and load: throughput and TTFT / TPOT percentiles of both, measured by
``vllite bench serve``'s client or (``--client vllm``) by vLLM's own ``vllm bench serve``.

``disagg``: prefill/decode disaggregation against one colocated engine on the same cores and load (long prompts,
short outputs, arriving at ``--request-rate``): a ``p2p`` kv_producer and a kv_consumer ``vllite serve``, each on
half of the CPUs (``VLLITE_CPU_OMP_THREADS_BIND``), behind ``vllite disagg-proxy``, vs one ``vllite serve`` on all
of them. Throughput, TTFT and TPOT percentiles of both.

    python benchmarks/bench_serve.py overhead --rounds 3 --stream-intervals 1,8
    python benchmarks/bench_serve.py peer --vllm-python /tmp/vllm-venv/bin/python --rounds 3
    python benchmarks/bench_serve.py peer --vllm-python /tmp/vllm-venv/bin/python --client vllm --num-prompts 256
    python benchmarks/bench_serve.py disagg --model MODEL --input-len 512 --output-len 64 --range-ratio 0.5 \
        --request-rate 2 --num-prompts 48 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import _common as common

from vllite.plugins.bench.serve import bench_serve, demo_vocab_size
from vllite.plugins.bench.serve_config import ServeBenchConfig
from vllite.plugins.bench.serve_requests import RandomDataset
from vllite.plugins.openai_server.testing import RemoteServer


def load_config(args: argparse.Namespace, base_url: str, model: str | None = None) -> ServeBenchConfig:
    return ServeBenchConfig(
        base_url=base_url,
        model=model,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        random_input_len=args.input_len,
        random_output_len=args.output_len,
        random_range_ratio=args.range_ratio,
        vocab_size=args.vocab_size,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
    )


def in_process_tokens_per_s(engine, args: argparse.Namespace) -> float:
    """Output tokens/s of the load through ``AsyncLLM`` (DELTA streams, read as they come)."""
    from vllite import SamplingParams
    from vllite.sampling_params import RequestOutputKind

    dataset = RandomDataset(args.input_len, args.output_len, vocab_size=args.vocab_size, seed=args.seed)
    requests = [dataset[i] for i in range(args.num_prompts)]

    async def one(i: int) -> int:
        request = requests[i]
        params = SamplingParams(
            max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
        )
        count = 0
        async for out in engine.generate(request.prompt, params, f"bench-{time.monotonic_ns()}-{i}"):
            count += len(out.outputs[0].token_ids)
        return count

    async def run() -> float:
        await one(0)  # warm-up, as bench serve does
        start = time.perf_counter()
        counts = await asyncio.gather(*[one(i) for i in range(args.num_prompts)])
        return sum(counts) / (time.perf_counter() - start)

    return asyncio.run(run())


def engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--dtype", "float32", "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
    return ([args.model] if args.model else []) + flags


def overhead(args: argparse.Namespace) -> dict:
    from vllite.plugins.engine_proc.async_llm import AsyncLLM

    intervals = [int(v) for v in args.stream_intervals.split(",")]
    http: dict[int, list[float]] = {interval: [] for interval in intervals}
    inproc: list[float] = []
    for _ in range(args.rounds):
        engine = AsyncLLM(
            model=args.model, dtype="float32", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs
        )
        try:
            inproc.append(in_process_tokens_per_s(engine, args))
        finally:
            engine.shutdown()
        for interval in intervals:
            flags = [*engine_flags(args), "--uvicorn-log-level", "warning", "--stream-interval", str(interval)]
            with RemoteServer(flags) as server:
                tok_s = bench_serve(load_config(args, server.url), log=lambda _: None)["output_throughput"]
            http[interval].append(tok_s)
        shown = ", ".join(f"HTTP stream-interval {i} {http[i][-1]:.1f}" for i in intervals)
        print(f"round: in-process {inproc[-1]:.1f} tok/s, {shown} tok/s", flush=True)
    in_process = statistics.median(inproc)
    result: dict = {"in_process_tok_s": in_process, "rounds": {"in_process": inproc}}
    for interval in intervals:
        median = statistics.median(http[interval])
        result[f"http_tok_s_interval_{interval}"] = median
        result[f"ratio_interval_{interval}"] = median / in_process
        result["rounds"][f"http_interval_{interval}"] = http[interval]
    return result


def _start_vllm(args: argparse.Namespace, port: int):
    import subprocess
    import urllib.request

    from vllite.assets import default_model_path

    model = args.model or str(default_model_path())
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
               "--port", str(port), "--served-model-name", "bench", "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(args.max_num_seqs), "--disable-uvicorn-access-log",
               "--gpu-memory-utilization", "0.4"]  # fmt: skip
    log = open(Path(args.output_dir) / "vllm-server.log", "w")  # noqa: SIM115
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM's server exited; see {log.name}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return process
        except OSError:
            time.sleep(1)
    process.kill()
    raise RuntimeError("vLLM's server did not start in 600 s")


def vllm_client(args: argparse.Namespace, url: str, name: str, round_index: int) -> dict:
    """One run of vLLM's own ``vllm bench serve`` client (random dataset) against ``url``; its saved JSON."""
    import subprocess

    from vllite.assets import default_model_path

    filename = f"vllm-client-{name}-{round_index}.json"
    command = [args.vllm_python, str(Path(__file__).with_name("vllm_bench_client.py")), "--backend", "vllm",
               "--base-url", url, "--tokenizer", args.model or str(default_model_path()), "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--random-range-ratio", str(args.range_ratio), "--num-prompts", str(args.num_prompts),
               "--max-concurrency", str(args.max_concurrency), "--request-rate", str(args.request_rate),
               "--ignore-eos", "--seed", str(args.seed), "--disable-tqdm", "--save-result",
               "--result-dir", str(Path(args.output_dir).resolve()), "--result-filename", filename]  # fmt: skip
    # From outside the checkout: nothing in it may shadow a package vLLM imports (vllite's kernels folder once did).
    subprocess.run(command, check=True, cwd="/", stdout=subprocess.DEVNULL)
    figures = json.loads((Path(args.output_dir) / filename).read_text())
    figures["failed"] = figures.get("failed", figures["num_prompts"] - figures["completed"])
    return figures


def peer(args: argparse.Namespace) -> dict:
    rows: dict[str, list[dict]] = {"vllite": [], "vllm": []}
    vllm = _start_vllm(args, args.vllm_port)
    try:
        with RemoteServer([*engine_flags(args), "--uvicorn-log-level", "warning"]) as server:
            for round_index in range(args.rounds):
                for name, url in (("vllite", server.url), ("vllm", f"http://127.0.0.1:{args.vllm_port}")):
                    if args.client == "vllm":
                        figures = vllm_client(args, url, name, round_index)
                    else:
                        figures = bench_serve(load_config(args, url), log=lambda _: None)
                    rows[name].append(figures)
                    print(
                        f"{name}: {figures['output_throughput']:.1f} tok/s, TTFT p50 {figures['median_ttft_ms']:.0f} "
                        f"ms, TPOT p50 {figures['median_tpot_ms']:.1f} ms, failed {figures['failed']}",
                        flush=True,
                    )
    finally:
        vllm.terminate()
        vllm.wait(60)
    keys = ["output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"]
    summary = {name: {k: statistics.median(r[k] for r in runs) for k in keys} for name, runs in rows.items()}
    summary["throughput_ratio_vllite_over_vllm"] = (
        summary["vllite"]["output_throughput"] / summary["vllm"]["output_throughput"]
    )
    return summary


def _p2p_flags(role: str) -> list[str]:
    config = {"kv_connector": "p2p", "kv_role": role, "kv_load_failure_policy": "recompute"}
    return ["--kv-transfer-config", json.dumps(config)]


def disagg(args: argparse.Namespace) -> dict:
    import os

    cpus = sorted(os.sched_getaffinity(0))
    half = max(1, len(cpus) // 2)
    prefill_cpus, decode_cpus = cpus[:half], cpus[half:] or cpus[:half]
    quiet = [*engine_flags(args), "--uvicorn-log-level", "warning"]

    def bind(cpu_list: list[int]) -> dict[str, str]:
        return {"VLLITE_CPU_OMP_THREADS_BIND": ",".join(map(str, cpu_list))}

    rows: dict[str, list[dict]] = {"colocated": [], "disaggregated": []}
    with (
        RemoteServer(quiet) as colocated,
        RemoteServer([*quiet, *_p2p_flags("kv_producer")], env=bind(prefill_cpus)) as prefill,
        RemoteServer([*quiet, *_p2p_flags("kv_consumer")], env=bind(decode_cpus)) as decode,
        RemoteServer(
            ["--prefill", prefill.url, "--decode", decode.url, "--uvicorn-log-level", "warning"],
            command="disagg-proxy",
        ) as proxy,
    ):
        for _ in range(args.rounds):
            for name, url in (("colocated", colocated.url), ("disaggregated", proxy.url)):
                figures = bench_serve(load_config(args, url), log=lambda _: None)
                rows[name].append(figures)
                print(
                    f"{name}: {figures['output_throughput']:.1f} tok/s, TTFT p50 {figures['median_ttft_ms']:.0f} ms, "
                    f"TPOT p50 {figures['median_tpot_ms']:.1f} ms p99 {figures['p99_tpot_ms']:.1f} ms, "
                    f"failed {figures['failed']}",
                    flush=True,
                )
    keys = ["output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"]
    summary: dict = {name: {k: statistics.median(r[k] for r in runs) for k in keys} for name, runs in rows.items()}
    summary["cpus"] = {"colocated": cpus, "prefill": prefill_cpus, "decode": decode_cpus}
    summary["throughput_ratio_disagg_over_colocated"] = (
        summary["disaggregated"]["output_throughput"] / summary["colocated"]["output_throughput"]
    )
    summary["p99_tpot_ratio_disagg_over_colocated"] = (
        summary["disaggregated"]["p99_tpot_ms"] / summary["colocated"]["p99_tpot_ms"]
    )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["overhead", "peer", "disagg"])
    common.add_model_args(parser)
    common.add_workload_args(parser, num_prompts=64, input_len=128)
    parser.add_argument("--range-ratio", type=float, default=0.0, help="Lengths vary by +-this fraction.")
    parser.add_argument("--request-rate", type=float, default=float("inf"))
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stream-intervals", default="1,8", help="overhead: the server's --stream-interval values.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-python", default=None, help="peer: the python that has vLLM installed.")
    parser.add_argument("--vllm-port", type=int, default=8765)
    parser.add_argument(
        "--client",
        choices=["vllite", "vllm"],
        default="vllite",
        help="peer: the load generator, `vllite bench serve`'s or vLLM's own `vllm bench serve` (needs --vllm-python).",
    )
    parser.add_argument("--max-concurrency", type=int, default=64, help="Requests in flight at most.")
    parser.add_argument("--output-dir", default="bench-results/serve")
    args = parser.parse_args()
    args.vocab_size = args.vocab_size or demo_vocab_size()
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    if args.mode == "peer" and not args.vllm_python:
        sys.exit("peer needs --vllm-python PATH (a python with vLLM installed)")
    result = {"overhead": overhead, "peer": peer, "disagg": disagg}[args.mode](args)
    path = Path(args.output_dir) / f"{args.mode}.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
