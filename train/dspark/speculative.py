"""Speculative decoding with the frozen backbone as the greedy verifier, and the DSpark drafter's acceptance
measured on held-out prompts (launch/eval_dspark.py; V41_SPEC §8b; the loop of the public `generate.py` with
`forward_spec`, and DeepSpec's `generate_decoding_sample` at temperature 0).

One verification step per row, with n the committed length and g the backbone's token for position n
(known from the previous step):
1. the drafter drafts d_1 .. d_K for positions n + 1 .. n + K from its context at anchor n - 1 (the target
   layers' hc-means of the committed tokens) and the block [g, noise, ...] (`DSpark.draft`: greedy, the
   Markov bias of each drafted token);
2. the backbone runs once over the committed tokens followed by [g, d_1 .. d_K]; its greedy tokens p_j for
   positions n + 1 .. n + K + 1 verify the drafts: d_j is accepted while d_i == p_i for every i <= j;
3. g and the m accepted drafts are committed, and p_{n+m+1} (the correction, or the bonus token after a
   fully accepted block) is the next step's g. The step yields m + 1 tokens: its accepted length.
Every committed token is the backbone's greedy choice given the tokens before it, so the output equals the
backbone's own greedy decoding. The features the next step drafts from come from this step's forward at
the committed positions (the backbone is causal), so a step costs one backbone and one drafter forward.

Without a KV cache (training-mode modules) every forward runs the whole buffer: the rows are padded to
one fixed length (prompt + new tokens + block + 1), so every forward has the same shapes; the positions
after a row's end hold PAD or rejected drafts, which the causal backbone never lets earlier positions see.

Reported, per run (a drafter, or a baseline):
- `mean_accepted_length`: tokens per verification step (accepted drafts + 1), averaged over the steps
  (DeepSpec's `accept_len`);
- `acceptance_per_position`: for draft position k, accepted / reached (reached: every earlier draft of the
  step was accepted), the conditional acceptance the confidence head predicts;
- `confidence_ece`: over the reached positions, equal-width bins of sigmoid(confidence) against the 0 / 1
  outcome: sum over bins of |sum predicted - sum accepted| / reached.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashtrain.config.errors import ConfigError, DataError
from flashtrain.data.heldout import heldout_set
from flashtrain.data.tokenizer import load_tokenizer, token_byte_counts
from flashtrain.model.dspark import DSpark, block_tokens, context_features
from flashtrain.parallel.construct import model_template
from flashtrain.train.build import bring_up, read_configs
from flashtrain.train.checkpoint import load_weights, read_meta
from flashtrain.train.dspark.stage import drafter_template, has_drafter, load_backbone


@dataclass
class Acceptance:
    """The counts of one run of `speculative_decode` (summed over rows and steps)."""
    block: int
    bins: int = 10
    steps: int = 0
    tokens: int = 0  # sum of accepted lengths
    reached: list = field(default_factory=list)
    accepted: list = field(default_factory=list)
    bin_n: list = field(default_factory=list)
    bin_pred: list = field(default_factory=list)
    bin_hit: list = field(default_factory=list)

    def __post_init__(self):
        self.reached, self.accepted = [0] * self.block, [0] * self.block
        self.bin_n, self.bin_pred, self.bin_hit = [0] * self.bins, [0.0] * self.bins, [0] * self.bins

    def add(self, m: list[int], conf: list[list[float]]) -> None:
        """One verification step of some rows: accepted drafts m[r], the drafts' predicted acceptance conf[r]."""
        for mr, cr in zip(m, conf):
            self.steps += 1
            self.tokens += mr + 1
            for k in range(min(mr + 1, self.block)):  # positions 0..m reached (all before them accepted)
                hit = int(k < mr)
                self.reached[k] += 1
                self.accepted[k] += hit
                b = min(int(cr[k] * self.bins), self.bins - 1)
                self.bin_n[b] += 1
                self.bin_pred[b] += cr[k]
                self.bin_hit[b] += hit

    def summary(self) -> dict:
        n = sum(self.bin_n)
        return {"mean_accepted_length": self.tokens / self.steps if self.steps else None,
                "acceptance_per_position": [a / r if r else None for a, r in zip(self.accepted, self.reached)],
                "confidence_ece": (sum(abs(p - h) for p, h in zip(self.bin_pred, self.bin_hit)) / n) if n else None,
                "steps": self.steps, "tokens": self.tokens}


