"""vllite's vLLM compatibility layer: ``vllm.*`` imports served by vllite when no real vLLM is installed.

Covers the layer itself: every served module and name maps to vllite's object; an unserved name fails with an
error that says so; a real vLLM (a fake ``vllm`` package on ``sys.path`` stands in for one) wins over the layer;
``BatchUpdate`` moves compare equal to whichever ``MoveDirectionality`` a processor imported; the config and
slot state have the shape vLLM plugins read; and a processor written exactly as a vLLM plugin loads through a
class path and has its effect. Installed plugin distributions are covered by tests/test_vllm_compat_suite.py.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vllite.config import EngineConfig
from vllite.engine_args import EngineArgs
from vllite.exceptions import VlliteError, VLLMValidationError
from vllite.logits_processor import (
    BatchUpdateBuilder,
    LogitsProcessor,
    MoveDirectionality,
    build_logitsprocs,
)
from vllite.plugins import vllm_compat
from vllite.plugins.vllm_compat.buffers import StagedWriteTensor, UvaBackedTensor
from vllite.plugins.vllm_compat.finder import VllmCompatFinder, VllmCompatImportError
from vllite.plugins.vllm_compat.slot_adapter import SlotLogitsProcessorAdapter
from vllite.plugins.vllm_compat.slot_interface import LogitsProcRequestState
from vllite.sampling_params import SamplingParams
from vllite.testing import make_tiny_model_dir_cached

ROOT = Path(__file__).resolve().parents[1]


def _forget_vllm() -> None:
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def fresh_vllm_names():
    """Each test starts with no ``vllm`` module imported and ends with the layer as it found it."""
    was_active = vllm_compat.is_active()
    vllm_compat.deactivate()
    _forget_vllm()
    yield
    vllm_compat.deactivate()
    _forget_vllm()
    if was_active:
        vllm_compat.activate()


def write_fake_vllm(root: Path) -> Path:
    """A stand-in for a real vLLM install: a ``vllm`` package with its own ``MoveDirectionality`` enum."""
    files = {
        "vllm/__init__.py": "__version__ = '9.9.9'\nREAL = True\n",
        "vllm/v1/__init__.py": "",
        "vllm/v1/sample/__init__.py": "",
        "vllm/v1/sample/logits_processor/__init__.py": """
            from enum import Enum, auto


            class MoveDirectionality(Enum):
                UNIDIRECTIONAL = auto()
                SWAP = auto()
        """,
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(write_fake_vllm(tmp_path / "site")))
    importlib.invalidate_caches()
    return tmp_path / "site"


# ---------------------------------------------------------------------------- what is served
def test_every_served_name_is_vllites_object():
    from vllite.plugins.vllm_compat.finder import _resolve

    vllm_compat.activate()
    for module_name, names in vllm_compat.SERVED_MODULES.items():
        module = importlib.import_module(module_name)
        assert vllm_compat.is_shim_module(module) and module.__spec__.origin == "vllite.plugins.vllm_compat"
        assert sorted(names) == module.__all__ and set(names) <= set(dir(module))
        for name, reference in names.items():
            assert getattr(module, name) is _resolve(reference), f"{module_name}.{name}"
        parent = module_name.rpartition(".")[0]
        assert not parent or parent in vllm_compat.SERVED_MODULES, f"{module_name}: parent not served"


def test_plugin_imports_get_the_same_objects_as_vllite():
    import vllite.builtin_logitsprocs as builtins
    import vllite.config
    import vllite.logits_processor as lp
    import vllite.structured_output
    from vllite.plugins.vllm_compat import slot_interface as slot

    vllm_compat.activate()
    from vllm import SamplingParams as TopSamplingParams
    from vllm.config import VllmConfig
    from vllm.exceptions import VLLMValidationError as ServedValidationError
    from vllm.logger import init_logger
    from vllm.sampling_params import SamplingParams as ServedSamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tokenizers import cached_tokenizer_from_config
    from vllm.utils.torch_utils import async_tensor_h2d
    from vllm.v1.sample.logits_processor import (
        LOGITSPROCS_GROUP,
        AdapterLogitsProcessor,
        BatchUpdate,
        LogitsProcessor,
        RequestLogitsProcessor,
        builtin,
        process_dict_updates,
    )
    from vllm.v1.sample.logits_processor import MoveDirectionality as ServedMove
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcRequestState
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as ServedSlotProcessor

    assert (LogitsProcessor, BatchUpdate, ServedMove) == (lp.LogitsProcessor, lp.BatchUpdate, lp.MoveDirectionality)
    assert AdapterLogitsProcessor is lp.AdapterLogitsProcessor and RequestLogitsProcessor is lp.RequestLogitsProcessor
    assert process_dict_updates is lp.process_dict_updates and LOGITSPROCS_GROUP == "vllm.logits_processors"
    assert builtin.MinPLogitsProcessor is builtins.MinPLogitsProcessor
    assert builtin.LogitBiasLogitsProcessor is builtins.LogitBiasLogitsProcessor
    assert builtin.MinTokensLogitsProcessor is builtins.MinTokensLogitsProcessor
    assert VllmConfig is vllite.config.EngineConfig
    assert TopSamplingParams is ServedSamplingParams is SamplingParams
    assert StructuredOutputsParams is vllite.structured_output.StructuredOutputsParams
    assert ServedValidationError is VLLMValidationError and issubclass(VLLMValidationError, ValueError)
    assert ServedSlotProcessor is slot.SlotLogitsProcessor
    assert (LogitsContext, LogitsProcRequestState) == (slot.LogitsContext, slot.LogitsProcRequestState)
    assert callable(init_logger) and callable(async_tensor_h2d) and callable(cached_tokenizer_from_config)
    import vllm

    assert vllm.__version__.startswith(vllm_compat.VLLM_API_VERSION + "+vllite")


def test_not_active_after_import_vllite():
    code = (
        "import importlib.util, vllite, vllite.logits_processor, vllite.config\n"
        "assert importlib.util.find_spec('vllm') is None, 'vllm findable after import vllite'\n"
        "from vllite.plugins import vllm_compat\n"
        "assert not vllm_compat.is_active()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_loading_a_class_path_activates_the_layer_in_a_fresh_process(tmp_path):
    """What the engine-core process does first: load the processor classes (nothing activated it before)."""
    (tmp_path / "fresh_lp.py").write_text(
        "from vllm.v1.sample.logits_processor import AdapterLogitsProcessor\n"
        "class Nop(AdapterLogitsProcessor):\n"
        "    def is_argmax_invariant(self):\n        return True\n"
        "    def new_req_logits_processor(self, params):\n        return None\n"
    )
    code = (
        "from vllite.logits_processor import load_logitsprocs_classes\n"
        "classes = load_logitsprocs_classes(custom=['fresh_lp:Nop'])\n"
        "assert classes[-1].__name__ == 'Nop', classes\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))  # vllite may live there
    env = {**os.environ, "PYTHONPATH": path, "VLLITE_PLUGINS": ""}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env)


# ---------------------------------------------------------------------------- what is not served
@pytest.mark.parametrize(
    ("statement", "missing", "parent_lists"),
    [
        ("import vllm.model_executor.layers", "vllm.model_executor", "vllm provides CompletionOutput"),
        ("from vllm.config import CompilationConfig", "vllm.config.CompilationConfig", "VllmConfig"),
        ("from vllm.v1.sample.logits_processor import Nope", "vllm.v1.sample.logits_processor.Nope", "BatchUpdate"),
        ("from vllm.v1 import engine", "vllm.v1.engine", "vllm.v1.sample"),
    ],
)
def test_an_unserved_name_says_the_layer_does_not_provide_it(statement, missing, parent_lists):
    vllm_compat.activate()
    with pytest.raises(VllmCompatImportError) as info:
        exec(statement, {})
    message = str(info.value)
    assert isinstance(info.value, ModuleNotFoundError) and isinstance(info.value, VlliteError)
    assert f"vllite's vLLM compatibility layer does not provide {missing!r}" in message
    assert parent_lists in message and "vllm.v1.sample.logits_processor" in message  # lists what it serves
    assert "No module named" not in message


def test_an_unserved_attribute_is_an_attribute_error_that_says_so():
    vllm_compat.activate()
    import vllm.config

    assert not hasattr(vllm.config, "CompilationConfig")
    with pytest.raises(AttributeError, match=r"layer does not provide 'vllm\.config\.CompilationConfig'"):
        _ = vllm.config.CompilationConfig  # type: ignore[attr-defined]


def test_nothing_is_served_while_inactive():
    with pytest.raises(ModuleNotFoundError) as info:
        import vllm  # noqa: F401
    assert not isinstance(info.value, VllmCompatImportError)


# ---------------------------------------------------------------------------- a real vLLM wins
def test_a_real_vllm_on_the_path_wins_over_the_layer(fake_vllm):
    vllm_compat.activate()
    assert VllmCompatFinder().find_spec("vllm") is None
    import vllm
    from vllm.v1.sample.logits_processor import MoveDirectionality as TheirMove

    assert vllm.REAL and vllm.__version__ == "9.9.9" and not vllm_compat.is_shim_module(vllm)
    assert TheirMove is not MoveDirectionality and TheirMove.__module__ == "vllm.v1.sample.logits_processor"
    with pytest.raises(ModuleNotFoundError) as info:  # the real package lacks it: Python's own error
        import vllm.config
    assert not isinstance(info.value, VllmCompatImportError)


def test_a_bare_vllm_folder_is_no_real_vllm(tmp_path, monkeypatch):
    (tmp_path / "vllm" / "data").mkdir(parents=True)  # a namespace-package portion, not an install
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    vllm_compat.activate()
    import vllm

    assert vllm_compat.is_shim_module(vllm)


def test_the_finder_asks_the_other_finders_first(fake_vllm, monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [VllmCompatFinder(), *sys.meta_path])
    import vllm

    assert vllm.REAL


# ---------------------------------------------------------------------------- MoveDirectionality identity
def _their_enum(kind: str) -> type:
    if kind == "vllite":
        return MoveDirectionality
    vllm_compat.activate()
    from vllm.v1.sample.logits_processor import MoveDirectionality as theirs

    return theirs


def _track(states: dict[int, str], update, theirs) -> None:
    """A processor's bookkeeping written against ``theirs`` (as a vLLM plugin writes it)."""
    for index in update.removed:
        states.pop(index, None)
    for index, params, _, _ in update.added:
        states[index] = params.extra_args["tag"]
    for a, b, direct in update.moved:
        a_state, b_state = states.pop(a, None), states.pop(b, None)
        if a_state is not None:
            states[b] = a_state
        if theirs.SWAP == direct and b_state is not None:  # noqa: SIM300 (the reflected comparison, on purpose)
            states[a] = b_state
        elif direct == theirs.UNIDIRECTIONAL:
            pass
        elif direct != theirs.SWAP:
            raise AssertionError(f"unknown move {direct!r}")


