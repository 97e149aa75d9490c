"""Best-fit packing (data/loader.py `WorkerPipeline.next_row`, DESIGN.md "Data"): a row opens with the
oldest piece of the stream behind the mix ratio, then takes the largest buffered piece that fits the
remaining room -- a piece that fits exactly included -- until none fits; the rest is PAD."""

import numpy as np

from flashtrain.data.config import DataConfig
from flashtrain.data.images import TEXT
from flashtrain.data.loader import Piece, WorkerPipeline
from flashtrain.data.sources import default_sources
from flashtrain.train.config import token_spec


def piece(n: int, first: int) -> Piece:
    return Piece(np.arange(first, first + n, dtype=np.int64), np.full(n, TEXT, dtype=np.int64), [], 0)


def test_best_fit_takes_an_exact_fit(tiny_cfg):
    # rows of seq_len + 1 = 10 positions; no shards: only the pieces placed in the buffer by hand
    w = WorkerPipeline(DataConfig(seq_len=9, batch_size=1), token_spec(tiny_cfg), default_sources([], []), [[], []],
                       seed="0")
    w.buffers[0] = [piece(4, 100), piece(6, 200), piece(5, 300), piece(3, 400)]
    w._refill = lambda: None  # no stream to refill from: the rule sees exactly these four pieces
    # row 1, worked by hand: opens with the oldest (4), room 6; the largest piece <= 6 is the 6 (exact)
    row = w.next_row()
    assert [int(p.tokens[0]) for p in row] == [100, 200] and w.counters.pad_tokens == 0
    # row 2: opens with the oldest left (5), room 5; 3 fits (room 2); nothing left: 2 PAD
    row = w.next_row()
    assert [int(p.tokens[0]) for p in row] == [300, 400] and w.counters.pad_tokens == 2
    assert w.counters.rows == 2 and w.counters.tokens == 20
