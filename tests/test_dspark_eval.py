"""Speculative decoding with the frozen backbone as the greedy verifier (train/dspark/speculative.py,
launch/eval_dspark.py): the verified output equals the backbone's own greedy decoding token for token;
the accepted lengths and per-position counts of a drafter that always agrees, one that never does and
one right for exactly two positions, against hand counts; the calibration error by hand; and, on a hand-built
backbone stand-in, drafts [right, wrong, right, right]: only the prefix before the first mismatch is accepted."""

from types import SimpleNamespace

import pytest
import torch
from layer_plans import FOUR_LAYERS

from flashtrain.model import Transformer
from flashtrain.model.dspark import DSpark
from flashtrain.train.config import compose, model_config
from flashtrain.train.dspark.speculative import (
    Acceptance,
    backbone_pass,
    drafter_proposal,
    greedy_at,
    greedy_decode,
    speculative_decode,
)
from flashtrain.train.dspark.stage import freeze

TARGETS = [1, 2, 3]  # the last layers of the 4-layer plan
P, N = 12, 10


@pytest.fixture(scope="module")
def parts():
    cfg = model_config(compose(["+exp=flash_tiny", *FOUR_LAYERS, "model.dspark_target_layer_ids=[1,2,3]"]))
    torch.manual_seed(0)
    backbone = Transformer(cfg, seed=3)
    with torch.no_grad():  # a peaked next-token distribution, as a trained model has (no flat near-ties)
        backbone.head.weight.normal_(0, 0.5)
        backbone.embed.weight.normal_(0, 0.5)
    prompts = torch.randint(3, 400, (3, P), generator=torch.Generator().manual_seed(1))
    backbone = freeze(backbone)
    K = cfg.dspark_block_size
    # the backbone's greedy decoding, one token per forward (far enough for the oracles' drafts below), shared
    truth = greedy_decode(backbone, prompts, N + 2 * K + 2, cfg.pad_id, P + N + 3 * K + 3)
    return cfg, backbone, DSpark(cfg, seed=4).eval(), prompts, truth


def test_verified_output_equals_greedy_decoding(parts):
    """A random drafter (few drafts accepted) and the oracle below (all accepted): both outputs are the
    backbone's greedy decoding."""
    cfg, backbone, drafter, prompts, truth = parts
    K = cfg.dspark_block_size
    ref = truth[:, :P + N]
    stats = Acceptance(K)
    got = speculative_decode(backbone, TARGETS, drafter_proposal(drafter, backbone), prompts, N, K, cfg.pad_id, stats)
    assert torch.equal(got, ref)
    assert stats.steps > 0 and stats.tokens >= N * prompts.shape[0]
    assert len(set(ref[:, P:].flatten().tolist())) > 5  # the decoding is not one repeated token


def oracle(backbone, K, truth, right: int | None = None):
    """Proposes the true continuation (`truth`, the greedy decoding) for `right` positions (all if None), then
    wrong tokens; predicted acceptance 0.75 everywhere."""
    def propose(features, g, n):
        B = g.shape[0]
        idx = (n.unsqueeze(1) + 1 + torch.arange(K)).clamp(max=truth.shape[1] - 1)
        d = truth[torch.arange(B).unsqueeze(1), idx]
        if right is not None:
            d[:, right:] = (d[:, right:] + 1) % 400 + 3
        return d, torch.full((B, K), 0.75)
    return propose


