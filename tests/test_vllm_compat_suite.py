"""The vLLM compatibility suite: logits processors written for vLLM run on vllite unchanged, without vLLM.

The three distributions under ``examples/vllm-compat/`` are vLLM's documented example processors as a third
party ships them: each imports ``vllm…`` exactly as the documented original does and registers in the
``vllm.logits_processors`` entry-point group.

- ``vllm-example-target-token``: the batch-level ``DummyLogitsProcessor`` (``update_state`` tracking moves by
  comparing ``MoveDirectionality``, ``validate_params`` raising ``VLLMValidationError``);
- ``vllm-example-per-request``: a per-request callable wrapped by ``AdapterLogitsProcessor``, reading
  ``model_config.get_vocab_size()`` in its constructor;
- ``vllm-example-dry``: a DRY repetition penalty on the slot interface
  (``vllm.v1.worker.gpu.sample.logits_processor``), reading ``req_states.all_token_ids.gpu``.

Each is installed the way the other plugin tests fake an installation (a throwaway ``*.dist-info`` on
``sys.path``, here built from the example's own ``pyproject.toml``) and run through ``LLM.generate`` on a tiny
random model, in-process and in the engine-core process, loaded through the entry-point group and through an
explicit class path (``--logits-processors pkg.mod:Class``). Six requests with different ``max_tokens`` share
a batch of four slots, so requests join freed slots and the batch condenses (moves) while the processors run.
The rows that ask for the effect have it; every other row equals a run without the processor.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import pytest

from vllite.logits_processor import BatchUpdate, LogitsProcessor
from vllite.plugins.vllm_compat import activate, is_shim_module
from vllite.sampling_params import SamplingParams

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; reads the examples' pyproject.toml

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples" / "vllm-compat"
MAX_NUM_SEQS = 4
# Six requests in four slots: the short ones finish first, the last two wait and join freed slots, and the
# batch condenses as the rest finish. Rows 0, 2 and 4 (the long ones) ask for the processor's effect; the
# tiny model repeats itself on rows 0 and 4 when nothing stops it (see test_dry_reference_repeats_itself).
PROMPTS = [
    [100] * 8,
    [30, 31, 32],
    [40, 41, 42, 43, 44],
    [50, 51],
    [60, 61, 62, 63],
    [70, 71, 72, 73, 74, 75],
]
MAX_TOKENS = [12, 3, 14, 5, 14, 4]
ASKING = (0, 2, 4)
TARGETS = {0: 9, 2: 3, 4: 17}
DRY_ARGS = {
    0: {"dry_multiplier": 1000.0},
    2: {"dry_multiplier": 1000.0, "dry_allowed_length": 2, "dry_base": 2.0},
    4: {"dry_multiplier": 1000.0, "dry_allowed_length": 1},
}


@dataclass(frozen=True)
class Example:
    """One example distribution and what the suite asks of it."""

    project: str  # folder under examples/vllm-compat
    class_path: str  # what --logits-processors names
    extra_args: Callable[[int, int], dict[str, Any] | None]  # (row, vocab_size) -> the row's extra_args
    check: Callable[[int, list[int], list[int]], None]  # (row, tokens, reference) for a row in ASKING

    @property
    def directory(self) -> Path:
        return EXAMPLES_DIR / self.project

    @property
    def project_table(self) -> dict[str, Any]:
        return tomllib.loads((self.directory / "pyproject.toml").read_text())["project"]

    @property
    def module(self) -> str:
        return self.class_path.partition(":")[0]


def _target_args(row: int, vocab_size: int) -> dict[str, Any] | None:
    if row in TARGETS:
        return {"target_token": TARGETS[row]}
    return {"unrelated": 1} if row == 3 else None  # other custom arguments do not switch it on


def _per_request_args(row: int, vocab_size: int) -> dict[str, Any] | None:
    if row in TARGETS:
        return {"target_token": TARGETS[row]}
    # Not a token id of the model: the wrapper warns and leaves the row alone (it reads the vocabulary size
    # from the engine config).
    return {"target_token": vocab_size + 100} if row == 5 else None


def _check_forced(row: int, tokens: list[int], reference: list[int]) -> None:
    assert reference != [TARGETS[row]] * MAX_TOKENS[row], "the reference already emits the target: no test"
    assert tokens == [TARGETS[row]] * MAX_TOKENS[row], f"row {row} did not emit only its target token"


def dry_violations(sequence: list[int], start: int, allowed_length: int) -> list[int]:
    """Positions ``q >= start`` whose token completes an ``allowed_length + 1``-gram that already ended earlier."""
    width = allowed_length + 1
    return [
        q
        for q in range(max(start, width - 1), len(sequence))
        if any(sequence[p - width + 1 : p + 1] == sequence[q - width + 1 : q + 1] for p in range(width - 1, q))
    ]


def _check_dry(row: int, tokens: list[int], reference: list[int]) -> None:
    allowed = DRY_ARGS[row].get("dry_allowed_length", 2)
    prompt = PROMPTS[row]
    assert len(tokens) == MAX_TOKENS[row]
    violations = dry_violations(prompt + tokens, len(prompt), allowed)
    assert not violations, f"row {row} repeats a sequence longer than {allowed} at {violations}: {tokens}"


def _dry_args(row: int, vocab_size: int) -> dict[str, Any] | None:
    if row in DRY_ARGS:
        return dict(DRY_ARGS[row])
    return {"dry_multiplier": 0.0} if row == 1 else None  # a zero multiplier switches it off


EXAMPLES = {
    "target_token": Example(
        "vllm-example-target-token", "vllm_example_target_token:DummyLogitsProcessor", _target_args, _check_forced
    ),
    "per_request": Example(
        "vllm-example-per-request",
        "vllm_example_per_request:WrappedPerReqLogitsProcessor",
        _per_request_args,
        _check_forced,
    ),
    "dry": Example("vllm-example-dry", "vllm_example_dry:DRYLogitsProcessor", _dry_args, _check_dry),
}


# ---------------------------------------------------------------------------------------------- installation
def _write_dist_info(site: Path, project: dict[str, Any]) -> None:
    """A ``*.dist-info`` with ``METADATA`` and ``entry_points.txt`` from a ``[project]`` table."""
    dist_info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, entry_points in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {value}" for name, value in entry_points.items())
        lines.append("")
    (dist_info / "entry_points.txt").write_text("\n".join(lines))


def _forget(module: str) -> None:
    for name in [name for name in sys.modules if name == module or name.startswith(module + ".")]:
        del sys.modules[name]


@pytest.fixture
def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Example, bool], None]]:
    """``install(example, entry_point)``: makes the example importable, and with ``entry_point`` also an
    installed distribution (its dist-info on ``sys.path``), for this process and the engine-core process."""
    from vllite.plugin_manager import reset_plugin_manager

    installed: list[Example] = []

    def _install(example: Example, entry_point: bool) -> None:
        monkeypatch.syspath_prepend(str(example.directory))
        if entry_point:
            site = tmp_path / f"site-{example.project}"
            _write_dist_info(site, example.project_table)
            monkeypatch.syspath_prepend(str(site))
        importlib.invalidate_caches()
        installed.append(example)
        reset_plugin_manager()

    yield _install
    for example in installed:
        _forget(example.module)
    importlib.invalidate_caches()
    reset_plugin_manager()


# ---------------------------------------------------------------------------------------------- running
class MoveProbe(LogitsProcessor):
    """A vllite processor that changes nothing and counts the batch's adds, removals and moves."""

    counts: ClassVar[dict[str, int]] = {}

    def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
        MoveProbe.counts = {"added": 0, "removed": 0, "moved": 0}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update:
            for kind in MoveProbe.counts:
                MoveProbe.counts[kind] += len(getattr(batch_update, kind))

    def apply(self, logits: Any) -> Any:
        return logits


