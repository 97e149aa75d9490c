"""The DSpark training objective (V41_SPEC §8b: "in the DSpark paper / DeepSpec training code"), over every
anchor of a micro-batch, tiled so that no [anchors x block, vocab] logits exist for the whole sequence.

Sources: DeepSeek's DeepSpec, `deepspec/modeling/dspark/loss.py` (`compute_dspark_loss`) and
`deepspec/modeling/dspark/qwen3/modeling.py` (`forward`: labels, aligned target logits, teacher-forced
Markov tokens). Per anchor t and block position k (the draft of the token at t + 2 + k, `model/dspark.py`):

- draft logits z = head(norm(x)) + Markov bias of the *true* previous token (teacher forcing: the token at
  t + 1 + k; DeepSpec `prev_token_ids` = [anchor token, target_ids[:-1]]);
- target: the frozen backbone's own next-token distribution at that position, q = softmax(head(final
  hidden at t + 1 + k)) (DeepSpec `aligned_target_logits`, the target's last hidden state at label - 1), and
  the data token there (DeepSpec `target_ids`);
- ce = -log softmax(z)[token]; l1 = sum |softmax(z) - q|; accept rate a = clamp(1 - l1 / 2, 0, 1) (the
  acceptance probability of rejection sampling, 1 - TV; DeepSpec `accept_rate_3d`);
- the confidence head's logit c is trained toward a (detached) by binary cross-entropy with logits
  (DeepSpec `confidence_targets = accept_rate_3d.detach()`, `binary_cross_entropy_with_logits`);
- weights w_k = exp(-k / decay_gamma) on the supervised positions: the anchor's token and the position's
  token exist (not padding, not an image position, inside the sequence), cumulatively over k (DeepSpec
  `build_eval_mask`, `_build_loss_weight_mask`);
- loss = ce_weight * sum(w ce) / sum(w) + l1_weight * sum(w l1) / sum(w) + confidence_weight *
  sum(w bce) / sum(w). DeepSpec's defaults: 0.1, 0.9, 1.0 and decay_gamma 4 (`config/dspark/*.py`).

One difference, the framework's: the sums are normalised per micro-batch (as the LM loss, train/loss.py)
and the micro-batches and data-parallel ranks averaged, where DeepSpec divides by the global (all-reduced)
weight sum; under context parallelism the weight sum is the whole sequences'.

Statistics (no gradient), summed per micro-batch into one vector (`STATS` names its parts): per position
the CE sum, the supervised count, the accept-rate sum and the greedy agreement count (argmax z ==
argmax q); per anchor with a supervised first position the expected accepted length 1 + sum_k prod_{j<=k}
a_j (DeepSpec `tau_probabilistic`) and the measured one 1 + sum_k prod_{j<=k} [argmax z_j == argmax q_j]
(greedy verification along the data's prefix: the drafter's and the backbone's choices both conditioned on
the true tokens); the loss parts; and the confidence calibration's bins (count, predicted, target) over
`ece_bins` equal-width bins of sigmoid(c) against a.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from flashtrain.data.loader import IGNORE


@dataclass
class DSparkLossConfig:
    """`train.dspark` (conf/train/default.yaml): the objective's weights (DeepSpec's defaults) and the
    calibration bins."""

    ce_weight: float = 0.1  # DeepSpec ce_loss_alpha
    l1_weight: float = 0.9  # DeepSpec l1_loss_alpha
    confidence_weight: float = 1.0  # DeepSpec confidence_head_alpha
    decay_gamma: float = 4.0  # DeepSpec loss_decay_gamma: w_k = exp(-k / gamma); <= 0 disables the decay
    ece_bins: int = 10  # equal-width bins of the predicted acceptance for confidence_ece


def stat_layout(K: int, bins: int) -> dict[str, slice]:
    """Where each statistic sits in the per-micro-batch vector."""
    sizes = [("ce", K), ("count", K), ("accept", K), ("agree", K), ("expected", 1), ("measured", 1), ("anchors", 1),
             ("w_ce", 1), ("w_l1", 1), ("w_bce", 1), ("w", 1), ("bin_n", bins), ("bin_pred", bins),
             ("bin_target", bins)]
    out, at = {}, 0
    for name, n in sizes:
        out[name] = slice(at, at + n)
        at += n
    return out


def stat_size(K: int, bins: int) -> int:
    return list(stat_layout(K, bins).values())[-1].stop


def supervision(labels: torch.Tensor, positions: torch.Tensor, K: int, gamma: float):
    """For anchors at `positions` [L] of sequences with labels [B, S] (labels[u] = the token at u + 1):
    (first [B, L] the token after each anchor or IGNORE, prev [B, L, K] the true token before each draft
    position, targets [B, L, K] the token each position drafts (IGNORE where none), target positions
    [L, K] = t + 1 + k clamped into the sequence, mask [B, L, K] the supervised positions (cumulative),
    weights [B, L, K] = mask x exp(-k / gamma))."""
    B, S = labels.shape
    k = torch.arange(K, device=labels.device)
    at = positions.unsqueeze(1) + k  # labels index of the previous token: t + k (the token at t + 1 + k)
    src = at.clamp(max=S - 1)
    tgt_at = (at + 1).clamp(max=S - 1)
    first = labels[:, positions]
    prev = labels[:, src]
    targets = torch.where((at + 1 < S).unsqueeze(0), labels[:, tgt_at], IGNORE)
    ok = (first != IGNORE).unsqueeze(-1) & (prev != IGNORE) & (targets != IGNORE)
    mask = ok.to(torch.int32).cumprod(-1).bool()
    decay = torch.exp(-k.float() / gamma) if gamma > 0 else torch.ones(K, device=labels.device)
    return first, prev, targets, tgt_at, mask, mask.float() * decay


def _tile(drafter, head: nn.Linear, cfg: DSparkLossConfig, bins: int, denom: torch.Tensor, scale: float,
          x, q, prev, targets, mask, weights):
    """One tile of anchors: x [..., K, D], q [..., K, vocab] (the backbone's distribution at the target
    positions, no gradient), prev / targets / mask / weights [..., K] -> (loss, statistics vector)."""
    K = x.shape[-2]
    x, q, prev, targets, mask, weights = (t.reshape(-1, K, *t.shape[x.dim() - 1:]) for t in
                                          (x, q, prev, targets, mask, weights))
    bias, memb = drafter.markov(prev.clamp(min=0))  # unsupervised positions (IGNORE) read some token
    z = drafter.base_logits(x, head) + bias
    logp = z.log_softmax(-1)
    ce = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    l1 = (logp.exp() - q).abs().sum(-1)
    accept = (1 - 0.5 * l1).clamp(0.0, 1.0)
    conf = drafter.confidence(x, memb)
    bce = F.binary_cross_entropy_with_logits(conf, accept.detach(), reduction="none")
    w = weights
    loss = (cfg.ce_weight * (ce * w).sum() + cfg.l1_weight * (l1 * w).sum()
            + cfg.confidence_weight * (bce * w).sum()) * (scale / denom)
    with torch.no_grad():
        m = mask.float()
        a = accept * m
        agree = (z.argmax(-1) == q.argmax(-1)).float() * m
        valid = mask[:, 0].float()
        p = conf.sigmoid()
        b = (p * bins).long().clamp(max=bins - 1)
        stats = torch.cat([
            (ce * m).sum(0), m.sum(0), a.sum(0), agree.sum(0),
            ((1 + a.cumprod(-1).sum(-1)) * valid).sum().view(1),
            ((1 + agree.cumprod(-1).sum(-1)) * valid).sum().view(1),
            valid.sum().view(1), (ce * w).sum().view(1), (l1 * w).sum().view(1), (bce * w).sum().view(1),
            w.sum().view(1),
            torch.zeros(bins, device=x.device).index_add_(0, b.flatten(), m.flatten()),
            torch.zeros(bins, device=x.device).index_add_(0, b.flatten(), (p * m).flatten()),
            torch.zeros(bins, device=x.device).index_add_(0, b.flatten(), a.flatten())]).double()
    assert stats.numel() == stat_size(K, bins)
    return loss, stats


class _TileGradients(torch.autograd.Function):
    """The tiles' summed loss, whose backward hands x the gradient the tiles computed in the forward (scaled by
    the incoming gradient; DeepSpeed's TiledFusedLogitsLoss pattern, as train/loss.py)."""

    @staticmethod
    def forward(ctx, x, total, grad):
        ctx.save_for_backward(grad)
        return total.clone()

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g, None, None


