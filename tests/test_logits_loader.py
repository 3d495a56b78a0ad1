"""Loading logits processors: registry builtins, both entry-point groups (throwaway distributions written as
``*.dist-info`` folders on ``sys.path``), the ``VLLITE_PLUGINS`` filter, both class-path spellings, every failure
message, slot-interface adaptation, and per-request validation at submit time."""

from __future__ import annotations

import importlib
import itertools
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vllite import plugin_manager
from vllite.builtin_logitsprocs.bad_words import BadWordsLogitsProcessor
from vllite.builtin_logitsprocs.logit_bias import LogitBiasLogitsProcessor
from vllite.builtin_logitsprocs.min_p import MinPLogitsProcessor
from vllite.builtin_logitsprocs.min_tokens import MinTokensLogitsProcessor
from vllite.builtin_logitsprocs.repetition_detection import RepetitionDetectionLogitsProcessor
from vllite.builtin_logitsprocs.thinking_budget import ThinkingBudgetLogitsProcessor
from vllite.config import SchedulerConfig, VllmConfig
from vllite.exceptions import PluginLoadError
from vllite.logits_processor import (
    BatchUpdateBuilder,
    LogitsProcessors,
    MoveDirectionality,
    build_logitsprocs,
    load_logitsprocs_classes,
    validate_sampling_params,
)
from vllite.plugins.vllm_compat.slot_adapter import SlotLogitsProcessorAdapter
from vllite.sampling_params import SamplingParams

BUILTINS = [
    MinTokensLogitsProcessor,
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    ThinkingBudgetLogitsProcessor,
    BadWordsLogitsProcessor,
    RepetitionDetectionLogitsProcessor,
]
_counter = itertools.count()

PROCESSORS = '''
import torch
from vllite.hookspecs import hookimpl
from vllite.logits_processor import LogitsProcessor


class Alpha(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        self.device = device

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass

    @classmethod
    def validate_params(cls, params):
        if (params.extra_args or {}).get("alpha") == "bad":
            raise ValueError("alpha must not be 'bad'")


class Beta(Alpha):
    def is_argmax_invariant(self):
        return False


class Gamma(Alpha):
    pass


class Outer:
    class Inner(Alpha):
        pass


class DuckTyped:
    """Shaped like vLLM's LogitsProcessor without deriving from vllite's."""

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update):
        pass


class NoUpdate:
    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def apply(self, logits):
        return logits

    def is_argmax_invariant(self):
        return True


class Abstract(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self):
        return True

    def update_state(self, batch_update):
        pass


class NoArgs(Alpha):
    def __init__(self):
        pass


class Exploding(Alpha):
    def __init__(self, vllm_config, device, is_pin_memory):
        raise RuntimeError("no accelerator here")


def not_a_class():
    pass


class SlotBoost:
    """Slot interface: adds extra_args['boost'] to token extra_args['token'] of the requests that set it."""

    def __init__(self, vllm_config, req_states):
        self.req_states = req_states
        self.boost = torch.zeros(req_states.max_num_reqs)
        self.token = torch.zeros(req_states.max_num_reqs, dtype=torch.long)
        self.staged = {}
        self.added = []
        self.flushes = 0
        self.applied = 0
        self.last_ctx = None

    @classmethod
    def validate_params(cls, params):
        if not isinstance((params.extra_args or {}).get("boost", 0.0), (int, float)):
            raise ValueError("boost must be a number")

    def add_request(self, req_idx, params):
        args = params.extra_args or {}
        self.added.append(req_idx)
        self.staged[req_idx] = (float(args.get("boost", 0.0)), int(args.get("token", 0)))
        return "boost" in args

    def apply_staged_writes(self):
        self.flushes += 1
        for slot, (boost, token) in self.staged.items():
            self.boost[slot] = boost
            self.token[slot] = token
        self.staged.clear()

    def apply(self, logits, ctx):
        self.applied += 1
        self.last_ctx = ctx
        slots = ctx.idx_mapping.long()
        logits[torch.arange(logits.shape[0]), self.token[slots]] += self.boost[slots]
        return logits


class SlotBadCtor(SlotBoost):
    def __init__(self, vllm_config):
        pass


@hookimpl
def vllite_register_logits_processors(register):
    register("gamma", Gamma)
'''