def test_accepted_lengths_by_hand(parts):
    cfg, backbone, _, prompts, truth = parts
    K = cfg.dspark_block_size
    for right, per_step in ((None, K + 1), (0, 1), (2, 3)):
        stats = Acceptance(K)
        out = speculative_decode(backbone, TARGETS, oracle(backbone, K, truth, right), prompts, N, K, cfg.pad_id,
                                 stats)
        assert torch.equal(out, truth[:, :P + N])
        # every row takes ceil(N / per_step) steps of per_step tokens (the last one may overshoot N)
        steps = -(-N // per_step)
        assert stats.steps == 3 * steps and stats.summary()["mean_accepted_length"] == per_step
        m = per_step - 1
        assert stats.reached == [3 * steps if k <= m else 0 for k in range(K)]
        assert stats.accepted == [3 * steps if k < m else 0 for k in range(K)]


def test_calibration_error_by_hand():
    a = Acceptance(block=3, bins=2)
    a.add([1], [[0.8, 0.3, 0.9]])  # position 0 accepted (0.8 -> bin 1), position 1 rejected (0.3 -> bin 0)
    a.add([0], [[0.6, 0.2, 0.1]])  # position 0 rejected (0.6 -> bin 1)
    s = a.summary()
    assert s["mean_accepted_length"] == 1.5 and s["acceptance_per_position"] == [0.5, 0.0, None]
    # bin 0: predicted 0.3, accepted 0; bin 1: predicted 1.4, accepted 1 -> (0.3 + 0.4) / 3
    assert s["confidence_ece"] == pytest.approx(0.7 / 3)


def test_greedy_at_reads_the_head_at_the_given_positions(parts):
    cfg, backbone, _, prompts, _ = parts
    _, final = backbone_pass(backbone, prompts, [])
    want = backbone.head(final).argmax(-1)
    pos = torch.tensor([[0, 5], [11, 3], [7, 7]])
    assert torch.equal(greedy_at(backbone, final, pos), want.gather(1, pos))


V = 97  # the stand-in's vocabulary


def next_token(t: torch.Tensor) -> torch.Tensor:
    """The stand-in backbone's greedy token after a token: t + 37 mod 97 (no fixed point, one cycle of 97)."""
    return (t + 37) % V


class NextTokenBackbone:
    """A causal backbone stand-in for `backbone_pass` / `greedy_at`: the hidden state at a position is the one-hot
    of `next_token` of its token and the head is the identity, so the greedy token after position i depends on
    token i alone."""

    def context(self, tokens):
        return SimpleNamespace(captures=None)

    def embed_inputs(self, tokens):
        return tokens

    def run_blocks(self, x, ctx):
        return x

    def final_hidden(self, h):
        return torch.nn.functional.one_hot(next_token(h), V).float()

    def head(self, rows):
        return rows


def right_wrong_right_right(features, g, n):
    """Drafts [d1, d2, d3, d4] after g: d1 = the backbone's token after g (right), d2 = one off the token after
    d1 (wrong), d3, d4 = the backbone's tokens after d2, d3 (right given the drafted tokens before them, so they
    match the verifier's tokens at their positions); predicted acceptance 0.9, 0.3, 0.8, 0.7."""
    d1 = next_token(g)
    d2 = (next_token(d1) + 1) % V
    d3 = next_token(d2)
    d4 = next_token(d3)
    return torch.stack([d1, d2, d3, d4], 1), torch.tensor([[0.9, 0.3, 0.8, 0.7]]).expand(g.shape[0], 4)


def test_only_the_matching_prefix_of_the_drafts_is_accepted():
    """Drafts [right, wrong, right, right] against a hand-built backbone: the verifier's tokens match drafts 1, 3
    and 4, but only the prefix before the first mismatch is accepted -- one draft a step. The accepted length of a
    step is the accepted drafts + 1, the +1 being g: the backbone's token for the step's first position, known
    from the previous verification (its correction after a rejection, its bonus token after a fully accepted
    block; at the first step, the prompt's forward), committed with the accepted drafts; the verifier's token
    after them (here the correction for draft 2) is the next step's g. So every step commits 2 tokens, 7 new
    tokens take 4 steps a row (the last overshooting to 8), and the output is the greedy decoding, by hand."""
    B, new, K = 2, 7, 4  # rows, new tokens, drafts a step
    prompts = torch.tensor([[5, 17, 60, 2, 91], [40, 40, 8, 33, 70]])
    # the inputs tell a prefix from a count of matches: drafts 1, 3, 4 equal the verifier's tokens at their positions
    g = next_token(prompts[:, -1])
    drafts, _ = right_wrong_right_right(None, g, None)
    verified = next_token(torch.cat([g.unsqueeze(1), drafts], 1))[:, :K]
    assert (drafts == verified).tolist() == [[True, False, True, True]] * B

    stats = Acceptance(K)
    out = speculative_decode(NextTokenBackbone(), [], right_wrong_right_right, prompts, new, K, 0, stats)

    want = [row.tolist() for row in prompts]
    for row in want:
        for _ in range(new):
            row.append((row[-1] + 37) % V)
    assert out.tolist() == want
    assert (stats.steps, stats.tokens) == (B * 4, B * 8)
    assert stats.reached == [8, 8, 0, 0] and stats.accepted == [8, 0, 0, 0]
    s = stats.summary()
    assert s["mean_accepted_length"] == 2.0 and s["acceptance_per_position"] == [1.0, 0.0, None, None]
    # reached: draft 1 (0.9 -> bin 9, accepted) and draft 2 (0.3 -> bin 3, rejected), 8 times each:
    # (|8 x 0.9 - 8| + |8 x 0.3 - 0|) / 16
    assert s["confidence_ece"] == pytest.approx((0.8 + 2.4) / 16)


def all_right_then_right_wrong(features, g, n):
    """Row 0: all four drafts right (five tokens a step); every other row: [right, wrong, right, right] (two tokens a
    step); predicted acceptance 0.9, 0.3, 0.8, 0.7 on every row."""
    good = [next_token(g)]
    for _ in range(3):
        good.append(next_token(good[-1]))
    mixed, conf = right_wrong_right_right(features, g, n)
    drafts = torch.where((torch.arange(g.shape[0]) == 0).unsqueeze(1), torch.stack(good, 1), mixed)
    return drafts, conf


def test_a_finished_row_is_no_longer_counted():
    """Rows that finish at different steps: row 0 commits 5 tokens a step and has its 7 new tokens after 2 steps,
    row 1 commits 2 a step and needs 4 (7 -> 8). The decoding goes on for row 1, but the counts hold each row's own
    steps only: 2 + 4 steps, 10 + 8 tokens; position 0 reached 6 times, accepted 6; position 1 reached 6 times,
    accepted 2 (row 0's); positions 2 and 3 reached and accepted twice (row 0's)."""
    prompts = torch.tensor([[5, 17, 60, 2, 91], [40, 40, 8, 33, 70]])
    stats = Acceptance(4)
    out = speculative_decode(NextTokenBackbone(), [], all_right_then_right_wrong, prompts, 7, 4, 0, stats)
    want = [row.tolist() for row in prompts]
    for row in want:
        for _ in range(7):
            row.append(next_token(torch.tensor(row[-1])).item())
    assert out.tolist() == want
    assert (stats.steps, stats.tokens) == (6, 18)
    assert stats.reached == [6, 6, 2, 2] and stats.accepted == [6, 2, 2, 2]
    s = stats.summary()
    assert s["mean_accepted_length"] == 3.0 and s["acceptance_per_position"] == [1.0, 2 / 6, 1.0, 1.0]
    # bins: 0.9 x 6 (all accepted), 0.3 x 6 (2 accepted), 0.8 x 2 and 0.7 x 2 (accepted): 16 reached positions
    assert s["confidence_ece"] == pytest.approx((abs(5.4 - 6) + abs(1.8 - 2) + abs(1.6 - 2) + abs(1.4 - 2)) / 16)


def test_eval_dspark_prints_the_drafter_and_each_baseline_by_hand():
    """launch/eval_dspark.py's printed lines from a hand-built result: each baseline line shows that baseline's own
    mean accepted length, a position never reached is "-", an ECE of 0 is 0.000."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "launch"))
    import eval_dspark

    result = {"mean_accepted_length": 2.5, "prompts": 3, "new_tokens": 16, "confidence_ece": 0.0,
              "acceptance_per_position": [0.75, 0.5, None],
              "baselines": {"untrained": {"mean_accepted_length": 1.125}, "block_1": {"mean_accepted_length": 1.75}},
              "equals_greedy": True}
    assert eval_dspark.summary("ck/step_00000003", result) == [
        "ck/step_00000003: mean accepted length 2.500 tokens per step (3 prompts x 16 tokens), confidence ECE 0.000",
        "  acceptance per position: 0.750, 0.500, -",
        "  baseline untrained: mean accepted length 1.125",
        "  baseline block_1: mean accepted length 1.750",
        "  verified output equals greedy decoding: True"]
    del result["equals_greedy"]
    assert eval_dspark.summary("x", result)[-1] == "  baseline block_1: mean accepted length 1.750"
