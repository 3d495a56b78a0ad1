"""n-gram speculative decoding, unit level: the config, the prompt-lookup drafter, the rejection sampler, the
acceptance statistics and their Prometheus metrics. End-to-end equality and distribution tests are in
``test_spec_decode_e2e.py``."""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import pytest
import torch

from vllite.config import SpeculativeConfig
from vllite.engine.stats import SpecDecodingMetrics
from vllite.engine_args import EngineArgs
from vllite.logits_processor import LogitsProcessor
from vllite.plugins.engine_proc.stat_loggers import SpecDecodingStatLogger
from vllite.plugins.transformers_executor.sampler import SamplingMetadata
from vllite.plugins.transformers_executor.spec_decode.decoder import NgramSpecDecoder
from vllite.plugins.transformers_executor.spec_decode.ngram import NgramProposer, find_ngram_draft
from vllite.plugins.transformers_executor.spec_decode.rejection_sampler import NO_DRAFT, RejectionSampler
from vllite.protocol import SchedulerStats, SpecDecodingStats

# ---------------------------------------------------------------------------------------------------- config


def test_cli_flag_reaches_the_vllm_shaped_config():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}',
        ]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.speculative_config == SpeculativeConfig("ngram", 3, 2, 4)
    assert config.speculative_config.num_lookahead_slots == 3 and not config.speculative_config.use_eagle()
    assert EngineArgs.from_cli_args(parser.parse_args([])).create_engine_config().speculative_config is None


def test_lookup_bounds_default_as_in_vllm():
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}) == SpeculativeConfig(
        "ngram", 2, 5, 5
    )
    only_max = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    only_min = SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert (only_min.method, only_min.prompt_lookup_min, only_min.prompt_lookup_max) == ("ngram", 2, 2)


@pytest.mark.parametrize(
    ("value", "field"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel": 1}, "draft_tensor_parallel"),
        ({"model": "some/draft-model", "num_speculative_tokens": 2}, "model"),
        ("[1, 2]", "JSON object"),
        ("{not json", "JSON"),
    ],
)
def test_bad_speculative_config_names_the_field(value, field):
    with pytest.raises(ValueError, match=field):
        EngineArgs(speculative_config=value).create_engine_config()


# ---------------------------------------------------------------------------------------------------- drafter


def test_drafter_takes_the_longest_then_latest_match():
    tokens = np.array([1, 2, 3, 4, 1, 2, 3, 9, 1, 2, 3])
    assert find_ngram_draft(tokens, 1, 3, 2).tolist() == [9, 1]  # "1 2 3" last seen before 9
    assert find_ngram_draft(tokens, 1, 3, 10).tolist() == [9, 1, 2, 3]  # fewer when the history ends
    # "7 3" never occurred, but "3" did (latest at index 6): the shorter n-gram is used.
    assert find_ngram_draft(np.array([3, 5, 3, 6, 7, 3]), 1, 2, 2).tolist() == [6, 7]
    # A longer match wins over a more recent shorter one.
    assert find_ngram_draft(np.array([8, 2, 3, 4, 0, 3, 5, 8, 2, 3]), 1, 3, 1).tolist() == [4]


def test_drafter_respects_the_bounds():
    tokens = np.array([1, 2, 3, 4, 1, 2, 3])
    assert find_ngram_draft(tokens, 4, 5, 3).tolist() == []  # "4 1 2 3" never occurred earlier
    assert find_ngram_draft(tokens, 3, 3, 3).tolist() == [4, 1, 2]
    assert find_ngram_draft(tokens, 1, 3, 0).tolist() == []
    assert find_ngram_draft(np.array([7]), 1, 3, 3).tolist() == []
    assert find_ngram_draft(np.array([5, 5, 5, 5]), 1, 3, 3).tolist() == [5]  # the match may overlap the suffix


def test_drafter_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, 4, size=int(rng.integers(1, 40)))
        low = int(rng.integers(1, 4))
        high = low + int(rng.integers(0, 3))
        k = int(rng.integers(1, 6))
        expected: list[int] = []
        for n in range(high, low - 1, -1):
            if len(tokens) <= n:
                continue
            suffix = tokens[-n:].tolist()
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n].tolist() == suffix]
            if starts:
                expected = tokens[starts[-1] + n : starts[-1] + n + k].tolist()
                break
        assert find_ngram_draft(tokens, low, high, k).tolist() == expected, (tokens, low, high, k)


