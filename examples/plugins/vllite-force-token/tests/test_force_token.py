"""Tests of the example plugin: its math and state, its validation, and its discovery by vllite."""

from __future__ import annotations

from importlib import metadata

import pytest
import torch
from vllite_force_token import ForceTokenLogitsProcessor

from vllite.config import SchedulerConfig, VllmConfig
from vllite.logits_processor import BatchUpdate, MoveDirectionality, build_logitsprocs, validate_sampling_params
from vllite.sampling_params import SamplingParams


def update(batch_size, removed=(), added=(), moved=()):
    return BatchUpdate(batch_size=batch_size, removed=list(removed), added=list(added), moved=list(moved))


def params(target=None):
    return SamplingParams(extra_args=None if target is None else {"force_token_id": target})


def test_forces_only_requests_that_ask():
    proc = ForceTokenLogitsProcessor(None, "cpu", False)
    assert proc.is_argmax_invariant() is False
    proc.update_state(update(3, added=[(0, params(2), [1], []), (1, params(), [1], []), (2, params(0), [1], [])]))
    base = torch.randn(3, 5)
    out = proc.apply(base.clone())
    assert out.argmax(-1)[[0, 2]].tolist() == [2, 0]
    assert torch.isinf(out[0]).sum() == 4 and out[0, 2] == 0
    assert torch.equal(out[1], base[1])


def test_follows_moves_and_removals():
    proc = ForceTokenLogitsProcessor(None, "cpu", False)
    proc.update_state(update(2, added=[(0, params(3), None, []), (1, params(), None, [])]))
    proc.update_state(update(2, moved=[(0, 1, MoveDirectionality.SWAP)]))
    assert proc.apply(torch.zeros(2, 4)).argmax(-1).tolist() == [0, 3]
    proc.update_state(update(1, removed=[1]))
    logits = torch.zeros(1, 4)
    assert proc.targets == {} and torch.equal(proc.apply(logits), torch.zeros(1, 4))


@pytest.mark.parametrize("bad", [-1, "7", 1.5, True])
def test_validate_params_rejects(bad):
    with pytest.raises(ValueError, match="force_token_id"):
        ForceTokenLogitsProcessor.validate_params(params(bad))


def _declare_entry_point_if_not_installed(tmp_path, monkeypatch) -> None:
    """Without ``pip install``, put a dist-info built from this package's own pyproject.toml on ``sys.path``.

    Either way vllite finds the processor the way it finds an installed one: through the entry-point group.
    (Reading pyproject.toml needs Python 3.11's tomllib; on 3.10, pip-install the plugin first.)
    """
    if any(ep.name == "force_token" for ep in metadata.entry_points(group="vllm.logits_processors")):
        return
    import importlib
    from pathlib import Path

    import tomllib

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    dist_info = tmp_path / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, eps in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {value}" for name, value in eps.items())
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


def test_discovered_by_vllite_without_configuration(tmp_path, monkeypatch):
    _declare_entry_point_if_not_installed(tmp_path, monkeypatch)
    eps = {ep.name: ep for ep in metadata.entry_points(group="vllm.logits_processors")}
    assert eps["force_token"].load() is ForceTokenLogitsProcessor
    monkeypatch.delenv("VLLITE_PLUGINS", raising=False)
    monkeypatch.delenv("VLLITE_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    config = VllmConfig(scheduler_config=SchedulerConfig(max_num_seqs=4))
    procs = build_logitsprocs(config, "cpu", False)
    assert any(isinstance(p, ForceTokenLogitsProcessor) for p in procs.non_argmax_invariant)
    with pytest.raises(ValueError, match="force_token_id"):
        validate_sampling_params(procs, params(-3))
