"""The packed, mixed, resumable data stream (DESIGN.md "Data"; format and rules: data/README.md).

Per data-parallel rank and dataloader worker:
- shards: sorted; reader group g = r * N + w (rank r of W, worker w of N) takes shards[g::W*N], so every
  shard is read by exactly one (rank, worker), and W x N groups read the same data however they are
  split into ranks and workers (1 rank x 2 workers = 2 ranks x 1 worker); each epoch visits a group's
  shards in an order seeded by (seed, group, stream, epoch);
- documents become `[BOS] + segments + [EOS]` (image segments expand to their token-type span), then
  are split into pieces of at most seq_len + 1 positions (text anywhere, image spans never);
- sources (data/sources.py: named shard lists with weights; by default `text` and `mm`, weighted
  `data.mix`) each keep their share (`pack_buffer` / sources) of the packing buffer filled;
- rows of seq_len + 1 positions: a row opens with the oldest buffered piece of the source furthest
  behind its weight in emitted tokens (so the shares hold to within about one row, and no piece waits
  long), then is filled by best fit over every buffer (the largest piece that fits the remaining
  space, until none fits; the rest is PAD).
Bad input (unreadable sample, corrupt tar, undecodable image, empty document, image span longer than a
row) is logged, counted and skipped. Shards are read with webdataset (data/shards.py), from local paths
or webdataset URLs. An image's span is planned from its header (size only, no pixels); its pixels are
decoded once, when its piece is placed in a row (a piece whose image turns out undecodable is dropped
there and counted in `skipped_bad_image`).

`PackedLoader` wraps the workers in a torch DataLoader. Every batch carries its worker's state after
producing it, so `state_dict()` is exact: restoring reproduces the following batches, re-reading only
each worker's current shard of each stream.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import random
import tarfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flashtrain.config.errors import DataError, InputNotFoundError
from flashtrain.data.config import DataConfig, TokenSpec, resolve_shards
from flashtrain.data.images import (
    IMAGE_START,
    TEXT,
    ImageDecodeError,
    ImageProcessorConfig,
    decode_problem,
    image_token_types,
    load_image,
    plan_image_size,
)
from flashtrain.data.shards import Document, ReadStats, is_url, read_shard, scan_shard
from flashtrain.data.sources import Source, default_sources

log = logging.getLogger(__name__)
IGNORE = -100
# 3: a cursor per shard, the layout's groups and row capacity (any layout resumes it: `relayout`); 2: per-source
# state by name (data.sources), one position per reader (read as 3: `cursors_of_state_v2`); 1: two unnamed streams
STATE_VERSION = 3
READABLE_VERSIONS = (2, 3)


@dataclass
class Piece:
    tokens: np.ndarray  # int64 ids
    types: np.ndarray  # int64 token types (TEXT -1 or an image type)
    images: list  # [(bytes, ext)] in order of appearance
    stream: int  # the index of its source in the run's source list
    pixels: list | None = field(default=None, repr=False, compare=False)  # decoded images, once placed in a row
    # where it comes from: (shard, document key, epoch, first position, end position) in the document's
    # `[BOS] + segments + [EOS]` positions (the data trace, `data.trace`); None for a piece made by hand
    origin: tuple | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def to_state(self) -> dict:
        return {"tokens": self.tokens, "types": self.types, "images": self.images, "stream": self.stream,
                "origin": self.origin}

    @classmethod
    def from_state(cls, s: dict, stream: int) -> "Piece":
        origin = s.get("origin")
        return cls(np.asarray(s["tokens"]), np.asarray(s["types"]), list(s["images"]), stream,
                   origin=None if origin is None else tuple(origin))


@dataclass
class Counters:
    documents: int = 0
    skipped_empty: int = 0
    skipped_bad_image: int = 0
    skipped_oversized_image: int = 0
    rows: int = 0
    pad_tokens: int = 0
    tokens: int = 0
    read: ReadStats = field(default_factory=ReadStats)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "read"}
        return {**d, **self.read.as_dict()}


def reader_group(rank: int, worker: int, n_workers: int) -> int:
    """Reader group g = rank * workers + worker: the unit that owns shards and seeds their order, so the
    same number of groups reads the same data however it is split into ranks and workers."""
    return rank * n_workers + worker


def split_shards(shards: list[str], rank: int, world: int, worker: int, n_workers: int) -> list[str]:
    return sorted(shards)[reader_group(rank, worker, n_workers)::world * n_workers]


def image_grid(data: bytes, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(n_llm_h, n_llm_w) of encoded image bytes from the image header alone (PIL reads the size without
    decoding pixels): the plan `load_image` will follow. Raises ImageDecodeError as decode_image would
    when the header cannot be read."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            width, height = im.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageDecodeError(f"cannot decode image ({len(data)} bytes): {decode_problem(e)}") from e
    n_h, n_w, _, _ = plan_image_size(width, height, cfg)
    return n_h, n_w


def decode_piece_images(piece: Piece, spec: TokenSpec) -> list:
    """The processed pixels of a piece's images, checked against the spans planned from their headers;
    raises ImageDecodeError if one cannot be decoded or does not match its span."""
    starts = np.flatnonzero(piece.types == IMAGE_START)
    out = []
    for (data, _), at in zip(piece.images, starts):
        img = load_image(data, spec.image)
        span = img.token_types().numpy()
        if not np.array_equal(piece.types[at:at + len(span)], span):
            raise ImageDecodeError(f"decoded image ({img.n_llm_h} x {img.n_llm_w} tokens) does not match the span "
                                   f"planned from its header")
        out.append(img.pixels)
    return out


def document_pieces(doc: Document, spec: TokenSpec, capacity: int, stream: int, counters: Counters,
                    where: tuple = (None, None, 0)) -> list[Piece]:
    """`[BOS] + segments + [EOS]` split into pieces of at most `capacity` positions; [] if skipped. `where`:
    (shard, document key, epoch) for the pieces' origins."""
    units: list[tuple[np.ndarray, np.ndarray, tuple | None]] = []
    has_content = False
    for seg in doc.segments:
        if seg[0] == "text":
            if len(seg[1]):
                has_content = True
                units.append((np.asarray(seg[1], dtype=np.int64), np.full(len(seg[1]), TEXT), None))
        else:
            try:
                n_h, n_w = image_grid(seg[1], spec.image)  # header only; pixels are decoded once, in a row
            except ImageDecodeError as e:
                counters.skipped_bad_image += 1
                log.warning("skipping a document with an undecodable image: %s", e)
                return []
            types = image_token_types(n_h, n_w).numpy()
            if len(types) > capacity:
                counters.skipped_oversized_image += 1
                log.warning("skipping a document whose image span (%d) exceeds a row (%d)", len(types), capacity)
                return []
            has_content = True
            units.append((np.full(len(types), spec.image_token_id, dtype=np.int64), types, (seg[1], seg[2])))
    if not has_content:
        counters.skipped_empty += 1
        return []
    counters.documents += 1
    units = ([(np.array([spec.bos_id]), np.array([TEXT]), None)] + units
             + [(np.array([spec.eos_id]), np.array([TEXT]), None)])
    return _cut(units, capacity, stream, where, 0)


