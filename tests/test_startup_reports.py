"""What start-up tells the user: the dtype ``--dtype auto`` resolved to (a value in the engine's ``EngineInfo``), one
log line with it, the context length and the KV cache's capacity; and a first-run kernel build announced (which
kernel, that it happens once) and timed, visible without any logging set up (``vllite serve``/``generate``)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from vllite import LLM
from vllite.assets import default_model_path
from vllite.model_files import load_hf_config
from vllite.plugins.transformers_executor.model_loader import resolve_dtype


def _auto_dtype() -> str:
    resolved = resolve_dtype("auto", load_hf_config(str(default_model_path())), torch.device("cpu"))
    return str(resolved).removeprefix("torch.")


def test_the_resolved_dtype_is_reported_and_logged_with_the_kv_cache_capacity(caplog, monkeypatch) -> None:
    monkeypatch.setenv("VLLITE_ENABLE_MULTIPROCESSING", "0")
    caplog.set_level(logging.INFO, logger="vllite.engine.core")
    llm = LLM(str(default_model_path()), max_model_len=256, num_gpu_blocks_override=40)
    try:
        info = llm.llm_engine.engine_info
    finally:
        llm.shutdown()
    assert info.dtype == _auto_dtype() != "auto"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Engine core ready")]
    assert len(lines) == 1, caplog.text
    found = re.search(r"dtype=(\w+) max_model_len=(\d+) KV cache: (\d+) blocks / (\d+) tokens / ([\d.]+) MiB", lines[0])
    assert found, lines[0]
    dtype, max_model_len, blocks, tokens, mib = found.groups()
    assert (dtype, int(max_model_len), int(blocks)) == (info.dtype, 256, 40)
    config = load_hf_config(str(default_model_path()))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    token_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * getattr(torch, dtype).itemsize
    assert int(tokens) == 40 * info.block_size and float(mib) == round(int(tokens) * token_bytes / 2**20, 1)


_BUILD = textwrap.dedent(
    """
    import logging, sys, types
    import torch.utils.cpp_extension as cpp_extension

    if sys.argv[1] == "warning":  # as the engine-core process sets logging up under `vllite serve`
        logging.basicConfig(level=logging.WARNING)
    built = []
    def load_inline(name, **kwargs):  # the compiler itself is not under test (a real build takes minutes)
        built.append(name)
        return types.SimpleNamespace(name=name)
    cpp_extension.load_inline = load_inline
    from vllite.kernels.cpp_build import load_cpp_module
    from vllite.kernels.cpu_linear import _CPP_DECL
    module = load_cpp_module("cpu_linear.cpp", _CPP_DECL, ["dense_linear"], "the CPU linear kernels", "SWITCH")
    assert built == [module.name], built
    """
)


@pytest.mark.parametrize("logging_setup", ["none", "warning"])
def test_a_first_kernel_build_is_announced_and_timed(tmp_path, logging_setup: str) -> None:
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "PATH": "/usr/bin:/bin", "CXX": "c++"}
    result = subprocess.run(
        [sys.executable, "-c", _BUILD, logging_setup], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    err = result.stderr
    assert re.search(r"INFO.*Compiling the CPU linear kernels \(vllite_cpu_linear_\w+\).*once", err), err
    assert re.search(r"INFO.*Compiled the CPU linear kernels in \d+\.\d s", err), err
