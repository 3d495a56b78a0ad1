"""The user API end to end on a tiny model: stop strings, n > 1, output kinds, finish reasons, seeds, bad input."""

from __future__ import annotations

import pytest

from vllite import LLM, SamplingParams
from vllite.exceptions import ModelLoadError
from vllite.sampling_params import RequestOutputKind
from vllite.testing import make_tiny_model_dir_cached

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "class Point:", "# compute the mean of a list"]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(str(make_tiny_model_dir_cached("llama")), dtype="float32", max_model_len=128, max_num_seqs=8)
    yield engine
    engine.shutdown()


def greedy(max_tokens=16, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_outputs_in_input_order_with_lengths(llm):
    outputs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.prompt for o in outputs] == PROMPTS
    for o in outputs:
        assert len(o.outputs[0].token_ids) == 16
        assert o.finished and o.outputs[0].finish_reason == "length"


def test_stop_string_truncates_and_reports(llm):
    full = llm.generate(PROMPTS[0], greedy(24), use_tqdm=False)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    for include in (False, True):
        out = llm.generate(PROMPTS[0], greedy(24, stop=[stop], include_stop_str_in_output=include), use_tqdm=False)
        completion = out[0].outputs[0]
        assert completion.finish_reason == "stop" and completion.stop_reason == stop
        cut = full.index(stop)
        assert completion.text == (full[: cut + len(stop)] if include else full[:cut])


def test_stop_token_id_and_eos(llm):
    tokens = llm.generate(PROMPTS[1], greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = tokens[5]
    out = llm.generate(PROMPTS[1], greedy(16, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert out.token_ids == tokens[: tokens.index(stop_id) + 1]
    # min_tokens keeps the stop token from ending the request early.
    out = llm.generate(PROMPTS[1], greedy(16, stop_token_ids=[stop_id], min_tokens=16), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 16


def test_n_greater_than_one(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPTS[2], params, use_tqdm=False)[0]
    assert sorted(c.index for c in out.outputs) == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different child seeds give different samples


def test_seeded_sampling_reproducible_across_batches(llm):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate([PROMPTS[3], PROMPTS[0], PROMPTS[1]], [others, params, others], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds(llm, kind):
    engine = llm.llm_engine
    engine.add_request("kind-test", PROMPTS[0], greedy(6, output_kind=kind))
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    final_text = llm.generate(PROMPTS[0], greedy(6), use_tqdm=False)[0].outputs[0].text
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(seen) == 1 and seen[0].outputs[0].text == final_text
    elif kind == RequestOutputKind.DELTA:
        assert len(seen) >= 2
        assert "".join(o.outputs[0].text for o in seen) == final_text
        assert sum(len(o.outputs[0].token_ids) for o in seen) == 6
    else:
        assert seen[-1].outputs[0].text == final_text
        assert [len(o.outputs[0].token_ids) for o in seen] == sorted(len(o.outputs[0].token_ids) for o in seen)


def test_abort_gives_abort_reason(llm):
    engine = llm.llm_engine
    engine.add_request("to-abort", PROMPTS[0], greedy(50, output_kind=RequestOutputKind.DELTA))
    engine.step()
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()


def test_chat(llm):
    out = llm.chat([{"role": "user", "content": "hello"}], greedy(5), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_bad_input_is_clear_and_engine_keeps_serving(llm):
    with pytest.raises(ValueError, match=r"max_model_len|too long|longer"):
        llm.generate({"prompt_token_ids": [11] * 500}, greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(PROMPTS[0], SamplingParams(temperature=-1.0), use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], {"prompt_token_ids": [11] * 500}], greedy(4), use_tqdm=False)
    outputs = llm.generate(PROMPTS, greedy(4), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
    assert not llm.llm_engine.has_unfinished_requests()


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM(str(tmp_path / "does-not-exist"))


def test_model_folder_without_tokenizer(tmp_path):
    import shutil

    src = make_tiny_model_dir_cached("llama")
    dst = tmp_path / "no-tokenizer"
    dst.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        LLM(str(dst))
