"""LoRA in the transformers executor: PEFT adapters loaded, validated and applied batched, checked against PEFT.

The oracle is ``peft.PeftModel`` on each segment alone; the wrapped model runs all segments in one ``[B, S]``
batch with per-token adapter ids (the LoRA layers see the flattened tokens, as they see the runner's packed batch).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from vllite.lora import LoRAConfig, LoRARequest
from vllite.plugins.transformers_executor.lora import (
    LoRAAdapterError,
    LoRABatch,
    LoRALinear,
    LoRAModelManager,
    LoRAWeights,
    find_targets,
    load_adapter,
)
from vllite.plugins.transformers_executor.lora.targets import is_linear_like
from vllite.testing.models import make_tiny_model_dir_cached

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers deprecations seen through PEFT

MODEL_KW: dict[str, Any] = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96)
ALL_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ = 7
#: name → (lora_int_id, peft.LoraConfig arguments): different ranks, scalings and target sets.
ADAPTERS: dict[str, tuple[int, dict[str, Any]]] = {
    "emb": (1, dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "embed_tokens"])),
    "full": (2, dict(r=16, lora_alpha=32, use_rslora=True, target_modules=ALL_PROJ)),
    "mlp": (
        3,
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["gate_proj", "down_proj", "o_proj"],
            rank_pattern={"o_proj": 2},
            alpha_pattern={"gate_proj": 3},
        ),
    ),
}


def load_base(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def save_adapter(model_dir: Path, out: Path, seed: int, **lora_kw: Any) -> Path:
    """A PEFT adapter with random (non-zero) A and B, saved as PEFT does."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = peft.get_peft_model(load_base(model_dir), peft.LoraConfig(init_lora_weights=False, **lora_kw))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT notes that it saves the embedding table of an embed_tokens adapter
        model.save_pretrained(out)
    return out


@dataclass
class Env:
    model_dir: Path
    adapters: dict[str, Path]
    input_ids: torch.Tensor  # [5, SEQ]: one row per segment
    reference: dict[str | None, torch.Tensor]  # adapter name (None: base) → logits [1, SEQ, V] on each row

    def request(self, name: str, lora_int_id: int | None = None) -> LoRARequest:
        return LoRARequest(name, ADAPTERS[name][0] if lora_int_id is None else lora_int_id, str(self.adapters[name]))

    def manager(self, **config: Any) -> tuple[torch.nn.Module, LoRAModelManager]:
        model = load_base(self.model_dir)
        cfg = LoRAConfig(**{"max_loras": 3, "max_lora_rank": 16, **config})
        return model, LoRAModelManager(model, cfg, torch.device("cpu"), torch.float32)


ROWS: list[str | None] = ["emb", None, "full", "mlp", "emb"]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Env:
    model_dir = make_tiny_model_dir_cached("llama", **MODEL_KW)
    root = tmp_path_factory.mktemp("lora")
    adapters = {
        name: save_adapter(model_dir, root / name, seed, **kw) for seed, (name, (_, kw)) in enumerate(ADAPTERS.items())
    }
    input_ids = torch.randint(3, 4000, (len(ROWS), SEQ), generator=torch.Generator().manual_seed(0))
    reference: dict[str | None, torch.Tensor] = {}
    with torch.no_grad():
        base = load_base(model_dir)
        for row, name in enumerate(ROWS):
            if name in reference:
                continue
            model = base if name is None else peft.PeftModel.from_pretrained(load_base(model_dir), adapters[name])
            reference[name] = model(input_ids[row : row + 1]).logits
    return Env(model_dir, adapters, input_ids, reference)


def token_ids_of(rows: list[str | None]) -> np.ndarray:
    return np.repeat([0 if n is None else ADAPTERS[n][0] for n in rows], SEQ)


def run_rows(model: torch.nn.Module, manager: LoRAModelManager, env: Env, rows: list[str | None]) -> torch.Tensor:
    ids = torch.stack([env.input_ids[ROWS.index(n)] for n in rows])
    manager.prepare_step(token_ids_of(rows))
    with torch.no_grad():
        return model(ids).logits


