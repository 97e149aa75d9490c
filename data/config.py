"""Typed data configuration (DESIGN.md "Data"), filled from `conf/data/*.yaml`, plus the token facts the
data pipeline takes from the model config (data/ does not import model/)."""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

from flashtrain.config.errors import DataError, InputNotFoundError
from flashtrain.data.images import ImageProcessorConfig


class DataConfigError(DataError):
    """A data setting is invalid; the message names it and the fix."""


@dataclass(frozen=True)
class TokenSpec:
    """Token ids and sizes the model fixes; the trainer fills this from its ModelConfig."""

    vocab_size: int
    bos_id: int = 0
    eos_id: int = 1
    pad_id: int = 2
    image_token_id: int = 129264
    image: ImageProcessorConfig = field(default_factory=ImageProcessorConfig)


@dataclass
class DataConfig:
    seq_len: int = 512  # tokens per training sequence (inputs; rows hold seq_len + 1 for the shifted labels)
    batch_size: int = 2  # sequences per micro-batch on one rank
    text_shards: list[str] | None = None  # paths or globs of text shards; null with mm_shards null: default corpus
    mm_shards: list[str] | None = None  # paths or globs of multimodal shards
    val_shards: list[str] | None = None  # held-out shards (train/evaluation/heldout.py); null: the default corpus's
    tokenizer: str | None = None  # tokenizer.json; null: the one beside the shards (manifest) or the corpus'
    mix: list[int] | None = None  # text : multimodal in tokens, without data.sources; null: 7 : 1 (V41_SPEC §8)
    sources: list | None = None  # named weighted sources (data/sources.py); null: text_shards / mm_shards + mix
    pack_buffer: int = 64  # documents pieces held for best-fit packing
    num_workers: int = 0  # dataloader worker processes per rank (0: in the main process)
    seed: int = 0
    trace: bool = False  # the data trace: the documents of every micro-batch (data/trace.py)
    corpus_dir: str | None = None  # default corpus cache; null: $FLASHTRAIN_CACHE or ~/.cache/flashtrain
    corpus_text_bytes: int = 12_000_000  # stdlib source read for the default corpus
    corpus_mm_docs: int = 4000  # rendered image documents in the default corpus
    corpus_shards: int = 16  # shards per stream in the default corpus
    corpus_val_text_bytes: int = 200_000  # held-out stdlib text of the default corpus (data/corpus.py)
    corpus_val_mm_docs: int = 100  # held-out rendered image documents of the default corpus

    def __post_init__(self) -> None:
        from flashtrain.data.sources import DEFAULT_MIX, source_configs

        if self.sources is not None:
            self.sources = source_configs(self.sources)
        elif self.mix is None:
            self.mix = list(DEFAULT_MIX)

    def validate(self) -> None:
        if self.sources is not None:
            given = [f"data.{k}={getattr(self, k)!r}" for k in ("text_shards", "mm_shards", "mix")
                     if getattr(self, k) is not None]
            if given:
                raise DataConfigError(f"data.sources and {', '.join(given)} are both set: with data.sources give "
                                      f"every source's shards and weight there, and leave "
                                      f"{', '.join(g.split('=')[0] for g in given)} null")
            return self._validate_common()
        self._validate_common()
        if len(self.mix) != 2 or min(self.mix) < 0 or sum(self.mix) == 0:
            raise DataConfigError(f"data.mix={self.mix}: needs [text, multimodal] token weights, e.g. [7, 1]")

    def _validate_common(self) -> None:
        for name in ("seq_len", "batch_size", "pack_buffer", "corpus_shards"):
            if getattr(self, name) <= 0:
                raise DataConfigError(f"data.{name}={getattr(self, name)}: must be positive")
        for name in ("corpus_val_text_bytes", "corpus_val_mm_docs"):
            if getattr(self, name) < 0:
                raise DataConfigError(f"data.{name}={getattr(self, name)}: must be >= 0")
        if self.num_workers < 0:
            raise DataConfigError(f"data.num_workers={self.num_workers}: must be >= 0")

    @property
    def default_corpus(self) -> bool:
        """No shards configured: the run reads the default corpus (data/corpus.py)."""
        return self.sources is None and self.text_shards is None and self.mm_shards is None

    def cache_dir(self) -> Path:
        if self.corpus_dir:
            return Path(self.corpus_dir).expanduser()
        return Path(os.environ.get("FLASHTRAIN_CACHE", Path.home() / ".cache" / "flashtrain")) / "corpus"


def resolve_shards(patterns: list[str] | None, what: str) -> list[str]:
    """Expand paths/globs, sorted; a pattern that matches nothing is a start-up error. A webdataset URL
    (`pipe:CMD`, `http://...`, `https://...`, other schemes webdataset opens) is not globbed nor checked on
    disk: it is brace-expanded as webdataset does (`.../text-{00000..00015}.tar`) and passed to
    webdataset's opener as is."""
    from flashtrain.data.shards import url_scheme, url_schemes

    if not patterns:
        return []
    out = []
    for pat in patterns:
        scheme = url_scheme(pat)
        if scheme is not None:
            if scheme != "pipe" and scheme not in url_schemes():
                raise DataConfigError(f"data.{what}: {pat!r}: webdataset cannot open {scheme}:// URLs (it opens "
                                      f"{', '.join(url_schemes())} and pipe:); use e.g. 'pipe:CMD' that writes the "
                                      f"tar to stdout")
            import braceexpand

            out += list(braceexpand.braceexpand(pat))
            continue
        hits = sorted(glob.glob(os.path.expanduser(pat)))
        if not hits:
            raise InputNotFoundError(f"data.{what}: {pat!r} matches no shard file; check the path, or run "
                                    f"launch/prepare_data.py to write shards")
        out += hits
    return sorted(dict.fromkeys(out))