def _make_llm(monkeypatch: pytest.MonkeyPatch, multiprocess: bool, logits_processors: list[Any]) -> Any:
    from vllite import LLM
    from vllite.testing import make_tiny_model_dir_cached

    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1" if multiprocess else "0")
    return LLM(
        str(make_tiny_model_dir_cached("llama")),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        block_size=4,
        max_num_seqs=MAX_NUM_SEQS,
        logits_processors=logits_processors,
    )


def _params(row: int, extra_args: dict[str, Any] | None) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS[row], ignore_eos=True, detokenize=False, extra_args=extra_args
    )


def _generate(llm: Any, extra_args: list[dict[str, Any] | None]) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": prompt} for prompt in PROMPTS],
        [_params(row, args) for row, args in enumerate(extra_args)],
        use_tqdm=False,
    )
    for out in outs:
        assert out.outputs[0].finish_reason == "length", out.outputs[0]
    return [list(out.outputs[0].token_ids) for out in outs]


@pytest.fixture(scope="module")
def vocab_size() -> int:
    from vllite.config import ModelConfig
    from vllite.testing import make_tiny_model_dir_cached

    return int(ModelConfig(model=str(make_tiny_model_dir_cached("llama"))).hf_text_config.vocab_size)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Every row's greedy tokens without any compatibility processor (same batch, same schedule)."""
    monkeypatch = pytest.MonkeyPatch()
    llm = _make_llm(monkeypatch, multiprocess=False, logits_processors=[MoveProbe])
    try:
        tokens = _generate(llm, [None] * len(PROMPTS))
        # The schedule this suite relies on: requests join freed slots and the batch condenses.
        assert MoveProbe.counts["moved"] > 0 and MoveProbe.counts["added"] == len(PROMPTS), MoveProbe.counts
        return tokens
    finally:
        llm.shutdown()
        monkeypatch.undo()