def assert_rows_match(logits: torch.Tensor, env: Env, rows: list[str | None]) -> None:
    for row, name in enumerate(rows):
        torch.testing.assert_close(logits[row], env.reference[name][0], atol=1e-5, rtol=1e-5, msg=f"row {row}: {name}")


# ------------------------------------------------------------------------------------------------ correctness


def test_mixed_batch_matches_peft_per_segment(env: Env) -> None:
    model, manager = env.manager()
    for name in ADAPTERS:
        assert manager.add_adapter(env.request(name)) is True
    logits = run_rows(model, manager, env, ROWS)
    assert_rows_match(logits, env, ROWS)
    for name in ADAPTERS:  # each adapter changes the logits: the oracle is not the base model in disguise
        assert (env.reference[name] - env.reference[None]).abs().max() > 1e-3
    # the same adapters in other slots and another order: still the same logits
    rows = ["mlp", "full", None, "emb"]
    assert_rows_match(run_rows(model, manager, env, rows), env, rows)


@pytest.mark.skipif(
    torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
    reason="interpreter tests run on CPU-only machines with triton installed",
)
def test_triton_path_matches_peft_under_the_interpreter(env: Env) -> None:
    """The layers' CUDA path (SGMV kernels, embedding gather) on CPU tensors through ``TRITON_INTERPRET=1``."""
    model, manager = env.manager()
    manager.batch.use_triton = True
    for name in ADAPTERS:
        manager.add_adapter(env.request(name))
    assert_rows_match(run_rows(model, manager, env, ROWS), env, ROWS)


@pytest.mark.parametrize("arch", ["qwen2", "phi3"])  # biased q/k/v; fused qkv_proj and gate_up_proj
def test_other_architectures_match_peft(arch: str, tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir_cached(arch, **MODEL_KW)
    folder = save_adapter(model_dir, tmp_path / arch, 5, r=8, lora_alpha=8, target_modules="all-linear")
    ids = torch.randint(3, 4000, (2, SEQ), generator=torch.Generator().manual_seed(1))
    model = load_base(model_dir)
    manager = LoRAModelManager(model, LoRAConfig(max_loras=1, max_lora_rank=8), torch.device("cpu"), torch.float32)
    manager.add_adapter(LoRARequest("a", 1, str(folder)))
    manager.prepare_step(np.repeat([1, 0], SEQ))
    with torch.no_grad():
        got = model(ids).logits
        expected = peft.PeftModel.from_pretrained(load_base(model_dir), folder)(ids[:1]).logits
        base = load_base(model_dir)(ids[1:]).logits
    torch.testing.assert_close(got[:1], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1:], base, atol=1e-5, rtol=1e-5)
    assert (expected - base[:1]).abs().max() > 1e-3


def test_base_path_is_bit_identical_to_the_unwrapped_model(env: Env) -> None:
    model, manager = env.manager()
    plain = load_base(env.model_dir)
    manager.add_adapter(env.request("full"))
    with torch.no_grad():
        expected = plain(env.input_ids).logits
        manager.prepare_step(np.zeros(env.input_ids.numel(), dtype=np.int64))
        assert not manager.batch.active
        assert torch.equal(model(env.input_ids).logits, expected)
        run_rows(model, manager, env, ["full"])  # an adapter step, then base again
        manager.prepare_step(np.zeros(env.input_ids.numel(), dtype=np.int64))
        assert torch.equal(model(env.input_ids).logits, expected)


