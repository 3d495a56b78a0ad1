"""Test support: a byte-level BPE tokenizer trained in memory, for detokenizer and input-processor tests."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any


def build_tiny_tokenizer(
    corpus: Iterable[str],
    *,
    vocab_size: int = 300,
    chat_template: str | None = None,
    save_dir: str | Path | None = None,
) -> Any:
    """Trains a byte-level BPE tokenizer on ``corpus`` in memory (milliseconds).

    Special tokens: ``<pad>`` (0), ``<s>`` (1, bos), ``</s>`` (2, eos). Byte-level, so every string encodes
    and multi-byte characters split across tokens. Saved with ``save_pretrained`` when ``save_dir`` is given.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template is not None:
        hf.chat_template = chat_template
    if save_dir is not None:
        hf.save_pretrained(str(save_dir))
    return hf
