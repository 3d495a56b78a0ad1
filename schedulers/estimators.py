"""Tool-call estimators for the Continuum scheduler: how long to keep a finished turn's KV pinned.

An estimator is built as ``cls(config)`` and sees every turn of every job:

- ``request_arrives(request, now)``: a turn arrived. If its job's previous turn finished with a tool call, the
  gap ``now - finish`` is that tool's duration (measured server-side, so it includes client and network time).
- ``request_finished(request, now)``: a non-last turn of a job finished (its tool, if known, is in
  ``turn_info(request).this_func_call``).
- ``set_up_pin(request, now) -> float``: the TTL in seconds for the turn that just finished; 0 = do not pin.
- optional ``record_queueing_delay(seconds)``: the scheduler reports how long an "evicted" turn (one whose job
  held no pin when it arrived) waited before admission.

``fixed`` is the released fork's rule; ``utility`` (the default) is the paper's Eq. (2) with the cold-start
tiers. All histories are bounded: per-tool samples and the number of tools and jobs are capped (oldest first).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from vllite.policies.continuum_turns import turn_info
from vllite.request import Request

if TYPE_CHECKING:
    from vllite.config import EngineConfig

FIXED_THRESHOLD_S = 2.0
MIN_TTL_S = 1e-3  # the TTL when instantaneous tools make pinning worth it
UNKNOWN_TOOL = None  # turns whose tool is unknown share one key


def _policy_args(config: EngineConfig | None) -> dict[str, Any]:
    return dict(config.scheduler_config.policy_args) if config is not None else {}


class _JobGaps:
    """Per job, the finish time and tool of its last finished turn, until its next turn arrives (LRU-capped)."""

    def __init__(self, max_jobs: int) -> None:
        self.max_jobs = max_jobs
        self._last: OrderedDict[str, tuple[float, str | None]] = OrderedDict()

    def finished(self, job_id: str, now: float, tool: str | None) -> None:
        self._last[job_id] = (now, tool)
        self._last.move_to_end(job_id)
        while len(self._last) > self.max_jobs:
            self._last.popitem(last=False)

    def arrived(self, request: Request, now: float) -> tuple[str | None, float] | None:
        """``(tool, duration)`` when the job's previous turn finished with a recorded departure, else None."""
        info = turn_info(request)
        if info.job_id is None:
            return None
        last = self._last.pop(info.job_id, None)
        if last is None:
            return None
        finished_at, tool = last
        if info.last_func_call is not None:
            tool = info.last_func_call
        elif tool is not None:
            info.last_func_call = tool
        return tool, max(0.0, now - finished_at)

    def forget(self, job_id: str) -> None:
        self._last.pop(job_id, None)


class FixedTTLEstimator:
    """The released code's rule: pin for 2.0 s when the tool's mean observed duration is ≤ 2.0 s; a tool never
    seen counts as mean 0 (so a cold start pins); a turn with no known tool is not pinned.

    ``policy_args``: ``fixed_ttl`` (2.0) and ``fixed_threshold`` (2.0). Memory: a running (sum, count) per tool,
    at most ``max_tools`` tools (least recently seen dropped) and ``max_jobs`` jobs in flight.
    """

    accepted_policy_args: ClassVar[dict[str, str]] = {
        "fixed_ttl": "pin duration in seconds (2.0)",
        "fixed_threshold": "pin when the tool's mean duration is at most this many seconds (2.0)",
        "max_tools": "tools remembered (256)",
        "max_jobs": "jobs in flight remembered (10000)",
    }

    def __init__(self, config: EngineConfig | None = None) -> None:
        args = _policy_args(config)
        self.ttl = float(args.get("fixed_ttl", FIXED_THRESHOLD_S))
        self.threshold = float(args.get("fixed_threshold", FIXED_THRESHOLD_S))
        self.max_tools = int(args.get("max_tools", 256))
        self._jobs = _JobGaps(int(args.get("max_jobs", 10_000)))
        self._stats: OrderedDict[str | None, tuple[float, int]] = OrderedDict()

    def request_arrives(self, request: Request, now: float) -> None:
        gap = self._jobs.arrived(request, now)
        if gap is None:
            return
        tool, duration = gap
        total, count = self._stats.pop(tool, (0.0, 0))
        self._stats[tool] = (total + duration, count + 1)
        while len(self._stats) > self.max_tools:
            self._stats.popitem(last=False)

    def request_finished(self, request: Request, now: float) -> None:
        info = turn_info(request)
        if info.job_id is not None:
            self._jobs.finished(info.job_id, now, info.this_func_call)

    def mean_duration(self, tool: str | None) -> float:
        """The mean observed duration of ``tool``; 0.0 when never observed."""
        total, count = self._stats.get(tool, (0.0, 0))
        return total / count if count else 0.0

    def set_up_pin(self, request: Request, now: float) -> float:
        tool = turn_info(request).this_func_call
        if tool is None:
            return 0.0
        return 0.0 if self.mean_duration(tool) > self.threshold else self.ttl

    def forget_job(self, job_id: str) -> None:
        """The job ended: drop what is kept about it."""
        self._jobs.forget(job_id)