def test_proposer_caps_per_row():
    proposer = NgramProposer(3, 1, 2)
    token_ids = np.zeros((3, 16), dtype=np.int64)
    token_ids[0, :6] = [1, 2, 3, 1, 2, 9]
    token_ids[1, :5] = [4, 5, 6, 4, 5]
    token_ids[2, :3] = [7, 8, 7]
    drafts = proposer.propose(token_ids, np.array([6, 5, 3]), [0, 1, 2], [3, 1, 0])
    assert drafts == {1: [6]}  # row 0 has no match, row 1 is capped at 1, row 2 may not draft


def test_logits_indices_keep_each_requests_last_positions():
    indices, first_rows = NgramSpecDecoder.logits_indices(np.array([0, 5, 6, 10]), np.array([2, 0, 3]))
    assert indices.tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert first_rows.tolist() == [0, 3, 4]


# ---------------------------------------------------------------------------------------------------- rejection


def chi2_passes(statistic: float, dof: int, alpha: float = 1e-3) -> bool:
    """Whether a chi-square ``statistic`` with ``dof`` degrees of freedom is below the ``1 - alpha`` quantile
    (scipy's when installed, else the Wilson-Hilferty approximation)."""
    try:
        from scipy import stats
    except ImportError:
        z = statistics.NormalDist().inv_cdf(1 - alpha)
        return statistic < dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3
    return bool(stats.chi2.sf(statistic, dof) > alpha)


def chi_square_agrees(observed: np.ndarray, expected: np.ndarray) -> bool:
    """Pearson's goodness-of-fit test at level 0.001: counts ``observed`` against probabilities ``expected``."""
    observed = np.asarray(observed, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    expected = expected * observed.sum() / expected.sum()
    return chi2_passes(float(((observed - expected) ** 2 / expected).sum()), len(observed) - 1)


def same_distribution(table: np.ndarray, alpha: float = 1e-3) -> bool:
    """Pearson's homogeneity test at level ``alpha`` on a ``samples x categories`` table of counts."""
    table = np.asarray(table, dtype=np.float64)
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    statistic = float(((table - expected) ** 2 / expected).sum())
    return chi2_passes(statistic, (table.shape[0] - 1) * (table.shape[1] - 1), alpha)


def test_chi_square_helpers_reject_a_different_distribution():
    assert same_distribution(np.array([[500, 300, 200], [510, 290, 200]]))
    assert not same_distribution(np.array([[500, 300, 200], [400, 400, 200]]))
    assert chi_square_agrees(np.array([400, 600]), np.array([0.4, 0.6]))
    assert not chi_square_agrees(np.array([300, 700]), np.array([0.4, 0.6]))


def _metadata(temperature: list[float], generators=None, default_seed: int = 0) -> SamplingMetadata:
    t = torch.tensor(temperature, dtype=torch.float32)
    greedy = t < 1e-5
    default = torch.Generator().manual_seed(default_seed)
    return SamplingMetadata(
        temperature=t,
        all_greedy=bool(greedy.all()),
        all_random=bool((~greedy).all()),
        top_p=None,
        top_k=None,
        generators=generators or {},
        default_generator=default,
        max_num_logprobs=None,
    )


def test_greedy_accepts_exactly_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    drafts = torch.tensor([1, 2, NO_DRAFT])
    result = RejectionSampler().verify(logits, _metadata([0.0, 0.0, 0.0]), drafts)
    assert result.token_ids.tolist() == [1, 0, 2]
    assert result.accepted.tolist() == [True, False, False]


def test_mixed_batch_greedy_rows_ignore_randomness():
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, 3.0, 1.0]])
    result = RejectionSampler().verify(logits, _metadata([0.0, 1.0]), torch.tensor([2, NO_DRAFT]))
    assert result.token_ids[0].item() == 1 and not result.accepted[0].item()
    assert not result.accepted[1].item()


def test_a_certain_draft_is_always_accepted():
    logits = torch.full((64, 5), float("-inf"))
    logits[:, 3] = 0.0
    result = RejectionSampler().verify(logits, _metadata([1.0] * 64), torch.full((64,), 3))
    assert result.accepted.all() and (result.token_ids == 3).all()


def test_sampled_tokens_follow_the_target_distribution():
    """With the draft token x, the emitted token is distributed as p, x is accepted with probability p(x), and a
    rejection never emits x."""
    n = 40_000
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = p.log().expand(n, 4).clone()
    md = _metadata([1.0] * n, default_seed=123)
    result = RejectionSampler().verify(logits, md, torch.full((n,), 1))
    counts = torch.bincount(result.token_ids, minlength=4).numpy()
    assert chi_square_agrees(counts, p.numpy())
    accepted = result.accepted.numpy()
    assert abs(accepted.mean() - 0.3) < 0.02
    assert (result.token_ids.numpy()[~accepted] != 1).all()


