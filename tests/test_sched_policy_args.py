"""The ``policy_args`` contract: a scheduler rejects keys it does not read, naming them and listing the valid ones."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest

from vllite.policies.continuum import ContinuumScheduler
from vllite.sched import Scheduler, create_scheduler
from vllite.testing import make_config


def config_with(policy_args: dict[str, Any], **config_kw: Any):
    config = make_config(**config_kw)
    sched = dataclasses.replace(config.scheduler_config, policy_args=policy_args)
    return dataclasses.replace(config, scheduler_config=sched)


def test_base_scheduler_accepts_only_the_session_timeout() -> None:
    assert set(Scheduler.accepted_policy_args) == {"session_idle_timeout_s"}
    assert Scheduler(config_with({}), 16, step_observer=None).session_idle_timeout_s == 60.0
    assert Scheduler(config_with({"session_idle_timeout_s": 5}), 16, step_observer=None).session_idle_timeout_s == 5.0
    with pytest.raises(ValueError, match=r"Unknown policy_args key\(s\) 'ttl'\..*session_idle_timeout_s"):
        Scheduler(config_with({"ttl": 1}), 16, step_observer=None)


@pytest.mark.parametrize("name", ["fcfs", "priority"])
def test_builtin_policies_reject_unknown_keys_through_the_factory(name: str) -> None:
    with pytest.raises(ValueError, match=r"'bogus', 'other'"):
        create_scheduler(config_with({"other": 1, "bogus": 2}, scheduler_cls=name), 16)


def test_continuum_names_the_typo_and_lists_valid_keys() -> None:
    with pytest.raises(ValueError) as info:
        ContinuumScheduler(config_with({"release_pin_on_admision": False}), 16, step_observer=None)
    message = str(info.value)
    assert "'release_pin_on_admision'" in message
    assert "release_pin_on_admission:" in message and "job_idle_timeout_s:" in message and "eta:" in message


def test_continuum_accepts_its_own_and_its_estimators_keys() -> None:
    args = {"release_pin_on_admission": False, "max_jobs": 5, "eta": 0.5, "fixed_ttl": 1.0, "load_tokenizer": False}
    s = ContinuumScheduler(config_with(args), 16, step_observer=None)
    assert s.release_pin_on_admission is False and s.max_jobs == 5


class ExtendedPolicy(Scheduler):
    accepted_policy_args: ClassVar[dict[str, str]] = {**Scheduler.accepted_policy_args, "knob": "a test knob (0)"}


def test_a_subclass_extends_the_accepted_keys() -> None:
    ExtendedPolicy(config_with({"knob": 3}), 16, step_observer=None)
    with pytest.raises(ValueError, match="Valid keys for ExtendedPolicy: knob: a test knob"):
        ExtendedPolicy(config_with({"knb": 3}), 16, step_observer=None)


def test_llm_rejects_a_policy_args_typo() -> None:
    from vllite import LLM
    from vllite.testing import make_tiny_model_dir_cached

    path = str(make_tiny_model_dir_cached("llama"))
    with pytest.raises(ValueError, match="'release_pin_on_admision'"):
        LLM(path, max_model_len=64, scheduler_cls="continuum", policy_args={"release_pin_on_admision": False})
