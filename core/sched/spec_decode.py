"""The scheduler's speculative-decoding figures: drafts verified and accepted, per step and since start-up.

With D drafts scheduled for a request and G tokens sampled for it, G - 1 drafts were accepted (the verifier
emits the accepted drafts and one more token). The per-step ``SpecDecodingStats`` ride on ``SchedulerStats``
(only when stats are on); the running totals (:class:`~vllite.engine.stats.SpecDecodingMetrics`) are kept
whenever speculative decoding is on, for in-process readers such as tests and benchmarks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllite.engine.stats import SpecDecodingMetrics
from vllite.protocol import SpecDecodingStats

if TYPE_CHECKING:
    from vllite.sched.output import ModelRunnerOutput, SchedulerOutput


class SpecDecodingTracker:
    """Counts each verified request's drafts and accepted drafts (``observe``, once per step)."""

    def __init__(self, num_spec_tokens: int, log_stats: bool) -> None:
        self.num_spec_tokens = num_spec_tokens
        self.log_stats = log_stats
        self.totals = SpecDecodingMetrics(num_accepted_tokens_per_pos=[0] * num_spec_tokens)
        self._stats = SpecDecodingStats.new(num_spec_tokens)

    @classmethod
    def from_config(cls, config: Any, log_stats: bool) -> SpecDecodingTracker | None:
        """A tracker when ``config.speculative_config`` is set, else ``None``."""
        spec = getattr(config, "speculative_config", None)
        return None if spec is None else cls(spec.num_speculative_tokens, log_stats)

    def observe(self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput) -> None:
        """Counts the step's verifications: every request with scheduled drafts that sampled tokens."""
        step = SpecDecodingStats.new(self.num_spec_tokens)
        index = model_runner_output.req_id_to_index
        sampled = model_runner_output.sampled_token_ids
        for request_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            row = index.get(request_id)
            if not drafts or row is None or not sampled[row]:
                continue
            step.observe_draft(len(drafts), min(len(sampled[row]) - 1, len(drafts)))
        if not step.num_drafts:
            return
        self.totals.add(step)
        if self.log_stats:
            self._stats = _merge(self._stats, step)

    def take_stats(self) -> SpecDecodingStats | None:
        """The figures since the previous call (``None`` when stats are off), and starts counting afresh."""
        if not self.log_stats:
            return None
        stats, self._stats = self._stats, SpecDecodingStats.new(self.num_spec_tokens)
        return stats


def _merge(into: SpecDecodingStats, step: SpecDecodingStats) -> SpecDecodingStats:
    into.num_drafts += step.num_drafts
    into.num_draft_tokens += step.num_draft_tokens
    into.num_accepted_tokens += step.num_accepted_tokens
    into.num_accepted_tokens_per_pos = [
        a + b for a, b in zip(into.num_accepted_tokens_per_pos, step.num_accepted_tokens_per_pos)
    ]
    return into
