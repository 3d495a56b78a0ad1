"""A compiled CPU decode step: a Llama-family decoder's whole forward for a few decode tokens in one call.

At batch 1 a decode step reads every weight once and does little else; on a ~30M Llama in float32 the 57 linear
layers took 2.7 ms of a 7.0 ms step at the memory's speed, and the rest went to what runs around them: about 25 small
torch operations per layer (norms, rotary, views, the residual adds), a module call each, the attention glue, and a
parallel region woken for every one. ``cpu_decode_step.cpp`` runs the step as one parallel region: the threads meet
at a spin barrier between the phases of a layer (Q/K/V heads with rotary and the cache write; attention per sequence
and KV head; o-proj; gate/up/SiLU; down-proj) and split each phase's output channels, so each weight is read once per
step by one thread, and nothing returns to Python until the logits are written.

It computes what transformers' Llama (and Mistral, Qwen2) computes, in the model's dtype: float32, or bfloat16 with
every value rounded to bfloat16 where transformers stores one (float32 accumulation inside each operation). The
linear layers use :mod:`vllite.kernels.cpu_linear`'s row kernel and attention :mod:`vllite.kernels.cpu_decode`'s
(both compiled into the same module), so a fused step adds the same sums as the unfused one.

Built like the other kernels (:mod:`vllite.kernels.cpp_build`); :func:`decode_step_kernel` is ``None`` when it cannot
be built or ``VLLITE_CPU_DECODE_STEP=0`` turns it off. The model side (which models qualify, the weights and rotary
tables it is given) is :mod:`vllite.plugins.transformers_executor.fused_decode`.
"""

from __future__ import annotations

import functools
from typing import Any

from vllite.kernels.cpp_build import load_cpp_module

__all__ = ["decode_step_kernel"]


@functools.cache
def decode_step_kernel() -> Any | None:
    """The compiled module, whose ``DecodeStep(layer_tensors, embed, final_norm, lm_head, cos, sin, num_heads,
    num_kv_heads, head_dim, eps, scale)`` holds one model and whose ``step(logits, ids, positions, slots,
    block_tables, seq_lens, kv)`` runs one decode step; ``None`` when it cannot be built or is turned off."""
    return load_cpp_module(
        "cpu_decode_step.cpp",
        "",
        None,
        "the fused CPU decode step",
        switch="VLLITE_CPU_DECODE_STEP",
        after=("cpu_decode.cpp", "cpu_linear.cpp"),
    )
