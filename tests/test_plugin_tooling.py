"""Plugin tooling (issue 15, item 4): the deny list (``VLLITE_PLUGINS=-name``, ``VLLITE_DISABLED_PLUGINS``) on every
entry-point group, ``vllite plugins`` / ``--check`` running the engine's own checks on every logits processor,
``PluginLoadError`` naming a hook-registered processor's entry point and distribution, and a processor that raises
in ``apply`` / ``update_state`` named with where it came from. Plugins are throwaway distributions (``*.dist-info``
folders on ``sys.path``); engine tests run ``LLM.generate`` on a tiny random model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.plugin_utils import forget_modules, make_distribution
from vllite import plugin_manager
from vllite.cli import main
from vllite.exceptions import PluginHookError, PluginLoadError
from vllite.logits_processor import load_logitsprocs_classes
from vllite.sampling_params import SamplingParams

FILTER_VARIABLES = ("VLLITE_PLUGINS", "VLLITE_DISABLED_PLUGINS", "VLLITE_DISABLE_PLUGIN_AUTOLOAD")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An empty throwaway site folder on sys.path, no plugin filter, a fresh plugin manager before and after."""
    root = tmp_path / "site"
    root.mkdir()
    for name in FILTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(root))
    plugin_manager.reset_plugin_manager()
    yield root
    plugin_manager.reset_plugin_manager()


def _set_env(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> None:
    for name in FILTER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    plugin_manager.reset_plugin_manager()


# ------------------------------------------------------------------------------------------------ the filter
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ["tf_a", "tf_b", "tf_c"]),
        ({"VLLITE_PLUGINS": "-tf_a"}, ["tf_b", "tf_c"]),
        ({"VLLITE_PLUGINS": "-tf_a,-tf_b"}, ["tf_c"]),
        ({"VLLITE_PLUGINS": " - tf_a , tf_c "}, ["tf_c"]),  # mixed: the allow list, less the denied
        ({"VLLITE_PLUGINS": "tf_a,tf_b,-tf_b"}, ["tf_a"]),
        ({"VLLITE_PLUGINS": "tf_b"}, ["tf_b"]),  # today's allow list is unchanged
        ({"VLLITE_PLUGINS": ""}, []),
        ({"VLLITE_DISABLED_PLUGINS": "tf_b"}, ["tf_a", "tf_c"]),
        ({"VLLITE_DISABLED_PLUGINS": "tf_b, tf_c"}, ["tf_a"]),
        ({"VLLITE_PLUGINS": "tf_a,tf_b", "VLLITE_DISABLED_PLUGINS": "tf_b"}, ["tf_a"]),
        ({"VLLITE_PLUGINS": "-tf_a", "VLLITE_DISABLED_PLUGINS": "tf_c"}, ["tf_b"]),
        ({"VLLITE_PLUGINS": "-tf_a", "VLLITE_DISABLE_PLUGIN_AUTOLOAD": "1"}, []),
    ],
)
@pytest.mark.parametrize("group", ["vllite", "vllm.logits_processors", "vllite.logits_processors"])
def test_deny_list_applies_to_every_entry_point_group(site, monkeypatch, group, env, expected):
    make_distribution(site, "tf-dist", {group: {n: f"tf_mod:{n}" for n in ("tf_a", "tf_b", "tf_c")}}, {})
    _set_env(monkeypatch, env)
    names = [info.name for info in plugin_manager.iter_entry_points(group) if info.name.startswith("tf_")]
    assert names == expected


# ------------------------------------------------------------------------------------------------ the engine
FORCED, MARKED = 7, 11

GOOD_LP = """
from vllite.logits_processor import AdapterLogitsProcessor


def force(token):
    def apply(output_ids, logits):
        logits[:] = float("-inf")
        logits[token] = 0.0
        return logits

    return apply


class ForceToken(AdapterLogitsProcessor):
    \"\"\"extra_args={"force": t}: every token of that request is t.\"\"\"

    key = "force"

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        token = (params.extra_args or {}).get(self.key)
        return None if token is None else force(token)


class MarkToken(ForceToken):
    key = "mark"
"""

GOOD_HOOKS = """
from vllite import hookimpl


@hookimpl
def vllite_register_logits_processors(register):
    from tool_good_lp import MarkToken

    register("mark", MarkToken)
"""

BROKEN_IMPORT = 'raise ImportError("libvllm_ops.so: cannot open shared object file")\n'

BROKEN_CLASS = """
class NoUpdate:
    def __init__(self, vllm_config, device, is_pin_memory): ...
    def apply(self, logits): return logits
    def is_argmax_invariant(self): return True
"""

