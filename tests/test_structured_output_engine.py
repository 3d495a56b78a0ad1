"""Structured outputs end to end through ``LLM`` (in-process and in the engine-core process), on a tiny random model
that never writes valid JSON by itself: every sampled output (temperature 1, whitespace disabled) finishes with
``stop`` and is valid; greedy output equals Hugging Face ``generate()`` masked by the same backend's matcher; a batch
mixing constrained and unconstrained requests leaves the unconstrained ones exact; a slow compilation holds up
nobody; a constraint that fails to compile fails its request only. ``scripts/structured_outputs_validity.py`` runs
the 200-sample version of the validity check."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from vllite import LLM, SamplingParams
from vllite.structured_output import StructuredOutputsParams as P
from vllite.testing.models import make_tiny_model_dir_cached

N = 16  # samples per constraint and backend here; the script checks 200

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "vip": {"type": "boolean"}},
            "required": ["id", "vip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{2}(\.[0-9])?"
CHOICES = ["positive", "negative", "neutral"]
# A bracketed list of 1-4 items, each a short word or a parenthesised number.
GRAMMAR = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-z]{1,4} | "(" [0-9]{1,3} ")"'


def parse_grammar(text: str) -> bool:
    """A recursive-descent parser for :data:`GRAMMAR` (independent of the backends)."""
    pos = 0

    def item() -> bool:
        nonlocal pos
        if text.startswith("(", pos):
            end = pos + 1
            while end < len(text) and text[end].isascii() and text[end].isdigit():
                end += 1
            if not 1 <= end - pos - 1 <= 3 or not text.startswith(")", end):
                return False
            pos = end + 1
            return True
        end = pos
        while end < len(text) and "a" <= text[end] <= "z":
            end += 1
        if not 1 <= end - pos <= 4:
            return False
        pos = end
        return True

    if not text.startswith("("):
        return False
    pos = 1
    if not item():
        return False
    count = 1
    while text.startswith(",", pos) and count < 4:
        pos += 1
        if not item():
            return False
        count += 1
    return text[pos:] == ")"


def valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)  # json.loads is strict: no raw control characters
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


CASES = {
    "json": (P(json=SCHEMA), valid_json),
    "regex": (P(regex=REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    "choice": (P(choice=CHOICES), lambda text: text in CHOICES),
    "grammar": (P(grammar=GRAMMAR), parse_grammar),
}


@pytest.fixture(scope="module")
def model_path():
    return str(make_tiny_model_dir_cached("llama"))


@pytest.fixture(scope="module", params=["xgrammar", "guidance"])
def llm(request, model_path):
    engine = LLM(
        model_path,
        max_model_len=512,
        structured_outputs_config={"backend": request.param, "disable_any_whitespace": True},
    )
    yield engine
    engine.llm_engine.shutdown()


def sample(llm: LLM, constraint: P, n: int, max_tokens: int = 200, seed: int = 0) -> list:
    params = [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=max_tokens, structured_outputs=constraint)
        for i in range(n)
    ]
    return [out.outputs[0] for out in llm.generate(["Give me data:"] * n, params, use_tqdm=False)]


def test_the_model_never_writes_json_by_itself(model_path):
    llm = LLM(model_path, max_model_len=512)
    outputs = llm.generate(["Give me data:"] * 8, SamplingParams(temperature=1.0, max_tokens=64), use_tqdm=False)
    assert not any(valid_json(out.outputs[0].text) for out in outputs)
    assert not any(out.outputs[0].text in CHOICES for out in outputs)


@pytest.mark.parametrize("kind", list(CASES))
def test_sampled_outputs_are_valid(llm, kind):
    constraint, check = CASES[kind]
    outputs = sample(llm, constraint, N)
    bad = [(o.finish_reason, o.text) for o in outputs if o.finish_reason != "stop" or not check(o.text)]
    assert not bad


def test_json_object_and_structural_tag(llm):
    # Any JSON object: a random model may nest on past max_tokens, so only finished outputs must parse.
    for output in sample(llm, P(json_object=True), 4, max_tokens=120):
        assert output.text.startswith("{")
        if output.finish_reason == "stop":
            assert isinstance(json.loads(output.text), dict)
    if llm.llm_engine.config.structured_outputs_config.backend != "xgrammar":
        return
    tag = {
        "structures": [
            {
                "begin": "<f>",
                "schema": {
                    "type": "object",
                    "properties": {"x": {"enum": [1, 2]}},
                    "required": ["x"],
                    "additionalProperties": False,
                },
                "end": "</f>",
            }
        ],
        "triggers": ["<f>"],
    }
    outputs = sample(llm, P(structural_tag=json.dumps(tag)), 4, max_tokens=40)
    for output in outputs:
        for body in re.findall(r"<f>(.*?)</f>", output.text, flags=re.S):
            assert json.loads(body)["x"] in (1, 2)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_engine_core_process(monkeypatch, model_path, backend):
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")
    llm = LLM(
        model_path, max_model_len=512, structured_outputs_config={"backend": backend, "disable_any_whitespace": True}
    )
    try:
        assert type(llm.llm_engine.engine_core).__name__ != "InprocClient"
        for constraint, check in CASES.values():
            outputs = sample(llm, constraint, 6)
            assert all(o.finish_reason == "stop" and check(o.text) for o in outputs), [o.text for o in outputs]
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_greedy_equals_hf_generate_masked_by_the_same_matcher(model_path, backend):
    import torch
    import transformers

    from vllite.engine.tokenizer import get_tokenizer
    from vllite.structured_output.bitmask import unpack_bitmask
    from vllite.structured_output.registry import backend_class

    tokenizer = get_tokenizer(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path).eval()
    vocab = model.config.vocab_size
    so_backend = backend_class(backend)(tokenizer, vocab, [tokenizer.eos_token_id])
    llm = LLM(model_path, max_model_len=512, structured_outputs_config={"backend": backend})
    try:
        for constraint in (P(json=SCHEMA, disable_any_whitespace=True), P(regex=REGEX), P(grammar=GRAMMAR)):
            grammar = so_backend.new_grammar(so_backend.compile(validate(constraint, backend).spec()))
            prompt = tokenizer.encode("Give me data:")

            class Masked(transformers.LogitsProcessor):
                """Masks each step's logits with the matcher (advanced by the tokens generated so far)."""

                def __init__(self, matcher, prompt_len):
                    self.matcher, self.start = matcher, prompt_len

                def __call__(self, input_ids, scores):
                    new = input_ids[0, self.start :].tolist()
                    assert self.matcher.accept_tokens(new)
                    self.start += len(new)
                    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
                    self.matcher.fill_bitmask(bitmask, 0)
                    return scores.masked_fill(unpack_bitmask(bitmask, scores.shape[-1]), float("-inf"))

            hf = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=200,
                do_sample=False,
                logits_processor=transformers.LogitsProcessorList([Masked(grammar, len(prompt))]),
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )[0, len(prompt) :].tolist()
            params = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=constraint)
            ours = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
            assert list(ours.token_ids) == hf
            assert ours.finish_reason == "stop"
    finally:
        llm.llm_engine.shutdown()


