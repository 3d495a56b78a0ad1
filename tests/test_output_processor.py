"""OutputProcessor with a real (tiny, trained on the fly) tokenizer: detokenization, stop strings, output
kinds, logprobs, n>1 fan-in, aborts and the async output collector."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizer_support import build_tiny_tokenizer

from vllite.engine.detokenizer import IncrementalDetokenizer, check_stop_strings
from vllite.engine.output_processor import OutputProcessor
from vllite.engine.parallel_sampling import ParentRequest
from vllite.plugins.engine_proc.output_collector import RequestOutputCollector
from vllite.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists, LogprobsTensors
from vllite.sampling_params import RequestOutputKind, SamplingParams

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "héllo wörld 日本語のテキスト 😀 émojis and ünïcode",
    "stop here STOP there END of text",
] * 4
EOS = 2


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer(CORPUS, vocab_size=320)


def request(rid="r", params=None, prompt_ids=(5, 6, 7)) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(prompt_ids), params or SamplingParams(), EOS, 0.0)


def step(proc, rid, ids, finish=None, **kw):
    return proc.process_outputs([EngineCoreOutput(rid, list(ids), finish_reason=finish, **kw)])


def feed(proc, rid, ids, chunk=1, finish=FinishReason.LENGTH):
    """Feeds ``ids`` in chunks, finishing on the last one; returns every RequestOutput and abort list."""
    outs, aborts = [], []
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        res = step(proc, rid, ids[i : i + chunk], finish if last else None)
        outs += res.request_outputs
        aborts += res.reqs_to_abort
        if rid not in proc.request_states:
            break
    return outs, aborts


# ---------------------------------------------------------------------------- incremental detokenization
@settings(max_examples=60, deadline=None)
@given(
    st.text(alphabet=list("helo wrdquickbfx,.日本語テ😀éöü"), min_size=1, max_size=30),
    st.integers(1, 4),
    st.sampled_from(list(RequestOutputKind)),
)
def test_incremental_text_matches_full_decode(tok, text, chunk, kind):
    ids = tok.encode(text)
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(output_kind=kind, max_tokens=100)), "p")
    outs, _ = feed(proc, "r", ids, chunk)
    expected = tok.decode(ids)
    if kind == RequestOutputKind.DELTA:
        assert "".join(o.outputs[0].text for o in outs) == expected
        assert [t for o in outs for t in o.outputs[0].token_ids] == ids
    else:
        assert outs[-1].outputs[0].text == expected and outs[-1].outputs[0].token_ids == ids
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outs) == 1
    assert "\ufffd" not in "".join(o.outputs[0].text for o in outs)


def test_multibyte_characters_are_held_until_complete(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # the emoji spans several byte-level tokens
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(output_kind=RequestOutputKind.DELTA)), None)
    texts = [step(proc, "r", [t]).request_outputs[0].outputs[0].text for t in ids]
    assert texts[:-1] == [""] * (len(ids) - 1) and texts[-1] == "😀"


def test_check_stop_strings():
    assert check_stop_strings("abcSTOPdef", 3, ["STOP"], False) is None  # ended before the new chars
    assert check_stop_strings("abcSTOPd", 2, ["STOP"], False) == ("STOP", 3)
    assert check_stop_strings("abcSTOPd", 2, ["STOP"], True) == ("STOP", 7)
    assert check_stop_strings("abcSTOP", 1, ["STOP"], True) == ("STOP", -1)
    assert check_stop_strings("abcSTOP", 0, ["STOP"], False) is None
    assert check_stop_strings("xxEND", 5, ["STOP", "END"], False) == ("END", 2)


# ---------------------------------------------------------------------------- stop strings
def test_stop_string_finishes_truncates_and_aborts(tok):
    ids = tok.encode("hello world STOP there")
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(stop=["STOP"])), "p")
    outs, aborts = feed(proc, "r", ids, finish=None)
    final = outs[-1]
    assert final.finished and final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "STOP"
    assert final.outputs[0].text == "hello world "
    assert aborts == ["r"] and not proc.has_unfinished_requests()
    # late outputs for the finished request are ignored
    assert step(proc, "r", [5]).request_outputs == []


def test_stop_string_included_in_output(tok):
    ids = tok.encode("hello world STOP there")
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(stop=["STOP"], include_stop_str_in_output=True)), "p")
    outs, aborts = feed(proc, "r", ids, finish=None)
    assert outs[-1].outputs[0].text == "hello world STOP" and aborts == ["r"]


def test_hold_back_buffer_hides_partial_stop_string(tok):
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(stop=["END of"])), "p")
    texts = []
    for t in tok.encode("the lazy END"):
        out = step(proc, "r", [t]).request_outputs[0]
        texts.append(out.outputs[0].text)
        full = proc.request_states["r"].detokenizer.output_text
        assert out.outputs[0].text == full[: max(0, len(full) - 5)]
    final = step(proc, "r", tok.encode(" there"), FinishReason.LENGTH).request_outputs[0]
    assert final.outputs[0].text == "the lazy END there"  # no match: the held-back text is released


def test_stop_strings_ignored_within_min_tokens(tok):
    ids = tok.encode("STOP hello STOP world")
    proc = OutputProcessor(tok)
    min_tokens = len(tok.encode("STOP hello"))
    proc.add_request(request(params=SamplingParams(stop=["STOP"], min_tokens=min_tokens)), "p")
    outs, aborts = feed(proc, "r", ids, finish=None)
    assert outs[-1].outputs[0].text == "STOP hello " and aborts == ["r"]


def test_stop_string_across_a_multi_token_step(tok):
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(stop=["fox"], output_kind=RequestOutputKind.DELTA)), "p")
    res = step(proc, "r", tok.encode("the quick brown fox jumps"))
    assert res.request_outputs[0].outputs[0].text == "the quick brown " and res.reqs_to_abort == ["r"]


def test_engine_stop_token_not_in_text_and_not_aborted(tok):
    ids = [*tok.encode("hello world"), EOS]
    proc = OutputProcessor(tok)
    proc.add_request(request(), "p")
    res = step(proc, "r", ids, FinishReason.STOP, stop_reason=EOS)
    out = res.request_outputs[0]
    assert out.outputs[0].text == "hello world" and out.outputs[0].token_ids == ids
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == EOS
    assert res.reqs_to_abort == []


def test_special_tokens_kept_when_asked(tok):
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True)), "")
    out = step(proc, "r", [*tok.encode("hi"), EOS], FinishReason.STOP).request_outputs[0]
    assert out.outputs[0].text.endswith("</s>")


# ---------------------------------------------------------------------------- output kinds
def test_cumulative_outputs(tok):
    proc = OutputProcessor(tok)
    proc.add_request(request("int-1"), "the prompt", external_req_id="ext")
    ids = tok.encode("hello world")
    first = step(proc, "int-1", ids[:1]).request_outputs[0]
    second = step(proc, "int-1", ids[1:], FinishReason.LENGTH).request_outputs[0]
    assert first.request_id == "ext" and first.prompt == "the prompt" and first.prompt_token_ids == [5, 6, 7]
    assert not first.finished and first.outputs[0].finish_reason is None and first.outputs[0].stop_reason is None
    assert second.outputs[0].token_ids == ids and second.outputs[0].text == "hello world"
    assert second.finished and second.outputs[0].finish_reason == "length"
    assert dict(proc.external_req_ids) == {}


def test_delta_outputs_and_logprobs(tok):
    proc = OutputProcessor(tok)
    params = SamplingParams(output_kind=RequestOutputKind.DELTA, logprobs=1, prompt_logprobs=1)
    proc.add_request(request(params=params), None)
    ids = tok.encode("hello world")
    plp = LogprobsTensors(
        torch.tensor([[6, 9], [7, 6]]), torch.tensor([[-1.0, -0.5], [-2.0, -0.1]]), torch.tensor([2, 3])
    )
    outs = []
    for i, t in enumerate(ids):
        lists = LogprobsLists([[t, 9]], [[-0.25 * (i + 1), -0.1]], [2])
        kw = {"new_prompt_logprobs_tensors": plp} if i == 0 else {}
        finish = FinishReason.LENGTH if i == len(ids) - 1 else None
        outs += step(proc, "r", [t], finish, new_logprobs=lists, **kw).request_outputs
    assert [o.outputs[0].token_ids for o in outs] == [[t] for t in ids]
    assert "".join(o.outputs[0].text for o in outs) == "hello world"
    assert all(len(o.outputs[0].logprobs) == 1 for o in outs)
    assert outs[0].prompt_logprobs is not None and outs[0].prompt_logprobs[0] is None
    assert all(not o.prompt_logprobs for o in outs[1:])
    assert outs[-1].outputs[0].cumulative_logprob == pytest.approx(-0.25 * sum(range(1, len(ids) + 1)))


def test_final_only_emits_once_with_all_tokens(tok):
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY)), "p")
    ids = tok.encode("the lazy dog")
    assert step(proc, "r", ids[:2]).request_outputs == []
    out = step(proc, "r", ids[2:], FinishReason.LENGTH).request_outputs
    assert len(out) == 1 and out[0].outputs[0].text == "the lazy dog" and out[0].outputs[0].token_ids == ids


def test_detokenize_false_gives_ids_without_text(tok):
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(detokenize=False, logprobs=0)), "p")
    out = step(
        proc,
        "r",
        [10, 11],
        FinishReason.LENGTH,
        new_logprobs=LogprobsLists([[10], [11]], [[-1.0], [-2.0]], [1, 4]),
    ).request_outputs[0]
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == [10, 11]
    assert out.outputs[0].logprobs[1][11].decoded_token is None and out.outputs[0].logprobs[1][11].rank == 4


def test_no_tokenizer_at_all():
    proc = OutputProcessor(None)
    proc.add_request(request(), None)
    out = step(proc, "r", [3, 4], FinishReason.LENGTH).request_outputs[0]
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == [3, 4]


def test_outputs_keep_engine_order_and_skip_unknown(tok):
    proc = OutputProcessor(tok)
    for rid in ("a", "b", "c"):
        proc.add_request(request(rid), None)
    res = proc.process_outputs([EngineCoreOutput(r, [10]) for r in ("c", "zz", "a", "b")])
    assert [o.request_id for o in res.request_outputs] == ["c", "a", "b"]
    with pytest.raises(ValueError, match="already running"):
        proc.add_request(request("a"), None)


def test_stats_and_cached_tokens(tok):
    proc = OutputProcessor(tok, log_stats=True)
    proc.add_request(request(), None)
    step(proc, "r", [10], num_cached_tokens=16)
    out = proc.process_outputs(
        [EngineCoreOutput("r", [11, 12], finish_reason=FinishReason.LENGTH, num_cached_tokens=16)],
        engine_core_timestamp=5.0,
    )
    out = out.request_outputs[0]
    assert out.num_cached_tokens == 16 and out.metrics.num_generation_tokens == 3
    assert out.metrics.last_token_time == 5.0
    assert OutputProcessor(tok).request_states == {}


# ---------------------------------------------------------------------------- logprobs
def test_sample_logprobs_ranks_and_decoded_tokens(tok):
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(logprobs=2)), None)
    a, b, c = tok.encode("the quick brown")[:3]
    lists = LogprobsLists([[a, b, c]], [[-1.5, -0.2, -1.0]], [3])
    out = step(proc, "r", [a], new_logprobs=lists).request_outputs[0].outputs[0]
    entry = out.logprobs[0]
    assert list(entry) == [a, b, c]
    assert entry[a].rank == 3 and entry[b].rank == 1 and entry[c].rank == 2
    assert entry[a].logprob == -1.5 and entry[a].decoded_token == tok.decode([a])
    assert out.cumulative_logprob == -1.5


def test_prompt_logprobs_over_chunks(tok):
    proc = OutputProcessor(tok)
    proc.add_request(request(params=SamplingParams(prompt_logprobs=0), prompt_ids=[5, 6, 7, 8]), None)
    chunk1 = LogprobsTensors(torch.tensor([[6], [7]]), torch.tensor([[-1.0], [-2.0]]), torch.tensor([4, 1]))
    chunk2 = LogprobsTensors(torch.tensor([[8]]), torch.tensor([[-3.0]]), torch.tensor([2]))
    step(proc, "r", [], new_prompt_logprobs_tensors=chunk1)
    out = step(proc, "r", [10], FinishReason.LENGTH, new_prompt_logprobs_tensors=chunk2).request_outputs[0]
    plp = out.prompt_logprobs
    assert len(plp) == 4 and plp[0] is None
    assert [next(iter(p)) for p in plp[1:]] == [6, 7, 8]
    assert plp[1][6].rank == 4 and plp[3][8].logprob == -3.0
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


# ---------------------------------------------------------------------------- n > 1
def parent_with_children(proc, n, kind, seed=None):
    req = request("p-1", SamplingParams(n=n, output_kind=kind, seed=seed))
    parent = ParentRequest(req, "0")
    ids = []
    for i in range(n):
        child_id, child_params = parent.get_child_info(i)
        child = request(child_id, child_params)
        proc.add_request(child, "prompt", parent, i)
        ids.append(child_id)
    return parent, ids


def test_parent_child_ids_and_seeds():
    parent = ParentRequest(request("p", SamplingParams(n=3, seed=10)), "user-id")
    infos = [parent.get_child_info(i) for i in range(3)]
    assert [i for i, _ in infos] == ["p-0", "p-1", "p-2"]
    assert [p.seed for _, p in infos] == [10, 11, 12] and all(p.n == 1 for _, p in infos)
    assert parent.sampling_params.n == 3 and parent.sampling_params.seed == 10
    unseeded = ParentRequest(request("q", SamplingParams(n=2)), "q")
    a, b = unseeded.get_child_info(0)[1], unseeded.get_child_info(1)[1]
    assert a is b and a.n == 1 and a.seed is None
    with pytest.raises(IndexError):
        unseeded.get_child_info(2)


def test_n_final_only_aggregates_in_index_order(tok):
    proc = OutputProcessor(tok)
    _, ids = parent_with_children(proc, 3, RequestOutputKind.FINAL_ONLY)
    assert proc.get_num_unfinished_requests() == 3
    assert step(proc, ids[2], [10], FinishReason.LENGTH).request_outputs == []
    assert step(proc, ids[0], [11], FinishReason.LENGTH).request_outputs == []
    assert step(proc, ids[1], [12]).request_outputs == []
    outs = step(proc, ids[1], [13], FinishReason.STOP, stop_reason=13).request_outputs
    assert len(outs) == 1 and outs[0].request_id == "0" and outs[0].finished
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert [c.token_ids for c in outs[0].outputs] == [[11], [12, 13], [10]]
    assert not proc.has_unfinished_requests() and proc.parent_requests == {} and dict(proc.external_req_ids) == {}


def test_n_streaming_passes_child_outputs_through(tok):
    proc = OutputProcessor(tok)
    _, ids = parent_with_children(proc, 2, RequestOutputKind.CUMULATIVE)
    out = step(proc, ids[1], [10], FinishReason.LENGTH).request_outputs[0]
    assert out.request_id == "0" and out.outputs[0].index == 1 and not out.finished
    out = step(proc, ids[0], [11, 12], FinishReason.LENGTH).request_outputs[0]
    assert out.outputs[0].index == 0 and out.finished


def test_abort_external_id_aborts_all_children(tok):
    proc = OutputProcessor(tok)
    _, ids = parent_with_children(proc, 3, RequestOutputKind.FINAL_ONLY)
    proc.add_request(request("other"), None)
    assert sorted(proc.abort_requests(["0", "missing"])) == sorted(ids)
    assert list(proc.request_states) == ["other"] and proc.parent_requests == {}
    assert step(proc, ids[0], [1], FinishReason.LENGTH).request_outputs == []


def test_abort_by_internal_and_parent_id(tok):
    proc = OutputProcessor(tok)
    _, ids = parent_with_children(proc, 2, RequestOutputKind.CUMULATIVE)
    assert proc.abort_requests([ids[0]], internal=True) == [ids[0]]
    assert proc.abort_requests(["p-1"]) == [ids[1]]
    assert not proc.has_unfinished_requests() and proc.abort_requests(["p-1"]) == []


# ---------------------------------------------------------------------------- async queue
def test_collector_merges_delta_outputs_when_consumer_lags(tok):
    proc = OutputProcessor(tok)
    queue = RequestOutputCollector(RequestOutputKind.DELTA)
    proc.add_request(request(params=SamplingParams(output_kind=RequestOutputKind.DELTA)), "p", queue=queue)
    ids = tok.encode("hello world")
    for t in ids[:-1]:
        assert step(proc, "r", [t]).request_outputs == []
    merged = queue.get_nowait()
    assert merged.outputs[0].text == tok.decode(ids[:-1]) and merged.outputs[0].token_ids == ids[:-1]
    assert queue.get_nowait() is None
    step(proc, "r", ids[-1:], FinishReason.LENGTH)
    last = asyncio.run(queue.get())
    assert last.finished and last.outputs[0].token_ids == ids[-1:]


def test_collector_cumulative_keeps_newest_and_abort_output(tok):
    proc = OutputProcessor(tok)
    queue = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    proc.add_request(request(), "p", queue=queue)
    step(proc, "r", [10])
    step(proc, "r", [11])
    assert queue.get_nowait().outputs[0].token_ids == [10, 11]
    assert proc.abort_requests(["r"]) == ["r"]
    aborted = queue.get_nowait()
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"


def test_propagate_error_reaches_waiting_consumers(tok):
    proc = OutputProcessor(tok)
    queues = [RequestOutputCollector() for _ in range(2)]
    for i, q in enumerate(queues):
        proc.add_request(request(f"r{i}"), None, queue=q)

    async def main():
        waiter = asyncio.create_task(queues[0].get())
        await asyncio.sleep(0)
        proc.propagate_error(RuntimeError("engine died"))
        with pytest.raises(RuntimeError, match="engine died"):
            await waiter
        queues[1].put(proc.request_states["r1"].make_request_output([1], None, None))  # error wins
        with pytest.raises(RuntimeError):
            queues[1].get_nowait()

    asyncio.run(main())


def test_detokenizer_without_prompt_context(tok):
    detok = IncrementalDetokenizer(tok, None)
    rng = random.Random(0)
    ids = tok.encode("日本語 hello 😀")
    i = 0
    while i < len(ids):
        n = rng.randint(1, 3)
        detok.update(ids[i : i + n], False)
        i += n
    assert detok.output_text == tok.decode(ids) and detok.output_token_ids == ids


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_stream_interval_hands_out_the_first_token_then_every_n_and_the_last(tok, kind):
    proc = OutputProcessor(tok, stream_interval=3)
    proc.add_request(request(params=SamplingParams(max_tokens=10, output_kind=kind)), "p")
    handed_out = []
    for i in range(10):
        outputs = step(proc, "r", [40 + i], FinishReason.LENGTH if i == 9 else None).request_outputs
        handed_out += [(i, list(o.outputs[0].token_ids), o.finished) for o in outputs]
    all_ids = [40 + i for i in range(10)]
    if kind == RequestOutputKind.DELTA:  # every token exactly once, in order
        assert handed_out == [(0, all_ids[:1], False), (3, all_ids[1:4], False), (6, all_ids[4:7], False),
                              (9, all_ids[7:], True)]  # fmt: skip
    else:
        assert handed_out == [(0, all_ids[:1], False), (3, all_ids[:4], False), (6, all_ids[:7], False),
                              (9, all_ids, True)]  # fmt: skip
    plain = OutputProcessor(tok)
    plain.add_request(request(params=SamplingParams(max_tokens=3, output_kind=kind)), "p")
    assert all(step(plain, "r", [41]).request_outputs for _ in range(2))  # the default: every token
