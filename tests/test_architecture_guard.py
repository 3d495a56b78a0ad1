"""Architectures vllite would run wrongly are refused at start-up with a ``ModelLoadError`` naming what is missing.

Config-level refusals (state layers, encoder-decoder) are checked on transformers' own config classes; the
attention-call check (an argument the kernels do not read) runs in the start-up probe forward, through ``LLM`` on a
tiny random-weight checkpoint. Architectures vllite serves pass both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from vllite import LLM
from vllite.exceptions import AttentionRoutingError, ModelLoadError
from vllite.plugins.transformers_executor.architecture_guard import check_architecture, check_attention_kwargs
from vllite.testing.models import copy_demo_tokenizer

SMALL = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
GQA = {**SMALL, "num_key_value_heads": 2, "head_dim": 16}

REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "mamba": ({"hidden_size": 64, "num_hidden_layers": 2, "state_size": 8}, "linear_attention layers"),
    "mamba2": (
        {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16, "state_size": 8, "n_groups": 1},
        "linear_attention layers",
    ),
    "jamba": ({**GQA, "num_experts": 2, "attn_layer_period": 2, "attn_layer_offset": 1}, "linear_attention layers"),
    "falcon_h1": (GQA, "hybrid layers"),
    "qwen3_next": ({**GQA, "num_hidden_layers": 4}, "linear_attention layers"),
    "granitemoehybrid": ({**GQA, "layer_types": ["mamba", "attention"]}, "linear_attention layers"),
    "t5": ({"d_model": 64}, "an encoder-decoder model"),
}

SERVED = {
    "llama": GQA,
    "qwen3": GQA,
    "gemma3_text": GQA,
    "mixtral": GQA,
    "gpt_oss": GQA,  # attention sinks, which the kernels implement (tests/test_model_families.py)
    "deepseek_v3": SMALL,  # multi-head latent attention: keys and values of their own head sizes in the cache
    "granitemoehybrid": {**GQA, "layer_types": ["attention", "attention"]},
}


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_by_the_config_naming_what_is_missing(model_type):
    kwargs, missing = REFUSED[model_type]
    with pytest.raises(ModelLoadError, match="cannot run on vllite: it needs") as info:
        check_architecture(AutoConfig.for_model(model_type, **kwargs))
    assert missing in str(info.value)


@pytest.mark.parametrize("model_type", sorted(SERVED))
def test_served_architectures_pass_the_config_check(model_type):
    check_architecture(AutoConfig.for_model(model_type, **SERVED[model_type]))


def test_attention_arguments_that_change_the_result_are_refused():
    module = torch.nn.Linear(1, 1)
    tensor = torch.zeros(2)
    check_attention_kwargs(module, {"position_ids": tensor, "output_attentions": False, "sinks": None})
    with pytest.raises(AttentionRoutingError, match=r"attention sinks passed under another name .*\(sinks="):
        check_attention_kwargs(module, {"sinks": tensor})
    with pytest.raises(AttentionRoutingError, match="an attention argument vllite does not read \\('alibi'\\)"):
        check_attention_kwargs(module, {"alibi": tensor})


def _checkpoint(path: Path, model_type: str, **kwargs: Any) -> str:
    copy_demo_tokenizer(path)
    config = AutoConfig.for_model(model_type, vocab_size=4096, max_position_embeddings=256, **kwargs)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def test_an_attention_argument_vllite_does_not_read_is_refused_at_start_up(tmp_path, monkeypatch):
    from transformers.models.llama import modeling_llama

    original = modeling_llama.LlamaAttention.forward

    def forward_with_alibi(self, hidden_states, *args, **kwargs):
        return original(self, hidden_states, *args, alibi=torch.zeros(1), **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward_with_alibi)
    model = _checkpoint(tmp_path, "llama", **GQA)
    with pytest.raises(ModelLoadError, match=r"LlamaForCausalLM cannot run on vllite: .*'alibi'"):
        LLM(model=model, max_model_len=64, max_num_seqs=2)


def test_mamba_is_refused_with_a_sentence_not_an_attribute_error(tmp_path):
    model = _checkpoint(tmp_path, "mamba", **REFUSED["mamba"][0])
    with pytest.raises(ModelLoadError, match=r"MambaForCausalLM cannot run on vllite: .*linear_attention layers"):
        LLM(model=model, max_model_len=64, max_num_seqs=2)