def test_temperature_and_top_k_define_p():
    n = 30_000
    logits = torch.tensor([2.0, 1.0, 0.0, -5.0]).expand(n, 4).clone()
    md = _metadata([2.0] * n, default_seed=7)
    md.top_k = torch.full((n,), 3)
    result = RejectionSampler().verify(logits, md, torch.full((n,), 0))
    target = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 2.0, -1)
    counts = torch.bincount(result.token_ids, minlength=4).numpy()
    assert counts[3] == 0
    assert chi_square_agrees(counts[:3], target.numpy())


def test_a_seeded_row_depends_only_on_its_generator():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    drafts = torch.tensor([4, 4, 4])

    def run(default_seed: int) -> tuple[int, bool]:
        md = _metadata([1.0, 1.0, 1.0], {1: torch.Generator().manual_seed(99)}, default_seed)
        result = RejectionSampler().verify(logits.clone(), md, drafts)
        return int(result.token_ids[1]), bool(result.accepted[1])

    assert run(0) == run(1) == run(2)


# ---------------------------------------------------------------------------------------------------- stats


def test_stats_count_drafts_and_positions():
    stats = SpecDecodingStats.new(3)
    stats.observe_draft(3, 2)
    stats.observe_draft(2, 0)
    stats.observe_draft(3, 3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 8, 5)
    assert stats.num_accepted_tokens_per_pos == [2, 2, 1]
    logger = SpecDecodingStatLogger()
    logger.record(SchedulerStats(spec_decoding_stats=stats), None)
    logger.record(SchedulerStats(), None)
    logger.record(SchedulerStats(spec_decoding_stats=stats), None)
    metrics = logger.metrics[0]
    assert metrics.num_drafts == 6 and metrics.num_accepted_tokens_per_pos == [4, 4, 2]
    assert metrics.acceptance_rate == pytest.approx(10 / 16)
    assert metrics.mean_acceptance_length == pytest.approx(1 + 10 / 6)
    assert metrics.per_position_acceptance_rates == pytest.approx([4 / 6, 4 / 6, 2 / 6])
    assert SpecDecodingMetrics().acceptance_rate == 0.0


def test_prometheus_metrics_use_vllms_names():
    pytest.importorskip("prometheus_client")
    from vllite.plugins.openai_server.observability.metrics import PrometheusStatLogger
    from vllite.protocol import EngineInfo

    info = EngineInfo(max_model_len=128, num_gpu_blocks=8, block_size=16, max_num_batched_tokens=128, vocab_size=64)
    metrics = PrometheusStatLogger("m", info)
    stats = SpecDecodingStats.new(2)
    stats.observe_draft(2, 1)
    stats.observe_draft(2, 2)
    metrics.record(SchedulerStats(spec_decoding_stats=stats), None)
    body = metrics.render()[0].decode()
    labels = 'engine="0",model_name="m"'
    assert f"vllite:spec_decode_num_drafts_total{{{labels}}} 2.0" in body
    assert f"vllite:spec_decode_num_draft_tokens_total{{{labels}}} 4.0" in body
    assert f"vllite:spec_decode_num_accepted_tokens_total{{{labels}}} 3.0" in body
    assert f'vllite:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="0"}} 2.0' in body
    assert f'vllite:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="1"}} 1.0' in body


class _SeesSpeculativeConfig(LogitsProcessor):
    """A V1 processor that records the engine config it was built with (as a vLLM plugin would read it)."""

    seen: list = []

    def __init__(self, vllm_config, device, is_pin_memory) -> None:
        type(self).seen.append(vllm_config.speculative_config)

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        return None

    def apply(self, logits):
        return logits


def test_plugins_see_the_speculative_config(monkeypatch):
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    from vllite import LLM
    from vllite.testing import make_tiny_model_dir_cached

    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    _SeesSpeculativeConfig.seen.clear()
    with LLM(
        str(make_tiny_model_dir_cached("llama")),
        max_model_len=64,
        speculative_config=spec,
        logits_processors=[_SeesSpeculativeConfig],
    ):
        pass
    (seen,) = _SeesSpeculativeConfig.seen
    assert (seen.method, seen.num_speculative_tokens, seen.prompt_lookup_min, seen.prompt_lookup_max) == (
        "ngram",
        4,
        2,
        3,
    )


def test_vllm_compat_serves_speculative_config():
    from vllite.plugins.vllm_compat.served import SERVED_MODULES

    assert SERVED_MODULES["vllm.config"]["SpeculativeConfig"] == "vllite.config:SpeculativeConfig"
