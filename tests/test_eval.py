"""Held-out evaluation (train/evaluation/heldout.py, data/heldout.py) against independent references: the UTF-8
length of text, a literal log-softmax, hand-counted shares and sums. The trainer and layout parity
of the eval records are in tests/test_trainer.py, the command in tests/test_launch.py."""

import io
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from flashtrain.data.config import DataConfig, TokenSpec
from flashtrain.data.heldout import collate_labels, heldout_set
from flashtrain.data.images import ImageProcessorConfig
from flashtrain.data.loader import IGNORE, collate
from flashtrain.data.shards import Document, write_shards
from flashtrain.data.tokenizer import token_byte_counts, train_tokenizer
from flashtrain.train.evaluation.heldout import EvalConfig, Evaluator, eval_record
from flashtrain.train.loss import heldout_sums
from flashtrain.train.metrics import resumed_lines

SPEC = TokenSpec(vocab_size=400, image_token_id=390,
                 image=ImageProcessorConfig(patch_size=14, downsample_ratio=3, max_n_token=64, min_pixels=84 * 84))
TEXTS = ["def f(x):\n    return x * 2\n", "größe = 'ünïcode ✓'\n", "for i in range(10):\n    print(i)\n"] * 5


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, SPEC)


def test_token_bytes_add_up_to_the_utf8_length(tok):
    nbytes = token_byte_counts(tok, SPEC.vocab_size)
    for text in ["plain ascii", "größe ✓ 日本", "    return x\n\n", "🙂 emoji"]:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert int(nbytes[ids].sum()) == len(text.encode("utf-8")), text
    assert nbytes[[SPEC.bos_id, SPEC.eos_id, SPEC.pad_id, SPEC.image_token_id, SPEC.vocab_size - 1]].sum() == 0


def test_heldout_sums_equal_a_literal_log_softmax():
    torch.manual_seed(0)
    hidden, head = torch.randn(2, 5, 8), torch.nn.Linear(8, 11, bias=False)
    labels = torch.tensor([[3, 0, IGNORE, 7, 1], [IGNORE, 10, 4, 4, 2]])
    token_bytes = torch.zeros(11, dtype=torch.float64)
    token_bytes[[3, 4, 7, 10]] = torch.tensor([1.0, 2.0, 3.0, 1.0], dtype=torch.float64)  # 0, 1, 2: special
    got = heldout_sums(hidden, head, labels, token_bytes, tile_tokens=3)
    logp = torch.log_softmax((hidden @ head.weight.T).double(), -1)
    ce, ce_bytes = 0.0, 0.0
    for b in range(2):
        for t in range(5):
            y = int(labels[b, t])
            if y == IGNORE:
                continue
            ce += -logp[b, t, y].item()
            ce_bytes += -logp[b, t, y].item() if y in (3, 4, 7, 10) else 0.0
    assert got.tolist() == pytest.approx([ce, ce_bytes], rel=1e-6)