@pytest.mark.parametrize("kind", ["vllite", "shim", "real"])
def test_moves_compare_equal_to_the_enum_the_processor_imported(kind, request):
    if kind == "real":
        request.getfixturevalue("fake_vllm")
    theirs = _their_enum(kind)
    assert (theirs is MoveDirectionality) == (kind != "real")
    ours = MoveDirectionality
    assert ours.SWAP == theirs.SWAP and theirs.SWAP == ours.SWAP
    assert ours.UNIDIRECTIONAL == theirs.UNIDIRECTIONAL and theirs.UNIDIRECTIONAL == ours.UNIDIRECTIONAL
    assert ours.SWAP != theirs.UNIDIRECTIONAL and theirs.UNIDIRECTIONAL != ours.SWAP
    assert not (ours.SWAP != theirs.SWAP) and not (theirs.SWAP != ours.SWAP)  # noqa: SIM202
    assert {theirs.SWAP: "s"}[ours.SWAP] == "s" and {ours.SWAP: "s"}[theirs.SWAP] == "s"
    assert ours.UNIDIRECTIONAL in {theirs.UNIDIRECTIONAL} and theirs.SWAP in {ours.SWAP}
    assert ours.SWAP not in {theirs.UNIDIRECTIONAL}
    match ours.SWAP:
        case theirs.UNIDIRECTIONAL:
            raise AssertionError("matched the wrong member")
        case theirs.SWAP:
            pass
        case _:
            raise AssertionError("matched no member")

    builder = BatchUpdateBuilder()
    states: dict[int, str] = {}
    builder.added += [(i, SamplingParams(extra_args={"tag": t}), [1], []) for i, t in enumerate("abcd")]
    _track(states, builder.get_and_reset(4), theirs)
    builder.removed_append(1)  # b finishes; d condenses into its row
    builder.moved.append((3, 1, MoveDirectionality.UNIDIRECTIONAL))
    _track(states, builder.get_and_reset(3), theirs)
    assert states == {0: "a", 1: "d", 2: "c"}
    builder.moved.append((0, 2, MoveDirectionality.SWAP))
    _track(states, builder.get_and_reset(3), theirs)
    assert states == {0: "c", 1: "d", 2: "a"}