# group of the broken entry point -> (its value, its module source)
BROKEN = {
    "vllite": ("tool_broken_mod", BROKEN_IMPORT),
    "vllm.logits_processors": ("tool_broken_mod:NoUpdate", BROKEN_CLASS),
    "vllite.logits_processors": ("tool_broken_mod:Anything", BROKEN_IMPORT),
}
MODULES = ("tool_good_lp", "tool_good_hooks", "tool_broken_mod")


def _install_good_and_broken(site: Path, broken_group: str) -> None:
    forget_modules(*MODULES)
    make_distribution(
        site,
        "tool-good",
        {"vllite": {"good_hooks": "tool_good_hooks"}, "vllm.logits_processors": {"force": "tool_good_lp:ForceToken"}},
        {"tool_good_lp": GOOD_LP, "tool_good_hooks": GOOD_HOOKS},
    )
    value, source = BROKEN[broken_group]
    make_distribution(site, "tool-broken", {broken_group: {"broken": value}}, {"tool_broken_mod": source}, "2.0")


def _llm(**kwargs):
    from vllite import LLM
    from vllite.testing import make_tiny_model_dir_cached

    return LLM(
        str(make_tiny_model_dir_cached("llama")),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        block_size=4,
        **kwargs,
    )


PROMPTS = [[3, 4, 5, 6], [9, 8, 7], [20, 21, 22, 23, 24]]


def _params(**extra: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, detokenize=False, extra_args=extra or None)


