"""How a model's layers share the KV-cache tensors (``kv_cache_layout``): one group unless sliding-window and
full-attention layers mix; then groups of equal size, full attention first, layer ``j`` of each group in slot ``j``."""

from __future__ import annotations

from transformers import AutoConfig

from vllite.plugins.transformers_executor.kv_cache_layout import KVCacheLayout, kv_cache_layout

SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}


def _layout(model_type: str, num_layers: int, **kwargs) -> KVCacheLayout:
    config = AutoConfig.for_model(model_type, num_hidden_layers=num_layers, **SMALL, **kwargs)
    return kv_cache_layout(config, num_layers)


def test_one_kind_of_layer_is_one_group() -> None:
    assert _layout("llama", 4) == KVCacheLayout.plain(4)
    assert _layout("mistral", 4, sliding_window=8) == KVCacheLayout.plain(4)  # one window everywhere
    assert KVCacheLayout.plain(4).num_groups == 1


def test_alternating_layers_make_two_groups_of_half_the_layers() -> None:
    kinds = ["sliding_attention", "full_attention"] * 2
    layout = _layout("gemma3_text", 4, sliding_window=8, layer_types=kinds)
    assert layout.windows == (None, 8)
    assert layout.layer_group == (1, 0, 1, 0)
    assert layout.layer_slot == (0, 0, 1, 1)
    assert layout.num_slots == 2 and layout.num_groups == 2


def test_five_to_one_makes_one_full_group_and_five_sliding_groups() -> None:
    kinds = (["sliding_attention"] * 5 + ["full_attention"]) * 2
    layout = _layout("gemma3_text", 12, sliding_window=8, layer_types=kinds)
    assert layout.windows == (None, 8, 8, 8, 8, 8)
    assert layout.num_slots == 2  # a block holds two layers' KV: one sixth of the model
    for group in range(6):
        members = [i for i in range(12) if layout.layer_group[i] == group]
        assert [layout.layer_slot[i] for i in members] == [0, 1]


def test_uneven_counts_pad_the_last_group() -> None:
    kinds = ["full_attention"] * 2 + ["sliding_attention"] * 3
    layout = _layout("qwen2", 5, sliding_window=8, use_sliding_window=True, layer_types=kinds)
    assert layout.windows == (None, 8, 8)
    assert layout.num_slots == 2
    assert sorted(zip(layout.layer_group, layout.layer_slot)) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]


def test_hybrid_off_keeps_one_group() -> None:
    config = AutoConfig.for_model("gpt_oss", num_hidden_layers=2, sliding_window=8, **SMALL)
    assert kv_cache_layout(config, 2).num_groups == 2
    assert kv_cache_layout(config, 2, hybrid=False) == KVCacheLayout.plain(2)