# ---------------------------------------------------------------------------- vLLM-shaped config and state
def test_the_config_has_the_paths_vllm_plugins_read():
    model = make_tiny_model_dir_cached("llama")
    config = EngineArgs(model=str(model), max_num_seqs=8, block_size=4).create_engine_config()
    assert config.device_config.device == "auto"  # what the user asked for; the engine's copy resolves it
    engine = config.with_limits(128)
    assert isinstance(engine, EngineConfig)
    model_config = engine.model_config
    assert model_config.runner_type == "generate" and model_config.tokenizer_mode == "auto"
    assert model_config.tokenizer_revision is None and model_config.revision is None
    assert model_config.max_model_len == 128 and model_config.model == str(model)
    vocab = model_config.hf_config.vocab_size
    assert model_config.vocab_size == model_config.get_vocab_size() == vocab > 0
    assert model_config.get_hidden_size() == model_config.hf_text_config.hidden_size
    assert engine.scheduler_config.max_num_seqs == 8 and engine.cache_config.block_size == 4
    assert engine.speculative_config is None
    parallel = engine.parallel_config
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.world_size) == (1, 1, 1)
    assert parallel.data_parallel_size == 1 and parallel.data_parallel_rank == 0
    assert engine.device_config.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert torch.zeros(1, device=engine.device_config.device).device.type == engine.device_config.device