def _cut(units: list[tuple[np.ndarray, np.ndarray, tuple | None]], capacity: int, stream: int, where: tuple,
         first: int) -> list[Piece]:
    """Consecutive units (text runs, which are cut anywhere, and whole image spans) packed into pieces of at
    most `capacity` positions; the pieces' origins count positions from `first`."""
    pieces: list[Piece] = []
    toks, types, imgs, size = [], [], [], 0
    at = first

    def close():
        nonlocal toks, types, imgs, size, at
        if size:
            pieces.append(Piece(np.concatenate(toks), np.concatenate(types), imgs, stream,
                                origin=(*where, at, at + size)))
            at += size
        toks, types, imgs, size = [], [], [], 0

    for t, y, img in units:
        if img is not None:  # an image span moves whole to the next piece when it does not fit
            if size + len(t) > capacity:
                close()
            toks.append(t)
            types.append(y)
            imgs.append(img)
            size += len(t)
            continue
        while len(t):  # text is cut anywhere
            take = min(len(t), capacity - size)
            if take == 0:
                close()
                continue
            toks.append(t[:take])
            types.append(y[:take])
            size += take
            t, y = t[take:], y[take:]
    close()
    return pieces


def resplit(piece: Piece, capacity: int, counters: Counters) -> list[Piece]:
    """A piece cut for a longer row, cut again for rows of `capacity` positions (a resume with a shorter
    `data.seq_len`): its text anywhere, its image spans whole; [] (counted in `skipped_oversized_image`,
    logged) when an image span of it is longer than a row."""
    if len(piece) <= capacity:
        return [piece]
    starts = list(np.flatnonzero(piece.types == IMAGE_START))
    units, i, images = [], 0, iter(piece.images)
    while i < len(piece):
        if piece.types[i] == IMAGE_START:
            nxt = [j for j in starts if j > i]
            end = i + 1
            while end < len(piece) and piece.types[end] >= 0 and (not nxt or end < nxt[0]):
                end += 1
            if end - i > capacity:
                counters.skipped_oversized_image += 1
                log.warning("dropping a piece whose image span (%d) exceeds the new row (%d)", end - i, capacity)
                return []
            units.append((piece.tokens[i:end], piece.types[i:end], next(images)))
        else:
            end = i
            while end < len(piece) and piece.types[end] == TEXT:
                end += 1
            units.append((piece.tokens[i:end], piece.types[i:end], None))
        i = end
    shard, key, epoch, first, _ = piece.origin if piece.origin is not None else (None, None, 0, 0, len(piece))
    return _cut(units, capacity, piece.stream, (shard, key, epoch), first)