def validate(constraint: P, backend: str) -> P:
    from vllite.structured_output import StructuredOutputsConfig
    from vllite.structured_output.registry import validate_structured_outputs

    return validate_structured_outputs(constraint, StructuredOutputsConfig(backend=backend))


def test_mixed_batch_leaves_unconstrained_requests_exact(model_path):
    llm = LLM(model_path, max_model_len=512, structured_outputs_config={"disable_any_whitespace": True})
    try:
        prompts = ["Once upon a time", "def main():", "The weather", "import numpy"]
        plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
        params = [
            plain,
            SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=P(json=SCHEMA)),
            plain,
            SamplingParams(temperature=1.0, structured_outputs=P(choice=CHOICES)),
        ]
        mixed = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert mixed[0].token_ids == reference[0] and mixed[2].token_ids == reference[2]
        assert valid_json(mixed[1].text) and mixed[3].text in CHOICES
    finally:
        llm.llm_engine.shutdown()


def test_slow_compilation_holds_up_nobody(monkeypatch, model_path):
    """A grammar whose compilation waits on an event: the requests behind it run to the end first."""
    from vllite.plugins.structured_outputs.xgrammar_backend import XgrammarBackend
    from vllite.request import RequestStatus

    release = threading.Event()
    compile_grammar = XgrammarBackend.compile

    def slow_compile(self, spec):
        if spec.kind == "regex":
            assert release.wait(60)
        return compile_grammar(self, spec)

    monkeypatch.setattr(XgrammarBackend, "compile", slow_compile)
    llm = LLM(model_path, max_model_len=512)
    engine = llm.llm_engine
    try:
        engine.add_request(
            "slow", "hi", SamplingParams(temperature=1.0, max_tokens=50, structured_outputs=P(regex=REGEX))
        )
        engine.add_request("plain", "hi", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        engine.add_request("fast", "hi", SamplingParams(temperature=1.0, structured_outputs=P(choice=CHOICES)))
        done = {}
        while "plain" not in done or "fast" not in done:
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output.outputs[0]
        core = engine.engine_core.engine_core
        (slow,) = [r for r in core.scheduler.requests.values() if r.request_id.startswith("slow")]
        assert slow.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
        assert done["fast"].text in CHOICES and len(done["plain"].token_ids) == 8
        release.set()
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output.outputs[0]
        assert re.fullmatch(REGEX, done["slow"].text) and done["slow"].finish_reason == "stop"
    finally:
        release.set()
        engine.shutdown()


def test_a_compile_failure_fails_that_request_only(monkeypatch, model_path):
    from vllite.plugins.structured_outputs.xgrammar_backend import XgrammarBackend

    compile_grammar = XgrammarBackend.compile

    def failing_compile(self, spec):
        if spec.kind == "regex":
            raise ValueError("the compiler ran out of patience")
        return compile_grammar(self, spec)

    monkeypatch.setattr(XgrammarBackend, "compile", failing_compile)
    llm = LLM(model_path, max_model_len=512)
    try:
        params = [
            SamplingParams(temperature=1.0, structured_outputs=P(regex=REGEX)),
            SamplingParams(temperature=1.0, structured_outputs=P(choice=CHOICES)),
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        ]
        failed, chosen, plain = [o.outputs[0] for o in llm.generate(["a", "b", "c"], params, use_tqdm=False)]
        assert failed.finish_reason == "error" and "ran out of patience" in failed.error and "regex" in failed.error
        assert chosen.finish_reason == "stop" and chosen.text in CHOICES
        assert plain.finish_reason == "length" and len(plain.token_ids) == 4
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("fill_during_forward", [False, True])
def test_a_grammar_that_raises_while_filling_fails_that_request_only(monkeypatch, model_path, fill_during_forward):
    """A matcher that raises while its step's bitmask is filled (a faulty backend plugin) ends its own request with
    ERROR naming the grammar class and the exception; the batch's other requests, constrained or not, finish."""
    from vllite.plugins.structured_outputs.xgrammar_backend import XgrammarBackend, XgrammarGrammar

    fill_bitmask = XgrammarGrammar.fill_bitmask

    def fill_or_fail(self, bitmask, index):
        if getattr(self, "fails", False):
            raise RuntimeError("the matcher lost its place")
        fill_bitmask(self, bitmask, index)

    new_grammar = XgrammarBackend.new_grammar

    def marked_grammar(self, compiled):
        grammar = new_grammar(self, compiled)
        grammar.fails = compiled is failing_compiled[0]
        return grammar

    failing_compiled: list = [None]
    compile_grammar = XgrammarBackend.compile

    def remember_regex(self, spec):
        compiled = compile_grammar(self, spec)
        if spec.kind == "regex":
            failing_compiled[0] = compiled
        return compiled

    monkeypatch.setattr(XgrammarGrammar, "fill_bitmask", fill_or_fail)
    monkeypatch.setattr(XgrammarBackend, "new_grammar", marked_grammar)
    monkeypatch.setattr(XgrammarBackend, "compile", remember_regex)
    llm = LLM(model_path, max_model_len=512)
    llm.llm_engine.engine_core.engine_core.structured_output_manager.fill_during_forward = fill_during_forward
    try:
        params = [
            SamplingParams(temperature=1.0, seed=0, structured_outputs=P(regex=REGEX)),
            SamplingParams(temperature=1.0, seed=1, structured_outputs=P(choice=CHOICES)),
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        ]
        failed, chosen, plain = [o.outputs[0] for o in llm.generate(["a", "b", "c"], params, use_tqdm=False)]
        assert failed.finish_reason == "error"
        assert "XgrammarGrammar.fill_bitmask raised RuntimeError: the matcher lost its place" in failed.error
        assert chosen.finish_reason == "stop" and chosen.text in CHOICES
        assert plain.finish_reason == "length" and len(plain.token_ids) == 4
        again = llm.generate("d", SamplingParams(temperature=1.0, structured_outputs=P(choice=CHOICES)))
        assert again[0].outputs[0].text in CHOICES  # the engine serves on
    finally:
        llm.llm_engine.shutdown()


def test_bad_constraints_fail_alone_at_submit(llm):
    from test_structured_output import BAD_CASES

    for _, kwargs, config, match in BAD_CASES:
        if config.backend != "auto":
            kwargs = {**kwargs, "backend": config.backend}
        with pytest.raises(ValueError, match=match):
            llm.generate("x", SamplingParams(structured_outputs=P(**kwargs)), use_tqdm=False)
    # The engine keeps serving.
    assert sample(llm, P(choice=CHOICES), 2)[0].text in CHOICES


def test_pipelined_steps_with_the_batch_queue(model_path):
    """With two batches in flight a request is never in both, so its matcher is current when the next bitmask is
    filled: outputs stay valid and greedy ones equal the unpipelined engine's."""
    so_config = {"disable_any_whitespace": True}
    llm = LLM(model_path, max_model_len=512, structured_outputs_config=so_config, batch_queue_depth=2)
    reference = LLM(model_path, max_model_len=512, structured_outputs_config=so_config)
    try:
        for constraint, check in CASES.values():
            outputs = sample(llm, constraint, 6)
            assert all(o.finish_reason == "stop" and check(o.text) for o in outputs), [o.text for o in outputs]
        greedy = [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=c) for c, _ in CASES.values()]
        prompts = ["Give me data:"] * len(greedy)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert got == [o.outputs[0].token_ids for o in reference.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
        reference.llm_engine.shutdown()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_the_bitmask_filled_during_the_forward_pass_gives_the_same_tokens(model_path, backend):
    """On the CPU the bitmask is filled in place before the model runs; on an accelerator a thread fills it while
    the model runs. Both give the same tokens, greedy and seeded."""
    so_config = {"backend": backend, "disable_any_whitespace": True}
    llm = LLM(model_path, max_model_len=512, structured_outputs_config=so_config)
    manager = llm.llm_engine.engine_core.engine_core.structured_output_manager
    constraints = [c for c, _ in CASES.values()]
    params = [SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=c) for c in constraints]
    params += [SamplingParams(temperature=1.0, seed=7, max_tokens=120, structured_outputs=c) for c in constraints]
    prompts = ["Give me data:"] * len(params)
    try:
        assert not manager.fill_during_forward  # the test model runs on the CPU
        in_place = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        manager.fill_during_forward = True
        on_thread = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert manager._fill_pool is not None  # the thread did the filling
    finally:
        llm.llm_engine.shutdown()
    assert on_thread == in_place


