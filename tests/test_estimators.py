"""Tool-call estimators: ``fixed`` reproduces the released fork's rule; ``utility`` returns the hand-computed τ*
of Eq. (2), follows the cold-start tiers, uses T·η and the prefill profile, and keeps bounded histories."""

from __future__ import annotations

import math

import pytest

from vllite.policies.estimators import (
    MIN_TTL_S,
    DurationHistory,
    FixedTTLEstimator,
    PrefillProfile,
    UtilityEstimator,
    best_ttl,
    exp_default_ttl,
)
from vllite.request import Request
from vllite.sampling_params import SamplingParams
from vllite.testing import make_config


def turn(rid: str, job: str | None = "J", tool: str | None = None, n: int = 10, **extra) -> Request:
    args = {"job_id": job, "this_func_call": tool, **extra}
    return Request(rid, list(range(n)), SamplingParams(extra_args=args))


def config(**policy_args):
    return make_config(policy_args=policy_args)


def observe(est, tool: str | None, duration: float, job: str = "J", t0: float = 0.0) -> None:
    """One turn calling ``tool`` finishes at t0; the next arrives ``duration`` later."""
    est.request_finished(turn(f"{job}-a", job, tool), t0)
    est.request_arrives(turn(f"{job}-b", job), t0 + duration)


# ---------------------------------------------------------------------- fixed
def test_fixed_reproduces_the_released_rule():
    est = FixedTTLEstimator(config())
    assert est.set_up_pin(turn("a", tool=None), 0.0) == 0.0  # no tool parsed: no pin
    assert est.set_up_pin(turn("a", tool="ls"), 0.0) == 2.0  # unseen tool: pins (mean counts as 0)
    observe(est, "ls", 1.0)
    observe(est, "ls", 3.0)  # mean exactly 2.0: still pins
    assert est.mean_duration("ls") == pytest.approx(2.0)
    assert est.set_up_pin(turn("a", tool="ls"), 0.0) == 2.0
    observe(est, "ls", 3.1)
    assert est.set_up_pin(turn("a", tool="ls"), 0.0) == 0.0  # slow tool: never pinned
    observe(est, "cd", 0.1)
    assert est.set_up_pin(turn("a", tool="cd"), 0.0) == 2.0


def test_duration_is_finish_to_next_arrival_and_client_last_func_call_wins():
    est = FixedTTLEstimator(config())
    est.request_finished(turn("a", tool="ls"), 10.0)
    nxt = turn("b", last_func_call="pytest")
    est.request_arrives(nxt, 14.0)
    assert est.mean_duration("pytest") == 4.0 and est.mean_duration("ls") == 0.0
    est.request_arrives(turn("c"), 20.0)  # no finished turn pending: nothing recorded
    assert est.mean_duration(None) == 0.0
    # overlapping first arrivals and unknown jobs are ignored
    est.request_arrives(turn("d", job=None), 1.0)


def test_fixed_state_is_bounded():
    est = FixedTTLEstimator(config(max_tools=3, max_jobs=4))
    for i in range(20):
        observe(est, f"tool{i}", 1.0, job=f"j{i}")
        est.request_finished(turn(f"x{i}", f"k{i}", "ls"), 0.0)
    assert len(est._stats) == 3 and len(est._jobs._last) == 4


# ---------------------------------------------------------------------- utility: Eq. (2)
@pytest.mark.parametrize(
    ("durations", "benefit", "expected"),
    [
        ([0.5, 1.0, 1.0, 4.0], 3.0, 1.0),  # 0.25·3-0.5=0.25, 0.75·3-1=1.25, 1·3-4<0
        ([0.5, 1.0, 1.0, 4.0], 10.0, 1.0),  # 7.5-1=6.5 beats 10-4=6
        ([0.5, 1.0, 1.0, 4.0], 20.0, 4.0),  # 20-4=16 beats 15-1=14
        ([0.5, 1.0, 1.0, 4.0], 0.5, 0.0),  # nothing beats not pinning
        ([2.0, 2.0, 8.0, 9.0], 5.0, 2.0),  # 0.5·5-2=0.5
        ([2.0, 2.0, 8.0, 9.0], 3.9, 0.0),  # 0.5·3.9-2<0
        ([], 100.0, 0.0),
        ([0.0, 0.0, 5.0], 1.0, MIN_TTL_S),  # instantaneous tools: the smallest pin
    ],
)
def test_best_ttl_hand_computed(durations, benefit, expected):
    assert best_ttl(sorted(durations), benefit) == pytest.approx(expected)


