"""The held-out set (DESIGN.md "Evaluation"): a fixed, deterministic list of micro-batches that the
evaluation (train/evaluation/heldout.py) scores every time, the same on every rank and in every layout.

- Sources: the documents of `data.val_shards` (default: the default corpus's held-out part,
  data/corpus.py), read in sorted shard order from the start; a document with an image belongs to the
  multimodal source `mm`, any other to `text`. Each source's share of the micro-batches follows the
  training mix (`data.mix`, or with `data.sources` the sum of each modality's weights; in tokens):
  `M = ceil(tokens / (batch_size x seq_len))` micro-batches in all, `max(1, round(M x weight / total
  weight))` for each source with a weight (a source without held-out documents is left out, with a
  warning).
- Rows: `[BOS] + segments + [EOS]` split into pieces of at most seq_len + 1 positions as for training
  (data/loader.py `document_pieces`), packed in reading order (next fit: a piece that does not fit
  closes the row, whose rest is PAD); a micro-batch holds `data.batch_size` rows of one source, so its
  scores belong to one source. A source whose documents run out before its share ends with PAD rows.
- Counted on the host from the labels, independent of the model and the layout: per source the scored
  positions (labels not IGNORE) and the UTF-8 bytes they stand for (data/tokenizer.py
  `token_byte_counts`).

A piece whose image cannot be decoded is dropped (logged). Rows keep the encoded image bytes and are
collated when scored, so the set holds no pixels between evaluations.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np

from flashtrain.config.errors import DataError
from flashtrain.data.config import DataConfig, TokenSpec
from flashtrain.data.images import ImageDecodeError
from flashtrain.data.loader import IGNORE, Counters, Piece, collate, decode_piece_images, document_pieces
from flashtrain.data.shards import read_shard
from flashtrain.data.sources import modality_weights

log = logging.getLogger(__name__)
SOURCES = ("text", "mm")  # held-out source names, in the order of data.mix
MODALITIES = {"text": "text", "mm": "multimodal"}


@dataclass
class HeldOutSet:
    """`batches[i]`: (source index, rows of pieces) of micro-batch i; `targets` / `bytes`: per source, the
    scored positions and the bytes they stand for."""

    sources: tuple[str, ...]
    batches: list[tuple[int, list[list[Piece]]]]
    targets: np.ndarray
    bytes: np.ndarray
    spec: TokenSpec = field(repr=False)
    seq_len: int = 0

    def batch(self, i: int) -> dict:
        """Micro-batch i collated as for training (its images decoded now)."""
        return collate(self.batches[i][1], self.spec, self.seq_len)

    def pad_batch(self, batch_size: int) -> dict:
        """A micro-batch of PAD rows (nothing scored): fills a layout's last group of micro-batches."""
        return collate([[] for _ in range(batch_size)], self.spec, self.seq_len)


def _source_of(doc) -> int:
    return 1 if any(seg[0] == "image" for seg in doc.segments) else 0


def _micro_batches(cfg: DataConfig, tokens: int) -> list[int]:
    """Micro-batches per source: the training mix's shares of ceil(tokens / (batch_size x seq_len))."""
    weights = modality_weights(cfg)
    total = max(1, math.ceil(tokens / (cfg.batch_size * cfg.seq_len)))
    return [max(1, round(total * w / sum(weights))) if w else 0 for w in weights]


def heldout_set(cfg: DataConfig, spec: TokenSpec, shards: list[str], tokens: int,
                token_bytes: np.ndarray) -> HeldOutSet:
    """The held-out micro-batches of about `tokens` positions from `shards` (module docstring). Reading
    stops once every source's share is full."""
    if not shards:
        raise DataError("data.val_shards is empty; give held-out shards, or null for the default corpus's")
    capacity = cfg.seq_len + 1
    counters = Counters()
    quota = [m * cfg.batch_size for m in _micro_batches(cfg, tokens)]
    rows: list[list[list[Piece]]] = [[], []]
    open_row: list[list[Piece]] = [[], []]
    room = [capacity, capacity]

    def add(s: int, piece: Piece) -> None:
        if len(piece) > room[s]:
            rows[s].append(open_row[s])
            open_row[s], room[s] = [], capacity
        open_row[s].append(piece)
        room[s] -= len(piece)

    def full() -> bool:
        return all(len(rows[s]) >= quota[s] for s in (0, 1))

    read_any = False
    for shard in sorted(shards):
        for doc in read_shard(shard, counters.read):
            if doc is None:
                continue
            read_any, s = True, _source_of(doc)
            if len(rows[s]) >= quota[s]:
                continue
            for piece in document_pieces(doc, spec, capacity, s, counters):
                if piece.images:
                    try:
                        decode_piece_images(piece, spec)
                    except ImageDecodeError as e:
                        log.warning("held-out set: dropping a piece with an undecodable image: %s", e)
                        continue
                add(s, piece)
            if full():
                break
        if full():
            break
    if not read_any:
        raise DataError(f"data.val_shards: no readable document in {len(shards)} shard(s) ({shards[0]!r}); point it "
                        f"at webdataset tars written by launch/prepare_data.py")
    batches = []
    for s in (0, 1):
        if open_row[s] and len(rows[s]) < quota[s]:
            rows[s].append(open_row[s])
        if not rows[s]:
            if quota[s]:
                log.warning("the held-out shards hold no %s document; the training mix gives that source weight "
                            "%s: it is not evaluated", SOURCES[s], modality_weights(cfg)[s])
            continue
        if len(rows[s]) < quota[s]:
            log.warning("held-out source %s fills %d row(s) of the %d its share asks for; scoring those", SOURCES[s],
                        len(rows[s]), quota[s])
        mine = rows[s][:quota[s]]
        mine += [[] for _ in range(-len(mine) % cfg.batch_size)]  # the last micro-batch filled with PAD rows
        batches += [(s, mine[i:i + cfg.batch_size]) for i in range(0, len(mine), cfg.batch_size)]
    out = HeldOutSet(SOURCES, batches, np.zeros(2, np.int64), np.zeros(2, np.int64), spec, cfg.seq_len)
    for s, row_pieces in batches:  # the scored positions and their bytes, from the labels
        labels = collate_labels(row_pieces, spec, cfg.seq_len)
        valid = labels[labels != IGNORE]
        out.targets[s] += valid.size
        out.bytes[s] += int(token_bytes[valid].sum())
    return out


def collate_labels(rows: list[list[Piece]], spec: TokenSpec, seq_len: int) -> np.ndarray:
    """The labels `collate` gives these rows, without decoding their images: the next token of every
    position, IGNORE on PAD and on image tokens."""
    out = np.full((len(rows), seq_len), IGNORE, dtype=np.int64)
    for b, row in enumerate(rows):
        toks = np.concatenate([p.tokens for p in row]) if row else np.zeros(0, np.int64)
        types = np.concatenate([p.types for p in row]) if row else np.zeros(0, np.int64)
        out[b, :max(0, len(toks) - 1)] = np.where(types[1:] < 0, toks[1:], IGNORE)
    return out