def _tiles(split, L: int, S: int, K: int, n: int):
    """(anchor rows [r0, r1), target window [w0, w1)) per tile: n anchors of one contiguous local chunk (its
    global positions g .. g + n - 1 draft the tokens at g + 1 .. g + n - 1 + K, inside the sequence)."""
    chunks = [((0, L), 0)] if split is None else list(zip(split.chunks, split.offsets))
    for (a, b), o in chunks:
        for g0 in range(a, b, n):
            g1 = min(b, g0 + n)
            yield (o + g0 - a, o + g1 - a), (min(g0 + 1, S - 1), min(g1 + K, S))


def dspark_loss(x: torch.Tensor, drafter, head: nn.Linear, final: torch.Tensor, labels: torch.Tensor,
                positions: torch.Tensor, cfg: DSparkLossConfig, tile_tokens: int, scale: float = 1.0,
                split=None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, L, K, D] the drafter's hidden states at the anchors `positions` [L] (this rank's: every position,
    or `split`'s under context parallelism), final [B, S, D] the backbone's final hidden states of the whole
    sequences (no gradient), labels [B, S] -> (scale x the objective of the micro-batch, its statistics
    vector float64 [stat_size]).

    Tiles of about `tile_tokens` draft positions (contiguous anchors): the backbone's distribution once per
    target position of the tile (a position is the target of K anchors), and, when training, the tile's
    backward right after its forward (into the drafter's head-side parameters, accumulated once per
    micro-batch, and into x, handed over by the returned loss): no tile's [positions, vocab] tensors outlive
    it and nothing is recomputed. The returned loss must be back-propagated with gradient 1 (as train/loss.py's).
    `split`: context parallelism (the weight sum over the whole sequences)."""
    B, L, K, D = x.shape
    S = labels.shape[1]
    _, prev, targets, tgt_at, mask, weights = supervision(labels, positions, K, cfg.decay_gamma)
    denom = weights.sum()
    if split is not None:
        denom = split.sum(denom)
    denom = denom.clamp_min(1e-6).detach()
    train = torch.is_grad_enabled() and x.requires_grad
    last = drafter.mtp[-1]
    side = [p for m in (last.norm, last.markov_head, last.confidence_head) for p in m.parameters() if p.requires_grad]
    grad_x = torch.zeros_like(x) if train else None
    grad_side = [torch.zeros_like(p) for p in side] if train else []
    total, stats = torch.zeros((), dtype=torch.float32, device=x.device), None
    for (r0, r1), (w0, w1) in _tiles(split, L, S, K, max(1, tile_tokens // (K * B))):
        with torch.no_grad():
            q = head(final[:, w0:w1]).float().softmax(-1)[:, (tgt_at[r0:r1] - w0).clamp(0, w1 - w0 - 1)]
        args = (prev[:, r0:r1], targets[:, r0:r1], mask[:, r0:r1], weights[:, r0:r1])
        if not train:
            tl, ts = _tile(drafter, head, cfg, cfg.ece_bins, denom, scale, x[:, r0:r1], q, *args)
        else:
            with torch.enable_grad():
                xt = x[:, r0:r1].detach().requires_grad_()
                tl, ts = _tile(drafter, head, cfg, cfg.ece_bins, denom, scale, xt, q, *args)
                got = torch.autograd.grad(tl, [xt, *side], allow_unused=True)
            grad_x[:, r0:r1] = got[0]
            for acc, g in zip(grad_side, got[1:]):
                if g is not None:
                    acc += g
        total += tl.detach()
        stats = ts if stats is None else stats + ts
    if not train:
        return total, stats
    if side:  # one accumulation per parameter (its gradient-reduction hook fires once per micro-batch)
        torch.autograd.backward(side, grad_side)
    return _TileGradients.apply(x, total, grad_x), stats


def read_stats(total: list[float] | torch.Tensor, K: int, bins: int) -> dict:
    """The metrics record's DSpark fields from the statistics summed over a step (every micro-batch and
    rank): `draft_loss` (mean CE over the supervised draft positions) and `draft_loss_per_position`,
    `acceptance_length` {expected, measured}, `accept_rate_per_position`, `l1_loss`, `confidence_loss`,
    `confidence_ece` (sum over bins of |mean predicted - mean target| x the bin's share; null without any)."""
    t = torch.as_tensor(total, dtype=torch.float64)
    lay = stat_layout(K, bins)

    def div(a, b):
        return [x / y if y else math.nan for x, y in zip(a.tolist(), b.tolist())]

    ce, count, anchors, w = t[lay["ce"]], t[lay["count"]], t[lay["anchors"]].item(), t[lay["w"]].item()
    n, pred, target = t[lay["bin_n"]], t[lay["bin_pred"]], t[lay["bin_target"]]
    total_n = n.sum().item()
    ece = sum((abs(p - q) for p, q in zip(pred.tolist(), target.tolist())), 0.0) / total_n if total_n else math.nan
    return {
        "draft_loss": ce.sum().item() / count.sum().item() if count.sum() else math.nan,
        "draft_loss_per_position": div(ce, count),
        "acceptance_length": {"expected": t[lay["expected"]].item() / anchors if anchors else math.nan,
                              "measured": t[lay["measured"]].item() / anchors if anchors else math.nan},
        "accept_rate_per_position": div(t[lay["accept"]], count),
        "agreement_per_position": div(t[lay["agree"]], count),
        "l1_loss": t[lay["w_l1"]].item() / w if w else math.nan,
        "confidence_loss": t[lay["w_bce"]].item() / w if w else math.nan,
        "confidence_ece": ece,
    }