def test_rank_padding_and_folded_scaling(env: Env) -> None:
    model, manager = env.manager()
    manager.add_adapter(env.request("emb"))  # r=8 in slots of rank 16
    manager.prepare_step(token_ids_of(["emb"]))
    slot = manager.resident_adapters()[1]
    adapter = manager.get_adapter(1)
    assert adapter is not None and adapter.rank == 8
    q = manager.layers["model.layers.0.self_attn.q_proj"]
    weights = adapter.modules["model.layers.0.self_attn.q_proj"]
    assert weights.scaling == 2.0
    assert torch.equal(q.a_stack[slot, :8], weights.a) and not q.a_stack[slot, 8:].any()
    torch.testing.assert_close(q.b_stack[slot, :, :8], weights.b * 2.0)
    assert not q.b_stack[slot, :, 8:].any()
    assert not manager.layers["model.layers.0.mlp.up_proj"].lora_a.any()  # a module the adapter leaves alone
    embed = manager.layers["model.embed_tokens"]
    assert torch.equal(embed.a_stack[slot, :8], adapter.modules["model.embed_tokens"].a)
    assert_rows_match(run_rows(model, manager, env, ["emb"]), env, ["emb"])


def test_wraps_quantized_linear_like_modules() -> None:
    from vllite.plugins.transformers_executor.quantization.formats import QuantizedWeight
    from vllite.plugins.transformers_executor.quantization.linear import Int8WeightLinear

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-100, 100, (48, 32), generator=g, dtype=torch.int8)
    base = Int8WeightLinear(
        QuantizedWeight(8, q, torch.rand(48, 1, generator=g) / 50, None, 32, None), None, torch.float32
    )
    assert is_linear_like(base)
    batch = LoRABatch(2, 4, torch.device("cpu"), torch.float32)
    layer = LoRALinear(base, "q", batch)
    a, b = torch.randn(3, 32, generator=g), torch.randn(48, 3, generator=g)
    layer.set_slot(1, LoRAWeights(a, b, 0.5))
    x = torch.randn(2, 3, 32, generator=g)
    slots = torch.tensor([1, -1, 1, 0, 1, -1])
    batch.set_token_slots(slots)
    got = layer(x).reshape(6, 48)
    expected = base(x).reshape(6, 48) + (slots == 1)[:, None] * (x.reshape(6, 32) @ a.T @ b.T * 0.5)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    batch.set_token_slots(torch.tensor([0, 0]))
    with pytest.raises(Exception, match="got 6 tokens but the step's adapter slots cover 2"):
        layer(x)


def test_targets_are_decoder_projections_and_the_input_embedding(env: Env) -> None:
    targets = find_targets(load_base(env.model_dir))
    assert targets.modules["model.embed_tokens"].kind == "embedding"
    linear = {n for n, s in targets.modules.items() if s.kind == "linear"}
    assert linear == {f"model.layers.{i}.{p}.{m}" for i in range(2) for p, ms in _PROJ.items() for m in ms}
    assert targets.is_output_module("lm_head") and "lm_head" not in targets.modules