def _png(w=60, h=30):
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (10, 200, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def val_shards(tmp_path_factory, tok):
    """Held-out shards mixing 30 text and 10 image documents, in a known order."""
    out = tmp_path_factory.mktemp("val")
    docs = []
    for i in range(40):
        ids = np.asarray(tok.encode(TEXTS[i % len(TEXTS)] * (1 + i % 4), add_special_tokens=False).ids, np.int32)
        docs.append(Document([("image", _png(), "png"), ("text", ids)]) if i % 4 == 3 else Document([("text", ids)]))
    entries = write_shards(docs, out, "val", 15)
    return [str(out / e["path"]) for e in entries], docs


def test_heldout_set_is_fixed_follows_the_mix_and_counts_from_the_labels(val_shards, tok):
    shards, docs = val_shards
    cfg = DataConfig(seq_len=32, batch_size=2, mix=[3, 1])
    nbytes = token_byte_counts(tok, SPEC.vocab_size)
    a = heldout_set(cfg, SPEC, shards, 512, nbytes)
    # ceil(512 / (2 x 32)) = 8 micro-batches, 3 : 1 -> 6 text, 2 multimodal
    assert [s for s, _ in a.batches] == [0] * 6 + [1] * 2
    # the text rows are the text documents in reading order: [BOS] + tokens + [EOS], split, next fit
    first_text = next(d for d in docs if len(d.segments) == 1).segments[0][1]
    row0 = np.concatenate([p.tokens for p in a.batches[0][1][0]])
    assert row0[0] == SPEC.bos_id and list(row0[1:1 + min(len(first_text), 32)]) == list(first_text[:32])
    # rows of seq_len + 1 = 33 positions, as in training: the third document ([BOS] + 3 x 13 tokens + [EOS], 41
    # positions) is split into a first piece of exactly 33, which fills a row of its own
    assert max(sum(len(p) for p in row) for _, rows in a.batches for row in rows) == 33
    b = heldout_set(cfg, SPEC, shards, 512, nbytes)
    assert [[[p.tokens.tolist() for p in row] for row in rows] for _, rows in a.batches] == \
        [[[p.tokens.tolist() for p in row] for row in rows] for _, rows in b.batches]
    targets, n_bytes = [0, 0], [0, 0]
    for i, (s, rows) in enumerate(a.batches):
        labels = collate(rows, SPEC, cfg.seq_len)["labels"]
        assert torch.equal(torch.from_numpy(collate_labels(rows, SPEC, cfg.seq_len)), labels)
        assert torch.equal(a.batch(i)["labels"], labels)
        valid = labels[labels != IGNORE]
        targets[s] += valid.numel()
        n_bytes[s] += int(sum(nbytes[int(t)] for t in valid))
    assert a.targets.tolist() == targets and a.bytes.tolist() == n_bytes and min(targets) > 0


@pytest.mark.parametrize("weights, tokens, want", [
    # M = ceil(tokens / (2 x 32)) micro-batches, max(1, round(M x w / total)) per weighted source:
    (([1000, 1], None), 512, [8, 1]),  # M = 8: round(7.992) = 8, round(0.008) = 0 -> 1
    (([1, 1000], None), 512, [1, 8]),
    (([1000, 1], None), 100, [2, 1]),  # M = 2: round(1.998) = 2, round(0.002) = 0 -> 1
    ((None, [("web", 999, "text"), ("code", 1, "text"), ("caps", 1, "multimodal")]), 512, [8, 1]),  # 1000 : 1
    (([1, 0], None), 512, [8, 0]),  # a zero weight: no held-out micro-batch
])
def test_every_weighted_source_gets_a_held_out_micro_batch(val_shards, tok, weights, tokens, want):
    """A source whose share of `train.eval.tokens` rounds to zero still gets one micro-batch (and is scored),
    so that a small source's loss is in every eval record; counts worked out by hand above."""
    from flashtrain.data.sources import SourceConfig

    shards, _ = val_shards
    mix, named = weights
    sources = None if named is None else [SourceConfig(name, shards, w, m) for name, w, m in named]
    cfg = DataConfig(seq_len=32, batch_size=2, mix=mix, sources=sources)
    got = heldout_set(cfg, SPEC, shards, tokens, token_byte_counts(tok, SPEC.vocab_size))
    assert [s for s, _ in got.batches] == [0] * want[0] + [1] * want[1]
    assert all(len(rows) == 2 for _, rows in got.batches)
    assert [bool(t) for t in got.targets] == [n > 0 for n in want]  # each present source has scored labels


def test_eval_record_by_hand():
    class Set:
        sources, targets, bytes = ("text", "mm"), np.array([100, 50]), np.array([300, 0])

    rec = eval_record(6, np.array([[230.0, 200.0], [90.0, 0.0]]), Set())
    assert rec["event"] == "eval" and rec["step"] == 6 and rec["tokens"] == 150
    assert rec["loss"] == pytest.approx(320 / 150) and rec["bpb"] == pytest.approx(200 / (math.log(2) * 300))
    assert rec["per_source"]["text"] == {"loss": pytest.approx(2.3), "bpb": pytest.approx(200 / (math.log(2) * 300)),
                                         "tokens": 100}
    assert rec["per_source"]["mm"] == {"loss": pytest.approx(1.8), "bpb": None, "tokens": 50}
    # each modality over its own sources' labels and bytes: the multimodal source has no bytes, so no bpb
    assert rec["per_modality"] == {"text": rec["per_source"]["text"], "multimodal": rec["per_source"]["mm"]}
    json.dumps(rec)



def test_a_new_heldout_score_is_one_entry(monkeypatch):
    """A held-out metric added as one `HELDOUT_SCORES` entry (here top-1 accuracy over the scored positions) is
    summed per micro-batch by `heldout_sums` and divided in each field of the eval record, beside the two it has."""
    import flashtrain.train.evaluation.heldout as heldout_module
    import flashtrain.train.loss as loss_module

    scores = (*loss_module.HELDOUT_SCORES, loss_module.HeldOutScore(
        "accuracy", lambda t: (t.logits.argmax(-1) == t.targets).double(), "token"))
    monkeypatch.setattr(loss_module, "HELDOUT_SCORES", scores)
    monkeypatch.setattr(heldout_module, "HELDOUT_SCORES", scores)
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.eye(3, 2))  # logits (h0, h1, 0)
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [-1.0, -1.0]]])
    labels = torch.tensor([[0, 0, IGNORE, 2]])  # right, wrong, unscored, right
    got = heldout_sums(hidden, head, labels, torch.ones(3, dtype=torch.float64), tile_tokens=3)
    assert got[2].item() == 2.0

    class Set:
        sources, targets, bytes = ("text", "mm"), np.array([100, 50]), np.array([300, 0])

    rec = eval_record(6, np.array([[230.0, 200.0, 60.0], [90.0, 0.0, 15.0]]), Set())
    assert rec["accuracy"] == pytest.approx(75 / 150) and rec["loss"] == pytest.approx(320 / 150)
    assert rec["per_source"]["text"]["accuracy"] == pytest.approx(0.6)
    assert rec["per_modality"]["multimodal"]["accuracy"] == pytest.approx(0.3)

