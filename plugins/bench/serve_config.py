"""The flags of ``vllite bench serve`` and the run's configuration (:class:`ServeBenchConfig`).

Light on purpose: ``vllite`` builds every command's parser at start-up, so this module imports only the standard
library; the run (:mod:`vllite.plugins.bench.serve`, asyncio, aiohttp) loads when the command is chosen.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from typing import Any

#: The metrics a run reports, in table order.
METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")


@dataclass
class ServeBenchConfig:
    """One ``vllite bench serve`` run; the fields are the command's flags."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = field(default=None, repr=False)  # None: $OPENAI_API_KEY, then $VLLITE_API_KEY
    num_prompts: int | None = None  # None: 100, or unlimited with a duration
    duration: float | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    random_input_len: int = 256
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    vocab_size: int | None = None  # random token ids in [0, vocab_size); None: the demo model's
    tokenizer: str | None = None
    dataset_path: str | None = None
    ignore_eos: bool | None = None  # None: on for random prompts, off for a dataset
    temperature: float = 0.0
    return_token_ids: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    percentile_metrics: list[str] = field(default_factory=lambda: list(METRIC_NAMES))
    metric_percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    save_result: bool = False
    result_dir: str = "."
    result_filename: str | None = None

    @property
    def chat(self) -> bool:
        """Whether the endpoint is chat completions (messages in, deltas out)."""
        return self.endpoint.rstrip("/").endswith("chat/completions")


# ---------------------------------------------------------------------------------------------- command line
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``vllite bench serve`` (``vllm bench serve``'s names where it has them)."""
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="The server (default http://127.0.0.1:8000).")
    add("--endpoint", default="/v1/completions", help="/v1/completions (default) or /v1/chat/completions.")
    add("--model", default=None, help="Model name to send (default: the first id of GET /v1/models).")
    add("--api-key", default=None, help="Bearer token (default: $OPENAI_API_KEY, then $VLLITE_API_KEY).")
    add("--num-prompts", type=int, default=None, help="Requests to send (default 100; no limit with --duration).")
    add("--duration", type=float, default=None, help="Stop sending after this many seconds.")
    add("--request-rate", type=float, default=math.inf, help="Requests per second; inf (default) sends all at once.")
    add("--burstiness", type=float, default=1.0, help="Gamma shape of the arrivals: 1 = Poisson, < 1 burstier.")
    add("--max-concurrency", type=int, default=None, help="At most this many requests in flight.")
    add("--random-input-len", type=int, default=256, help="Random prompts: prompt tokens.")
    add("--random-output-len", type=int, default=64, help="Random prompts: max_tokens (also a dataset's default).")
    add("--random-range-ratio", type=float, default=0.0, help="Lengths uniform in [len*(1-r), len*(1+r)].")
    add("--vocab-size", type=int, default=None, help="Random token ids below this (default: the demo model's).")
    add("--tokenizer", default=None, help="Tokenizer folder: send random prompts as text (needed for chat).")
    add("--dataset-path", default=None, help='JSON lines of {"prompt": TEXT or [IDS], "max_tokens": N}.')
    add("--ignore-eos", action=argparse.BooleanOptionalAction, default=None, help="Default: on for random prompts.")
    add("--temperature", type=float, default=0.0)
    add(
        "--return-token-ids",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Ask for token_ids in the chunks (vLLM/vllite extra; count tokens exactly).",
    )
    add("--extra-body", type=json.loads, default=None, help="JSON object merged into every request body.")
    add("--seed", type=int, default=0)
    add("--percentile-metrics", type=_names, default=list(METRIC_NAMES), help="Of ttft,tpot,itl,e2el (default all).")
    add("--metric-percentiles", type=_floats, default=[50.0, 90.0, 99.0], help="Default 50,90,99.")
    add("--save-result", action="store_true", help="Write the figures and per-request values as JSON.")
    add("--result-dir", default=".", help="Folder for --save-result (default: the current one).")
    add("--result-filename", default=None, help="File name for --save-result (default: rate, model and time).")


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """The :class:`ServeBenchConfig` of parsed flags."""
    values = {k: getattr(args, k) for k in ServeBenchConfig.__dataclass_fields__ if hasattr(args, k)}
    if values.get("extra_body") is None:
        values["extra_body"] = {}
    elif not isinstance(values["extra_body"], dict):
        raise ValueError("--extra-body must be a JSON object.")
    return ServeBenchConfig(**values)