_PROJ = {"self_attn": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"]}


# --------------------------------------------------------------------------------------------- slots and host


def test_device_slots_keep_residents_and_evict_the_least_recently_used(env: Env) -> None:
    model, manager = env.manager(max_loras=2, max_cpu_loras=3)
    writes: list[tuple[int, int]] = []
    original = manager._write_slot
    manager._write_slot = lambda slot, adapter: (writes.append((adapter.int_id, slot)), original(slot, adapter))  # type: ignore[method-assign]
    for name in ADAPTERS:
        manager.add_adapter(env.request(name))
    manager.prepare_step(token_ids_of(["emb", "full"]))
    assert manager.resident_adapters() == {1: 0, 2: 1} and writes == [(1, 0), (2, 1)]
    manager.prepare_step(token_ids_of(["full", None]))
    assert writes == [(1, 0), (2, 1)]  # resident: nothing copied
    manager.prepare_step(token_ids_of(["mlp"]))  # slot 0 (emb) is the least recently used
    assert manager.resident_adapters() == {3: 0, 2: 1} and writes[-1] == (3, 0)
    rows: list[str | None] = ["emb", "mlp"]  # emb replaces full (not in this step), in a slot full filled entirely
    logits = run_rows(model, manager, env, rows)
    assert manager.resident_adapters() == {3: 0, 1: 1} and writes[-1] == (1, 1)
    assert_rows_match(logits, env, rows)


def test_step_errors(env: Env) -> None:
    _, manager = env.manager(max_loras=2, max_cpu_loras=3)
    for name in ADAPTERS:
        manager.add_adapter(env.request(name))
    with pytest.raises(LoRAAdapterError, match=r"3 distinct adapters \[1, 2, 3\], more than max_loras=2"):
        manager.prepare_step(token_ids_of(["emb", "full", "mlp"]))
    with pytest.raises(LoRAAdapterError, match="adapter id 9, which is not loaded"):
        manager.prepare_step(np.array([0, 9, 1]))
    with pytest.raises(LoRAAdapterError, match="must be >= 0"):
        manager.prepare_step(np.array([-1, 1]))


def test_host_cache_lru_pins_and_identity(env: Env) -> None:
    _, manager = env.manager(max_loras=1, max_cpu_loras=2)
    emb, full, mlp = (env.request(n) for n in ADAPTERS)
    assert manager.add_adapter(emb) and manager.add_adapter(full)
    assert manager.add_adapter(emb) is False  # already loaded: now the most recently used
    assert manager.add_adapter(mlp) and manager.list_adapters() == {1, 3}  # full (2) evicted
    manager.prepare_step(token_ids_of(["emb"]))  # a step touches emb: mlp is now the LRU
    assert manager.pin_adapter(3) is True and manager.pin_adapter(3) is False
    assert manager.add_adapter(full) and manager.list_adapters() == {2, 3}  # pinned mlp survives, emb goes
    assert manager.resident_adapters() == {}  # emb's device slot went with it
    assert manager.pin_adapter(2)
    with pytest.raises(LoRAAdapterError, match=r"'emb': cannot be loaded: .* all pinned"):
        manager.add_adapter(emb)
    with pytest.raises(LoRAAdapterError, match="cannot pin LoRA adapter id 1: it is not loaded"):
        manager.pin_adapter(1)
    with pytest.raises(LoRAAdapterError, match="'full': is already loaded under lora_int_id 2"):
        manager.add_adapter(env.request("full", lora_int_id=7))
    with pytest.raises(LoRAAdapterError, match="'emb': lora_int_id 2 is already loaded as adapter 'full'"):
        manager.add_adapter(env.request("emb", lora_int_id=2))
    assert manager.remove_adapter(2) is True and manager.remove_adapter(2) is False
    assert manager.add_adapter(emb) and manager.list_adapters() == {1, 3}


# ------------------------------------------------------------------------------------------ adapter validation


def edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_tensors(folder: Path, edit: Any) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _rename_layer(t: dict[str, torch.Tensor]) -> None:
    for key in [k for k in t if ".layers.1." in k]:
        t[key.replace(".layers.1.", ".layers.7.")] = t.pop(key)


def _perturb_embedding_copy(t: dict[str, torch.Tensor]) -> None:
    t["base_model.model.model.embed_tokens.base_layer.weight"][5] += 1.0


BROKEN: list[tuple[str, str, Any, str]] = [
    # (id, adapter copied, breakage applied to the copy, message expected)
    ("no-config", "full", lambda d: (d / "adapter_config.json").unlink(), "adapter_config.json is missing"),
    ("bad-json", "full", lambda d: (d / "adapter_config.json").write_text("{r: 8"), "cannot read .*adapter_config"),
    (
        "no-weights",
        "full",
        lambda d: (d / "adapter_model.safetensors").unlink(),
        "adapter_model.safetensors is missing",
    ),
    (
        "bin-only",
        "full",
        lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"),
        r"only adapter_model.bin \(a pickle\)",
    ),
    (
        "corrupt",
        "full",
        lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x10\x00garbage"),
        "corrupt or not a safetensors file",
    ),
    ("dora", "full", lambda d: edit_config(d, use_dora=True), r"DoRA \(use_dora\) is not supported"),
    (
        "modules-to-save",
        "full",
        lambda d: edit_config(d, modules_to_save=["score"]),
        r"modules_to_save is not supported: .*\['score'\]",
    ),
    ("bias", "full", lambda d: edit_config(d, bias="all"), "bias='all' is not supported"),
    ("not-lora", "full", lambda d: edit_config(d, peft_type="IA3"), "peft_type is 'IA3'"),
    ("bad-pattern", "mlp", lambda d: edit_config(d, rank_pattern={"(": 2}), r"rank_pattern key '\(' is not a valid"),
    (
        "rank-vs-config",
        "mlp",
        lambda d: edit_config(d, rank_pattern={}),
        r"model.layers.0.self_attn.o_proj has rank 2 but adapter_config.json gives it rank 4",
    ),
    (
        "missing-module",
        "full",
        lambda d: edit_tensors(d, _rename_layer),
        "targets module 'model.layers.7.mlp.down_proj', which the base model does not have",
    ),
    (
        "shape",
        "full",
        lambda d: edit_tensors(d, lambda t: t.update({Q_A: torch.zeros(16, 65)})),
        r"model.layers.0.self_attn.q_proj's weights do not fit .*lora_A is \[16, 65\] \(expected \[16, 64\]\)",
    ),
    (
        "no-lora-b",
        "full",
        lambda d: edit_tensors(d, lambda t: t.pop(Q_A.replace("lora_A", "lora_B"))),
        "module 'model.layers.0.self_attn.q_proj' has no lora_B tensor",
    ),
    (
        "stray-tensor",
        "full",
        lambda d: edit_tensors(
            d, lambda t: t.update({Q_A.replace("lora_A.weight", "lora_magnitude_vector"): t[Q_A].clone()})
        ),
        "is not a LoRA A/B matrix",
    ),
    (
        "embedding-copy",
        "emb",
        lambda d: edit_tensors(d, _perturb_embedding_copy),
        "copy of model.embed_tokens's table differs from the model's",
    ),
]


@pytest.mark.parametrize(("source", "breakage", "message"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_adapters_are_refused_with_the_reason(
    env: Env, tmp_path: Path, source: str, breakage: Any, message: str
) -> None:
    folder = tmp_path / "broken"
    shutil.copytree(env.adapters[source], folder)
    breakage(folder)
    targets = find_targets(load_base(env.model_dir))
    with pytest.raises(LoRAAdapterError, match=f"LoRA adapter 'broken': .*{message}"):
        load_adapter(LoRARequest("broken", 5, str(folder)), targets, max_rank=16)


def test_rank_above_the_limit_and_missing_folder_through_the_manager(env: Env, tmp_path: Path) -> None:
    _, manager = env.manager(max_lora_rank=8)
    with pytest.raises(LoRAAdapterError, match=r"'full': rank 16 of model\.layers\.\d\.\S+ is above max_lora_rank=8"):
        manager.add_adapter(env.request("full"))
    with pytest.raises(LoRAAdapterError, match=r"'gone': lora_path .* is not a folder"):
        manager.add_adapter(LoRARequest("gone", 4, str(tmp_path / "nowhere")))
    assert manager.list_adapters() == set()


def test_lm_head_adapters_are_refused(env: Env, tmp_path: Path) -> None:
    folder = save_adapter(env.model_dir, tmp_path / "head", 0, r=4, lora_alpha=4, target_modules=["q_proj", "lm_head"])
    targets = find_targets(load_base(env.model_dir))
    request = LoRARequest("head", 1, str(folder))
    with pytest.raises(LoRAAdapterError, match=r"'head': LoRA on lm_head is not served: .*logits only for the rows"):
        load_adapter(request, targets, 16)
    edit_config(folder, target_modules="q_proj|lm_head")  # a regex: only the tensors tell
    with pytest.raises(LoRAAdapterError, match="'head': targets 'lm_head': LoRA on lm_head is not served"):
        load_adapter(request, targets, 16)
