"""Numbers of the step record (train/trainer.py `train_step`) on hand-built micro-batches: rows of pieces
from two data sources with PAD and image positions, collated as the loader does (data/loader.py), run
through the local step runner (train/step_runner.py) on a stand-in model whose hidden states the test can
recompute, read as the trainer reads them (train/step_values.py):

- `per_source[name].loss`: that source's cross-entropy over its scored labels only, against a literal
  log-softmax over exactly the label positions worked out here from the rows (a label is the next
  token; PAD and image targets are not scored; a label belongs to the source of its target token);
- `padding_fraction`: the PAD positions over all B x (seq_len + 1) positions of the packed rows.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flashtrain.data.config import TokenSpec
from flashtrain.data.images import TEXT
from flashtrain.data.loader import Piece, collate
from flashtrain.train.runtime.collectives import Operation
from flashtrain.train.step_runner import LocalRunner
from flashtrain.train.step_values import source_fields

V, D, S = 32, 8, 12  # vocabulary, hidden width, seq_len: rows of S + 1 = 13 positions
SPEC = TokenSpec(vocab_size=V, bos_id=0, eos_id=1, pad_id=2, image_token_id=31)
I = SPEC.image_token_id  # noqa: E741 - an image position
WEB, CAPS = 0, 1  # the two sources' stream indices; a third, `empty`, has no shards


def piece(tokens, stream):
    """A piece as document_pieces makes them: image positions carry the image token and an image type."""
    types = np.array([0 if t == I else TEXT for t in tokens], np.int64)
    n_images = int(any(t == I for t in tokens))
    return Piece(np.array(tokens, np.int64), types, [(b"png", "png")] * n_images, stream,
                 pixels=[torch.zeros(3, 14, 14)] * n_images)  # placed pixels: collate decodes nothing


# two micro-batches of two rows each (micro-batch, row) -> pieces in order; the rest of a row is PAD
ROWS = [
    [[piece([0, 5, 6, 7, 8], WEB), piece([0, 9, I, I, I, 10, 11], CAPS)],  # 12 positions: 1 PAD
     [piece([0, I, I, 12, 13], CAPS), piece([0, 14, 15], WEB)]],  # 8: 5 PAD
    [[piece([0, *range(16, 28)], WEB)],  # 13: none
     [piece([0, I, 28], CAPS)]],  # 3: 10 PAD
]


class StandIn(torch.nn.Module):
    """An embedding and a head: the hidden state of a position is its token's embedding."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed, self.head = torch.nn.Embedding(V, D), torch.nn.Linear(D, V, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(V, D, generator=g))
            self.head.weight.copy_(torch.randn(V, D, generator=g))

    def run(self, tokens, types, images, stats, aux_grad_scale=1.0, routes=None):
        return self.embed(tokens)

    def final_hidden(self, h):
        return h

    def sequence_split(self, seq_len):
        return None


class NoReduction:
    def zero_grad(self):
        pass

    def mark_final(self):
        pass

    def finish(self):
        pass


def step_values(model):
    batches = [collate(rows, SPEC, S, n_sources=3) for rows in ROWS]
    runner = LocalRunner(model, NoReduction(), accumulation=len(batches), device=torch.device("cpu"),
                         loss_tile_tokens=7, mixed_precision=False, counts_data=True, op=Operation(),
                         micro_batches=len(batches))  # one rank: the global batch's micro-batches are its own
    sums, _ = runner.run(batches)
    return sums.read()


def test_per_source_loss_is_the_mean_ce_of_its_scored_labels_only():
    model = StandIn()
    v = step_values(model)
    ce, n, means = [0.0, 0.0], [0, 0], []
    with torch.no_grad():
        for rows in ROWS:
            ce_before, n_before = sum(ce), sum(n)
            for row in rows:
                tokens = [t for p in row for t in p.tokens.tolist()]
                source = [p.stream for p in row for _ in p.tokens]
                inputs = (tokens + [SPEC.pad_id] * (S + 1 - len(tokens)))[:S]
                logp = torch.log_softmax(model.head(model.embed(torch.tensor(inputs))).double(), -1)
                for t in range(S):
                    if t + 1 < len(tokens) and tokens[t + 1] != I:  # a token follows, and it is not an image's
                        ce[source[t + 1]] -= logp[t, tokens[t + 1]].item()
                        n[source[t + 1]] += 1
            means.append((sum(ce) - ce_before) / (sum(n) - n_before))  # this micro-batch's mean CE
    # by hand, the scored labels: web 4 + 3 + 12, caps 4 (BOS, 9, 10, 11) + 2 (12, 13) + 1 (28)
    assert n == [19, 7]
    # the step's loss: the mean over its 2 micro-batches of each one's mean CE (each scaled by 1 / 2 for the
    # backward, and back for the record)
    assert v["loss"] == pytest.approx(sum(means) / 2, rel=1e-6)
    seen = {"web": 100}
    sources = [SimpleNamespace(name="web", shards=["w.tar"]), SimpleNamespace(name="caps", shards=["c.tar"]),
               SimpleNamespace(name="empty", shards=[])]
    got = source_fields(sources, v, seen)
    assert got.keys() == {"web", "caps"}  # a source without shards is not reported
    assert got["web"]["loss"] == pytest.approx(ce[WEB] / 19, rel=1e-6)
    assert got["caps"]["loss"] == pytest.approx(ce[CAPS] / 7, rel=1e-6)
    # positions read: web 5 + 3 + 13, caps 7 + 5 + 3, added to the run's running count
    assert (got["web"]["tokens_seen"], got["caps"]["tokens_seen"]) == (100 + 21, 15)
    assert seen == {"web": 121, "caps": 15}


def test_padding_fraction_is_pad_over_all_positions_of_the_packed_rows():
    v = step_values(StandIn())
    # PAD by hand: 1 + 5 in the first micro-batch, 0 + 10 in the second, over 2 x 2 rows x (12 + 1) positions
    assert v["padding_fraction"] == 16 / 52