def test_the_validation_error_names_parameter_and_value():
    err = VLLMValidationError("bad target", parameter="target_token", value=0)
    assert str(err) == "bad target (parameter=target_token, value=0)" and isinstance(err, ValueError)


def test_staged_buffers_have_vllms_gpu_cpu_np_views():
    staged = StagedWriteTensor((3, 4), torch.int32, "cpu")
    staged.stage_write(1, 1, [7, 8])
    staged.stage_write_elem(2, 5)
    assert staged.gpu.sum() == 0  # nothing lands before apply_write
    staged.apply_write()
    assert staged.gpu.tolist() == [[0, 0, 0, 0], [0, 7, 8, 0], [5, 0, 0, 0]]
    assert staged.np.tolist() == staged.cpu.tolist() == staged.gpu.tolist()
    flat = StagedWriteTensor(4, torch.int32, "cpu")
    flat.stage_write_elem(3, 9)
    flat.apply_write()
    assert flat.gpu.tolist() == [0, 0, 0, 9]

    uva = UvaBackedTensor(4, torch.float32, device="cpu")
    view = uva.np
    view[1] = 2.5
    assert uva.copy_to_uva().tolist() == [0.0, 2.5, 0.0, 0.0] and uva.copy_to_uva(2).tolist() == [0.0, 2.5]
    assert uva.np is view


@pytest.mark.cuda
def test_staged_buffers_copy_to_the_device():
    staged = StagedWriteTensor((2, 3), torch.int32, "cuda")
    staged.stage_write(1, 0, [4, 5, 6])
    staged.apply_write()
    assert staged.gpu.device.type == "cuda" and staged.gpu.cpu().tolist() == [[0, 0, 0], [4, 5, 6]]
    assert staged.cpu.tolist() == [[0, 0, 0], [4, 5, 6]]
    uva = UvaBackedTensor(2, torch.int64, device="cuda")
    uva.np[0] = 3
    assert uva.copy_to_uva().device.type == "cuda" and uva.gpu.tolist() == [3, 0]


def _slot_config():
    model = make_tiny_model_dir_cached("llama")
    return EngineArgs(model=str(model), max_num_seqs=4, device="cpu").create_engine_config().with_limits(16)


