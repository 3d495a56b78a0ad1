"""Shared pytest set-up: CPU-only defaults, Triton's interpreter without a GPU, and the ``cuda`` marker."""

from __future__ import annotations

import os

# Triton kernels run through the interpreter on machines without a GPU; this must be set before triton loads.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tests use tiny shapes: one intra-op thread avoids OpenMP spin contention on small CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# dtype="auto" runs a bfloat16 checkpoint (the demo model) in bfloat16 on CPUs with AVX512-BF16 or AMX: the suite pins
# float32 so its float32 oracle holds on any CI machine; tests/test_bf16.py sets the override itself.
os.environ.setdefault("VLLITE_CPU_BF16", "0")
# Keep tests from loading whatever third-party plugins happen to be installed, unless a test asks.
os.environ.setdefault("VLLITE_ENABLE_MULTIPROCESSING", "0")

import pytest
from hypothesis import settings

# Locally hypothesis explores new examples on every run; CI replays a fixed derandomized set, so a green CI
# result does not depend on luck.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("cuda" in item.keywords for item in items):
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA device")
            for item in items:
                if "cuda" in item.keywords:
                    item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _cpu_decode_kernel_built() -> None:
    """Builds the compiled CPU decode-attention kernel once, before any engine starts: engines then import it from
    torch's extension cache instead of the first one building it inside a test's start-up timeout."""
    from vllite.kernels.cpu_decode import decode_kernel

    decode_kernel()


@pytest.fixture(scope="session")
def tiny_llama_dir() -> str:
    """The cached tiny random Llama checkpoint (vllite.testing) that the HF-oracle tests share."""
    from vllite.testing import make_tiny_model_dir_cached

    return str(make_tiny_model_dir_cached("llama"))


@pytest.fixture(scope="session")
def tiny_llama_hf(tiny_llama_dir: str):
    """Hugging Face's float32 model of ``tiny_llama_dir``: the oracle for greedy tokens and logprobs."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