class ShardStream:
    """Documents of one source for one reader group, epoch after epoch. The group owns the shards `shards`
    (the source's sorted shards i with i % groups == group, in index order: `split_shards`); where it
    stands is one cursor per owned shard, (epoch, samples read in it) -- the data position, the same
    whatever the layout: another split of the shards over readers reads each from its cursor. The group's
    epoch is the smallest of its shards' epochs; in it the group reads its shards that are not done yet in
    an order seeded by (`seed`, `tag`, epoch), each from its cursor's sample on. `tag`: the source's index
    when its stream first started (kept in the state, so a reordered source list reads on as before)."""

    def __init__(self, shards: list[str], tag: int, seed: str, counters: Counters, cursors: dict | None = None):
        self.shards, self.stream, self.seed, self.counters = shards, tag, seed, counters
        n = len(shards)
        cursors = cursors or {}
        self.epochs = np.array(cursors.get("epoch", np.zeros(n)), dtype=np.int32).reshape(n)
        self.skips = np.array(cursors.get("skip", np.zeros(n)), dtype=np.int32).reshape(n)
        self._reader, self._current = None, None
        self._empty_epochs, self._read_any = 0, False
        self._begin_epoch()

    def _begin_epoch(self) -> None:
        """The group's epoch: the smallest of its shards' (all done in the ones before)."""
        self.epoch = int(self.epochs.min()) if len(self.epochs) else 0
        self._order = list(range(len(self.shards)))
        random.Random(f"{self.seed}/{self.stream}/{self.epoch}").shuffle(self._order)
        self._pos = 0  # in `_order`: the shards before it are done in this epoch

    def state(self) -> dict:
        """The cursors: per owned shard (index order), its epoch and the samples read in it."""
        return {"epoch": self.epochs.copy(), "skip": self.skips.copy()}

    def next_document(self) -> tuple[Document, str, int]:
        """(document, its shard, its epoch)."""
        while True:
            if self._reader is None:
                while self._pos < len(self._order) and self.epochs[self._order[self._pos]] > self.epoch:
                    self._pos += 1  # done in this epoch (by this group, or by another layout's reader)
                if self._pos == len(self._order):
                    self._empty_epochs = 0 if self._read_any else self._empty_epochs + 1
                    self._read_any = False
                    if self._empty_epochs >= 2:
                        raise DataError(f"no readable document in the shards {self.shards} (two passes over them "
                                        f"gave none; each was logged): point the source's shards at webdataset "
                                        f"tars written by launch/prepare_data.py")
                    self._begin_epoch()
                    continue
                self._current = self._order[self._pos]
                self._reader = read_shard(self.shards[self._current], self.counters.read,
                                          int(self.skips[self._current]))
            j = self._current
            doc = next(self._reader, StopIteration)
            if doc is StopIteration:
                self._reader = None
                self.epochs[j], self.skips[j] = self.epoch + 1, 0
                continue
            self.skips[j] += 1
            if doc is not None:
                self._read_any = True
                return doc, self.shards[j], self.epoch


def cursors_of_state_v2(stream: dict, n: int, seed: str, tag: int) -> dict:
    """A version-2 stream state (epoch, position in the epoch's order, samples read in its shard) as the
    cursors of `ShardStream`: the shards before the position done in the epoch, the one at it partly."""
    epoch, pos, skip = stream["epoch"], stream["pos"], stream["skip"]
    order = list(range(n))
    random.Random(f"{seed}/{tag}/{epoch}").shuffle(order)
    epochs, skips = np.full(n, epoch, dtype=np.int32), np.zeros(n, dtype=np.int32)
    epochs[order[:pos]] = epoch + 1
    if pos < n:
        skips[order[pos]] = skip
    return {"epoch": epochs, "skip": skips}


