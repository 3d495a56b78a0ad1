"""Structured outputs with n-gram speculative decoding: drafts cut at the grammar's first refusal, every verified
position masked by the bitmask row of its draft position."""

from __future__ import annotations

from test_structured_output_engine import CASES, sample

from vllite import LLM, SamplingParams
from vllite.testing.models import make_tiny_model_dir_cached


def model_path_str() -> str:
    return str(make_tiny_model_dir_cached("llama"))


def test_speculative_decoding_keeps_outputs_valid_and_greedy_exact():
    model_path = model_path_str()
    """n-gram drafts of constrained requests are cut at the grammar's first refusal and every verified position is
    masked: greedy output equals the run without speculation, sampled outputs stay valid."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    so_config = {"disable_any_whitespace": True}
    plain = LLM(model_path, max_model_len=512, structured_outputs_config=so_config)
    drafting = LLM(model_path, max_model_len=512, structured_outputs_config=so_config, speculative_config=spec)
    try:
        # A prompt that repeats JSON text, so prompt lookup proposes drafts that are (partly) grammar-valid.
        prompt = 'Give me data: {"name": "ab", "kind": "cat", "age": 3, "tags": [], "owner": {"id": 1, "vip": true}}'
        for constraint, check in CASES.values():
            greedy = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=constraint)
            expected = plain.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
            got = drafting.generate(prompt, greedy, use_tqdm=False)[0].outputs[0]
            assert got.token_ids == expected.token_ids and check(got.text)
            outputs = sample(drafting, constraint, 6)
            assert all(o.finish_reason == "stop" and check(o.text) for o in outputs), [o.text for o in outputs]
        metrics = drafting.llm_engine.engine_core.engine_core.scheduler.spec_decoding.totals
        assert metrics.num_draft_tokens > 0
    finally:
        plain.llm_engine.shutdown()
        drafting.llm_engine.shutdown()