BROKEN = 'raise ImportError("libfoo.so: cannot open shared object file")\n'


def write_dist(root: Path, name: str, entry_points: dict[str, dict[str, str]]) -> None:
    info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    lines = []
    for group, entries in entry_points.items():
        lines.append(f"[{group}]")
        lines += [f"{key} = {value}" for key, value in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh module of test processors on sys.path, no plugin filter, and a fresh plugin manager."""
    mod = f"lp_test_mod_{next(_counter)}"
    (tmp_path / f"{mod}.py").write_text(textwrap.dedent(PROCESSORS))
    (tmp_path / f"{mod}_broken.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("VLLITE_PLUGINS", raising=False)
    monkeypatch.delenv("VLLITE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    importlib.invalidate_caches()
    plugin_manager.reset_plugin_manager()
    yield tmp_path, mod
    plugin_manager.reset_plugin_manager()
    for name in (mod, f"{mod}_broken"):
        sys.modules.pop(name, None)


def config(*explicit):
    return VllmConfig(scheduler_config=SchedulerConfig(max_num_seqs=4), logits_processors=list(explicit))


def names(classes):
    return [cls.__name__ for cls in classes]


def load_error(env_fixture, entries, group="vllm.logits_processors", dist="lp-bad"):
    root, _ = env_fixture
    write_dist(root, dist, {group: entries})
    with pytest.raises(PluginLoadError) as info:
        load_logitsprocs_classes()
    return info.value


# ---------------------------------------------------------------- builtins and discovery
def test_builtins_come_from_the_registry(env, monkeypatch):
    monkeypatch.setenv("VLLITE_PLUGINS", "")
    procs = build_logitsprocs(config(), "cpu", False)
    assert [type(p) for p in procs.non_argmax_invariant] == [
        MinTokensLogitsProcessor,
        LogitBiasLogitsProcessor,
        ThinkingBudgetLogitsProcessor,
        BadWordsLogitsProcessor,
        RepetitionDetectionLogitsProcessor,
    ]
    assert [type(p) for p in procs.argmax_invariant] == [MinPLogitsProcessor]


def test_discovery_in_both_groups_and_order(env, monkeypatch):
    root, mod = env
    write_dist(
        root,
        "lp-demo",
        {
            "vllite": {"lp_hooks": mod},
            "vllite.logits_processors": {"beta": f"{mod}:Beta", "slot": f"{mod}:SlotBoost"},
            "vllm.logits_processors": {"alpha": f"{mod}:Alpha"},
        },
    )
    monkeypatch.setenv("VLLITE_PLUGINS", "lp_hooks,alpha,beta,slot")
    classes = load_logitsprocs_classes(config(f"{mod}:Outer.Inner"), custom=[f"{mod}.DuckTyped"])
    assert classes[: len(BUILTINS)] == BUILTINS
    assert names(classes[len(BUILTINS) :]) == ["Gamma", "Alpha", "Beta", "SlotAdapter[SlotBoost]", "DuckTyped", "Inner"]
    assert issubclass(classes[len(BUILTINS) + 3], SlotLogitsProcessorAdapter)
    procs = build_logitsprocs(config(), torch.device("cpu"), False)
    assert [type(p).__name__ for p in procs.argmax_invariant] == ["MinPLogitsProcessor", "Gamma", "Alpha"]


def test_unfiltered_loads_every_entry_point(env):
    root, mod = env
    write_dist(root, "lp-demo", {"vllm.logits_processors": {"alpha": f"{mod}:Alpha"}})
    write_dist(root, "lp-other", {"vllite.logits_processors": {"beta": f"{mod}:Beta"}})
    assert {"Alpha", "Beta"} <= set(names(load_logitsprocs_classes()))


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"VLLITE_PLUGINS": "beta"}, ["Beta"]),
        ({"VLLITE_PLUGINS": " alpha , beta "}, ["Alpha", "Beta"]),
        ({"VLLITE_PLUGINS": ""}, []),
        ({"VLLITE_DISABLE_PLUGIN_AUTOLOAD": "1"}, []),
    ],
)
def test_vllite_plugins_filter(env, monkeypatch, variables, expected):
    root, mod = env
    write_dist(root, "lp-demo", {"vllm.logits_processors": {"alpha": f"{mod}:Alpha", "beta": f"{mod}:Beta"}})
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    assert names(load_logitsprocs_classes()[len(BUILTINS) :]) == expected


def test_explicit_spellings_classes_and_dedup(env, monkeypatch):
    _, mod = env
    monkeypatch.setenv("VLLITE_PLUGINS", "")
    module = importlib.import_module(mod)
    classes = load_logitsprocs_classes(
        config(f"{mod}.Alpha"), custom=[f"{mod}:Alpha", module.Beta, f"{mod}:Outer.Inner", f"{mod}.Beta"]
    )
    assert classes[len(BUILTINS) :] == [module.Alpha, module.Beta, module.Outer.Inner]


# ---------------------------------------------------------------- failure messages
def test_entry_point_import_failure(env):
    _, mod = env
    err = load_error(env, {"broken": f"{mod}_broken:Thing"})
    message = str(err)
    assert "'broken'" in message and "lp-bad" in message and "libfoo.so" in message
    assert err.plugin == "broken" and err.distribution == "lp-bad"
    assert isinstance(err.__cause__, ImportError)


def test_entry_point_not_a_class(env):
    _, mod = env
    err = load_error(env, {"func": f"{mod}:not_a_class"})
    assert "is not a class but function" in str(err) and "lp-bad" in str(err) and "'func'" in str(err)


def test_entry_point_missing_method(env):
    _, mod = env
    err = load_error(env, {"noupd": f"{mod}:NoUpdate"}, group="vllite.logits_processors")
    message = str(err)
    assert "does not satisfy the LogitsProcessor interface: missing update_state(batch_update)" in message
    assert "'noupd'" in message and "lp-bad" in message and "vllite.logits_processors" in message
    assert err.plugin == "noupd" and err.distribution == "lp-bad"


def test_entry_point_abstract_method(env):
    _, mod = env
    err = load_error(env, {"abs": f"{mod}:Abstract"})
    assert "missing an implementation of abstract method apply" in str(err)


def test_entry_point_wrong_constructor(env):
    _, mod = env
    err = load_error(env, {"noargs": f"{mod}:NoArgs"})
    assert "missing a constructor taking (vllm_config, device, is_pin_memory)" in str(err)


def test_slot_interface_wrong_constructor(env):
    _, mod = env
    err = load_error(env, {"slotbad": f"{mod}:SlotBadCtor"})
    assert "slot-interface" in str(err) and "(vllm_config, req_states)" in str(err)


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("no_such_module_xyz:Cls", "Cannot import module 'no_such_module_xyz'"),
        ("{mod}:Missing", "has no attribute 'Missing'"),
        ("{mod}.Missing", "has no attribute 'Missing'"),
        ("nodots", "Invalid class path 'nodots'"),
        ("{mod}:not_a_class", "is not a class"),
        ("{mod}:NoUpdate", "missing update_state(batch_update)"),
    ],
)
def test_explicit_class_path_failures(env, monkeypatch, path, fragment):
    _, mod = env
    monkeypatch.setenv("VLLITE_PLUGINS", "")
    with pytest.raises(PluginLoadError) as info:
        load_logitsprocs_classes(custom=[path.format(mod=mod)])
    assert fragment in str(info.value)


def test_explicit_non_class_object(env, monkeypatch):
    monkeypatch.setenv("VLLITE_PLUGINS", "")
    with pytest.raises(PluginLoadError, match=r"position 0.*is not a class"):
        load_logitsprocs_classes(custom=[object()])


def test_constructor_failure_names_the_entry_point(env, monkeypatch):
    root, mod = env
    write_dist(root, "lp-boom", {"vllm.logits_processors": {"boom": f"{mod}:Exploding"}})
    with pytest.raises(PluginLoadError, match=r"'boom'.*lp-boom.*failed to initialise: RuntimeError: no accelerator"):
        build_logitsprocs(config(), "cpu", False)


# ---------------------------------------------------------------- validation at submit time
def test_validate_sampling_params(env, monkeypatch):
    root, mod = env
    write_dist(root, "lp-demo", {"vllm.logits_processors": {"alpha": f"{mod}:Alpha", "slot": f"{mod}:SlotBoost"}})
    monkeypatch.setenv("VLLITE_PLUGINS", "alpha,slot")
    classes = load_logitsprocs_classes()
    procs = build_logitsprocs(config(), "cpu", False)
    good = SamplingParams(extra_args={"alpha": "ok", "boost": 1.5}, logit_bias={3: 1.0})
    for target in (classes, procs, list(procs.all)):
        validate_sampling_params(target, good)
        with pytest.raises(ValueError, match="alpha must not be 'bad'"):
            validate_sampling_params(target, SamplingParams(extra_args={"alpha": "bad"}))
        with pytest.raises(ValueError, match="boost must be a number"):
            validate_sampling_params(target, SamplingParams(extra_args={"boost": "x"}))
        with pytest.raises(ValueError, match="thinking_token_budget"):
            validate_sampling_params(target, SamplingParams(extra_args={"thinking_token_budget": -2}))


# ---------------------------------------------------------------- slot interface, adapted
def test_slot_interface_adapted_onto_batch_updates(env, monkeypatch):
    _, mod = env
    monkeypatch.setenv("VLLITE_PLUGINS", "")
    module = importlib.import_module(mod)
    procs = build_logitsprocs(config(), "cpu", False, custom=[module.SlotBoost])
    adapter = next(p for p in procs.non_argmax_invariant if isinstance(p, SlotLogitsProcessorAdapter))
    inner = adapter.inner
    builder = BatchUpdateBuilder()

    def params(**extra):
        return SamplingParams(extra_args=extra or None)

    outputs = [[], [], [7]]
    builder.added += [
        (0, params(boost=5.0, token=1), [10, 11], outputs[0]),
        (1, params(), [12], outputs[1]),
        (2, params(boost=2.0, token=3), None, outputs[2]),
    ]
    procs.update_state(builder.get_and_reset(3))
    assert inner.added == [0, 1, 2] and inner.flushes == 1
    out = adapter.apply(torch.zeros(3, 4))
    assert out.tolist() == [[0, 5, 0, 0], [0, 0, 0, 0], [0, 0, 0, 2]]
    states = inner.req_states
    assert states.all_token_ids.gpu[0, :2].tolist() == [10, 11] and states.total_len.gpu[:3].tolist() == [2, 1, 1]
    assert states.prompt_len.gpu[:3].tolist() == [2, 1, 0] and states.all_token_ids.gpu[2, 0] == 7

    outputs[0].append(42)  # generated tokens reach req_states without a batch change
    procs.update_state(builder.get_and_reset(3))
    assert states.all_token_ids.gpu[0, :3].tolist() == [10, 11, 42] and states.total_len.gpu[0] == 3
    adapter.apply(torch.zeros(3, 4))
    assert inner.last_ctx.input_ids.tolist() == [42, 12, 7] and inner.last_ctx.pos.tolist() == [2, 0, 0]

    builder.removed_append(0)  # request 0 finishes; request 2 moves down into its row
    builder.moved.append((2, 0, MoveDirectionality.UNIDIRECTIONAL))
    procs.update_state(builder.get_and_reset(2))
    out = adapter.apply(torch.zeros(2, 4))
    assert out.tolist() == [[0, 0, 0, 2], [0, 0, 0, 0]]
    assert inner.last_ctx.idx_mapping.tolist() == [2, 1]

    builder.added.append((2, params(boost=7.0, token=0), [1], []))  # the freed slot 0 is reused
    builder.moved.append((0, 2, MoveDirectionality.SWAP))
    procs.update_state(builder.get_and_reset(3))
    assert inner.added[-1] == 0
    out = adapter.apply(torch.zeros(3, 4))
    assert out.tolist() == [[7, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 2]]

    builder.removed_append(0)
    builder.removed_append(2)
    procs.update_state(builder.get_and_reset(1))
    applied = inner.applied
    logits = torch.zeros(1, 4)
    assert adapter.apply(logits) is logits and inner.applied == applied  # no active request: skipped


def test_container_from_build_is_a_logits_processors(env, monkeypatch):
    monkeypatch.setenv("VLLITE_PLUGINS", "")
    assert isinstance(build_logitsprocs(config(), "cpu", False), LogitsProcessors)
