"""A simulated executor: tokens without a model, step time from a cost model, on a virtual clock.

``SimExecutor`` (registered as executor ``sim``, selected with ``--device sim`` or ``--executor sim``) plays the
model runner's part for the real scheduler and KV-cache manager, unchanged: it keeps each request's token count
the way a worker does, samples a token when a step reaches the end of a request's known tokens (token ids from a
per-request seeded RNG, so runs are reproducible whatever the batch), and instead of running a forward pass it
advances a :class:`SimClock` by the step's cost under a :class:`CostModel`. Nothing sleeps, so an agent workload
of tens of thousands of tokens per program replays in seconds of CPU time.

The clock is shared: the executor exposes it as ``executor.clock`` and ``EngineCore`` builds the scheduler with
``clock=executor.clock``, so the scheduler's timestamps, a policy's TTLs and the replay driver's tool completions
all run on the same virtual time. To share a clock with a driver, put it in the config before building the
engine::

    clock = SimClock()
    config.plugin_config["sim"] = {"clock": clock, "kv_cache_gib": 8.0}
    core = EngineCore(config)          # executor "sim" (config.executor or --device sim)
    core.step()                        # clock() has advanced by the step's modelled cost

Settings, all optional, in ``config.plugin_config["sim"]``: ``clock`` (a ``SimClock``), ``cost`` (a dict of
:class:`CostModel` fields), ``profile`` (a JSON-lines file of measured steps to fit the cost model to),
``max_model_len`` (default 32768, or ``--max-model-len``), ``kv_cache_gib`` and ``kv_bytes_per_token`` (the
simulated KV memory; ``--num-gpu-blocks-override`` wins), ``vocab_size`` and ``seed``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllite.executor import Executor, KVCacheInfo, ModelInfo
from vllite.sched.output import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    pass

GiB = 1 << 30
DEFAULT_MAX_MODEL_LEN = 32768
#: Llama-3.1-8B in bf16: 2 (K, V) x 32 layers x 8 KV heads x 128 head dim x 2 bytes.
LLAMA_8B_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
DEFAULT_KV_CACHE_GIB = 8.0


class SimClock:
    """A virtual clock: ``clock()`` returns the current virtual time in seconds; only ``advance`` moves it.

    Pass the instance wherever a ``Callable[[], float]`` clock is expected (the scheduler's ``clock=``).
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def __call__(self) -> float:
        return self._now

    @property
    def now(self) -> float:
        """The current virtual time in seconds."""
        return self._now

    def advance(self, seconds: float) -> float:
        """Moves the clock forward by ``seconds`` (>= 0) and returns the new time."""
        if seconds < 0:
            raise ValueError(f"A clock cannot go back: advance({seconds}).")
        self._now += seconds
        return self._now

    def advance_to(self, when: float) -> float:
        """Moves the clock to ``when`` if that is later; never backwards. Returns the new time."""
        if when > self._now:
            self._now = float(when)
        return self._now

    def __repr__(self) -> str:
        return f"SimClock(now={self._now:.6f})"


@dataclass(frozen=True)
class CostModel:
    """Seconds one engine step takes: ``fixed_s + per_token_s * tokens + per_context_token_s * context``.

    ``tokens`` are the tokens computed in the step (prefill chunks and decodes); ``context`` is the sum, over the
    requests in the step, of the context each attends to (tokens already computed plus those of this step), the
    KV that attention reads. The defaults approximate Llama-3.1-8B in bf16 on one A100: ~8 ms to stream the
    weights, ~0.1 ms per token of compute, ~65 ns per context token of KV read (128 KiB at ~2 TB/s).
    """

    fixed_s: float = 0.008
    per_token_s: float = 1.0e-4
    per_context_token_s: float = 6.5e-8

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"CostModel.{f.name} must be a number >= 0, got {value!r}.")

    def step_time(self, num_tokens: int, num_context_tokens: int) -> float:
        """The modelled duration of a step computing ``num_tokens`` over ``num_context_tokens`` of context."""
        if num_tokens <= 0:
            return 0.0
        return self.fixed_s + self.per_token_s * num_tokens + self.per_context_token_s * num_context_tokens

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> CostModel:
        """Builds a cost model from a dict of its fields; unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"Unknown cost-model keys {sorted(unknown)}; known: {sorted(known)}.")
        return cls(**{k: float(v) for k, v in values.items()})

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def fit(cls, samples: Iterable[Sequence[float]]) -> CostModel:
        """Least-squares fit to measured steps ``(num_tokens, num_context_tokens, seconds)``.

        Needs at least three samples that vary in both token counts. Negative coefficients (noise) are clamped
        to 0 and the others refitted, so the model stays physical.
        """
        import numpy as np

        rows = np.asarray([tuple(s)[:3] for s in samples], dtype=float)
        if rows.ndim != 2 or len(rows) < 3:
            raise ValueError("CostModel.fit needs at least 3 samples of (num_tokens, num_context_tokens, seconds).")
        design = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
        target = rows[:, 2]
        active = [0, 1, 2]
        coef = np.zeros(3)
        while active:
            solution, *_ = np.linalg.lstsq(design[:, active], target, rcond=None)
            if (solution >= 0).all():
                coef[:] = 0.0
                coef[active] = solution
                break
            active = [a for a, c in zip(active, solution) if c >= 0]
        return cls(float(coef[0]), float(coef[1]), float(coef[2]))

    @classmethod
    def from_profile(cls, path: str | Path) -> CostModel:
        """Fits to a JSON-lines profile: one ``{"num_tokens", "num_context_tokens", "seconds"}`` object a line."""
        samples = []
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                samples.append((row["num_tokens"], row["num_context_tokens"], row["seconds"]))
        return cls.fit(samples)


def step_load(scheduler_output: SchedulerOutput) -> tuple[int, int]:
    """``(tokens computed, context tokens attended)`` of a scheduled step, as the cost model counts them."""
    computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    computed.update(zip(cached.req_ids, cached.num_computed_tokens))
    context = sum(computed[rid] + n for rid, n in scheduler_output.num_scheduled_tokens.items())
    return scheduler_output.total_num_scheduled_tokens, context


class SimExecutor(Executor):
    """Executor ``sim``: drives the real scheduler with modelled step times on a virtual clock (no model)."""

    def _init_executor(self) -> ModelInfo:
        config = self.config
        settings: dict[str, Any] = dict(config.plugin_config.get("sim") or {})
        clock = settings.get("clock")
        if clock is not None and not isinstance(clock, SimClock):
            raise TypeError(f"plugin_config['sim']['clock'] must be a SimClock, got {type(clock).__name__}.")
        self.clock: SimClock = clock or SimClock()
        if settings.get("profile"):
            self.cost_model = CostModel.from_profile(settings["profile"])
        else:
            self.cost_model = CostModel.from_dict(dict(settings.get("cost") or {}))
        self.vocab_size = int(settings.get("vocab_size", 32000))
        self.seed = int(settings.get("seed", config.model_config.seed))
        self.kv_cache_gib = float(settings.get("kv_cache_gib", DEFAULT_KV_CACHE_GIB))
        self.kv_bytes_per_token = int(settings.get("kv_bytes_per_token", LLAMA_8B_KV_BYTES_PER_TOKEN))
        max_model_len = config.model_config.max_model_len or int(settings.get("max_model_len", DEFAULT_MAX_MODEL_LEN))
        self.num_tokens: dict[str, int] = {}  # the worker's view: prompt + outputs known per request
        self._rngs: dict[str, random.Random] = {}
        self.num_steps = 0
        self.busy_time = 0.0
        return ModelInfo(max_model_len=max_model_len, vocab_size=self.vocab_size)

    def initialize_kv_cache(self) -> KVCacheInfo:
        """Blocks from ``--num-gpu-blocks-override``, else the simulated ``kv_cache_gib`` budget."""
        cache = self.config.cache_config
        if cache.num_gpu_blocks_override is not None:
            num_blocks = int(cache.num_gpu_blocks_override)
        else:
            num_blocks = int(self.kv_cache_gib * GiB) // (self.kv_bytes_per_token * cache.block_size)
        max_model_len = self.model_info.max_model_len
        if num_blocks * cache.block_size < max_model_len:
            raise ValueError(
                f"The simulated KV cache ({num_blocks} blocks of {cache.block_size}) cannot hold one request of "
                f"max_model_len={max_model_len}; raise kv_cache_gib or num_gpu_blocks_override."
            )
        return KVCacheInfo(num_blocks=num_blocks, max_model_len=max_model_len)

    def _sample(self, request_id: str) -> int:
        rng = self._rngs.get(request_id)
        if rng is None:
            rng = self._rngs[request_id] = random.Random(f"{self.seed}:{request_id}")
        return rng.randrange(self.vocab_size)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Applies the schedule to the per-request token counts, samples, and advances the clock by the cost."""
        so = scheduler_output
        for request_id in so.finished_req_ids:
            self.num_tokens.pop(request_id, None)
            self._rngs.pop(request_id, None)
        for request_id in so.preempted_req_ids:
            self.num_tokens.pop(request_id, None)
        for new in so.scheduled_new_reqs:
            self.num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        num_tokens, num_context = step_load(so)
        computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for request_id, num_scheduled in so.num_scheduled_tokens.items():
            drafts = so.scheduled_spec_decode_tokens.get(request_id, ())
            end = computed[request_id] + num_scheduled - len(drafts)
            known = self.num_tokens[request_id]
            tokens: list[int] = []
            if end >= known:  # the step reaches the end of the known tokens: sample one (drafts rejected)
                tokens.append(self._sample(request_id))
                self.num_tokens[request_id] = known + 1
            req_ids.append(request_id)
            sampled.append(tokens)
        elapsed = self.cost_model.step_time(num_tokens, num_context)
        self.clock.advance(elapsed)
        self.busy_time += elapsed
        self.num_steps += 1
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={rid: i for i, rid in enumerate(req_ids)}, sampled_token_ids=sampled
        )

    def shutdown(self) -> None:
        self.num_tokens.clear()
        self._rngs.clear()