class DurationHistory:
    """The last ``maxlen`` durations, also kept sorted (for the empirical CDF). Appending ages out the oldest."""

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self._order: deque[float] = deque()
        self.sorted: list[float] = []

    def append(self, value: float) -> None:
        self._order.append(value)
        bisect.insort(self.sorted, value)
        if len(self._order) > self.maxlen:
            old = self._order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]

    def __len__(self) -> int:
        return len(self._order)


def best_ttl(sorted_durations: Sequence[float], benefit: float) -> float:
    """τ* = argmax over τ ∈ {0} U durations of P(τ)·benefit - τ, with P the empirical CDF of the durations.

    Ties go to the smaller τ. Durations above ``benefit`` are never better than τ = 0, so the scan stops there.
    τ = 0 means "do not pin"; when observed durations of 0 s win, the TTL is ``MIN_TTL_S`` instead.
    """
    n = len(sorted_durations)
    if n == 0 or benefit <= 0.0:
        return 0.0
    best_tau, best_value = 0.0, 0.0
    pinned = False
    end = bisect.bisect_right(sorted_durations, benefit)
    i = 0
    while i < end:
        tau = sorted_durations[i]
        # P(τ) counts every duration ≤ τ: skip to the last duplicate.
        j = bisect.bisect_right(sorted_durations, tau, i, n)
        value = (j / n) * benefit - tau
        if value > best_value + 1e-12:
            best_tau, best_value, pinned = tau, value, True
        i = j
    return max(best_tau, MIN_TTL_S) if pinned else 0.0


def exp_default_ttl(benefit: float, mean: float = 1.0) -> float:
    """The optimum of (1 - e^(-τ/μ))·B - τ (tool time ~ Exp with mean μ): μ·ln(B/μ) when B > μ, else 0."""
    if mean <= 0.0 or benefit <= mean:
        return 0.0
    return mean * math.log(benefit / mean)


class PrefillProfile:
    """Prefill (reload) time in seconds for a context of ``n`` tokens: c0 + c1·n + c2·n².

    Built from coefficients, or least-squares fitted to measured ``(tokens, seconds)`` points (the paper profiles
    1k, 2k, 4k, … tokens at start-up and fits a quadratic). The default is a modest CPU-class profile.
    """

    DEFAULT = (0.02, 2.0e-4, 2.0e-9)

    def __init__(self, coeffs: Sequence[float] = DEFAULT) -> None:
        if len(coeffs) != 3:
            raise ValueError(f"a quadratic prefill profile needs 3 coefficients, got {list(coeffs)!r}")
        self.coeffs = tuple(float(c) for c in coeffs)

    @classmethod
    def fit(cls, points: Sequence[Sequence[float]]) -> PrefillProfile:
        """The least-squares quadratic through ``points`` ([tokens, seconds] pairs; at least 3 distinct lengths)."""
        xs = [float(p[0]) for p in points]
        ys = [float(p[1]) for p in points]
        if len(set(xs)) < 3:
            raise ValueError("fitting a quadratic prefill profile needs at least 3 distinct lengths")
        scale = max(abs(x) for x in xs)  # normalise for conditioning
        us = [x / scale for x in xs]
        s = [sum(u**k for u in us) for k in range(5)]
        t = [sum(y * u**k for u, y in zip(us, ys)) for k in range(3)]
        a = [[s[0], s[1], s[2], t[0]], [s[1], s[2], s[3], t[1]], [s[2], s[3], s[4], t[2]]]
        for col in range(3):  # Gauss-Jordan with partial pivoting
            pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
            a[col], a[pivot] = a[pivot], a[col]
            for row in range(3):
                if row != col:
                    f = a[row][col] / a[col][col]
                    a[row] = [x - f * y for x, y in zip(a[row], a[col])]
        c = [a[k][3] / a[k][k] for k in range(3)]
        return cls((c[0], c[1] / scale, c[2] / scale**2))

    @classmethod
    def from_policy_args(cls, value: Any) -> PrefillProfile:
        """``None`` → default; ``[c0, c1, c2]``; ``{"coeffs": [...]}``; or ``{"points": [[tokens, s], ...]}``."""
        if value is None:
            return cls()
        if isinstance(value, dict):
            if "points" in value:
                return cls.fit(value["points"])
            return cls(value["coeffs"])
        return cls(value)

    def __call__(self, num_tokens: int) -> float:
        c0, c1, c2 = self.coeffs
        return max(0.0, c0 + c1 * num_tokens + c2 * num_tokens * num_tokens)


