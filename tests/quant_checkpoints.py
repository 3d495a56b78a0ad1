"""Quantized checkpoints of the tiny test models, and the dequantized reference folders the tests compare with.

- compressed-tensors (W8A16, W4A16) made by ``llm-compressor``'s ``oneshot`` with a data-free
  ``QuantizationModifier`` when llm-compressor is installed (``make_llmcompressor``), and written here in the same
  on-disk format otherwise and for the formats it does not emit by default (``write_compressed_tensors``: the
  ``pack-quantized`` / ``int-quantized`` layout of ``compressed_tensors.compressors``);
- GPTQ 4-bit written here in AutoGPTQ's layout (``QuantLinear.pack``: ``qweight`` packed along the input rows,
  ``qzeros`` stored minus one, fp16 ``scales``, ``g_idx``), round-to-nearest with a random activation order when
  ``desc_act`` (the GPTQ error-feedback step does not change the format, only the codes).

The reference (``dequantize_folder``) reads the quantized tensors back from disk with code of its own (no vllite
import) and writes a plain float checkpoint that Hugging Face loads as usual.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linear_names(state: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k[: -len(".weight")] for k in state if k.endswith(".weight") and k.split(".")[-2] in _PROJ)


def _copy_folder(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copyfile(f, dst / f.name)


def _set_quant_config(folder: Path, qcfg: dict) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def make_llmcompressor(base: Path, out: Path, scheme: str) -> Path:
    """``oneshot(QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))`` saved compressed."""
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
    _copy_folder(base, out)
    model.save_pretrained(out, save_compressed=True)
    return out


def _pack_rows_le(codes: np.ndarray, bits: int) -> np.ndarray:
    """Packs unsigned codes [rows, cols] along cols, value j of a word at bit j * bits -> int32 [rows, cols/per]."""
    per = 32 // bits
    rows, cols = codes.shape
    words = np.zeros((rows, cols // per), dtype=np.uint32)
    for j in range(per):
        words |= codes[:, j::per].astype(np.uint32) << np.uint32(j * bits)
    return words.view(np.int32)


def write_compressed_tensors(base: Path, out: Path, *, bits: int, group_size: int | None, fmt: str) -> Path:
    """A symmetric round-to-nearest compressed-tensors checkpoint (llm-compressor's minmax observer rule)."""
    state = load_file(base / "model.safetensors")
    qmax = 2 ** (bits - 1) - 1
    for name in _linear_names(state):
        w = state.pop(f"{name}.weight").float()
        g = group_size or w.shape[1]
        wg = w.reshape(w.shape[0], -1, g)
        scale = wg.abs().amax(-1) / ((2 * qmax + 1) / 2)
        q = torch.clamp(torch.round(wg / scale[..., None]), -qmax - 1, qmax).reshape(w.shape).to(torch.int8)
        state[f"{name}.weight_scale"] = scale
        if fmt == "pack-quantized":
            unsigned = (q.numpy().astype(np.int32) + qmax + 1).astype(np.uint32)
            state[f"{name}.weight_packed"] = torch.from_numpy(_pack_rows_le(unsigned, bits).copy())
            state[f"{name}.weight_shape"] = torch.tensor(list(w.shape), dtype=torch.int64)
        else:
            state[f"{name}.weight"] = q
    _copy_folder(base, out)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    weights = {
        "num_bits": bits, "type": "int", "symmetric": True, "dynamic": False, "actorder": None,
        "strategy": "group" if group_size else "channel", "group_size": group_size, "observer": "minmax",
    }  # fmt: skip
    _set_quant_config(out, {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": fmt}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "version": "0.19.0",
    })  # fmt: skip
    return out


def write_gptq(base: Path, out: Path, *, group_size: int, desc_act: bool, sym: bool, seed: int = 0) -> Path:
    """An AutoGPTQ-format 4-bit checkpoint (``checkpoint_format: gptq``: zeros stored minus one)."""
    state = load_file(base / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name in _linear_names(state):
        w = state.pop(f"{name}.weight").float()  # [out, in]
        n_out, n_in = w.shape
        g = n_in if group_size == -1 else group_size
        order = torch.randperm(n_in, generator=gen) if desc_act else torch.arange(n_in)
        g_idx = torch.empty(n_in, dtype=torch.int32)
        g_idx[order] = torch.arange(n_in, dtype=torch.int32) // g
        ng = n_in // g
        scales = torch.empty(ng, n_out)
        zeros = torch.empty(ng, n_out)
        for gi in range(ng):
            cols = w[:, g_idx == gi]
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            if sym:
                scales[gi] = torch.maximum(-lo, hi) * 2 / 15
                zeros[gi] = 8
            else:
                scales[gi] = (hi - lo) / 15
                zeros[gi] = torch.round(-lo / scales[gi]).clamp(1, 15)  # 1..15: v1 stores zero - 1 in 4 bits
        scales = scales.half().float()  # stored in fp16; quantize against the stored scale
        q = torch.clamp(torch.round(w / scales[g_idx.long()].t()) + zeros[g_idx.long()].t(), 0, 15).to(torch.int64)
        state[f"{name}.qweight"] = torch.from_numpy(_pack_rows_le(q.numpy().astype(np.uint32), 4).T.copy())
        state[f"{name}.qzeros"] = torch.from_numpy(_pack_rows_le((zeros - 1).numpy().astype(np.uint32), 4).copy())
        state[f"{name}.scales"] = scales.half()
        state[f"{name}.g_idx"] = g_idx
    _copy_folder(base, out)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    _set_quant_config(out, {
        "quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
        "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq",
    })  # fmt: skip
    return out


def _unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes of int32 ``words`` packed along the last dim (low bits first), as int64."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    parts = [(w >> (bits * j)) & ((1 << bits) - 1) for j in range(32 // bits)]
    return torch.stack(parts, -1).reshape(*words.shape[:-1], -1)


def dequantize_folder(quant: Path, out: Path) -> Path:
    """The float checkpoint whose weights are the quantized checkpoint's, dequantized (the reference model)."""
    cfg = json.loads((quant / "config.json").read_text())
    qcfg = cfg.pop("quantization_config")
    state = {}
    for f in quant.glob("*.safetensors"):
        state.update(load_file(f))
    for key in [k for k in state if k.endswith((".weight_scale", ".scales"))]:
        name = key.rsplit(".", 1)[0]
        if qcfg["quant_method"] == "gptq":
            q = _unpack(state.pop(f"{name}.qweight").t(), 4).t()  # [in, out]
            z = _unpack(state.pop(f"{name}.qzeros"), 4) + 1  # [groups, out]
            s = state.pop(f"{name}.scales").float()
            gi = state.pop(f"{name}.g_idx").long()
            w = ((q - z[gi]) * s[gi]).t()
        else:
            bits = qcfg["config_groups"]["group_0"]["weights"]["num_bits"]
            s = state.pop(key).float()
            if f"{name}.weight_packed" in state:
                shape = state.pop(f"{name}.weight_shape").tolist()
                q = _unpack(state.pop(f"{name}.weight_packed"), bits)[:, : shape[1]] - 2 ** (bits - 1)
            else:
                q = state.pop(f"{name}.weight").to(torch.int64)
            w = q * s.repeat_interleave(-(-q.shape[1] // s.shape[1]), dim=1)[:, : q.shape[1]]
        state[f"{name}.weight"] = w.float().contiguous()
    _copy_folder(quant, out)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    return out