class _Runner:
    """Scores a micro-batch as (the sum of its token ids, 1), draws from the RNG as a forward might."""

    def __init__(self, eval_group):
        self.eval_group, self.calls = eval_group, []

    def evaluate(self, batches, token_bytes):
        assert len(batches) == self.eval_group
        torch.rand(3)
        self.calls.append(len(batches))
        return [torch.tensor([float(b["tokens"].sum()), 1.0 if b["labels"].ne(IGNORE).any() else 0.0],
                             dtype=torch.float64) for b in batches]


@pytest.mark.parametrize("dp,group", [(1, 1), (2, 1), (2, 2), (3, 2)])
def test_every_micro_batch_is_scored_once_over_the_dp_ranks(val_shards, tok, dp, group):
    """Padded to dp x group, split over dp ranks: summed over the ranks, each real micro-batch once, the
    PAD micro-batches nothing; the RNG left as it was."""
    shards, _ = val_shards
    cfg = DataConfig(seq_len=32, batch_size=2, mix=[3, 1])
    nbytes = token_byte_counts(tok, SPEC.vocab_size)
    heldout = heldout_set(cfg, SPEC, shards, 320, nbytes)  # 5 micro-batches: 4 text, 1 multimodal
    assert len(heldout.batches) == 5
    want = torch.zeros(2, 2, dtype=torch.float64)
    for i, (s, _) in enumerate(heldout.batches):
        want[s] += torch.tensor([float(heldout.batch(i)["tokens"].sum()), 1.0], dtype=torch.float64)
    total = torch.zeros(2, 2, dtype=torch.float64)
    for rank in range(dp):
        runner = _Runner(group)
        # data-parallel rank `rank` of `dp` (parallel/dims.py), each of 2 context-parallel ranks (they evaluate alike)
        dims = SimpleNamespace(dp=dp, dp_rank=rank, cp=2, dp_cp=2 * dp)
        ev = Evaluator(EvalConfig(interval=1, tokens=320), heldout, nbytes, runner, dims, 2, torch.device("cpu"), False)
        before = torch.get_rng_state()
        total += ev.sums()
        assert torch.equal(torch.get_rng_state(), before)
        assert len(ev.mine) == math.ceil(5 / (dp * group)) * group
    assert torch.equal(total, want)


def test_a_resume_keeps_the_eval_event_of_its_step():
    lines = [json.dumps(r) for r in (
        {"step": 1}, {"step": 2}, {"event": "eval", "step": 2}, {"step": 3}, {"event": "eval", "step": 4}, {"step": 4})]
    assert resumed_lines(lines, 2) == 3  # the step-2 record and its eval event
    assert resumed_lines(lines, 3) == 4
    assert resumed_lines(lines, 1) == 1


def test_evaluations_are_due_every_interval_and_at_the_schedules_last_step():
    ev = Evaluator.__new__(Evaluator)
    ev.cfg = EvalConfig(interval=50, tokens=8)
    assert [s for s in range(1, 392) if ev.due(s, 391)] == [50, 100, 150, 200, 250, 300, 350, 391]
    assert [s for s in range(1, 120) if ev.due(s)] == [50, 100]
    ev.cfg = EvalConfig(interval=0, tokens=8)
    assert not any(ev.due(s, 391) for s in range(1, 392))  # off is off


