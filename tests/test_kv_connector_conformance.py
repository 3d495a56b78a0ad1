"""The conformance kit (``vllite.testing.kv_connector_conformance``) run against the builtin ``shared-storage``
connector and ``MockKVConnector`` in several configurations, as a third party runs it against its own connector; and
connectors that break a rule, to show the kit catches each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllite.kv_connector import KVConnectorBase
from vllite.plugins.kv_connectors.mock import MOCK_CONNECTOR
from vllite.testing.kv_connector_conformance import *  # noqa: F403  (collects test_kv_connector_conformance)
from vllite.testing.kv_connector_conformance import KVConnectorConformanceError, run_conformance

MOCK_CONFIGS: dict[str, tuple[dict[str, Any], bool]] = {
    # name -> (kv_connector_extra_config, outputs comparable: the mock loads nothing, so only 0 external tokens)
    "no-match": ({}, True),
    "deferrals": ({"num_defers": 2}, True),
    "delayed-free": ({"delay_free_steps": 3, "kv_transfer_params": {"done": True}}, True),
    "sync-load": ({"matched_tokens": 8}, False),
    "async-load": ({"matched_tokens": -1, "is_async": True, "load_steps": 2, "delay_free_steps": 1}, False),
}


@pytest.fixture(params=["shared-storage", *MOCK_CONFIGS])
def connector_under_test(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fixture ``test_kv_connector_conformance`` (imported above) runs against."""
    if request.param == "shared-storage":
        extra = {"shared_storage_path": str(tmp_path / "kv")}
        return {"kv_connector": "shared-storage", "kv_connector_extra_config": extra}, {}
    extra, comparable = MOCK_CONFIGS[request.param]
    return {"kv_connector": MOCK_CONNECTOR, "kv_connector_extra_config": extra}, {"check_outputs": comparable}


def test_shared_storage_second_pass_loads_from_the_directory(tmp_path: Path) -> None:
    extra = {"shared_storage_path": str(tmp_path)}
    report = run_conformance({"kv_connector": "shared-storage", "kv_connector_extra_config": extra})
    assert report.num_external_tokens > 0  # the warm pass asked the connector and it offered the saved prefixes
    assert report.num_aborted == 4 and report.num_requests == 16


def test_mock_async_loads_and_delayed_frees_are_exercised() -> None:
    extra = MOCK_CONFIGS["async-load"][0]
    report = run_conformance({"kv_connector": MOCK_CONNECTOR, "kv_connector_extra_config": extra}, check_outputs=False)
    assert report.num_async_loads > 0 and report.num_delayed_frees > 0


class ClaimsWholePrompt(KVConnectorBase):
    """Breaks "never the last prompt token"."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return request.num_tokens - num_computed_tokens, False


class CountsLookups(KVConnectorBase):
    """Breaks "side-effect free": each lookup offers one token more."""

    lookups = 0

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        CountsLookups.lookups += 1
        return CountsLookups.lookups % 2, False


class AsyncNothing(KVConnectorBase):
    """Breaks "is_async is False with 0 tokens"."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, True


class NeverSends(KVConnectorBase):
    """Breaks "every delayed free ends": keeps every finished request's blocks and never reports the send."""

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return bool(block_ids), None


@pytest.mark.parametrize(
    ("cls", "rule"),
    [
        (ClaimsWholePrompt, "last prompt token"),
        (CountsLookups, "side-effect free"),
        (AsyncNothing, "is_async=True with 0 tokens"),
        (NeverSends, "delayed free"),
    ],
)
def test_the_kit_catches_a_broken_rule(cls: type[KVConnectorBase], rule: str) -> None:
    kv = {"kv_connector": cls.__name__, "kv_connector_module_path": __name__}
    with pytest.raises(KVConnectorConformanceError, match=rule):
        run_conformance(kv, check_outputs=False)