@torch.no_grad()
def backbone_pass(backbone, tokens: torch.Tensor, targets: list[int]):
    """One forward of the frozen backbone over tokens [B, L]: (the context features [B, L, n_targets x dim],
    the final hidden states [B, L, dim])."""
    ctx = backbone.context(tokens)
    ctx.captures = dict.fromkeys(targets)
    final = backbone.final_hidden(backbone.run_blocks(backbone.embed_inputs(tokens), ctx))
    return (context_features(ctx.captures, targets) if targets else None), final


def greedy_at(backbone, final: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The backbone's greedy token after each of `positions` [B, n] (argmax of the head there)."""
    rows = final.gather(1, positions.unsqueeze(-1).expand(-1, -1, final.shape[-1]))
    return backbone.head(rows).float().argmax(-1)


def drafter_proposal(drafter: DSpark, backbone, block: int | None = None):
    """The DSpark drafter's proposal: at each row's anchor n - 1, its greedy draft of `block` (default: all
    dspark_block_size) tokens after g, and their predicted acceptance (sigmoid of the confidence head)."""
    K = drafter.block_size
    block = K if block is None else block

    def propose(features: torch.Tensor, g: torch.Tensor, n: torch.Tensor):
        B, L = features.shape[:2]
        first = torch.full((B, L), -1, dtype=torch.long, device=g.device)
        first[torch.arange(B), n - 1] = g
        x = drafter.hidden(features, block_tokens(first, K, drafter.cfg.dspark_noise_token_id), backbone.embed)
        drafts, _, conf = drafter.draft(x[torch.arange(B), n - 1], g, backbone.head)
        return drafts[:, :block], conf[:, :block].sigmoid()

    return propose


@torch.no_grad()
def speculative_decode(backbone, targets: list[int], propose, prompts: torch.Tensor, new_tokens: int, block: int,
                       pad_id: int, stats: Acceptance | None = None) -> torch.Tensor:
    """Greedy speculative decoding of `new_tokens` tokens after prompts [B, P] (module docstring); `propose(
    features, g, n) -> (drafts [B, block], predicted acceptance [B, block])`. Returns [B, P + new_tokens]."""
    B, P = prompts.shape
    L = P + new_tokens + block + 1
    device = prompts.device
    buf = torch.full((B, L), pad_id, dtype=torch.long, device=device)
    buf[:, :P] = prompts
    n = torch.full((B,), P, dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)
    features, final = backbone_pass(backbone, buf, targets)
    g = greedy_at(backbone, final, (n - 1).unsqueeze(1))[:, 0]
    while int((n - P).min()) < new_tokens:
        live = (n - P) < new_tokens
        drafts, conf = propose(features, g, n)
        span = (n.unsqueeze(1) + torch.arange(block + 1, device=device)).clamp(max=L - 1)  # positions n .. n + block
        buf[rows[live].unsqueeze(1), span[live]] = torch.cat([g.unsqueeze(1), drafts], dim=1)[live]
        features, final = backbone_pass(backbone, buf, targets)
        verified = greedy_at(backbone, final, span)  # the backbone's tokens for positions n + 1 .. n + block + 1
        ok = (drafts == verified[:, :block]).long().cumprod(dim=1)
        m = ok.sum(1)
        if stats is not None:
            stats.add(m[live].tolist(), conf[live].tolist())
        g = torch.where(live, verified[rows, m], g)
        n = torch.where(live, n + 1 + m, n)
    return buf[:, :P + new_tokens]


@torch.no_grad()
def greedy_decode(backbone, prompts: torch.Tensor, new_tokens: int, pad_id: int, length: int) -> torch.Tensor:
    """The backbone's own greedy decoding, one token per forward, in a buffer of `length` positions (the
    reference `speculative_decode` must reproduce)."""
    B, P = prompts.shape
    buf = torch.full((B, length), pad_id, dtype=torch.long, device=prompts.device)
    buf[:, :P] = prompts
    for n in range(P, P + new_tokens):
        _, final = backbone_pass(backbone, buf, [])
        buf[:, n] = greedy_at(backbone, final, torch.full((B, 1), n - 1, device=prompts.device))[:, 0]
    return buf[:, :P + new_tokens]


def heldout_prompts(c, shards: list[str], tokenizer: str, count: int, length: int) -> torch.Tensor:
    """`count` prompts [count, length] from the held-out set (data/heldout.py; text micro-batches in order):
    each a row's first `length` tokens, rows with PAD or an image among them skipped."""
    token_bytes = token_byte_counts(load_tokenizer(tokenizer), c.spec.vocab_size)
    want = count * (c.data.seq_len + 1)
    heldout = heldout_set(c.data, c.spec, shards, max(want * 2, c.data.seq_len), token_bytes)
    out = []
    for i in range(len(heldout.batches)):
        batch = heldout.batch(i)
        for tokens, types in zip(batch["tokens"], batch["token_types"]):
            head = tokens[:length]
            if len(head) == length and (types[:length] < 0).all() and (head != c.spec.pad_id).all():
                out.append(head)
            if len(out) == count:
                return torch.stack(out)
    raise DataError(f"the held-out set holds {len(out)} text rows of {length} tokens, fewer than --prompts {count}; "
                    f"lower --prompts or --prompt-len, or give more held-out data (data.val_shards)")


def evaluate_dspark(cfg, path: str, prompts: int, prompt_len: int, new_tokens: int, check_greedy: bool = False,
                    log=print) -> dict:
    """launch/eval_dspark.py: the drafter of the DSpark-stage checkpoint `path` (or an import of the release
    holding `mtp.*`) against its frozen backbone, on held-out prompts, deterministically: its acceptance,
    and the same for an untrained drafter (the seeded initialisation, model/init.py) and for a block of 1
    (the trained drafter proposing one token per step, an MTP-1-like baseline)."""
    c = read_configs(cfg)
    meta = read_meta(path)
    backbone_path = (meta.get("backbone") or {}).get("path")
    if backbone_path is None:
        if not has_drafter(path):
            raise ConfigError(f"{path} holds no drafter: give a DSpark-stage checkpoint (train.stage=dspark) or an "
                              f"import of the release with its mtp.* tensors")
        backbone_path = path
    c.model.validate_drafter()
    run = bring_up(c, 1, checks=False).read_data(heldout=True)  # one process; the seed, the data, the Engram map
    device, shards, tok = run.device, run.heldout, run.tokenizer
    if not shards:
        raise ConfigError("no held-out data: give data.val_shards=[...] (shards written by launch/prepare_data.py)")
    backbone = load_backbone(c, run.dims, device, model_template(c.model, run.token_map), backbone_path)
    trained = drafter_template(c.model).materialize(device, c.train.seed).eval()
    load_weights(path, trained)
    untrained = drafter_template(c.model).materialize(device, c.train.seed).eval()
    batch = heldout_prompts(c, shards, tok, prompts, prompt_len).to(device)
    targets, K, pad = list(c.model.dspark_target_layer_ids), c.model.dspark_block_size, c.spec.pad_id
    runs = {"dspark": (trained, K), "untrained": (untrained, K), "block_1": (trained, 1)}
    out: dict = {"checkpoint": str(path), "backbone": str(backbone_path), "prompts": prompts,
                 "prompt_len": prompt_len, "new_tokens": new_tokens, "block_size": K}
    texts = {}
    for name, (drafter, block) in runs.items():
        stats = Acceptance(block)
        texts[name] = speculative_decode(backbone, targets, drafter_proposal(drafter, backbone, block), batch,
                                         new_tokens, block, pad, stats)
        result = stats.summary()
        log(f"{name}: mean accepted length {result['mean_accepted_length']:.3f} over {result['steps']} steps")
        if name == "dspark":
            out.update(result)
        else:
            out.setdefault("baselines", {})[name] = result
    same = all(torch.equal(texts["dspark"], t) for t in texts.values())
    out["outputs_agree"] = same  # every run's verified output is the backbone's greedy decoding: all equal
    if check_greedy:
        ref = greedy_decode(backbone, batch, new_tokens, pad, prompt_len + new_tokens + K + 1)
        out["equals_greedy"] = bool(torch.equal(ref, texts["dspark"]))
    return out