def test_a_checkpoint_is_scored_in_the_launchs_layout_and_named_for_what_it_is():
    """Issue 47 items 3 and 6: launch/evaluate.py scores in this launch's layout, so the training batch is
    rounded up to a multiple of its data-parallel ranks x data.batch_size when it does not divide (4
    sequences of 128 on 2 ranks x 3: 6 sequences, 768 tokens; 3 ranks x 2 after pp=2 of 6 processes: 6
    again; 4 on 2 x 2: unchanged); and the lines name a run's step, or an import's source."""
    from types import SimpleNamespace as NS

    from flashtrain.train.evaluation.checkpoint import checkpoint_label, scoring_batch_tokens

    def run(batch_size, pp=1, cp=1, tokens=512.0):
        return NS(data=NS(seq_len=128, batch_size=batch_size), parallel=NS(pp=pp, cp=cp),
                  train=NS(global_batch_tokens=tokens))

    assert scoring_batch_tokens(run(3), 2) == 768.0
    assert scoring_batch_tokens(run(2, pp=2), 6) == 768.0
    assert scoring_batch_tokens(run(2), 2) == 512.0
    assert scoring_batch_tokens(run(1, cp=2, tokens=384.0), 2) == 384.0  # dp = 1: 3 sequences fit
    assert checkpoint_label({"step": 40, "tokens_seen": 5120}) == "step 40"
    assert checkpoint_label({"step": 0, "weights_only": True, "imported_from": "/rel/V4.1-Flash"}) == \
        "imported weights, from /rel/V4.1-Flash"


def test_harness_scores_sum_the_continuation_over_the_last_window_of_context():
    """The lm-eval adapter's `loglikelihood` on a bigram model (the logits of the next token are a row of a fixed
    table, looked up by the current token; window 4, one request a batch, BOS = 0): "3 4" + " 5 6" scores the row
    [BOS 3 4 5] as log P(5 | 4) + log P(6 | 5), the sum, not the mean; a context of 7 tokens keeps the last window of
    inputs, [5 6 7 8] for " 8 9" -- the row is the window's 4 inputs, its last target the 5th token. The greedy flag
    (what `acc` of a task like lambada reads) holds only when every continuation token is its row's argmax: 5 is
    after 4 and 6 is not after 5 (False), 8 after 7 and 9 after 8 (True)."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import CacheHook

    from flashtrain.data.config import TokenSpec
    from flashtrain.train.evaluation.harness import FlashtrainLM

    table = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))
    table[4, 5] = table[7, 8] = table[8, 9] = 10.0  # the argmax of their rows
    table[5, 6] = -10.0  # not the argmax after 5
    rows = []
    lm = object.__new__(FlashtrainLM)  # the scoring alone: no checkpoint
    lm.window, lm.batch_size, lm.spec, lm.cache_hook = 4, 1, TokenSpec(vocab_size=16), CacheHook(None)
    lm.encode = lambda text: [int(t) for t in text.split()]
    lm.logits = lambda batch: (rows.extend(batch), table[torch.tensor(batch)])[1]
    got = lm.loglikelihood([Instance("loglikelihood", {}, ("3 4", " 5 6"), 0),
                            Instance("loglikelihood", {}, ("1 2 3 4 5 6 7", " 8 9"), 1)])
    lp = torch.log_softmax(table.double(), -1)
    assert rows == [[0, 3, 4, 5], [5, 6, 7, 8]]
    assert [g[0] for g in got] == pytest.approx([(lp[4, 5] + lp[5, 6]).item(), (lp[7, 8] + lp[8, 9]).item()],
                                                rel=1e-6)
    assert [g[1] for g in got] == [False, True]


def test_evaluate_prints_the_set_and_each_source_by_hand():
    """launch/evaluate.py's lines for a hand-set record: the whole set (loss 2.1333, bpb 0.9618, 150 tokens), then
    each source with its own figures, "-" for a source without bytes."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "evaluate_tool", Path(__file__).resolve().parent.parent / "launch" / "evaluate.py")
    evaluate_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(evaluate_tool)

    record = {"loss": 320 / 150, "bpb": 0.96176, "tokens": 150,
              "per_source": {"text": {"loss": 2.3, "bpb": 1.25, "tokens": 100},
                             "mm": {"loss": 1.8, "bpb": None, "tokens": 50}}}
    assert evaluate_tool.summary("ckpt/step_00000004", "step 4", record) == [
        "ckpt/step_00000004 (step 4): loss 2.1333, bpb 0.9618, 150 tokens",
        "      text: loss 2.3000, bpb 1.2500, 100 tokens",
        "        mm: loss 1.8000, bpb -, 50 tokens"]