def test_best_ttl_matches_brute_force():
    import random

    rng = random.Random(3)
    for _ in range(200):
        ds = sorted(round(rng.expovariate(1.0), 2) + 0.01 for _ in range(rng.randrange(1, 30)))
        b = rng.uniform(0, 6)
        values = {0.0: 0.0} | {t: sum(d <= t for d in ds) / len(ds) * b - t for t in ds}
        best = max(values.items(), key=lambda kv: (kv[1], -kv[0]))
        assert best_ttl(ds, b) == pytest.approx(best[0]), (ds, b)


def test_exp_default_ttl():
    assert exp_default_ttl(3.0) == pytest.approx(math.log(3.0))
    assert exp_default_ttl(1.0) == 0.0 and exp_default_ttl(0.2) == 0.0
    assert exp_default_ttl(6.0, mean=2.0) == pytest.approx(2.0 * math.log(3.0))


def test_cold_start_tiers():
    # B = prefill 3 s (constant profile), T = 0.
    est = UtilityEstimator(config(cold_start_k=3, prefill_profile=[3.0, 0.0, 0.0]))
    r = turn("r", tool="f")
    assert est.tier("f") == "default"
    assert est.set_up_pin(r, 0.0) == pytest.approx(math.log(3.0))
    for d in (2.5, 2.5, 2.5):
        observe(est, "g", d)
    assert est.tier("f") == "default"  # |S| = 3 ≤ K
    observe(est, "f", 0.5)  # |S| = 4 > K, |S[f]| = 1 ≤ K: the global CDF
    assert est.tier("f") == "global"
    # global {0.5, 2.5x3}: τ=0.5 → 0.25·3-0.5 = 0.25; τ=2.5 → 3-2.5 = 0.5 → 2.5
    assert est.set_up_pin(r, 0.0) == pytest.approx(2.5)
    for _ in range(3):
        observe(est, "f", 0.5)
    assert est.tier("f") == "tool"  # |S[f]| = 4 > K: f's own CDF → 0.5
    assert est.set_up_pin(r, 0.0) == pytest.approx(0.5)
    assert est.tier("unseen") == "global" and est.tier(None) == "global"
    # unknown tool: the global CDF {0.5x4, 2.5x3}: τ=0.5 → 4/7·3-0.5 ≈ 1.21 beats τ=2.5 → 0.5
    assert est.set_up_pin(turn("u", tool=None), 0.0) == pytest.approx(0.5)


def test_default_ttl_override_and_fixed_k():
    est = UtilityEstimator(config(default_ttl=1.5))
    assert est.k == 100
    assert est.set_up_pin(turn("r", tool="f"), 0.0) == 1.5


def test_benefit_uses_queueing_delay_eta_and_prefill_profile():
    est = UtilityEstimator(config(eta=1.5, prefill_profile=[0.0, 0.01, 0.0], queueing_window=2))
    r = turn("r", n=100)  # prefill 1.0 s
    assert est.benefit(r) == pytest.approx(1.0)
    est.record_queueing_delay(10.0)
    est.record_queueing_delay(2.0)
    est.record_queueing_delay(4.0)  # window of 2: T = 3
    assert est.mean_queueing_delay == pytest.approx(3.0)
    assert est.benefit(r) == pytest.approx(3.0 * 1.5 + 1.0)


def test_prefill_profile_fit_and_forms():
    true = (0.05, 1e-4, 3e-9)
    points = [[n, true[0] + true[1] * n + true[2] * n * n] for n in (1000, 2000, 4000, 8000, 16000)]
    fitted = PrefillProfile.fit(points)
    for got, want in zip(fitted.coeffs, true):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert PrefillProfile.from_policy_args({"points": points})(3000) == pytest.approx(
        true[0] + true[1] * 3000 + true[2] * 9e6
    )
    assert PrefillProfile.from_policy_args([1, 2, 3]).coeffs == (1.0, 2.0, 3.0)
    assert PrefillProfile.from_policy_args({"coeffs": [1, 0, 0]})(10**6) == 1.0
    assert PrefillProfile.from_policy_args(None).coeffs == PrefillProfile.DEFAULT
    with pytest.raises(ValueError):
        PrefillProfile([1.0, 2.0])
    with pytest.raises(ValueError):
        PrefillProfile.fit([[1, 1], [1, 2], [2, 3]])


def test_histories_are_bounded_and_sorted():
    h = DurationHistory(3)
    for v in (5.0, 1.0, 3.0, 2.0):
        h.append(v)
    assert len(h) == 3 and h.sorted == [1.0, 2.0, 3.0]  # 5.0, the oldest, aged out
    est = UtilityEstimator(config(history_size=4, global_history_size=6, max_tools=2))
    for i in range(10):
        observe(est, f"t{i % 3}", float(i))
    assert len(est.global_history) == 6 and len(est.tool_history) == 2
    assert all(len(h) <= 4 for h in est.tool_history.values())