class WorkerPipeline:
    """Mixing + splitting + best-fit packing for one (rank, worker). `shards[i]`: this worker's shards
    of `sources[i]` ([] leaves the source out of this worker)."""

    def __init__(self, cfg: DataConfig, spec: TokenSpec, sources: list[Source], shards: list[list[str]], seed: str,
                 state: dict | None = None):
        self.cfg, self.spec = cfg, spec
        self.capacity = cfg.seq_len + 1
        self.names = [s.name for s in sources]
        self.weights = [s.weight for s in sources]
        state = state or {}
        self.counters = Counters()
        if "counters" in state:
            c = dict(state["counters"])
            # the corrupt shards by name (a state from before names: as many placeholders as it counted)
            corrupt = state.get("corrupt_shards_found", [f"{seed}#{i}" for i in range(c["corrupt_shards"])])
            self.counters = Counters(**{k: v for k, v in c.items() if k not in ("corrupt_shards", "bad_samples")},
                                     read=ReadStats(c["bad_samples"], set(corrupt)))
        saved = state.get("sources", {})
        same_weights = state.get("weights") == dict(zip(self.names, self.weights))
        self.tags = [saved[n]["tag"] if n in saved else i for i, n in enumerate(self.names)]
        self.streams = [ShardStream(sh, self.tags[i], seed, self.counters, self._cursors(saved.get(n), sh, seed, i))
                        if sh else None for i, (n, sh) in enumerate(zip(self.names, shards))]
        # the emitted tokens the mix compares; they restart with changed weights (the new shares hold from then)
        self.mix_tokens = [saved[n]["mix_tokens"] if n in saved and same_weights else 0 for n in self.names]
        self._shas = [_names_sha(sh) if sh else None for sh in shards]  # (a constant of the group's shards)
        self.pending = [deque(Piece.from_state(p, i) for p in saved.get(n, {}).get("pending", []))
                        for i, n in enumerate(self.names)]
        self.buffers = [[Piece.from_state(p, i) for p in saved.get(n, {}).get("buffer", [])]
                        for i, n in enumerate(self.names)]

    def _cursors(self, saved: dict | None, shards: list[str], seed: str, i: int) -> dict | None:
        """The saved cursors of a source's shards here (a version-2 state's stream position converted); None
        (from their start) for a new source, or when its shards are not the ones the cursors were saved for
        (said once: the shard list of a source changed)."""
        if not saved:
            return None
        if "cursors" not in saved:  # version 2: one position in the epoch's order
            return None if saved.get("stream") is None else cursors_of_state_v2(saved["stream"], len(shards), seed,
                                                                                  self.tags[i])
        if saved.get("shards_sha") not in (None, _names_sha(shards)):
            log.warning("data source %s: its shards are not the ones of the checkpoint; reading them from the start "
                        "(the data position is per shard)", self.names[i])
            return None
        return saved["cursors"]

    def state(self) -> dict:
        return {"weights": dict(zip(self.names, self.weights)), "counters": self.counters.as_dict(),
                "corrupt_shards_found": sorted(self.counters.read.corrupt),
                "sources": {n: {"tag": self.tags[i], "cursors": self.streams[i].state() if self.streams[i] else None,
                                "shards_sha": self._shas[i], "mix_tokens": self.mix_tokens[i],
                                "pending": [p.to_state() for p in self.pending[i]],
                                "buffer": [p.to_state() for p in self.buffers[i]]}
                            for i, n in enumerate(self.names)}}

    def _behind(self) -> int:
        """The source furthest behind its weight in emitted tokens (smallest tokens / weight, compared
        exactly as products; ties go to the earlier source)."""
        present = [s for s, st in enumerate(self.streams) if st is not None] or [0]
        best = present[0]
        for s in present[1:]:
            if self.mix_tokens[s] * self.weights[best] < self.mix_tokens[best] * self.weights[s]:
                best = s
        return best

    def _refill(self) -> None:
        """Keep each present source's share of the packing buffer full."""
        share = max(1, self.cfg.pack_buffer // sum(1 for st in self.streams if st is not None))
        for s, stream in enumerate(self.streams):
            if stream is None:
                continue
            while len(self.buffers[s]) < share:
                while not self.pending[s]:
                    doc, shard, epoch = stream.next_document()
                    self.pending[s].extend(document_pieces(doc, self.spec, self.capacity, s, self.counters,
                                                           (shard, doc.key, epoch)))
                self.buffers[s].append(self.pending[s].popleft())

    def next_row(self) -> list[Piece]:
        row, room = [], self.capacity
        while room:
            self._refill()
            if not row:  # open with the oldest piece of the stream that is behind the mix ratio
                s, i = self._behind(), 0
            else:  # then best fit: the largest buffered piece that fits
                s, i, size = -1, -1, 0
                for bs, buf in enumerate(self.buffers):
                    for j, p in enumerate(buf):
                        if size < len(p) <= room:
                            s, i, size = bs, j, len(p)
                if s < 0:
                    break
            piece = self.buffers[s].pop(i)
            if piece.images:
                try:
                    piece.pixels = decode_piece_images(piece, self.spec)
                except ImageDecodeError as e:  # the header read, the pixels do not: drop the piece
                    self.counters.skipped_bad_image += 1
                    log.warning("dropping a piece with an undecodable image: %s", e)
                    continue
            row.append(piece)
            room -= len(piece)
            self.mix_tokens[s] += len(piece)
        self.counters.rows += 1
        self.counters.pad_tokens += room
        self.counters.tokens += self.capacity
        return row

    def next_batch(self) -> dict:
        return collate([self.next_row() for _ in range(self.cfg.batch_size)], self.spec, self.cfg.seq_len,
                       len(self.names))


def _names_sha(shards: list[str]) -> str:
    return hashlib.sha256("\n".join(shards).encode()).hexdigest()[:16]


def collate(rows: list[list[Piece]], spec: TokenSpec, seq_len: int, n_sources: int = 2) -> dict:
    """Rows of pieces -> the training batch (inputs are positions 0..S-1, labels 1..S). Per source (the
    pieces' `stream`): `stream_tokens` [B, n_sources] its positions per row, `label_sources` [B, S] the
    source of each label position's target, `source_targets` [n_sources] its scored labels. `trace`: per
    row, (source index, origin) of each piece in row order (the data trace, `data.trace`)."""
    L = seq_len + 1
    B = len(rows)
    tokens = torch.full((B, L), spec.pad_id, dtype=torch.long)
    types = torch.full((B, L), TEXT, dtype=torch.long)
    pad = torch.ones(B, L, dtype=torch.bool)
    source = torch.zeros(B, L, dtype=torch.long)
    stream_tokens = torch.zeros(B, n_sources, dtype=torch.long)
    images: list[list[torch.Tensor]] = []
    for b, row in enumerate(rows):
        at, row_images = 0, []
        for p in row:
            n = len(p)
            tokens[b, at:at + n] = torch.from_numpy(p.tokens)
            types[b, at:at + n] = torch.from_numpy(p.types)
            pad[b, at:at + n] = False
            source[b, at:at + n] = p.stream
            stream_tokens[b, p.stream] += n
            row_images += (p.pixels if p.pixels is not None
                           else [load_image(data, spec.image).pixels for data, _ in p.images])
            at += n
        images.append(row_images)
    labels = tokens[:, 1:].clone()
    labels[pad[:, 1:] | (types[:, 1:] >= 0)] = IGNORE
    label_sources = source[:, 1:].clone()
    return {"tokens": tokens[:, :-1], "labels": labels, "token_types": types[:, :-1], "images": images,
            "stream_tokens": stream_tokens, "pad_tokens": int(pad.sum()), "label_sources": label_sources,
            "source_targets": torch.bincount(label_sources[labels != IGNORE], minlength=n_sources),
            "trace": [[(p.stream, p.origin) for p in row] for row in rows]}


def _identity(x):
    return x


class _PackedIterable(torch.utils.data.IterableDataset):
    def __init__(self, cfg, spec, sources, rank, world, states, first_worker):
        super().__init__()
        self.cfg, self.spec, self.sources = cfg, spec, sources
        self.rank, self.world, self.states, self.first_worker = rank, world, states, first_worker

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        n = max(1, self.cfg.num_workers)
        logical = ((info.id if info else 0) + self.first_worker) % n
        pipe = WorkerPipeline(self.cfg, self.spec, self.sources,
                              [split_shards(list(s.shards), self.rank, self.world, logical, n) for s in self.sources],
                              f"{self.cfg.seed}/{reader_group(self.rank, logical, n)}", self.states.get(logical))
        while True:
            batch = pipe.next_batch()
            batch["_worker"], batch["_state"] = logical, pipe.state()
            yield batch


class PackedLoader:
    """Infinite iterator of packed batches for one data-parallel rank, with exact state_dict(), mixing
    `sources` (data/sources.py; `default_sources(text, mm, mix)` for the two unnamed streams).
    `worker_init_fn(worker_id)` runs first in each loader worker (the trainer binds its workers' lives to
    its own: train/runtime/run_guard.py `die_with_parent`)."""

    def __init__(self, cfg: DataConfig, spec: TokenSpec, sources: list[Source], rank: int = 0, world: int = 1,
                 state: dict | None = None, worker_init_fn=None, known_corrupt: set[str] | frozenset = frozenset()):
        self.cfg, self.spec, self.rank, self.world = cfg, spec, rank, world
        self.worker_init_fn = worker_init_fn
        self.known_corrupt = set(known_corrupt)  # this rank's shards the start-up check found unreadable
        self.sources = list(sources)
        if not any(s.shards for s in self.sources):
            raise DataError("no shards: set data.sources (or data.text_shards / data.mm_shards), or leave them null "
                            "for the default corpus")
        check_workers(cfg, {s.setting: len(s.shards) for s in self.sources}, world)
        self.worker_states: dict[int, dict] = {}
        self.next_worker = 0
        if state is not None:
            self.load_state_dict(state)
        self._it = None

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "rank": self.rank, "world": self.world,
                "num_workers": max(1, self.cfg.num_workers), "capacity": self.cfg.seq_len + 1,
                "worker_states": dict(self.worker_states), "next_worker": self.next_worker}

    def same_layout(self, state: dict) -> bool:
        """Was `state` (this data-parallel rank's) saved by this layout: the same readers x workers and row
        capacity? Then it resumes exactly (`load_state_dict(state)`); else every rank's state is needed."""
        _check_version(state)
        return (state["world"], state["num_workers"], state.get("capacity", self.cfg.seq_len + 1)) == (
            self.world, max(1, self.cfg.num_workers), self.cfg.seq_len + 1)

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """`state`: this rank's, saved by this layout (`same_layout`): every batch that follows is the one the
        saved run would have read. A list: every data-parallel rank's state, saved by any layout (another
        number of readers or workers, another `data.seq_len`): the data position re-split over this one
        (`relayout`): each document read once, the ones in flight included."""
        n = max(1, self.cfg.num_workers)
        if isinstance(state, list):
            mine = [s for s in state if s.get("rank") == self.rank]
            if mine and len(state) == self.world and self.same_layout(mine[0]):
                return self.load_state_dict(mine[0])
            groups = relayout(state, self.sources, self.world * n, self.cfg.seq_len + 1, self.cfg.seed)
            self.worker_states = {w: groups[reader_group(self.rank, w, n)] for w in range(n)}
            self.next_worker = 0
        else:
            if not self.same_layout(state):
                raise DataError(f"data loader state was saved with {state['world']} rank(s) x "
                                f"{state['num_workers']} worker(s), rows of {state.get('capacity', '?')} positions; "
                                f"this run has {self.world} x {n}, rows of {self.cfg.seq_len + 1}: resume it from "
                                f"every rank's state (a list)")
            self.worker_states = dict(state["worker_states"])
            self.next_worker = state["next_worker"]
        self._it = None
        self._log_source_changes()

    def _log_source_changes(self) -> None:
        """A resume with other weights or sources than the state's: allowed, said once (rank 0)."""
        if self.rank != 0 or not self.worker_states:
            return
        saved = next(iter(self.worker_states.values()))["weights"]
        now = {s.name: s.weight for s in self.sources}
        if saved == now:
            return
        added, removed = sorted(set(now) - set(saved)), sorted(set(saved) - set(now))
        log.warning("data sources changed at this resume: weights %s -> %s. Every kept source reads on from its "
                    "position; the mix counts restart here, so the new weights' shares hold from now on%s%s",
                    saved, now, f"; added (from their start): {', '.join(added)}" if added else "",
                    f"; removed: {', '.join(removed)}" if removed else "")

    def counters(self) -> dict:
        """Skipped/corrupt/padding counts summed over this rank's workers (cumulative); `corrupt_shards`:
        the distinct shards found unreadable, by the start-up check (`known_corrupt`) or while reading."""
        total: dict = {}
        corrupt = set(self.known_corrupt)
        for w, s in self.worker_states.items():
            for k, v in s["counters"].items():
                total[k] = total.get(k, 0) + v
            old = [f"worker {w} #{i}" for i in range(s["counters"].get("corrupt_shards", 0))]  # a state before names
            corrupt.update(s.get("corrupt_shards_found", old))
        total["corrupt_shards"] = len(corrupt)
        return total

    def close(self) -> None:
        """Stop the workers (a new iterator starts them again from the state)."""
        self._it = None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._it is None:
            ds = _PackedIterable(self.cfg, self.spec, self.sources, self.rank, self.world, self.worker_states,
                                 self.next_worker)
            # its own generator: the iterator then draws its worker seeds from it, not from the global torch
            # RNG, which is the training's (checkpointed) and must not depend on when the loader first ran
            self._it = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=self.cfg.num_workers,
                                                        collate_fn=_identity, worker_init_fn=self.worker_init_fn,
                                                        generator=torch.Generator().manual_seed(0)))
        batch = next(self._it)
        w = batch.pop("_worker")
        self.worker_states[w] = batch.pop("_state")
        self.next_worker = (w + 1) % max(1, self.cfg.num_workers)
        return batch


