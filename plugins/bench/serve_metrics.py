"""The figures of a ``vllite bench serve`` run and their table, in ``vllm bench serve``'s names and layout.

:func:`summarize` turns the per-request :class:`~vllite.plugins.bench.serve_client.RequestResult` list
and the run's duration into a flat dict: ``completed``, ``failed``, ``duration``, token totals, throughputs, and
for each metric of ``ttft``, ``tpot``, ``itl``, ``e2el`` its ``mean_*_ms``, ``median_*_ms``, ``std_*_ms`` and
``p{P}_*_ms``. ITL pools every gap of every request; the others are one value per successful request (TPOT only
for requests of two tokens or more). :func:`format_table` prints them as vLLM does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from vllite.plugins.bench.serve_client import RequestResult

METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear interpolation between ranks (numpy's default); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _std(values: Sequence[float]) -> float:
    """Population standard deviation (numpy's default)."""
    if not values:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def _label(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def metric_values(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Per metric, its samples in seconds over the successful requests."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    *,
    prompt_lens: Sequence[int | None] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
    metrics: Sequence[str] = tuple(METRICS),
) -> dict[str, Any]:
    """The run's figures (times in ms) from its requests and ``duration`` (s, first send to last response).

    ``prompt_lens[i]`` is request ``i``'s prompt length where the server did not report ``usage.prompt_tokens``.
    """
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {', '.join(unknown)}: choose from {', '.join(METRICS)}.")
    lens = list(prompt_lens) if prompt_lens is not None else [None] * len(results)
    ok = [(r, n) for r, n in zip(results, lens, strict=True) if r.success]
    input_lens = [r.prompt_tokens if r.prompt_tokens is not None else (n or 0) for r, n in ok]
    output_lens = [r.output_tokens for r, _ in ok]
    failed = [r for r in results if not r.success]
    total_input, total_output = sum(input_lens), sum(output_lens)
    per_s = 1.0 / duration if duration > 0 else 0.0
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) * per_s,
        "output_throughput": total_output * per_s,
        "total_token_throughput": (total_input + total_output) * per_s,
    }
    values = metric_values([r for r, _ in ok])
    for name in metrics:
        ms = [1000.0 * v for v in values[name]]
        summary[f"mean_{name}_ms"] = _mean(ms)
        summary[f"median_{name}_ms"] = percentile(ms, 50)
        summary[f"std_{name}_ms"] = _std(ms)
        for p in percentiles:
            summary[f"p{_label(p)}_{name}_ms"] = percentile(ms, p)
    summary["input_lens"] = input_lens
    summary["output_lens"] = output_lens
    return summary


def format_table(
    summary: dict[str, Any], *, percentiles: Sequence[float] = (50, 90, 99), metrics: Sequence[str] = tuple(METRICS)
) -> str:
    """The summary as ``vllm bench serve`` prints it (the median stands for P50)."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, value: Any) -> None:
        text = f"{value:<10.2f}" if isinstance(value, float) else f"{value:<10}"
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", float(summary["duration"]))
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", float(summary["request_throughput"]))
    row("Output token throughput (tok/s):", float(summary["output_throughput"]))
    row("Total Token throughput (tok/s):", float(summary["total_token_throughput"]))
    for name in metrics:
        short, header = METRICS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", float(summary[f"mean_{name}_ms"]))
        row(f"Median {short} (ms):", float(summary[f"median_{name}_ms"]))
        for p in percentiles:
            if p != 50:
                row(f"P{_label(p)} {short} (ms):", float(summary[f"p{_label(p)}_{name}_ms"]))
    lines.append("=" * 50)
    if summary.get("first_error"):
        lines.append(f"First error: {summary['first_error']}")
    return "\n".join(lines)
