#!/usr/bin/env python
"""Train vllite's embedded demo model from scratch on the Python standard library's own source.

The demo model lets ``vllite generate "def fibonacci(n):"`` run on a fresh machine with no download. Everything it
needs is on every machine that runs Python: the training text is the ``*.py`` source of the standard library
(``sysconfig.get_paths()["stdlib"]``), selected deterministically (sorted paths, tests and generated tables left
out). The script

1. trains a byte-level BPE tokenizer with the ``tokenizers`` library and saves it as a transformers
   ``PreTrainedTokenizerFast`` with a ChatML chat template;
2. trains a small ``LlamaForCausalLM`` (grouped-query attention, tied embeddings) on packed windows of the
   tokenized corpus with AdamW and a cosine learning-rate schedule;
3. saves the weights in bfloat16 as safetensors together with ``config.json``, ``generation_config.json``, the
   tokenizer files and ``training_summary.json`` (loss curve and settings).

Runs are deterministic for a given seed, thread count, Python version (the corpus) and library versions. Usage::

    python scripts/train_demo_model.py --out core/demo_model --steps 2400 --threads 2 --seed 0

``--tokenizer-only`` stops after step 1 (seconds), which is enough for tests that need a tokenizer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import sysconfig
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Leave the cores to the process that is training: tokenizers' Rust thread pool is not needed here.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: Special tokens. ``<|endoftext|>`` is bos, eos and document separator; ``<|pad|>`` pads batches;
#: ``<|im_start|>`` / ``<|im_end|>`` frame the turns of the ChatML chat template.
ENDOFTEXT = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, PAD, IM_START, IM_END]

#: ChatML, the format Qwen and many others use. The bos token starts the conversation; each turn ends with
#: ``<|im_end|>``, which is also an end-of-sequence token in ``generation_config.json``. OpenAI's tool round trip
#: renders as Qwen's template renders it: an assistant message's ``tool_calls`` (its ``content`` may be null) as
#: Hermes ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks, a ``tool`` message as a ``tool`` turn.
#: The tool definitions themselves are not rendered: the model never saw any, and they would only lengthen prompts.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{{ '<tool_call>\n{\"name\": \"' + function['name'] + '\", \"arguments\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | tojson }}{% endif %}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Folders of the standard library that are left out of the corpus: the test suites (large, and full of
#: deliberately odd code), third-party packages, and the generated codec tables in ``encodings``.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "encodings", "pydoc_data", "__pycache__"}
)
#: Files larger than this are generated data rather than code people write (e.g. ``_pydecimal`` stays in).
MAX_FILE_BYTES = 300_000


def stdlib_sources(root: Path | None = None, max_bytes: int | None = None) -> list[tuple[str, str]]:
    """The standard library's ``*.py`` files as ``(relative path, text)`` pairs, in sorted path order.

    ``root`` defaults to ``sysconfig.get_paths()["stdlib"]``. Folders in :data:`EXCLUDED_DIRS` and files over
    :data:`MAX_FILE_BYTES` are skipped; ``max_bytes`` caps the total size (the sorted prefix is kept).
    """
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out: list[tuple[str, str]] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        text = text.replace("\r\n", "\n").strip("\n")
        if not text:
            continue
        if max_bytes is not None and total + len(text) > max_bytes:
            break
        out.append((rel.as_posix(), text))
        total += len(text)
    return out


def train_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int) -> Any:
    """Train a byte-level BPE tokenizer on ``texts``; return it as a ``PreTrainedTokenizerFast``.

    The tokenizer prepends ``<|endoftext|>`` (bos) to every encoded text, like Llama's tokenizers do, and carries
    :data:`CHAT_TEMPLATE`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(ENDOFTEXT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{ENDOFTEXT} $A",
        pair=f"{ENDOFTEXT} $A {ENDOFTEXT} $B",
        special_tokens=[(ENDOFTEXT, bos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        unk_token=None,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def encode_corpus(tokenizer: Any, texts: list[str]) -> Any:
    """Concatenate the texts into one token stream, each document preceded by ``<|endoftext|>``."""
    import torch

    ids: list[int] = []
    # The Rust tokenizer directly: the documents are longer than model_max_length, which is fine here.
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=True):
        ids.extend(enc.ids)
    ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def build_model(args: argparse.Namespace, tokenizer: Any) -> Any:
    """A freshly initialised ``LlamaForCausalLM`` sized by the command-line arguments."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``--lr``, then cosine decay to ``--lr * --min-lr-ratio`` at the last step."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cosine)


def sample_batch(tokens: Any, batch_size: int, seq_len: int, generator: Any) -> Any:
    """``batch_size`` windows of ``seq_len`` tokens at random offsets of the packed stream."""
    import torch

    starts = torch.randint(0, tokens.numel() - seq_len, (batch_size,), generator=generator)
    return torch.stack([tokens[s : s + seq_len] for s in starts.tolist()])


def evaluate(model: Any, tokens: Any, seq_len: int, max_windows: int = 16) -> float:
    """Mean next-token loss over consecutive windows of the held-out stream."""
    import torch

    n = min(max_windows, tokens.numel() // seq_len)
    if n == 0:
        return float("nan")
    batch = tokens[: n * seq_len].view(n, seq_len)
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=batch, labels=batch).loss.item()
    model.train()
    return loss


def set_seed(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators."""
    import torch

    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)


def greedy_sample(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation of ``prompt`` with Hugging Face ``generate()`` (the project's correctness oracle)."""
    import torch

    enc = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def save_tokenizer(tokenizer: Any, out: Path) -> None:
    """Save the tokenizer in the portable layout that transformers 4.x and 5.x both read.

    That is ``tokenizer.json``, ``tokenizer_config.json`` (class ``PreTrainedTokenizerFast``, the chat template
    inline, ``additional_special_tokens``) and ``special_tokens_map.json``.
    """
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        config["additional_special_tokens"] = extra
    template_file = out / "chat_template.jinja"
    if template_file.exists():
        config["chat_template"] = template_file.read_text()
        template_file.unlink()
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def save_model(model: Any, tokenizer: Any, out: Path, dtype: str) -> None:
    """Save the weights in ``dtype`` as safetensors, plus config, generation config and tokenizer files.

    ``config.json`` gets the legacy ``torch_dtype`` key next to ``dtype`` so older transformers read it too.
    """
    import torch
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    model = model.to(getattr(torch, dtype))
    model.config.use_cache = True
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out)
    save_tokenizer(tokenizer, out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = dtype
    config.setdefault("dtype", dtype)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in out.iterdir():  # safetensors writes 0600; package data should be world-readable
        if path.is_file():
            path.chmod(0o644)


def write_model_card(out: Path, summary: dict[str, Any]) -> None:
    """Write ``README.md`` into the model folder: what the model is, how it was made, and the PSF notice."""
    a = summary["args"]
    hist = summary["history"]
    evals = [h for h in hist if "val_loss" in h]
    psf_notice = sys.copyright.splitlines()[0]  # "Copyright (c) 2001-20xx Python Software Foundation."
    curve = ", ".join(f"{h['step'] + 1}: {h['val_loss']:.2f}" for h in evals)
    card = f"""# vllite demo model

A {summary["parameters"] / 1e6:.1f}M-parameter `LlamaForCausalLM` ({a["num_layers"]} layers, hidden {a["hidden_size"]},
{a["num_heads"]} heads / {a["num_kv_heads"]} KV heads, tied embeddings, {a["dtype"]} weights) with a
{a["vocab_size"]}-token byte-level BPE tokenizer, trained from scratch by `scripts/train_demo_model.py` on the
Python {summary["python"]} standard library's source ({summary["corpus_files"]} files,
{summary["corpus_chars"] / 1e6:.1f}M characters, {summary["tokens"] / 1e6:.2f}M tokens). It exists so that
`vllite generate "def fibonacci(n):"` works with no download; it writes Python-looking text, not correct programs.

Training: {a["steps"]} steps x {a["batch_size"]} x {a["seq_len"]} tokens
({summary["train_tokens_seen"] / 1e6:.2f}M tokens), AdamW, peak lr {a["lr"]}, cosine schedule, seed {a["seed"]},
{a["threads"]} CPU thread(s), {summary["train_seconds"] / 60:.1f} min. Held-out loss by step: {curve}.
Details: `training_summary.json`, `docs/demo-model.md`.

## Licence of the training text

The training text is the source of the Python standard library ({psf_notice} All Rights Reserved),
used under the PSF License Agreement (https://docs.python.org/3/license.html). The tokenizer and weights are
derived from that text by the training script above.
"""
    (out / "README.md").write_text(card)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; the defaults are the settings the shipped demo model was trained with."""
    repo_root = Path(__file__).resolve().parent.parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=repo_root / "core" / "demo_model", help="output folder")
    p.add_argument("--stdlib", type=Path, default=None, help="corpus root (default: this Python's stdlib)")
    p.add_argument("--max-corpus-bytes", type=int, default=None, help="cap on corpus size (sorted prefix)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (keep it at 1 or 2)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256, help="training window length in tokens")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=2400)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--holdout-fraction", type=float, default=0.01, help="tail of the stream kept for eval")
    p.add_argument(
        "--autocast",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bfloat16 autocast for the forward pass (weights stay float32)",
    )
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--sample-prompt", default="def fibonacci(n):")
    p.add_argument("--sample-tokens", type=int, default=64)
    p.add_argument("--tokenizer-only", action="store_true", help="train and save the tokenizer, then stop")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the whole pipeline; returns the process exit status."""
    args = parse_args(argv)
    import torch
    from tqdm.auto import tqdm

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    set_seed(args.seed)
    t0 = time.perf_counter()

    docs = stdlib_sources(args.stdlib, args.max_corpus_bytes)
    corpus_bytes = sum(len(text) for _, text in docs)
    print(f"corpus: {len(docs)} files, {corpus_bytes / 1e6:.2f} MB", file=sys.stderr)
    tokenizer = train_tokenizer((text for _, text in docs), args.vocab_size, args.max_position_embeddings)
    if args.tokenizer_only:
        save_tokenizer(tokenizer, args.out)
        print(f"tokenizer ({len(tokenizer)} tokens) saved to {args.out}", file=sys.stderr)
        return 0

    tokens = encode_corpus(tokenizer, [text for _, text in docs])
    n_hold = max(args.seq_len * 4, int(tokens.numel() * args.holdout_fraction))
    train_tokens, held_out = tokens[:-n_hold], tokens[-n_hold:]
    print(
        f"tokens: {tokens.numel():,} ({corpus_bytes / tokens.numel():.2f} chars/token), "
        f"held out {held_out.numel():,}; tokenizer {time.perf_counter() - t0:.1f}s",
        file=sys.stderr,
    )

    model = build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", file=sys.stderr)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    generator = torch.Generator().manual_seed(args.seed)
    history: list[dict[str, float]] = []
    model.train()
    t_train = time.perf_counter()
    ema: float | None = None
    bar = tqdm(range(args.steps), desc="train", unit="step", mininterval=5.0)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        batch = sample_batch(train_tokens, args.batch_size, args.seq_len, generator)
        # bf16 autocast: the matmuls run in bfloat16 (about 1.6x faster on CPUs with avx512_bf16 or AMX), the
        # weights, gradients and optimizer state stay in float32.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast):
            loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        optimizer.step()
        value = loss.item()
        ema = value if ema is None else 0.95 * ema + 0.05 * value
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr_at(step, args):.1e}", refresh=False)
        last = step + 1 == args.steps
        eval_now = last or bool(args.eval_every and (step + 1) % args.eval_every == 0)
        if step % 25 == 0 or eval_now:
            history.append({"step": step, "loss": round(value, 4), "loss_ema": round(ema, 4)})
        if eval_now:
            val = evaluate(model, held_out, args.seq_len)
            history[-1]["val_loss"] = round(val, 4)
            tqdm.write(f"step {step + 1}: train(ema) {ema:.3f}  held-out {val:.3f}", file=sys.stderr)
    train_seconds = time.perf_counter() - t_train

    model.eval()
    save_model(model, tokenizer, args.out, args.dtype)
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(args.out)
    sample = greedy_sample(saved, tokenizer, args.sample_prompt, args.sample_tokens)
    final_val = evaluate(saved.float(), held_out, args.seq_len)
    summary = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "corpus_files": len(docs),
        "corpus_chars": corpus_bytes,
        "tokens": tokens.numel(),
        "parameters": n_params,
        "train_tokens_seen": args.steps * args.batch_size * args.seq_len,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t0, 1),
        "final_val_loss_saved_dtype": round(final_val, 4),
        "sample_prompt": args.sample_prompt,
        "sample_greedy": sample,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
        "history": history,
    }
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_model_card(args.out, summary)
    print(f"saved to {args.out} in {summary['total_seconds']}s; held-out loss {final_val:.3f}", file=sys.stderr)
    print(f"--- greedy sample ---\n{args.sample_prompt}{sample}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