def _check_version(state: dict) -> None:
    if state.get("version", 1) not in READABLE_VERSIONS:
        raise DataError(f"data loader state version {state.get('version', 1)} (written before data.sources had "
                        f"names); this flashtrain reads versions {', '.join(map(str, READABLE_VERSIONS))}: resume that "
                        f"run with the flashtrain that wrote it, or start from its weights (train.resume_from with a "
                        f"weights-only checkpoint)")


def relayout(states: list[dict], sources: list[Source], groups: int, capacity: int, seed: int) -> dict[int, dict]:
    """The data position of every reader of a checkpoint (`states`: each data-parallel rank's loader state,
    any layout) re-split over `groups` reader groups (data-parallel ranks x workers) with rows of `capacity`
    positions: {group: its WorkerPipeline state}. Per source:
    - the cursors of every shard (each old group's owned shards) go to the shard's owner in the new split
      (`split_shards`: shard i to group i % groups), so each reads its shards on from where they stood;
    - the documents in flight (pieces read but not yet placed in a row: every old group's packing buffer
      and pending pieces, cut again for a shorter row, `resplit`) are dealt to the new groups in turn and
      placed before anything new is read;
    - the tokens each group emitted for the mix are shared out evenly (the mix's shares hold on);
    and the loader's counters (skips) go to group 0, the corrupt shards found to their new owners, so the
    run's totals continue. A group that never delivered a batch (no state) had read nothing."""
    old: dict[int, dict] = {}
    old_groups = None
    for st in states:
        _check_version(st)
        n_w = st["num_workers"]
        old_groups = st["world"] * n_w
        for w, gs in st["worker_states"].items():
            old[reader_group(st["rank"], int(w), n_w)] = gs
    counters = Counters()
    totals: dict = {}
    for gs in old.values():
        for k, v in gs["counters"].items():
            totals[k] = totals.get(k, 0) + v
    any_state = next(iter(old.values()), {})
    weights = any_state.get("weights", {s.name: s.weight for s in sources})
    out = {g: {"weights": weights, "counters": {}, "corrupt_shards_found": [], "sources": {}} for g in range(groups)}
    for i, source in enumerate(sources):
        shards = sorted(source.shards)
        n = len(shards)
        epochs, skips = np.zeros(n, dtype=np.int32), np.zeros(n, dtype=np.int32)
        tag, mix, pieces = i, 0, []
        for g in sorted(old):
            saved = old[g].get("sources", {}).get(source.name)
            if not saved:
                continue
            tag = saved["tag"]
            mix += saved["mix_tokens"]
            pieces += [Piece.from_state(p, i) for p in saved["buffer"] + saved["pending"]]
            owned = np.arange(g, n, old_groups)
            cursors = saved.get("cursors")
            if "cursors" not in saved and saved.get("stream") is not None:  # version 2
                cursors = cursors_of_state_v2(saved["stream"], len(owned), f"{seed}/{g}", tag)
            if cursors is None:
                continue
            if len(cursors["epoch"]) != len(owned) or saved.get("shards_sha") not in (
                    None, _names_sha(shards[g::old_groups])):
                log.warning("data source %s: its shards are not the ones of the checkpoint; reading them from the "
                            "start (the data position is per shard)", source.name)
                continue
            epochs[owned], skips[owned] = cursors["epoch"], cursors["skip"]
        pieces = [q for p in pieces for q in resplit(p, capacity, counters)]
        for g in range(groups):
            owned = np.arange(g, n, groups)
            out[g]["sources"][source.name] = {
                "tag": tag, "cursors": {"epoch": epochs[owned], "skip": skips[owned]},
                "shards_sha": _names_sha(shards[g::groups]) if len(owned) else None,
                "mix_tokens": mix // groups + (g < mix % groups),
                "pending": [p.to_state() for p in pieces[g::groups]], "buffer": []}
    totals["skipped_oversized_image"] = totals.get("skipped_oversized_image", 0) + counters.skipped_oversized_image
    out[0]["counters"] = totals
    owner = {shard: k % groups for source in sources for k, shard in enumerate(sorted(source.shards))}
    for name in sorted({c for gs in old.values() for c in gs.get("corrupt_shards_found", [])}):
        out[owner.get(name, 0)]["corrupt_shards_found"].append(name)
    for g in out:  # the counters as Counters.as_dict() has them, zero where nothing was counted
        out[g]["counters"] = {**Counters().as_dict(), **out[g]["counters"]}
        out[g]["counters"]["corrupt_shards"] = len(out[g]["corrupt_shards_found"])
    return out


