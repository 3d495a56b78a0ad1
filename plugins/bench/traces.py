"""Agent traces for ``vllite bench agent``: the file format, Poisson arrivals, and a synthetic generator.

Format (JSON lines, one job — an agent program — per line)::

    {"job_id": "swe-0", "turns": [
        {"new_prompt_tokens": 3400, "output_tokens": 140, "tool": "grep", "tool_duration_s": 0.12},
        {"new_prompt_tokens": 260, "output_tokens": 95, "tool": "pytest", "tool_duration_s": 7.9},
        {"new_prompt_tokens": 410, "output_tokens": 120, "tool": null, "tool_duration_s": 0.0}]}

Turn ``i``'s prompt is the job's whole history — every earlier turn's new prompt tokens and output tokens — plus
its own ``new_prompt_tokens`` (the system prompt and task for turn 0, the tool's observation afterwards), so the
prefix cache can serve everything but the new part. ``output_tokens`` is the planned output length (forced at
replay with ``max_tokens`` and ``ignore_eos``); ``tool``/``tool_duration_s`` is the tool the turn calls and how
long it runs before the next turn arrives; the last turn calls none. An optional ``"arrival_s"`` fixes the job's
arrival; otherwise the replay draws Poisson arrivals. Lines starting with ``#`` are comments.

"Tokens per program" (Table 2 of the Continuum paper) is counted as the sum over turns of the full prompt plus
the output, i.e. what an engine without prefix caching would compute.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Turn:
    """One LLM call of a job and the tool call that follows it."""

    new_prompt_tokens: int
    output_tokens: int
    tool: str | None = None
    tool_duration_s: float = 0.0

    def __post_init__(self) -> None:
        if self.new_prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"A turn needs >= 1 new prompt token and >= 1 output token, got {self}.")
        if self.tool_duration_s < 0:
            raise ValueError(f"tool_duration_s must be >= 0, got {self.tool_duration_s}.")


@dataclass
class Job:
    """An agent program: turns executed in order, separated by tool calls."""

    job_id: str
    turns: list[Turn]
    arrival_s: float | None = None

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"Job {self.job_id!r} has no turns.")

    def prompt_len(self, index: int) -> int:
        """The full prompt length of turn ``index`` (history + its new tokens), as planned."""
        return (
            sum(t.new_prompt_tokens + t.output_tokens for t in self.turns[:index]) + self.turns[index].new_prompt_tokens
        )

    @property
    def max_context(self) -> int:
        """Prompt plus output of the last turn: the longest context the job reaches."""
        return self.prompt_len(len(self.turns) - 1) + self.turns[-1].output_tokens

    @property
    def total_tokens(self) -> int:
        """Tokens per program: the sum over turns of full prompt plus output."""
        return sum(self.prompt_len(i) + t.output_tokens for i, t in enumerate(self.turns))

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"job_id": self.job_id, "turns": [vars(t) for t in self.turns]}
        if self.arrival_s is not None:
            data["arrival_s"] = self.arrival_s
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Job:
        turns = [
            Turn(
                int(t["new_prompt_tokens"]),
                int(t["output_tokens"]),
                t.get("tool"),
                float(t.get("tool_duration_s") or 0.0),
            )
            for t in data["turns"]
        ]
        arrival = data.get("arrival_s")
        return cls(str(data["job_id"]), turns, None if arrival is None else float(arrival))


def write_trace(path: str | Path, jobs: Iterable[Job]) -> Path:
    """Writes jobs as JSON lines; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for job in jobs:
            f.write(json.dumps(job.to_dict(), separators=(",", ":")) + "\n")
    return path