def _generate(llm, params: list[SamplingParams]):
    return [out.outputs[0] for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_reference() -> list[list[int]]:
    """Greedy tokens of each prompt with no third-party plugin."""
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLITE_PLUGINS", "")
    plugin_manager.reset_plugin_manager()
    llm = _llm()
    try:
        return [c.token_ids for c in _generate(llm, [_params()] * len(PROMPTS))]
    finally:
        llm.shutdown()
        mp.undo()
        plugin_manager.reset_plugin_manager()


def _check_every_other_plugin_runs(llm, reference: list[list[int]]) -> None:
    outs = _generate(llm, [_params(force=FORCED), _params(), _params(mark=MARKED)])
    assert outs[0].token_ids == [FORCED] * 5  # the entry-point processor (vllm.logits_processors)
    assert outs[1].token_ids == reference[1]  # a row that asked for nothing is unchanged
    assert outs[2].token_ids == [MARKED] * 5  # the hook-registered processor (vllite group)
    assert all(c.finish_reason == "length" and c.error is None for c in outs)


@pytest.mark.parametrize(
    ("broken_group", "deny"),
    [
        ("vllite", {"VLLITE_DISABLED_PLUGINS": "broken"}),
        ("vllm.logits_processors", {"VLLITE_PLUGINS": "-broken"}),
        ("vllite.logits_processors", {"VLLITE_PLUGINS": "-broken", "VLLITE_DISABLED_PLUGINS": "unrelated"}),
    ],
)
def test_deny_list_keeps_one_broken_plugin_from_stopping_the_engine(
    site, monkeypatch, plain_reference, broken_group, deny
):
    _install_good_and_broken(site, broken_group)
    with pytest.raises(PluginLoadError) as info:  # without the deny list the broken plugin stops start-up
        _llm()
    assert info.value.plugin == "broken" and info.value.distribution == "tool-broken"
    assert "'broken'" in str(info.value) and "tool-broken 2.0" in str(info.value)

    _set_env(monkeypatch, deny)
    llm = _llm()
    try:
        _check_every_other_plugin_runs(llm, plain_reference)
    finally:
        llm.shutdown()
    forget_modules(*MODULES)


def test_deny_list_reaches_the_engine_core_process(site, monkeypatch, plain_reference):
    _install_good_and_broken(site, "vllite")
    _set_env(monkeypatch, {"VLLITE_PLUGINS": "-broken", "VLLITE_ENABLE_MULTIPROCESSING": "1"})
    llm = _llm()
    try:
        assert type(llm.llm_engine.engine_core).__name__ != "InprocClient"
        _check_every_other_plugin_runs(llm, plain_reference)
    finally:
        llm.shutdown()
    forget_modules(*MODULES)


# ------------------------------------------------------------------------------------------------ vllite plugins
CHECK_MOD = """
class Good:
    def __init__(self, vllm_config, device, is_pin_memory): ...
    def apply(self, logits): return logits
    def is_argmax_invariant(self): return True
    def update_state(self, batch_update): ...


class NoUpdate:
    def __init__(self, vllm_config, device, is_pin_memory): ...
    def apply(self, logits): return logits
    def is_argmax_invariant(self): return True


class NoApply:
    def __init__(self, vllm_config, device, is_pin_memory): ...
    def is_argmax_invariant(self): return True
    def update_state(self, batch_update): ...
"""

CHECK_HOOKS = """
from vllite import hookimpl


@hookimpl
def vllite_register_logits_processors(register):
    from check_mod import {cls}

    register("half", {cls})
"""


def _install_check_dists(site: Path, hook_cls: str = "NoUpdate") -> None:
    forget_modules("check_mod", "check_hooks")
    make_distribution(
        site,
        "check-dist",
        {
            "vllite": {"bad_hooks": "check_hooks"},
            "vllm.logits_processors": {"bad_ep": "check_mod:NoUpdate"},
            "vllite.logits_processors": {"good_ep": "check_mod:Good"},
        },
        {"check_mod": CHECK_MOD, "check_hooks": CHECK_HOOKS.format(cls=hook_cls)},
        "1.5",
    )


def _rows(capsys, *args: str, status: int = 0) -> dict[str, dict]:
    assert main(["plugins", "--json", *args]) == status
    return {row["name"]: row for row in json.loads(capsys.readouterr().out)}


def test_plugins_check_flags_broken_entry_point_and_hook_processor(site, capsys, monkeypatch):
    _install_check_dists(site)
    assert main(["plugins", "--check"]) == 1
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("vllite: error: ")]
    entry_point = next(line for line in errors if "'bad_ep'" in line)
    assert "check-dist 1.5" in entry_point and "missing update_state(batch_update)" in entry_point
    hook = next(line for line in errors if "'half'" in line)
    assert "registered by entry point 'bad_hooks'" in hook and "check-dist 1.5" in hook
    assert "missing update_state(batch_update)" in hook
    assert errors[-1] == "vllite: error: 2 broken plugin(s) (VLLITE_DISABLED_PLUGINS=bad_ep,bad_hooks turns them off)"
    assert "    BROKEN: " in out  # the listing is printed too

    rows = _rows(capsys, "--check", status=1)
    assert rows["good_ep"]["errors"] == [] and rows["good_ep"]["class"] == "check_mod.Good"
    assert rows["bad_ep"]["entry_point"] == "check_mod:NoUpdate" and rows["bad_ep"]["class"] == "check_mod.NoUpdate"
    assert "missing update_state" in rows["bad_ep"]["errors"][0]
    assert rows["bad_hooks"]["components"] == {"logits_processors": ["half"]}
    assert "'half'" in rows["bad_hooks"]["errors"][0]
    assert rows["vllite.builtin_logitsprocs.plugin"]["errors"] == []

    # Without --check: the same plugins, listed without importing their processors, and a pointer to --check.
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    block = out[out.index("good_ep  [check-dist 1.5]  (group vllite.logits_processors)") :]
    assert block.splitlines()[1] == "    entry point: check_mod:Good"
    assert "    class: " not in out and "BROKEN" not in out
    assert out.rstrip().endswith("`vllite plugins --check` imports and checks each one.")
    rows = _rows(capsys)
    assert rows["bad_ep"]["errors"] == [] and rows["bad_ep"]["class"] is None

    # The deny list the message suggests makes the check pass.
    _set_env(monkeypatch, {"VLLITE_DISABLED_PLUGINS": "bad_ep,bad_hooks"})
    assert main(["plugins", "--check"]) == 0
    assert "none broken" in capsys.readouterr().out
    forget_modules("check_mod", "check_hooks")


def test_plugins_marks_a_hook_processor_the_registry_refuses_instead_of_crashing(site, capsys):
    _install_check_dists(site, hook_cls="NoApply")
    with pytest.raises(PluginLoadError) as info:  # what engine start-up raises
        plugin_manager.get_registry("logits_processors")
    assert (info.value.plugin, info.value.distribution) == ("bad_hooks", "check-dist")
    plugin_manager.reset_plugin_manager()

    rows = _rows(capsys, "--check", status=1)
    assert len(rows["bad_hooks"]["errors"]) == 1
    assert "missing apply(logits)" in rows["bad_hooks"]["errors"][0]
    assert rows["good_ep"]["errors"] == []  # every other processor is still checked
    assert main(["plugins", "--check"]) == 1
    assert "entry point 'bad_hooks' (check_hooks) of distribution check-dist 1.5" in capsys.readouterr().err
    forget_modules("check_mod", "check_hooks")


def test_plugin_load_error_of_a_hook_processor_names_entry_point_and_distribution(site):
    _install_check_dists(site)
    with pytest.raises(PluginLoadError) as info:
        load_logitsprocs_classes()
    err = info.value
    message = str(err)
    assert "logits processor 'half' registered by entry point 'bad_hooks' (check_hooks)" in message
    assert "check-dist 1.5" in message and "check_mod.NoUpdate" in message
    assert (err.plugin, err.distribution) == ("bad_hooks", "check-dist")
    forget_modules("check_mod", "check_hooks")