def reader_shards(sources: list[Source], rank: int, world: int, num_workers: int) -> list[str]:
    """The shards data-parallel rank `rank` of `world` reads, over its workers and every source."""
    n = max(1, num_workers)
    return [shard for s in sources for w in range(n) for shard in split_shards(list(s.shards), rank, world, w, n)]


def check_shard_indexes(shards: list[str]) -> dict[str, str]:
    """The start-up check of the shards a rank will read: {shard: what is wrong} for each local one whose
    tar index cannot be walked to a clean end (data/shards.py `scan_shard`: headers only). Such a shard is
    not an error: the loader reads its complete samples, logs it and counts it in `corrupt_shards`."""
    return {s: problem for s in shards if (problem := scan_shard(s)) is not None}


def check_workers(cfg: DataConfig, counts: dict[str, int], readers: int) -> None:
    """Every shard of a source is read by one (rank, worker): fewer shards than readers x workers would
    leave a reader without data (or duplicate shards)."""
    n = max(1, cfg.num_workers)
    for name, count in counts.items():
        if count and count < readers * n:
            most = count // readers
            fix = f"data.num_workers={most} or fewer" if most >= 1 else "fewer data-parallel ranks"
            raise DataError(f"data.num_workers={cfg.num_workers}: data.{name} has {count} shard(s), which cannot feed "
                            f"{readers} data-parallel rank(s) x {n} worker(s) without duplicates; use {fix}, or write "
                            f"more, smaller shards")


