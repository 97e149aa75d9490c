"""Byte-level BPE tokenizer trained with Hugging Face `tokenizers` (DESIGN.md "Data").

Ids: BOS 0, EOS 1, PAD 2 (as the model config says), learned tokens after them, the image token at the
model's `image_token_id`, and reserved tokens filling every other id up to `vocab_size`, so the
tokenizer's size equals the model's vocabulary (the Engram compressed map needs one entry per id).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from flashtrain.config.errors import ConfigError, DataError, InputNotFoundError
from flashtrain.data.config import TokenSpec

BOS, EOS, PAD, IMAGE_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>", "<|image|>"


def train_tokenizer(texts: Iterable[str], spec: TokenSpec):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if (spec.bos_id, spec.eos_id, spec.pad_id) != (0, 1, 2):
        raise ConfigError(f"the tokenizer puts BOS/EOS/PAD at 0/1/2; the model says "
                         f"{spec.bos_id}/{spec.eos_id}/{spec.pad_id}")
    if not 3 < spec.image_token_id < spec.vocab_size:
        raise ConfigError(f"model.image_token_id={spec.image_token_id} must lie in (3, vocab_size={spec.vocab_size})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.image_token_id, special_tokens=[BOS, EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    n = tok.get_vocab_size()
    if n > spec.image_token_id:
        raise DataError(f"trained {n} tokens, more than the {spec.image_token_id} ids below the image token")
    tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True) for i in range(n, spec.image_token_id)])
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True)])
    tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True)
                            for i in range(spec.image_token_id + 1, spec.vocab_size)])
    check_tokenizer(tok, spec)
    return tok


def tokenizer_mismatch(tok, spec: TokenSpec) -> str | None:
    """None when `tok` is this model's tokenizer (its size is `spec.vocab_size`, BOS / EOS / PAD / the image
    token at the model's ids); else what differs, e.g. "16384 ids, the model has model.vocab_size=512"."""
    if tok.get_vocab_size() != spec.vocab_size:
        return f"{tok.get_vocab_size()} ids, the model has model.vocab_size={spec.vocab_size}"
    want = {BOS: spec.bos_id, EOS: spec.eos_id, PAD: spec.pad_id, IMAGE_TOKEN: spec.image_token_id}
    got = {t: tok.token_to_id(t) for t in want}
    if got != want:
        wrong = ", ".join(f"{t} at {got[t]}" for t in want if got[t] != want[t])
        return f"{wrong}, the model has {', '.join(f'{t} at {want[t]}' for t in want if got[t] != want[t])}"
    return None


def check_tokenizer(tok, spec: TokenSpec) -> None:
    if problem := tokenizer_mismatch(tok, spec):
        raise DataError(f"the tokenizer does not fit the model ({problem}); retrain it for this model config")


def load_tokenizer(path: str | Path, spec: TokenSpec | None = None):
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise InputNotFoundError(f"tokenizer {str(path)!r} does not exist; train one with launch/prepare_data.py")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own untyped errors
        raise DataError(f"tokenizer {str(path)!r} is not a readable tokenizer.json ({' '.join(str(e).split())}); "
                        f"point data.tokenizer at the one launch/prepare_data.py wrote") from None
    if spec is not None:
        check_tokenizer(tok, spec)
    return tok


def token_byte_counts(tok, vocab_size: int):
    """int64 [vocab_size]: the UTF-8 bytes each id stands for, for bits per byte (train/evaluation/heldout.py). A
    byte-level BPE token's string holds one character per byte (the ByteLevel alphabet); another
    token's bytes are those of its decoded text; special / added tokens and ids past the tokenizer's
    size stand for none."""
    import numpy as np
    from tokenizers import pre_tokenizers

    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    special = set(tok.get_added_tokens_decoder())
    out = np.zeros(vocab_size, dtype=np.int64)
    for i in range(min(vocab_size, tok.get_vocab_size())):
        s = tok.id_to_token(i)
        if i in special or s is None:
            continue
        out[i] = len(s) if set(s) <= alphabet else len(tok.decode([i], skip_special_tokens=False).encode())
    return out
