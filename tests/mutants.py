"""Planted bugs that the suite must catch (tests/README.md, "Show that the test can fail").

Each mutant replaces one snippet of the code with a plausible wrong version, runs the tests that are
meant to catch it, and restores the file (also on an interrupt). A mutant that survives means the
tests cannot tell that behaviour from the right one.

    python tests/mutants.py                  # all (the trainer ones take 1-2 minutes each)
    python tests/mutants.py --fast           # skip the multi-process trainer mutants
    python tests/mutants.py -k clip          # the mutants whose name contains "clip"

Not collected by pytest (no test_ prefix); CI does not run it. Keep the snippets in step with the code:
a mutant whose snippet is no longer found is reported as STALE.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Mutant:
    name: str
    file: str
    old: str
    new: str
    tests: list[str]

    @property
    def slow(self) -> bool:
        return "tests/test_trainer.py" in self.tests


MUTANTS = [
    Mutant('tiled loss averages per tile', 'train/loss.py',
           'reduction="sum") * (scale / n_valid)',
           'reduction="mean") * scale',
           ['tests/test_loss.py']),
    Mutant('tiled loss counts ignored positions', 'train/loss.py',
           'n_valid = max(1, int((labels != IGNORE).sum()))',
           'n_valid = labels.numel()',
           ['tests/test_loss.py']),
    Mutant('candidate pool keeps invisible blocks', 'model/attention.py',
           'return torch.where(top.values > float("-inf"), top.indices, -1).to(torch.int32)',
           'return top.indices.to(torch.int32)',
           ['tests/test_attention.py']),
    Mutant('reindex ignores the candidate pool', 'model/attention.py',
           'sc = sc.masked_fill(~keep, float("-inf"))',
           'sc = sc',
           ['tests/test_attention.py']),
    Mutant('lean attention backward forgets rowsum(dout * out)', 'model/sparse_attention.py',
           'dsw = pw * (torch.einsum("bchd,bld->bchl", do, keys) - row)',
           'dsw = pw * torch.einsum("bchd,bld->bchl", do, keys)',
           ['tests/test_sparse_attention.py']),
    Mutant('lean attention sink gradient sign', 'model/sparse_attention.py',
           'dsink -= (p_sink',
           'dsink += (p_sink',
           ['tests/test_sparse_attention.py']),
    Mutant('lean attention drops the value path of K = V', 'model/sparse_attention.py',
           ' * scale + torch.einsum("bchl,bchd->bld", pw, do)',
           ' * scale',
           ['tests/test_sparse_attention.py']),
    Mutant('lean index logits: ReLU gate missing in backward', 'model/index_logits.py',
           'ds = (dl.unsqueeze(2) * wc.unsqueeze(-1)) * (s > 0)',
           'ds = (dl.unsqueeze(2) * wc.unsqueeze(-1))',
           ['tests/test_sparse_attention.py']),
    Mutant('rope rotates first channels', 'model/rope.py',
           'nope, rot = x[..., :-rd], x[..., -rd:].float()',
           'rot, nope = x[..., :rd].float(), x[..., rd:]',
           ['tests/test_rope.py']),
    Mutant('rope half-split pairs', 'model/rope.py',
           'a, b = rot[..., 0::2], rot[..., 1::2]',
           'a, b = rot[..., :rot.shape[-1]//2], rot[..., rot.shape[-1]//2:]',
           ['tests/test_rope.py']),
    Mutant('rope inverse ignored', 'model/rope.py',
           '        sin = -sin\n',
           '        sin = sin\n',
           ['tests/test_rope.py']),
    Mutant('attention no inverse on output', 'model/attention.py',
           'o = apply_rope(o, cos, sin, inverse=True)',
           'o = o',
           ['tests/test_rope.py']),
    Mutant('attention forward rope on output', 'model/attention.py',
           'o = apply_rope(o, cos, sin, inverse=True)',
           'o = apply_rope(o, cos, sin)',
           ['tests/test_rope.py']),
    Mutant('yarn ramp reversed', 'model/rope.py',
           'freqs = freqs / factor * (1 - keep) + freqs * keep',
           'freqs = freqs / factor * keep + freqs * (1 - keep)',
           ['tests/test_rope.py']),
    Mutant('yarn beta swapped', 'model/rope.py',
           'low = max(math.floor(corrected_dim(beta_fast)), 0)',
           'low = max(math.floor(corrected_dim(beta_slow)) - 20, 0)',
           ['tests/test_rope.py']),
    Mutant('indexer no relu', 'model/attention.py',
           's = torch.einsum("bchd,bnd->bchn", q.float(), k.float()).relu_()',
           's = torch.einsum("bchd,bnd->bchn", q.float(), k.float())',
           ['tests/test_attention.py']),
    Mutant('indexer heads unweighted', 'model/attention.py',
           'return (s * w.unsqueeze(-1)).sum(dim=2)',
           'return (s * w.abs().unsqueeze(-1)).sum(dim=2)',
           ['tests/test_attention.py']),
    Mutant('indexer max over heads', 'model/attention.py',
           'return (s * w.unsqueeze(-1)).sum(dim=2)',
           'return (s * w.unsqueeze(-1)).amax(dim=2)',
           ['tests/test_attention.py']),
    Mutant('indexer visibility off by one', 'model/attention.py',
           'sc = sc.masked_fill(pos >= n_vis[t0:t1].unsqueeze(-1), float("-inf"))',
           'sc = sc.masked_fill(pos > n_vis[t0:t1].unsqueeze(-1), float("-inf"))',
           ['tests/test_attention.py']),
    Mutant('indexer empty slots kept as index', 'model/attention.py',
           'idx = torch.where(top.values > float("-inf"), top.indices, -1)',
           'idx = top.indices',
           ['tests/test_attention.py']),
    Mutant('indexer smallest k', 'model/attention.py',
           'top = sc.topk(k, dim=-1)',
           'top = sc.topk(k, dim=-1, largest=False)',
           ['tests/test_attention.py']),
    Mutant('indexer weight scale', 'model/attention.py',
           '* (self.n_heads * self.head_dim) ** -0.5',
           '* (self.head_dim) ** -0.5',
           ['tests/test_attention.py']),
    Mutant('indexer key no rope', 'model/attention.py',
           'return apply_rope(self.k_norm(self.wk(stop_gradient_connected(latent))), cos, sin)',
           'return self.k_norm(self.wk(stop_gradient_connected(latent)))',
           ['tests/test_attention.py']),
    Mutant('kl target not renormalised', 'model/attention.py',
           'p = p / p.sum(-1, keepdim=True).clamp_min(1e-30)',
           'p = p',
           ['tests/test_attention.py']),
    Mutant('comb transposed in expand', 'model/mhc.py',
           'mixed = torch.einsum("bsij,bsid->bsjd", comb, h.float())',
           'mixed = torch.einsum("bsji,bsid->bsjd", comb, h.float())',
           ['tests/test_mhc.py']),
    Mutant('one extra sinkhorn round', 'model/mhc.py',
           'for _ in range(iters - 1):',
           'for _ in range(iters):',
           ['tests/test_mhc.py']),
    Mutant('one fewer sinkhorn round', 'model/mhc.py',
           'for _ in range(iters - 1):',
           'for _ in range(iters - 2):',
           ['tests/test_mhc.py']),
    Mutant('row/col order swapped', 'model/mhc.py',
           '        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)\n        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)',
           '        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)\n        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)',
           ['tests/test_mhc.py']),
    Mutant('column softmax', 'model/mhc.py',
           'comb = comb.softmax(dim=-1) + eps',
           'comb = comb.softmax(dim=-2) + eps',
           ['tests/test_mhc.py']),
    Mutant('rms per stream', 'model/mhc.py',
           'rsqrt = torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)',
           'rsqrt = torch.rsqrt(h.float().square().mean(-1).repeat_interleave(h.shape[-1], -1).mean(-1, keepdim=True) * 1.1 + norm_eps)',
           ['tests/test_mhc.py']),
    Mutant('no single-pass shift (attn uses own pre)', 'model/transformer.py',
           'x = self.attn_norm(hc_collapse(h, carry.pre_mix))',
           'x = self.attn_norm(hc_collapse(h, attn_pre))',
           ['tests/test_mhc.py']),
    Mutant('block hands on attn pre', 'model/transformer.py',
           'return Carry(h, ffn_pre, carry.shared)',
           'return Carry(h, attn_pre, carry.shared)',
           ['tests/test_mhc.py']),
    Mutant('ffn mixes from pre-attn streams', 'model/transformer.py',
           'ffn_pre, ffn_post, ffn_comb = self._mixes(h, "ffn")',
           'ffn_pre, ffn_post, ffn_comb = self._mixes(carry.h, "ffn")',
           ['tests/test_mhc.py']),
    Mutant('post scale 1 not 2', 'model/mhc.py',
           'post = 2 * torch.sigmoid(',
           'post = 1 * torch.sigmoid(',
           ['tests/test_mhc.py']),
    Mutant('muon scale uses cols', 'train/optim/muon.py',
           'out = out * (group["rms_scale"] * math.sqrt(max(rows, cols)))',
           'out = out * (group["rms_scale"] * math.sqrt(cols))',
           ['tests/test_optim.py']),
    Mutant('muon scale uses min', 'train/optim/muon.py',
           'out = out * (group["rms_scale"] * math.sqrt(max(rows, cols)))',
           'out = out * (group["rms_scale"] * math.sqrt(min(rows, cols)))',
           ['tests/test_optim.py']),
    Mutant('NS main b/c swapped', 'train/optim/newton_schulz.py',
           'MAIN_COEFFS = (3.4445, -4.7750, 2.0315)',
           'MAIN_COEFFS = (3.4445, 2.0315, -4.7750)',
           ['tests/test_optim.py']),
    Mutant('NS 7 main steps', 'train/optim/newton_schulz.py',
           'V41_NS_SCHEDULE = (MAIN_COEFFS,) * 8 + (POLISH_COEFFS,) * 2',
           'V41_NS_SCHEDULE = (MAIN_COEFFS,) * 7 + (POLISH_COEFFS,) * 2',
           ['tests/test_optim.py']),
    Mutant('NS polish tweak', 'train/optim/newton_schulz.py',
           'POLISH_COEFFS = (2.0, -1.5, 0.5)',
           'POLISH_COEFFS = (1.875, -1.25, 0.375)',
           ['tests/test_optim.py']),
    Mutant('NS yaml 3 polish steps', 'conf/optim/v41.yaml',
           '[2, [2.0, -1.5, 0.5]]]',
           '[3, [2.0, -1.5, 0.5]]]',
           ['tests/test_optim.py']),
    Mutant('NS yaml eps', 'conf/optim/v41.yaml',
           'ns_eps: 1.0e-7',
           'ns_eps: 1.0e-2',
           ['tests/test_optim.py']),
    Mutant('NS ignores eps in prepare', 'train/optim/newton_schulz.py',
           'X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)',
           'X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-2)',
           ['tests/test_optim.py']),
    Mutant('attention scale 1/head_dim', 'model/attention.py',
           'self.scale = cfg.head_dim ** -0.5',
           'self.scale = cfg.head_dim ** -1.0',
           ['tests/test_attention.py']),
    Mutant('wo_a groups interleaved', 'model/attention.py',
           'o = o.reshape(B, S, self.n_groups, -1)',
           'o = o.reshape(B, S, -1, self.n_groups).transpose(-1, -2)',
           ['tests/test_attention.py']),
    Mutant('window one too wide', 'model/sparse_attention.py',
           'band = (p <= t) & (p > t - window)',
           'band = (p <= t) & (p >= t - window)',
           ['tests/test_attention.py']),
    Mutant('moe routing weights renormalised by softmax', 'model/moe.py',
           'y = self.experts(flat, weights, indices)',
           'y = self.experts(flat, torch.softmax(weights, -1) * weights.sum(-1, keepdim=True), indices)',
           ['tests/test_moe.py']),
    Mutant('moe shared expert dropped', 'model/moe.py',
           '            y = y + self.shared_experts(flat).float()',
           '            y = y + 0 * self.shared_experts(flat).float()',
           ['tests/test_moe.py']),
    Mutant('engram q_weight ignored', 'model/engram.py',
           'dot = (x * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1)',
           'dot = (x * (self.k_weight.float()) * key).sum(-1)',
           ['tests/test_engram.py']),
    Mutant('engram q_weight stream flipped', 'model/engram.py',
           'dot = (x * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1)',
           'dot = (x * (self.q_weight.float().flip(0) * self.k_weight.float()) * key).sum(-1)',
           ['tests/test_engram.py']),
    Mutant('aligner tanh gelu', 'model/vision.py',
           'return self.w2(F.gelu(self.w1(pixel_unshuffle(feats, n_h, n_w, self.r))))',
           'return self.w2(F.gelu(self.w1(pixel_unshuffle(feats, n_h, n_w, self.r)), approximate="tanh"))',
           ['tests/test_vision.py']),
    Mutant('moe weights from biased scores', 'model/moe.py',
           'weights = scores.gather(1, indices)',
           'weights = (scores + bias).gather(1, indices)',
           ['tests/test_moe.py', '-k', 'literal']),
    Mutant('moe image tokens use text bias', 'model/moe.py',
           'torch.where(image_mask.unsqueeze(-1), self.bias_vl, self.bias)',
           'torch.where(image_mask.unsqueeze(-1), self.bias, self.bias)',
           ['tests/test_moe.py', '-k', 'literal']),
    Mutant('restore drops last buffered piece', 'data/loader.py',
           'self.buffers = [[Piece.from_state(p) for p in b] for b in state.get("buffers", [[], []])]',
           'self.buffers = [[Piece.from_state(p) for p in b][:-1] for b in state.get("buffers", [[], []])]',
           ['tests/test_data.py']),
    Mutant('restore drops pending pieces', 'data/loader.py',
           'self.pending = [deque(Piece.from_state(p) for p in q) for q in state.get("pending", [[], []])]',
           'self.pending = [deque() for q in state.get("pending", [[], []])]',
           ['tests/test_data.py']),
    Mutant("restore drops the mm buffer's newest piece", 'data/loader.py',
           'self.buffers = [[Piece.from_state(p) for p in b] for b in state.get("buffers", [[], []])]',
           'self.buffers = [[Piece.from_state(p) for p in b][:len(b) - i] for i, b in enumerate(state.get("buffers", [[], []]))]',
           ['tests/test_data.py']),
    Mutant('restore reverses buffer order', 'data/loader.py',
           'self.buffers = [[Piece.from_state(p) for p in b] for b in state.get("buffers", [[], []])]',
           'self.buffers = [[Piece.from_state(p) for p in b][:1] + [Piece.from_state(p) for p in b][1:][::-1] for b in state.get("buffers", [[], []])]',
           ['tests/test_data.py']),
    Mutant('expert replica divisor dp/ep', 'train/trainer.py',
           '            self._average(experts, self.rep_group, self.layout.dp)',
           '            self._average(experts, self.rep_group, self.layout.dp // self.layout.ep)',
           ['tests/test_trainer.py', '-k', 'four_processes']),
    Mutant('expert replicas not averaged', 'train/trainer.py',
           '        if self.layout.dp // self.layout.ep > 1:\n            self._average(experts',
           '        if False:\n            self._average(experts',
           ['tests/test_trainer.py', '-k', 'four_processes']),
    Mutant('expert grads averaged over dp group', 'train/trainer.py',
           '            self._average(experts, self.rep_group, self.layout.dp)',
           '            self._average(experts, self.dp_group, self.layout.dp)',
           ['tests/test_trainer.py', '-k', 'four_processes']),
    Mutant('clip ignores pp group', 'train/trainer.py',
           'self.ep_group if self.layout.ep > 1 else None, self.pp_group)',
           'self.ep_group if self.layout.ep > 1 else None, None)',
           ['tests/test_trainer.py', '-k', 'resumes_across_layouts']),
    Mutant('clip ignores ep group', 'train/trainer.py',
           'self.ep_group if self.layout.ep > 1 else None, self.pp_group)',
           'None, self.pp_group)',
           ['tests/test_trainer.py', '-k', 'resumes_across_ep']),
    Mutant('clip scales up', 'train/clipping.py',
           'coef = (max_norm / (norm + CLIP_EPS)).clamp(max=1.0)',
           'coef = (max_norm / (norm + CLIP_EPS))',
           ['tests/test_clipping.py']),
    Mutant('clip norm is sum not sqrt', 'train/clipping.py',
           'return _all_reduce(sq.reshape(1), stage_group).reshape(()).sqrt()',
           'return _all_reduce(sq.reshape(1), stage_group).reshape(())',
           ['tests/test_clipping.py']),
    Mutant('clip sharded counted once', 'train/clipping.py',
           'sq = sq + _all_reduce(sharded.reshape(1), shard_group).reshape(())',
           'sq = sq + sharded',
           ['tests/test_clipping.py']),
    Mutant('materialise before pruning', 'parallel/construct.py',
           '    if stages is not None:\n        prune_to_stages(template, stages)\n    if ep > 1:\n        shard_experts(template, ep, ep_rank, ep_group)\n    return template.materialize(device, seed)',
           '    template.materialize(device, seed)\n    if stages is not None:\n        prune_to_stages(template, stages)\n    if ep > 1:\n        shard_experts(template, ep, ep_rank, ep_group)\n    return template',
           ['tests/test_construction.py']),
    Mutant('expert init ignores the global offset', 'model/init.py',
           'row_offset=getattr(module, "offset", 0), stacked=True',
           'row_offset=0, stacked=True',
           ['tests/test_construction.py']),
    Mutant('init from the global RNG', 'model/init.py',
           '        block = torch.empty((min(per, total - start),) + row_shape).normal_(0.0, std, generator=_generator(seed, name, b))',
           '        block = torch.empty((min(per, total - start),) + row_shape).normal_(0.0, std)',
           ['tests/test_construction.py']),
    Mutant('buffers not recomputed', 'model/init.py',
           '        if module is not model and hasattr(module, "reset_buffers"):\n            module.reset_buffers()',
           '        pass',
           ['tests/test_construction.py']),
    Mutant('block seed ignores block index', 'model/init.py',
           'digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()',
           'digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()',
           ['tests/test_construction.py']),
    Mutant('nearest batch rounds down only', 'train/trainer.py',
           'nearest = sorted({max(unit, g // unit * unit), (g // unit + 1) * unit}, key=lambda n: (abs(n - g), n))',
           'nearest = [max(unit, g // unit * unit)]',
           ['tests/test_construction.py']),
    Mutant('recomputation writes the side channel', 'model/recompute.py',
           'run_ctx = ctx if first[0] else dataclasses.replace(ctx, stats=StepStats())',
           'run_ctx = ctx',
           ['tests/test_recompute.py']),
    Mutant('selective recomputes the all-to-alls', 'model/recompute.py',
           'ops = {aten.mm.default, aten.addmm.default, c10d.all_to_all_single.default, c10d.wait_tensor.default,\n           c10d._wrap_tensor_autograd.default}',
           'ops = {aten.mm.default, aten.addmm.default}',
           ['tests/test_recompute.py']),
    Mutant('selective keeps nothing', 'model/recompute.py',
           'return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE',
           'return CheckpointPolicy.PREFER_RECOMPUTE',
           ['tests/test_recompute.py']),
    Mutant('estimator counts no optimizer state', 'train/estimate.py',
           '        self.optim.step()\n        self.optim.zero_grad(set_to_none=True)',
           '        self.optim.zero_grad(set_to_none=True)',
           ['tests/test_estimate.py']),
]


def run(m: Mutant, basetemp: str) -> str:
    path = ROOT / m.file
    original = path.read_text()
    if m.old not in original:
        return "STALE"
    path.write_text(original.replace(m.old, m.new, 1))
    try:
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                              f"--basetemp={basetemp}", *m.tests], cwd=ROOT, capture_output=True, text=True)
    finally:
        path.write_text(original)
    return "caught" if out.returncode != 0 else "SURVIVED"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="skip the multi-process trainer mutants")
    ap.add_argument("-k", default="", help="only mutants whose name contains this")
    args = ap.parse_args()
    chosen = [m for m in MUTANTS if args.k in m.name and not (args.fast and m.slow)]
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for m in chosen:
            verdict = run(m, tmp)
            bad += verdict != "caught"
            print(f"{verdict:9} {m.name}  ({m.file})", flush=True)
    print(f"{len(chosen) - bad} of {len(chosen)} mutants caught")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