def _tar_problem(path: str) -> str | None:
    """None when `path` opens as a tar (compressed or not) with at least one member; else what is wrong."""
    try:
        with tarfile.open(path, mode="r|*") as tar:
            return None if next(iter(tar), None) is not None else "an empty tar"
    except (tarfile.TarError, EOFError, OSError) as e:
        return f"not a tar file ({type(e).__name__}: {e})"


def configured_sources(cfg: DataConfig) -> list[Source]:
    """The configured sources with their shard patterns resolved (a pattern matching nothing is an
    error): `data.sources`, or `data.text_shards` / `data.mm_shards` weighted `data.mix`. Not for the
    default corpus (`cfg.default_corpus`)."""
    if cfg.sources is not None:
        return [Source(s.name, tuple(resolve_shards(s.shards, f"sources[{s.name}].shards")), s.weight, s.modality,
                       f"sources[{s.name}].shards") for s in cfg.sources]
    text, mm = resolve_shards(cfg.text_shards, "text_shards"), resolve_shards(cfg.mm_shards, "mm_shards")
    if not text and not mm:
        raise DataError("data.text_shards and data.mm_shards are both empty; give shards or set both to null "
                        "for the default corpus")
    return default_sources(text, mm, cfg.mix)


def _configured_tokenizer(cfg: DataConfig, sources: list[Source]) -> str:
    """`data.tokenizer`, or the one the shards were written with: each local shard folder's manifest.json
    names its tokenizer (launch/prepare_data.py writes both; a folder without a manifest: tokenizer.json
    beside its shards). Folders that name different tokenizers (other content) are an error naming them;
    shards that are all URLs need `data.tokenizer`."""
    if cfg.tokenizer is not None:
        if not Path(cfg.tokenizer).is_file():
            raise InputNotFoundError(f"tokenizer {cfg.tokenizer!r} not found; set data.tokenizer to the tokenizer.json "
                                     f"written by launch/prepare_data.py")
        return cfg.tokenizer
    shards = [s for source in sources for s in source.shards]
    local = [s for s in shards if not is_url(s)]
    if not local:
        raise DataError(f"data.tokenizer is not set and the shards are URLs ({shards[0]!r}); set data.tokenizer "
                        f"to a local copy of the tokenizer.json written by launch/prepare_data.py")
    folders = list(dict.fromkeys(Path(s).parent for s in local))
    found = {folder: tok for folder in folders if (tok := _folder_tokenizer(folder)) is not None}
    if not found:
        raise InputNotFoundError(f"no tokenizer beside the shards (no manifest.json naming one, no tokenizer.json in "
                                 f"{', '.join(map(str, folders))}); set data.tokenizer to the tokenizer.json "
                                 f"written by launch/prepare_data.py")
    by_content: dict[str, list[Path]] = {}
    for tok in found.values():
        by_content.setdefault(hashlib.sha256(tok.read_bytes()).hexdigest(), []).append(tok)
    if len(by_content) > 1:
        raise DataError("the shards come from folders with different tokenizers ("
                        + ", ".join(str(toks[0]) for toks in by_content.values())
                        + "): tokens written with one mean other words under another; set data.tokenizer to the "
                          "one the shards were written with, or write every source with one tokenizer "
                          "(launch/prepare_data.py --tokenizer, or --name SOURCE into one directory)")
    return str(next(iter(found.values())))