def read_trace(path: str | Path) -> list[Job]:
    """Reads a JSON-lines trace; ``ValueError`` naming the line on a malformed record."""
    jobs: list[Job] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            jobs.append(Job.from_dict(json.loads(line)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: bad job record: {exc}") from exc
    return jobs


def poisson_arrivals(num_jobs: int, jobs_per_s: float, seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process at ``jobs_per_s``; the first job arrives at 0."""
    if jobs_per_s <= 0:
        raise ValueError(f"jobs_per_s must be > 0, got {jobs_per_s}.")
    rng = random.Random(seed)
    times, now = [], 0.0
    for i in range(num_jobs):
        if i:
            now += rng.expovariate(jobs_per_s)
        times.append(now)
    return times


# ---------------------------------------------------------------------------------------------- generator
@dataclass(frozen=True)
class ToolProfile:
    """A tool: how often it is called, its lognormal duration, and the size of its observation (tokens)."""

    name: str
    weight: float
    median_s: float
    sigma: float
    obs_median_tokens: float
    obs_sigma: float = 0.8


@dataclass(frozen=True)
class WorkloadPreset:
    """Parameters of a synthetic agent workload (turn count ~ rounded normal; lengths ~ lognormal)."""

    name: str
    turns_mean: float
    turns_std: float
    turns_min: int
    turns_max: int
    first_prompt_median: float
    first_prompt_sigma: float
    output_median: float
    output_sigma: float
    tools: tuple[ToolProfile, ...]
    max_tool_s: float = 60.0
    max_context: int = 32768
    targets: dict[str, float] = field(default_factory=dict)


#: mini-swe-agent on SWE-bench (Table 2: 10.9 ± 2.1 turns, tool 925 ± 3550 ms, 70,126 ± 19,732 tokens/program).
SWE_BENCH = WorkloadPreset(
    name="swe",
    turns_mean=10.9,
    turns_std=2.1,
    turns_min=2,
    turns_max=24,
    first_prompt_median=4300,
    first_prompt_sigma=0.15,
    output_median=130,
    output_sigma=0.5,
    tools=(
        ToolProfile("cat", 0.21, 0.03, 0.6, 250, 0.5),
        ToolProfile("grep", 0.18, 0.08, 0.9, 155, 0.5),
        ToolProfile("sed", 0.14, 0.04, 0.6, 55, 0.5),
        ToolProfile("find", 0.11, 0.06, 0.8, 95, 0.5),
        ToolProfile("python", 0.21, 0.5, 1.0, 180, 0.5),
        ToolProfile("git", 0.08, 0.05, 0.5, 150, 0.5),
        ToolProfile("pytest", 0.075, 6.6, 0.85, 420, 0.5),
    ),
    max_tool_s=120.0,
    max_context=32768,
    targets={
        "turns_mean": 10.9,
        "turns_std": 2.1,
        "tool_ms_mean": 925,
        "tool_ms_std": 3550,
        "tokens_mean": 70126,
        "tokens_std": 19732,
    },
)

#: BFCL v4 web search (Table 2: 6.3 ± 2.3 turns, tool 1,923 ± 2,133 ms, 93,256 ± 68,687 tokens/program).
BFCL = WorkloadPreset(
    name="bfcl",
    turns_mean=6.3,
    turns_std=2.3,
    turns_min=1,
    turns_max=16,
    first_prompt_median=1200,
    first_prompt_sigma=0.3,
    output_median=160,
    output_sigma=0.5,
    tools=(
        ToolProfile("web_search", 0.5, 0.95, 0.5, 1500, 0.5),
        ToolProfile("fetch_url", 0.5, 1.9, 0.84, 5800, 0.5),
    ),
    max_tool_s=60.0,
    max_context=65536,
    targets={
        "turns_mean": 6.3,
        "turns_std": 2.3,
        "tool_ms_mean": 1923,
        "tool_ms_std": 2133,
        "tokens_mean": 93256,
        "tokens_std": 68687,
    },
)

PRESETS: dict[str, WorkloadPreset] = {"swe": SWE_BENCH, "bfcl": BFCL}


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def generate_job(preset: WorkloadPreset, job_id: str, rng: random.Random) -> Job:
    """One synthetic job; turns stop early (the job ends) where the next prompt would not fit ``max_context``."""
    num_turns = min(preset.turns_max, max(preset.turns_min, round(rng.gauss(preset.turns_mean, preset.turns_std))))
    names = [t for t in preset.tools]
    weights = [t.weight for t in preset.tools]
    turns: list[Turn] = []
    context = 0
    new_prompt = max(1, round(_lognormal(rng, preset.first_prompt_median, preset.first_prompt_sigma)))
    for index in range(num_turns):
        output = max(1, round(_lognormal(rng, preset.output_median, preset.output_sigma)))
        tool = rng.choices(names, weights)[0]
        duration = min(preset.max_tool_s, _lognormal(rng, tool.median_s, tool.sigma))
        observation = max(1, round(_lognormal(rng, tool.obs_median_tokens, tool.obs_sigma)))
        fits_next = context + new_prompt + output + observation + 2 * preset.output_median <= preset.max_context
        last = index == num_turns - 1 or not fits_next
        if context + new_prompt + output > preset.max_context:
            break  # cannot happen for turn 0 with sane presets; guards hand-made ones
        turns.append(Turn(new_prompt, output, None if last else tool.name, 0.0 if last else round(duration, 4)))
        if last:
            break
        context += new_prompt + output
        new_prompt = observation
    return Job(job_id, turns)


def scale_tokens(preset: WorkloadPreset, token_scale: float) -> WorkloadPreset:
    """``preset`` with every token length and its max context multiplied by ``token_scale`` (turn counts and tool
    times unchanged): a small model with a short context can replay the same shape of work."""
    if not token_scale > 0:
        raise ValueError(f"token_scale must be > 0, got {token_scale!r}.")
    if token_scale == 1.0:
        return preset
    tools = tuple(replace(t, obs_median_tokens=t.obs_median_tokens * token_scale) for t in preset.tools)
    return replace(
        preset,
        first_prompt_median=preset.first_prompt_median * token_scale,
        output_median=preset.output_median * token_scale,
        tools=tools,
        max_context=max(1, int(preset.max_context * token_scale)),
        targets={},
    )


def generate_trace(preset: WorkloadPreset | str, num_jobs: int, seed: int = 0, token_scale: float = 1.0) -> list[Job]:
    """``num_jobs`` synthetic jobs of a preset (``"swe"``, ``"bfcl"`` or a ``WorkloadPreset``), reproducibly;
    ``token_scale`` shrinks (or grows) every token length, see :func:`scale_tokens`."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"Unknown workload {preset!r}; known: {', '.join(PRESETS)}.")
        preset = PRESETS[preset]
    preset = scale_tokens(preset, token_scale)
    rng = random.Random(f"{preset.name}:{seed}")
    return [generate_job(preset, f"{preset.name}-{i}", rng) for i in range(num_jobs)]


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    return statistics.fmean(values), (statistics.pstdev(values) if len(values) > 1 else 0.0)


def trace_stats(jobs: Sequence[Job]) -> dict[str, float]:
    """Table-2 statistics of a trace: turns, tool time (ms) and tokens per program, mean and std each."""
    turns_mean, turns_std = _mean_std([len(j.turns) for j in jobs])
    tool_ms = [t.tool_duration_s * 1000 for j in jobs for t in j.turns if t.tool is not None]
    tool_mean, tool_std = _mean_std(tool_ms)
    tokens_mean, tokens_std = _mean_std([j.total_tokens for j in jobs])
    return {
        "jobs": len(jobs),
        "turns_mean": turns_mean,
        "turns_std": turns_std,
        "tool_ms_mean": tool_mean,
        "tool_ms_std": tool_std,
        "tokens_mean": tokens_mean,
        "tokens_std": tokens_std,
        "max_context": max((j.max_context for j in jobs), default=0),
    }