# ---------------------------------------------------------------------------------------------- tests
def test_vllm_is_not_installed() -> None:
    """The suite is about running without vLLM: no ``vllm`` distribution may be installed beside vllite."""
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.distribution("vllm")


def test_dry_reference_repeats_itself(reference: list[list[int]]) -> None:
    """Without DRY the tiny model repeats itself on the asking rows 0 and 4, so the DRY test checks a real
    effect."""
    repeating = [
        row
        for row in DRY_ARGS
        if dry_violations(PROMPTS[row] + reference[row], len(PROMPTS[row]), DRY_ARGS[row].get("dry_allowed_length", 2))
    ]
    assert repeating == [0, 4], [reference[row] for row in DRY_ARGS]


@pytest.mark.parametrize("process", ["inprocess", "engine_process"])
@pytest.mark.parametrize("source", ["entry_point", "class_path"])
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_has_its_documented_effect(
    name: str,
    source: str,
    process: str,
    install: Callable[[Example, bool], None],
    monkeypatch: pytest.MonkeyPatch,
    reference: list[list[int]],
    vocab_size: int,
) -> None:
    example = EXAMPLES[name]
    install(example, source == "entry_point")
    multiprocess = process == "engine_process"
    processors: list[Any] = [example.class_path] if source == "class_path" else []
    if not multiprocess:
        processors.append(MoveProbe)  # counts moves where it can be read: in this process
    llm = _make_llm(monkeypatch, multiprocess, processors)
    try:
        tokens = _generate(llm, [example.extra_args(row, vocab_size) for row in range(len(PROMPTS))])
    finally:
        llm.shutdown()
    if not multiprocess:
        assert MoveProbe.counts["moved"] > 0, MoveProbe.counts
        # The example's ``import vllm…`` was answered by vllite's compatibility layer, not by a vLLM install.
        assert is_shim_module(sys.modules["vllm"]) and example.module in sys.modules
    for row in range(len(PROMPTS)):
        if row in ASKING:
            example.check(row, tokens[row], reference[row])
        else:
            assert tokens[row] == reference[row], f"row {row} (not asking) changed"


@pytest.mark.parametrize(
    ("name", "bad_args", "message"),
    [
        ("target_token", {"target_token": "seven"}, "target_token"),
        ("target_token", {"target_token": -1}, "target_token"),
        ("dry", {"dry_multiplier": -1.0}, "dry_multiplier"),
        ("dry", {"dry_multiplier": 1.0, "dry_allowed_length": 0}, "dry_allowed_length"),
    ],
)
def test_validate_params_rejects_a_bad_request_at_submit(
    name: str,
    bad_args: dict[str, Any],
    message: str,
    install: Callable[[Example, bool], None],
    monkeypatch: pytest.MonkeyPatch,
    reference: list[list[int]],
) -> None:
    """The processor's ``validate_params`` runs when the request is submitted: the bad request is refused with
    a ``ValueError`` naming the argument (vLLM's ``VLLMValidationError`` included), and the engine goes on."""
    install(EXAMPLES[name], True)
    llm = _make_llm(monkeypatch, multiprocess=False, logits_processors=[])
    try:
        with pytest.raises(ValueError, match=message):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, _params(0, bad_args), use_tqdm=False)
        out = llm.generate({"prompt_token_ids": PROMPTS[1]}, _params(1, None), use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == reference[1]
    finally:
        llm.shutdown()


def test_dry_penalties_follow_the_documented_rule() -> None:
    """The DRY example's penalty on its own: the token that would extend a repeat of ``n >= allowed`` tokens
    loses ``multiplier * base ** (n - allowed)``; the longest match per token counts."""
    activate()  # what vllite does before importing a plugin
    sys.path.insert(0, str(EXAMPLES["dry"].directory))
    try:
        from vllm_example_dry import dry_penalties
    finally:
        sys.path.remove(str(EXAMPLES["dry"].directory))
        _forget("vllm_example_dry")
    # ... a b c x a b c | next: "x" would repeat "a b c x" (match "a b c", n = 3).
    history = [1, 2, 3, 9, 1, 2, 3]
    assert dry_penalties(history, 1.0, 2.0, 2) == {9: 2.0}
    assert dry_penalties(history, 1.0, 2.0, 3) == {9: 1.0}
    assert dry_penalties(history, 1.0, 2.0, 4) == {}
    # Two earlier continuations of "c": the longer match decides each token's penalty.
    assert dry_penalties([3, 7, 2, 3, 8, 2, 3], 0.5, 3.0, 1) == {7: 0.5, 8: 1.5}
    assert dry_penalties([4], 1.0, 2.0, 1) == {}
