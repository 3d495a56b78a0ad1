"""Embedding throughput: vllite's ``LLM.embed`` against sentence-transformers' ``encode`` (and vLLM's CPU build).

    python benchmarks/bench_pooling.py                       # MiniLM-L6-sized BERT, 2,048 inputs of 16-512 tokens
    python benchmarks/bench_pooling.py --vllm-python /tmp/vllm-venv/bin/python --dtype float32

Builds a random-weight sentence-transformers folder (BERT encoder, mean pooling, normalize) of MiniLM-L6's shape
(``vllite.testing.pooling``), draws ``--num-inputs`` texts of ``--min-len`` to ``--max-len`` tokens (uniform),
and alternates rounds of every engine over the same inputs; the medians (embeddings/s) and their
ratios are reported. sentence-transformers encodes in batches of ``--st-batch-size`` (its default, 64, sorts the
inputs by length first); vLLM's offline ``LLM.embed`` runs in a child process under ``--vllm-python``. Every round's
embeddings are checked against the first engine's (cosine >= 0.999).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common as common
import torch

_VLLM_EMBED_CHILD = (
    __import__("bench_throughput").VLLM_CHILD_PRELUDE
    + r"""
from vllm import LLM
cfg = json.loads(sys.argv[1])
llm = LLM(model=cfg["model"], runner="pooling", dtype=cfg["dtype"], max_model_len=cfg["max_model_len"], seed=0,
          max_num_batched_tokens=cfg["max_num_batched_tokens"], gpu_memory_utilization=cfg["kv_fraction"])
llm.embed([{"prompt_token_ids": [11, 12, 13]}], use_tqdm=False)
print("READY", flush=True)
for line in sys.stdin:
    inputs = json.loads(line)
    start = time.perf_counter()
    outs = llm.embed(inputs, use_tqdm=False)
    elapsed = time.perf_counter() - start
    print("TIME", elapsed, json.dumps([o.outputs.embedding[:8] for o in outs[:4]]), flush=True)
"""
)

MINILM_L6 = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 1536}


class VllmEmbedRunner(common.LineChild):
    """vLLM's offline ``LLM.embed`` in a child process running ``--vllm-python``."""

    name = "vLLM's child"

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        cfg = {
            "model": model,
            "dtype": args.dtype,
            "max_model_len": 512,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_fraction": args.vllm_kv_fraction,
        }
        stderr = None if args.verbose_peers else subprocess.DEVNULL
        super().__init__([args.vllm_python, "-c", _VLLM_EMBED_CHILD, json.dumps(cfg)], stderr=stderr)
        self.expect("READY")

    def __call__(self, inputs: list[str]) -> tuple[float, torch.Tensor]:
        self.send(json.dumps(inputs))
        elapsed, heads = self.expect("TIME").split(" ", 1)
        return float(elapsed), torch.tensor(json.loads(heads))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", default=None, help="A sentence-transformers folder (default: build MiniLM-L6-sized)."
    )
    parser.add_argument("--num-inputs", type=int, default=2048)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--st-batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="Alternating rounds per engine (medians reported).")
    parser.add_argument("--skip-st", action="store_true")
    parser.add_argument("--vllm-python", default=None, help="A python with vLLM's CPU build: run it as a peer too.")
    parser.add_argument("--vllm-kv-fraction", type=float, default=0.1)
    parser.add_argument("--verbose-peers", action="store_true")
    common.add_json_arg(parser)
    return parser.parse_args()


def make_inputs(args: argparse.Namespace, tokenizer) -> list[str]:
    """Texts of ``--min-len`` to ``--max-len`` tokens (random tokens, decoded; shortened until they fit)."""
    rng = random.Random(0)
    texts = []
    for _ in range(args.num_inputs):
        ids = [rng.randrange(5, tokenizer.vocab_size) for _ in range(rng.randint(args.min_len, args.max_len))]
        text = tokenizer.decode(ids)
        while len(tokenizer.encode(text)) > args.max_len:
            ids = ids[: int(len(ids) * 0.9)]
            text = tokenizer.decode(ids)
        texts.append(text)
    return texts


def main() -> None:
    args = parse_args()
    from vllite import LLM
    from vllite.testing.pooling import make_sentence_transformer

    scratch = tempfile.TemporaryDirectory()
    model = args.model or str(make_sentence_transformer(Path(scratch.name) / "minilm", **MINILM_L6))
    llm = LLM(model, dtype=args.dtype, max_model_len=512, max_num_batched_tokens=args.max_num_batched_tokens)
    inputs = make_inputs(args, llm.get_tokenizer())
    prompts = inputs
    llm.embed(prompts[:8], use_tqdm=False)

    def run_vllite() -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        outputs = llm.embed(prompts, use_tqdm=False)
        return time.perf_counter() - start, torch.tensor([o.outputs.embedding[:8] for o in outputs[:4]])

    runners = {"vllite": run_vllite}
    if not args.skip_st:
        runners["sentence-transformers"] = _st_runner(model, inputs, args)
    if args.vllm_python:
        vllm = VllmEmbedRunner(model, args)
        runners["vLLM"] = lambda: vllm(inputs)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    reference = None
    try:
        for _ in range(args.repeats):
            for name, runner in runners.items():
                elapsed, heads = runner()
                rates[name].append(len(inputs) / elapsed)
                reference = heads if reference is None else reference
                agreement = torch.nn.functional.cosine_similarity(heads, reference, dim=-1).min().item()
                print(f"  {name}: {rates[name][-1]:.1f} embeddings/s (agreement {agreement:.4f})", file=sys.stderr)
    finally:
        if args.vllm_python:
            vllm.close()
        llm.shutdown()
    results: dict = {
        "model": model,
        "num_inputs": len(inputs),
        "dtype": args.dtype,
        "lengths": [args.min_len, args.max_len],
    }
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name, median in medians.items():
        results[f"{name}_embeddings_per_s"] = median
        results[f"{name}_all"] = sorted(rates[name])
        print(f"{name:>22} {median:9.1f} embeddings/s  (median of {len(rates[name])})")
    for name, median in medians.items():
        if name != "vllite":
            results[f"vllite_over_{name}"] = medians["vllite"] / median
            print(f"vllite / {name}: {medians['vllite'] / median:.2f}x")
    common.write_json(args.json, results)


def _st_runner(model: str, texts: list[str], args: argparse.Namespace):
    """sentence-transformers' ``encode`` over the same texts, in this process."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model, device="cpu")
    if args.dtype == "bfloat16":
        st = st.to(torch.bfloat16)

    def run() -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        embeddings = st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True)
        return time.perf_counter() - start, embeddings[:4, :8].float()

    return run


if __name__ == "__main__":
    main()