# ------------------------------------------------------------------------------------------------ runtime faults
FAULTY = """
from vllite.logits_processor import AdapterLogitsProcessor


class RowFault(AdapterLogitsProcessor):
    key = "row_fault"

    def is_argmax_invariant(self):
        return False

    def new_req_logits_processor(self, params):
        if self.key not in (params.extra_args or {}):
            return None

        def fail(output_ids, logits):
            raise ZeroDivisionError("row processor failed")

        return fail


class HookRowFault(RowFault):
    key = "hook_fault"


class StateFault:
    def __init__(self, vllm_config, device, is_pin_memory): ...
    def apply(self, logits): return logits
    def is_argmax_invariant(self): return True

    def update_state(self, batch_update):
        for _, params, _, _ in batch_update.added if batch_update else ():
            if "state_fault" in (params.extra_args or {}):
                raise KeyError("no state for this request")
"""

FAULTY_HOOKS = """
from vllite import hookimpl


@hookimpl
def vllite_register_logits_processors(register):
    from faulty_mod import HookRowFault

    register("hook_fault", HookRowFault)
"""


def test_a_processor_that_raises_is_named_with_its_entry_point_and_distribution(site):
    forget_modules("faulty_mod", "faulty_hooks")
    make_distribution(
        site,
        "faulty-dist",
        {
            "vllite": {"fault_hooks": "faulty_hooks"},
            "vllm.logits_processors": {"row_fault": "faulty_mod:RowFault"},
            "vllite.logits_processors": {"state_fault": "faulty_mod:StateFault"},
        },
        {"faulty_mod": FAULTY, "faulty_hooks": FAULTY_HOOKS},
        "3.0",
    )
    llm = _llm()
    try:
        outs = _generate(llm, [_params(row_fault=1), _params(), _params(hook_fault=1)])
        assert outs[1].finish_reason == "length" and outs[1].error is None
        assert outs[0].finish_reason == "error"
        assert "faulty_mod.RowFault.apply raised ZeroDivisionError: row processor failed" in outs[0].error
        assert "[entry point 'row_fault' (faulty_mod:RowFault) of distribution faulty-dist 3.0" in outs[0].error
        assert outs[2].finish_reason == "error"
        assert "faulty_mod.HookRowFault.apply raised ZeroDivisionError" in outs[2].error
        assert (
            "'hook_fault' registered by entry point 'fault_hooks' (faulty_hooks) of distribution faulty-dist 3.0"
            in outs[2].error
        )

        # update_state cannot be pinned to a row: the step fails as before, now naming the processor.
        with pytest.raises(PluginHookError) as info:
            _generate(llm, [_params(), _params(state_fault=1), _params()])
        message = str(info.value)
        assert "faulty_mod.StateFault.update_state raised KeyError: 'no state for this request'" in message
        assert "entry point 'state_fault' (faulty_mod:StateFault) of distribution faulty-dist 3.0" in message
        assert isinstance(info.value.__cause__, KeyError)
    finally:
        llm.shutdown()
        forget_modules("faulty_mod", "faulty_hooks")


# ------------------------------------------------------------------------------------------------ docs/plugins.md
def _doc_glue_block() -> str:
    text = (Path(__file__).resolve().parents[1] / "docs" / "plugins.md").read_text()
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if "(AdapterLogitsProcessor)" in b]
    assert blocks, "docs/plugins.md lost its AdapterLogitsProcessor glue example"
    return blocks[0]


def test_the_documented_adapter_glue_runs_a_v0_callable_per_request(site, monkeypatch, plain_reference):
    namespace: dict = {"__name__": "plugins_doc_glue"}
    exec(compile(_doc_glue_block(), "docs/plugins.md", "exec"), namespace)
    glue = namespace["BanTokensLogitsProcessor"]
    banned = sorted({plain_reference[0][0], plain_reference[0][1]})
    _set_env(monkeypatch, {"VLLITE_PLUGINS": ""})
    llm = _llm(logits_processors=[glue])
    try:
        outs = _generate(llm, [_params(), _params(), _params()])
        assert [c.token_ids for c in outs] == plain_reference  # nobody asked: nothing changes
        params = SamplingParams(
            temperature=0.0, max_tokens=5, ignore_eos=True, detokenize=False, extra_args={"banned_tokens": banned}
        )
        outs = _generate(llm, [params, _params(), _params()])
        assert not set(outs[0].token_ids) & set(banned) and outs[0].token_ids != plain_reference[0]
        assert [c.token_ids for c in outs[1:]] == plain_reference[1:]
    finally:
        llm.shutdown()