def test_the_documented_third_party_backend(tmp_path, monkeypatch, model_path):
    """docs/structured-outputs.md's "Adding a backend" example, installed as an entry-point plugin, drives LLM."""
    from pathlib import Path

    from plugin_utils import forget_modules, make_distribution

    from vllite import plugin_manager

    doc = (Path(__file__).resolve().parents[1] / "docs" / "structured-outputs.md").read_text()
    source = next(b for b in re.findall(r"```python\n(.*?)```", doc, flags=re.S) if "class FixedBackend" in b)
    root = tmp_path / "site"
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("VLLITE_PLUGINS", raising=False)
    forget_modules("fixed_backend_plugin")
    make_distribution(root, "fixed-backend", {"vllite": {"fixed-backend": "fixed_backend_plugin"}},
                      {"fixed_backend_plugin": source})  # fmt: skip
    plugin_manager.reset_plugin_manager()
    try:
        llm = LLM(model_path, max_model_len=512, structured_outputs_config={"backend": "fixed"})
        params = SamplingParams(temperature=1.0, max_tokens=50, structured_outputs=P(regex="hello world"))
        output = llm.generate("Say it:", params, use_tqdm=False)[0].outputs[0]
        assert output.text == "hello world" and output.finish_reason == "stop"
        with pytest.raises(ValueError, match="only takes regex"):
            llm.generate("x", SamplingParams(structured_outputs=P(choice=["a"])), use_tqdm=False)
        llm.llm_engine.shutdown()
    finally:
        plugin_manager.reset_plugin_manager()