class UtilityEstimator:
    """The paper's TTL (Eq. 2): τ* = argmax over τ ∈ {0} U S of P(τ, f)·(T·η + prefill_reload(r)) - τ.

    - P(τ, f): the empirical CDF of tool f's observed durations S[f];
    - T: the mean queueing delay of the last ``queueing_window`` evicted turns (0 until one is observed);
    - η: ``eta`` (memoryfulness, default 1);
    - prefill_reload(r): :class:`PrefillProfile` at the finished turn's length (``prefill_profile``).

    Cold start (K = ``cold_start_k``, 100): while the global history holds ≤ K durations, the TTL is the optimum
    under Exp(``cold_start_mean_s``) tool times (or ``default_ttl`` if given); while f has ≤ K durations the
    global CDF stands in for f's. A turn with no known tool uses the global CDF. Histories keep the last
    ``history_size`` durations per tool (``global_history_size`` overall), at most ``max_tools`` tools.
    """

    accepted_policy_args: ClassVar[dict[str, str]] = {
        "eta": "memoryfulness η (1.0)",
        "cold_start_k": "durations needed before a history is trusted (100)",
        "cold_start_mean_s": "mean tool time of the cold-start exponential model (1.0)",
        "default_ttl": "TTL during the cold start instead of the exponential optimum (none)",
        "prefill_profile": "prefill time model: coefficients or points (built-in profile)",
        "history_size": "durations kept per tool (1000)",
        "global_history_size": "durations kept overall (5000)",
        "max_tools": "tools remembered (256)",
        "queueing_window": "evicted turns averaged for the queueing delay T (100)",
        "max_jobs": "jobs in flight remembered (10000)",
    }

    def __init__(self, config: EngineConfig | None = None) -> None:
        args = _policy_args(config)
        self.eta = float(args.get("eta", 1.0))
        self.k = int(args.get("cold_start_k", 100))
        self.cold_start_mean = float(args.get("cold_start_mean_s", 1.0))
        default_ttl = args.get("default_ttl")
        self.default_ttl = None if default_ttl is None else float(default_ttl)
        self.prefill_reload = PrefillProfile.from_policy_args(args.get("prefill_profile"))
        self.history_size = int(args.get("history_size", 1000))
        self.max_tools = int(args.get("max_tools", 256))
        self.global_history = DurationHistory(int(args.get("global_history_size", 5000)))
        self.tool_history: OrderedDict[str | None, DurationHistory] = OrderedDict()
        self._waits: deque[float] = deque(maxlen=int(args.get("queueing_window", 100)))
        self._jobs = _JobGaps(int(args.get("max_jobs", 10_000)))

    # ------------------------------------------------------------------ observations
    def request_arrives(self, request: Request, now: float) -> None:
        gap = self._jobs.arrived(request, now)
        if gap is None:
            return
        tool, duration = gap
        self.record_duration(tool, duration)

    def record_duration(self, tool: str | None, duration: float) -> None:
        """Adds one observed duration of ``tool`` (also to the global history)."""
        self.global_history.append(duration)
        if tool is UNKNOWN_TOOL:
            return
        history = self.tool_history.pop(tool, None) or DurationHistory(self.history_size)
        history.append(duration)
        self.tool_history[tool] = history
        while len(self.tool_history) > self.max_tools:
            self.tool_history.popitem(last=False)

    def request_finished(self, request: Request, now: float) -> None:
        info = turn_info(request)
        if info.job_id is not None:
            self._jobs.finished(info.job_id, now, info.this_func_call)

    def record_queueing_delay(self, seconds: float) -> None:
        """One evicted turn's wait from arrival to admission."""
        self._waits.append(max(0.0, seconds))

    def forget_job(self, job_id: str) -> None:
        """The job ended: drop what is kept about it."""
        self._jobs.forget(job_id)

    # ------------------------------------------------------------------ the TTL
    @property
    def mean_queueing_delay(self) -> float:
        """T: the sliding-window mean wait of evicted turns (0 before any)."""
        return sum(self._waits) / len(self._waits) if self._waits else 0.0

    def benefit(self, request: Request) -> float:
        """T·η + prefill_reload(r), in seconds."""
        return self.mean_queueing_delay * self.eta + self.prefill_reload(request.num_tokens)

    def tier(self, tool: str | None) -> str:
        """Which cold-start tier applies: ``default``, ``global`` or ``tool``."""
        if len(self.global_history) <= self.k:
            return "default"
        history = self.tool_history.get(tool) if tool is not None else None
        if history is None or len(history) <= self.k:
            return "global"
        return "tool"

    def set_up_pin(self, request: Request, now: float) -> float:
        tool = turn_info(request).this_func_call
        benefit = self.benefit(request)
        tier = self.tier(tool)
        if tier == "default":
            if self.default_ttl is not None:
                return self.default_ttl
            return exp_default_ttl(benefit, self.cold_start_mean)
        history = self.global_history if tier == "global" else self.tool_history[tool]
        return best_ttl(history.sorted, benefit)