def test_slot_request_state_is_staged_like_vllms(monkeypatch):
    monkeypatch.setenv("VLLITE_PLUGINS", "")
    vllm_compat.activate()
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor

    class Recorder(LogitsProcessor):
        def __init__(self, vllm_config, req_states: LogitsProcRequestState) -> None:
            super().__init__(vllm_config, req_states)
            self.req_states = req_states
            self.prompt_len_np = req_states.prompt_len.np  # vLLM's builtins keep this view: it must stay live
            self.own = UvaBackedTensor(req_states.max_num_reqs, torch.float32)  # no device: the engine's
            self.seen: list[list[int]] = []

        def apply(self, logits, ctx: LogitsContext):
            states = self.req_states
            self.seen = [
                states.all_token_ids.gpu[slot, : states.total_len.gpu[slot]].tolist()
                for slot in ctx.expanded_idx_mapping.tolist()
            ]
            return logits

    config = _slot_config()
    procs = build_logitsprocs(config, "cpu", False, custom=[Recorder])
    adapter = next(p for p in procs.all if isinstance(p, SlotLogitsProcessorAdapter))
    inner = adapter.inner
    states = inner.req_states
    assert states.vocab_size == config.model_config.get_vocab_size() and states.max_num_reqs == 4
    assert inner.own.device.type == "cpu"
    builder = BatchUpdateBuilder()
    out0: list[int] = []
    builder.added += [(0, SamplingParams(), [3, 4, 5], out0), (1, SamplingParams(), [6], [])]
    procs.update_state(builder.get_and_reset(2))
    out0 += [9] * 20  # grows past max_model_len (16): all_token_ids is replaced by a larger buffer
    procs.update_state(builder.get_and_reset(2))
    adapter.apply(torch.zeros(2, 8))
    assert inner.seen == [[3, 4, 5, *[9] * 20], [6]]
    assert inner.prompt_len_np[:2].tolist() == [3, 1] and states.prefill_len.cpu[:2].tolist() == [3, 1]
    assert states.total_len.np[:2].tolist() == [23, 1] and states.all_token_ids.np.shape[1] >= 23


# ---------------------------------------------------------------------------- the small vLLM helpers
def test_init_logger_has_vllms_once_methods(caplog):
    from vllite.plugins.vllm_compat.logger import init_logger

    logger = init_logger("vllm_style_plugin.compat")
    assert init_logger("vllm_style_plugin.compat") is logger and logger.name == "vllm_style_plugin.compat"
    with caplog.at_level(logging.INFO, logger="vllm_style_plugin.compat"):
        for _ in range(3):
            logger.info_once("loaded %d slots", 4)
            logger.warning_once("warned once")
        logger.info("plain %s", "info")
    messages = [(r.levelname, r.getMessage(), Path(r.pathname).name) for r in caplog.records]
    assert messages == [
        ("INFO", "loaded 4 slots", "test_vllm_compat.py"),
        ("WARNING", "warned once", "test_vllm_compat.py"),
        ("INFO", "plain info", "test_vllm_compat.py"),
    ]


def test_async_tensor_h2d_takes_both_call_orders():
    from vllite.plugins.vllm_compat.torch_utils import async_tensor_h2d

    assert async_tensor_h2d([1, 2], "cpu", torch.int64).tolist() == [1, 2]
    old = async_tensor_h2d([1, 2], torch.int32, "cpu", False)  # (data, dtype, target_device, pin_memory)
    assert old.dtype == torch.int32 and old.tolist() == [1, 2]
    out = torch.zeros(2)
    assert async_tensor_h2d([3, 4], out=out) is out and out.tolist() == [3.0, 4.0]


def test_cached_tokenizer_from_config():
    from vllite.plugins.vllm_compat.tokenizers import cached_tokenizer_from_config

    config = EngineArgs(model=str(make_tiny_model_dir_cached("llama"))).create_engine_config()
    tokenizer = cached_tokenizer_from_config(config.model_config)
    assert tokenizer is cached_tokenizer_from_config(config.model_config) and tokenizer.encode("hi")
    no_tokenizer = EngineArgs(model=config.model_config.model, skip_tokenizer_init=True).create_engine_config()
    assert cached_tokenizer_from_config(no_tokenizer.model_config) is None