def _folder_tokenizer(folder: Path) -> Path | None:
    """The tokenizer a shard folder's manifest.json names, else its tokenizer.json; None if neither."""
    name = _manifest(folder).get("tokenizer")
    for path in ([folder / name] if isinstance(name, str) else []) + [folder / "tokenizer.json"]:
        if path.is_file():
            return path
    return None


WRITTEN_FOR = "written_for"  # manifest.json: the model the shards were tokenized for (launch/prepare_data.py)


def check_tokenizer_fits(cfg: DataConfig, sources: list[Source], spec: TokenSpec) -> None:
    """The tokenizer the shards were written with (`data.tokenizer`, or the one beside them) is this model's:
    shards written for another exp (another vocabulary, other special ids) are refused before anything is
    built, naming the model they were written for (manifest.json `written_for`) and the run's."""
    from flashtrain.data.tokenizer import load_tokenizer, tokenizer_mismatch

    path = _configured_tokenizer(cfg, sources)
    if is_url(path):
        return
    problem = tokenizer_mismatch(load_tokenizer(path), spec)
    if problem is None:
        return
    written = _manifest(Path(path).parent).get(WRITTEN_FOR)
    made = " ".join(written["overrides"]) if isinstance(written, dict) and written.get("overrides") else None
    origin = f"the shards were written with launch/prepare_data.py {made}" if made else \
        "the shards were written for another model config"
    raise DataError(f"{'data.tokenizer' if cfg.tokenizer is not None else 'the tokenizer beside the shards'} {path} "
                    f"does not fit this run's model ({problem}): {origin}; write them again with this run's +exp and "
                    f"model overrides (python launch/prepare_data.py OUT_DIR +exp=NAME --text ...)"
                    + (f", or train with {made}" if made else ""))


def _manifest(folder: Path) -> dict:
    """A shard folder's manifest.json as a dict ({} when absent or unreadable)."""
    try:
        found = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def check_sources(cfg: DataConfig, readers: int, spec: TokenSpec) -> None:
    """The start-up checks of the configured data, before any process group, model or corpus exists: the
    shard patterns match files, the lists are not all empty, the tokenizer exists and is this model's
    (`check_tokenizer_fits`: shards written for another exp are refused), the shards can feed
    `readers` data-parallel ranks x `data.num_workers`, and each source has at least one local shard that
    opens as a tar (a broken shard among good ones is logged and skipped while reading; none readable
    would stop the run only once it has started). The default corpus (no shards configured) has
    `data.corpus_shards` shards per stream."""
    if cfg.tokenizer is not None and not is_url(cfg.tokenizer) and not Path(cfg.tokenizer).is_file():
        raise InputNotFoundError(f"data.tokenizer={cfg.tokenizer!r} does not exist; set it to the tokenizer.json "
                                 f"written by launch/prepare_data.py, or to null for the one beside the shards (or "
                                 f"the default corpus's)")
    if cfg.default_corpus:
        check_workers(cfg, {"corpus_shards": cfg.corpus_shards}, readers)
        return
    sources = configured_sources(cfg)
    check_workers(cfg, {s.setting: len(s.shards) for s in sources}, readers)
    for source in sources:
        if not source.shards or any(is_url(s) for s in source.shards):
            continue  # a URL is opened (its command run) only when read
        problems = []
        for shard in source.shards:
            if (problem := _tar_problem(shard)) is None:
                break
            problems.append(problem)
        else:
            raise DataError(f"data.{source.setting}: none of its {len(source.shards)} shard(s) can be read "
                            f"({source.shards[0]!r}: {problems[0]}); point it at webdataset tars written by "
                            f"launch/prepare_data.py")
    check_tokenizer_fits(cfg, sources, spec)


def data_sources(cfg: DataConfig, spec: TokenSpec) -> tuple[list[Source], str]:
    """(sources, tokenizer.json) for a run: the configured sources (missing paths are an error now, not
    mid-run), or the default corpus's two, built on first use."""
    from flashtrain.data.corpus import corpus_shards, ensure_default_corpus

    if cfg.default_corpus:
        text, mm, tok = corpus_shards(ensure_default_corpus(cfg, spec))
        return default_sources(text, mm, cfg.mix), tok
    sources = configured_sources(cfg)
    return sources, _configured_tokenizer(cfg, sources)


def heldout_shards(cfg: DataConfig, spec: TokenSpec) -> list[str]:
    """The held-out shards of a run (data/heldout.py): `data.val_shards`, or with it null the default
    corpus's held-out part when the run trains on the default corpus; [] when it has none."""
    from flashtrain.data.corpus import corpus_val_shards, ensure_default_corpus

    if cfg.val_shards is not None:
        return resolve_shards(cfg.val_shards, "val_shards")
    if cfg.default_corpus:
        return corpus_val_shards(ensure_default_corpus(cfg, spec))
    return []
