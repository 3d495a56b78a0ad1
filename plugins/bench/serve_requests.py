"""What ``vllite bench serve`` sends, and when: prompt datasets and the arrival process.

- :class:`RandomDataset` — random prompts of ``input_len`` tokens (uniform in ``[len·(1-r), len·(1+r)]``) asking
  for ``output_len`` tokens, reproducible per index from the seed. Without a tokenizer the prompt is the token-id
  list itself (``/v1/completions`` of vllite and vLLM accept one); with a tokenizer it is the decoded text.
- :class:`JsonlDataset` — one ``{"prompt": ..., "max_tokens": ...}`` object a line (``prompt``: text or token ids).
- :func:`iter_arrivals` / :func:`arrival_times` — send times of a gamma-renewal process at ``rate`` req/s
  (``burstiness`` = gamma shape; 1 = Poisson, < 1 burstier, > 1 more regular); ``rate = inf`` sends everything at 0.
  The first request goes at 0, as in ``vllm bench serve``.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: the prompt (text or token ids), its length in tokens if known, and ``max_tokens``."""

    prompt: str | list[int]
    prompt_len: int | None
    max_tokens: int


def uniform_length(rng: random.Random, length: int, range_ratio: float, minimum: int = 1) -> int:
    """A length drawn uniformly from ``[length·(1-range_ratio), length·(1+range_ratio)]`` (at least ``minimum``)."""
    low, high = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    return max(minimum, rng.randint(low, max(low, high)))


class RandomDataset:
    """Random-token prompts; ``dataset[i]`` is the same request for the same seed, for any integer ``i``."""

    def __init__(
        self,
        input_len: int,
        output_len: int,
        *,
        range_ratio: float = 0.0,
        vocab_size: int,
        seed: int = 0,
        tokenizer: Any = None,
    ) -> None:
        if not 0.0 <= range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
        if input_len < 1 or output_len < 1:
            raise ValueError("--random-input-len and --random-output-len must be >= 1.")
        self.input_len, self.output_len, self.range_ratio = input_len, output_len, range_ratio
        self.seed, self.tokenizer = seed, tokenizer
        self.vocab_size = int(getattr(tokenizer, "vocab_size", 0) or vocab_size) if tokenizer else vocab_size
        if self.vocab_size < 1:
            raise ValueError(f"vocab size must be >= 1, got {self.vocab_size}.")

    def __getitem__(self, index: int) -> BenchRequest:
        rng = random.Random(f"{self.seed}:{index}")
        num_input = uniform_length(rng, self.input_len, self.range_ratio)
        num_output = uniform_length(rng, self.output_len, self.range_ratio)
        ids = [rng.randrange(self.vocab_size) for _ in range(num_input)]
        if self.tokenizer is None:
            return BenchRequest(ids, num_input, num_output)
        # Decoded random ids re-encode to a different length; trim the re-encoding and decode that (as vLLM does).
        text = self.tokenizer.decode(ids)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:num_input]
        return BenchRequest(self.tokenizer.decode(ids), len(ids), num_output)


class JsonlDataset:
    """Requests from a JSON-lines file, cycled: ``dataset[i]`` is line ``i mod len``.

    Each line is ``{"prompt": TEXT or [TOKEN_IDS], "max_tokens": N}``; ``max_tokens`` defaults to
    ``default_max_tokens``. Blank lines and lines starting with ``#`` are skipped.
    """

    def __init__(self, path: str | Path, default_max_tokens: int, tokenizer: Any = None) -> None:
        self.requests: list[BenchRequest] = []
        for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                record = json.loads(line)
                prompt = record["prompt"]
                max_tokens = int(record.get("max_tokens", default_max_tokens))
                if isinstance(prompt, list):
                    prompt = [int(t) for t in prompt]
                elif not isinstance(prompt, str):
                    raise TypeError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"{path}:{number}: bad request record: {exc}") from exc
            if isinstance(prompt, list):
                prompt_len: int | None = len(prompt)
            else:
                prompt_len = len(tokenizer.encode(prompt)) if tokenizer is not None else None
            self.requests.append(BenchRequest(prompt, prompt_len, max_tokens))
        if not self.requests:
            raise ValueError(f"{path}: no requests.")

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, index: int) -> BenchRequest:
        return self.requests[index % len(self.requests)]


def iter_arrivals(rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Send times (s from the start), endless: 0, then gamma(``burstiness``, 1/(rate·burstiness)) gaps.

    The mean gap is ``1/rate`` whatever the burstiness; ``rate = inf`` gives 0 forever.
    """
    if not rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf for a burst), got {rate}.")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}.")
    if math.isinf(rate):
        return itertools.repeat(0.0)
    return _gamma_renewal(random.Random(seed), burstiness, 1.0 / (rate * burstiness))


def _gamma_renewal(rng: random.Random, shape: float, scale: float) -> Iterator[float]:
    now = 0.0
    while True:
        yield now
        now += rng.gammavariate(shape, scale)


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """The first ``num_requests`` send times of :func:`iter_arrivals`."""
    return list(itertools.islice(iter_arrivals(rate, burstiness, seed), num_requests))