# ---------------------------------------------------------------------------- a vLLM plugin, unchanged
VLLM_STYLE_PLUGIN = '''
"""Written exactly as a vLLM V1 plugin: forces ``extra_args["target_token"]`` for the requests that set it."""

import torch

from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

logger = init_logger(__name__)


class TargetTokenLogitsProcessor(LogitsProcessor):
    @classmethod
    def validate_params(cls, params: SamplingParams):
        target = (params.extra_args or {}).get("target_token")
        if target is not None and not isinstance(target, int):
            raise VLLMValidationError("target_token must be an int", parameter="target_token", value=target)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        assert vllm_config.model_config.runner_type == "generate"
        assert vllm_config.speculative_config is None
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.req_info: dict[int, int] = {}
        logger.info_once("target-token processor for %d rows", self.max_num_seqs)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        if not batch_update:
            return
        for index in batch_update.removed:
            self.req_info.pop(index, None)
        for index, params, _, _ in batch_update.added:
            target = (params.extra_args or {}).get("target_token")
            if target is None:
                self.req_info.pop(index, None)
            else:
                self.req_info[index] = target
        for a, b, direct in batch_update.moved:
            a_target, b_target = self.req_info.pop(a, None), self.req_info.pop(b, None)
            if a_target is not None:
                self.req_info[b] = a_target
            if direct == MoveDirectionality.SWAP and b_target is not None:
                self.req_info[a] = b_target

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, target in self.req_info.items():
            assert 0 <= target < self.vocab_size
            logits[row].fill_(float("-inf"))
            logits[row, target] = 0.0
        return logits
'''


def test_a_vllm_plugin_loads_by_class_path_and_has_its_effect(tmp_path, monkeypatch):
    from vllite import LLM

    (tmp_path / "vllm_style_target.py").write_text(VLLM_STYLE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VLLITE_PLUGINS", "")
    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 64, "block_size": 4}
    model = str(make_tiny_model_dir_cached("llama"))
    prompts = [{"prompt_token_ids": [5 + i, 6, 7 + i]} for i in range(4)]
    # Rows finish at different times, so the batch condenses (moves) while targeted rows are still running.
    plan = [(3, 11), (8, None), (12, 13), (6, None)]

    def params(max_tokens: int, target: int | None) -> SamplingParams:
        extra = {"target_token": target} if target is not None else None
        return SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, extra_args=extra
        )

    plain = LLM(model, **kwargs)
    try:
        reference = plain.generate(prompts, [params(n, None) for n, _ in plan], use_tqdm=False)
    finally:
        plain.shutdown()
    llm = LLM(model, logits_processors=["vllm_style_target:TargetTokenLogitsProcessor"], **kwargs)
    try:
        outs = llm.generate(prompts, [params(n, t) for n, t in plan], use_tqdm=False)
        with pytest.raises(ValueError, match="target_token must be an int"):
            llm.generate(prompts[:1], params(2, "x"), use_tqdm=False)  # type: ignore[arg-type]
    finally:
        llm.shutdown()
    for (max_tokens, target), out, ref in zip(plan, outs, reference):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == max_tokens
        assert tokens == ([target] * max_tokens if target is not None else list(ref.outputs[0].token_ids))
    assert sys.modules.pop("vllm_style_target").LogitsProcessor is LogitsProcessor  # imported from the layer


def test_a_vllm_plugin_class_object_reaches_the_engine_process(tmp_path, monkeypatch):
    """The engine-core process unpickles its config before it loads anything: a class importing ``vllm`` travels as
    its class path and is imported there after the layer is active."""
    import pickle

    from vllite import LLM

    (tmp_path / "vllm_style_target_mp.py").write_text(VLLM_STYLE_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("VLLITE_PLUGINS", "")
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "1")
    vllm_compat.activate()  # as a user does before importing a vLLM-style class in their own code
    cls = importlib.import_module("vllm_style_target_mp").TargetTokenLogitsProcessor
    model = str(make_tiny_model_dir_cached("llama"))
    config = EngineArgs(model=model, logits_processors=[cls]).create_engine_config()
    assert pickle.loads(pickle.dumps(config)).logits_processors == ["vllm_style_target_mp:TargetTokenLogitsProcessor"]
    llm = LLM(model, dtype="float32", skip_tokenizer_init=True, max_model_len=64, logits_processors=[cls])
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False, extra_args={"target_token": 9})
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    finally:
        llm.shutdown()
        sys.modules.pop("vllm_style_target_mp", None)
    assert list(out[0].outputs[0].token_ids) == [9, 9, 9, 9]
