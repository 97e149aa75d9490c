"""The DSpark stage (train/dspark/stage.py, train/dspark/loss.py): the objective against a literal transcription of
DeepSpec's `compute_dspark_loss`, the statistics by hand, the draft loss falling on a fixed batch with the
backbone bit-identical and outside every autograd graph; end to end through launch/pretrain.py: exact
resume, and a resume against another backbone refused naming both."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import warm_launch
from layer_plans import FOUR_LAYERS

from flashtrain.data.loader import IGNORE
from flashtrain.model import Transformer
from flashtrain.model.dspark import DSpark
from flashtrain.train.config import compose, model_config
from flashtrain.train.dspark.loss import DSparkLossConfig, dspark_loss, read_stats, stat_layout, supervision

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["model.dspark_target_layer_ids=[1,2,3]"]  # the last layers of the 4-layer plan


@pytest.fixture(scope="module")
def cfg():
    return model_config(compose(["+exp=flash_tiny", *FOUR_LAYERS, *TARGETS]))


def fixed_batch(cfg, B=2, S=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 400, (B, S + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[0, 20:23] = IGNORE  # a gap (padding / an image): blocks across it stop being supervised
    labels[1, -1] = IGNORE
    return {"tokens": tokens[:, :-1], "labels": labels, "token_types": torch.full((B, S), -1),
            "images": [[] for _ in range(B)], "pad_tokens": 0}


def literal_objective(x, drafter, head, final, labels, lc: DSparkLossConfig):
    """DeepSpec's compute_dspark_loss written out per anchor and position: anchor t drafts the tokens at
    t + 2 + k (labels[t + 1 + k]) from the Markov bias of labels[t + k]; target distribution = softmax of the
    backbone's head at t + 1 + k; the eval mask is cumulative; weights exp(-k / gamma)."""
    B, L, K, _ = x.shape
    S = labels.shape[1]
    num = {"ce": 0.0, "l1": 0.0, "bce": 0.0}
    den = 0.0
    last = drafter.mtp[-1]
    for b in range(B):
        for t in range(L):
            alive = labels[b, t] != IGNORE
            for k in range(K):
                u = t + 1 + k
                alive = alive and u < S and labels[b, u] != IGNORE and labels[b, t + k] != IGNORE
                if not alive:
                    break
                w = math.exp(-k / lc.decay_gamma)
                prev = labels[b, t + k]
                markov = last.markov_head.head.weight @ last.markov_head.embed.weight[prev]
                z = head(last.norm(x[b, t, k])).float() + markov
                p = z.softmax(-1)
                q = head(final[b, u]).float().softmax(-1)
                ce = -z.log_softmax(-1)[labels[b, u]]
                l1 = (p - q).abs().sum()
                a = (1 - l1 / 2).clamp(0, 1)
                c = torch.cat([x[b, t, k], last.markov_head.embed.weight[prev]]) @ last.confidence_head.proj.weight[0]
                bce = F.binary_cross_entropy_with_logits(c, a.detach())
                num["ce"] += w * ce
                num["l1"] += w * l1
                num["bce"] += w * bce
                den += w
    return (lc.ce_weight * num["ce"] + lc.l1_weight * num["l1"] + lc.confidence_weight * num["bce"]) / den


def test_objective_equals_deepspec_literal_and_tiling_does_not_matter(cfg):
    torch.manual_seed(0)
    drafter = DSpark(cfg, seed=1)
    head = torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.3)  # a peaked target distribution (l1 far from 0 and 2)
    batch = fixed_batch(cfg, B=2, S=12)
    B, S, K = 2, 12, cfg.dspark_block_size
    x = torch.randn(B, S, K, cfg.dim, requires_grad=True)
    final = torch.randn(B, S, cfg.dim)
    lc = DSparkLossConfig()
    positions = torch.arange(S)
    side = [p for n, p in drafter.named_parameters() if n.startswith(("mtp.2.norm", "mtp.2.markov", "mtp.2.conf"))]
    loss, stats = dspark_loss(x, drafter, head, final, batch["labels"], positions, lc, tile_tokens=10)
    loss.backward()  # the head-side parameters' gradients were accumulated in the forward, x's now
    g, g_side = x.grad.clone(), [p.grad.clone() for p in side]
    x.grad = None
    drafter.zero_grad(set_to_none=True)
    ref = literal_objective(x, drafter, head, final, batch["labels"], lc)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    ref.backward()
    torch.testing.assert_close(g, x.grad, rtol=1e-4, atol=1e-7)
    for p, got in zip(side, g_side):
        torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-8)
    x.grad = None
    whole, stats_whole = dspark_loss(x, drafter, head, final, batch["labels"], positions, lc, tile_tokens=10_000)
    assert whole.item() == pytest.approx(loss.item(), rel=1e-6)
    torch.testing.assert_close(stats, stats_whole, rtol=1e-6, atol=1e-9)


def test_supervision_and_statistics_by_hand():
    """Labels with a gap: which positions are supervised (cumulative), and the accepted lengths from given
    accept rates."""
    labels = torch.tensor([[10, 11, 12, IGNORE, 14, 15]])
    first, prev, targets, _, mask, w = supervision(labels, torch.arange(6), K=3, gamma=2.0)
    assert first.tolist() == [[10, 11, 12, IGNORE, 14, 15]]
    # anchor 0 drafts labels[1..3] = 11, 12, IGNORE: two supervised positions; anchor 3's first token is missing
    assert mask[0].int().tolist() == [[1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]]
    assert targets[0, 0].tolist() == [11, 12, IGNORE] and prev[0, 0].tolist() == [10, 11, 12]
    assert w[0, 0].tolist() == pytest.approx([1.0, math.exp(-0.5), 0.0])
    # statistics: read_stats of a hand-filled vector (K = 2, 2 bins)
    lay = stat_layout(2, 2)
    v = torch.zeros(lay["bin_target"].stop, dtype=torch.float64)
    v[lay["ce"]] = torch.tensor([3.0, 4.0])
    v[lay["count"]] = torch.tensor([2.0, 1.0])
    v[lay["expected"]], v[lay["measured"]], v[lay["anchors"]] = 5.0, 3.0, 2.0
    v[lay["bin_n"]], v[lay["bin_pred"]], v[lay["bin_target"]] = (torch.tensor([1.0, 2.0]), torch.tensor([0.2, 1.6]),
                                                                 torch.tensor([0.5, 1.0]))
    r = read_stats(v, 2, 2)
    assert r["draft_loss"] == pytest.approx(7 / 3) and r["draft_loss_per_position"] == [1.5, 4.0]
    assert r["acceptance_length"] == {"expected": 2.5, "measured": 1.5}
    assert r["confidence_ece"] == pytest.approx((0.3 + 0.6) / 3)  # sum |pred - target| per bin over the count


def test_expected_acceptance_of_one_anchor_by_hand(cfg):
    """Anchor with accept rates a_k: 1 + a_0 + a_0 a_1 + ...; the measured length counts the agreeing prefix."""
    torch.manual_seed(0)
    drafter = DSpark(cfg, seed=1)
    head = torch.nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
    K = cfg.dspark_block_size
    labels = torch.randint(3, 400, (1, K + 2))
    x = torch.randn(1, 1, K, cfg.dim)
    final = torch.randn(1, K + 2, cfg.dim)
    with torch.no_grad():
        _, stats = dspark_loss(x, drafter, head, final, labels, torch.tensor([0]), DSparkLossConfig(), 100)
        lay = stat_layout(K, 10)
        last = drafter.mtp[-1]
        a, agree = [], []
        for k in range(K):
            z = head(last.norm(x[0, 0, k])) + last.markov_head.head.weight @ last.markov_head.embed.weight[labels[0, k]]
            q = head(final[0, 1 + k]).softmax(-1)
            a.append(1 - 0.5 * (z.softmax(-1) - q).abs().sum().item())
            agree.append(float(z.argmax() == q.argmax()))
    assert stats[lay["expected"]].item() == pytest.approx(1 + sum(math.prod(a[:k + 1]) for k in range(K)), rel=1e-5)
    assert stats[lay["measured"]].item() == 1 + sum(math.prod(agree[:k + 1]) for k in range(K))


def _autograd_leaves(t: torch.Tensor) -> set[int]:
    """ids of the tensors whose gradient a backward of t would accumulate (AccumulateGrad nodes)."""
    seen, out, todo = set(), set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            out.add(id(fn.variable))
        todo += [f for f, _ in fn.next_functions]
    return out


def test_fixed_batch_draft_loss_falls_and_the_backbone_never_changes(cfg):
    """Twelve optimizer steps of the stage's runner and optimizers on one batch: the objective and the draft
    CE fall; the backbone's parameters and buffers are bit-identical, none requires a gradient, none is a
    leaf of the objective's autograd graph, none has a .grad, and no optimizer holds one."""
    from flashtrain.model.aux import StepStats
    from flashtrain.parallel.dims import ParallelDims
    from flashtrain.train.build import read_configs
    from flashtrain.train.dspark.stage import DSparkRunner, freeze
    from flashtrain.train.optim import build_optimizers
    from flashtrain.train.runtime.collectives import Operation
    from flashtrain.train.step_values import StepValues

    c = read_configs(compose(["+exp=flash_tiny", *FOUR_LAYERS, *TARGETS]))  # the optimizer settings
    torch.manual_seed(0)
    backbone = Transformer(cfg, seed=5)
    with torch.no_grad():  # logits of a trained model's spread (at init std 0.006 every distribution is flat)
        backbone.head.weight.normal_(0, 0.3)
        backbone.embed.weight.normal_(0, 0.3)
    backbone = freeze(backbone)
    before = {k: v.clone() for k, v in backbone.state_dict().items()}
    drafter = DSpark(cfg, seed=6)
    dims = ParallelDims.build(1, 0, 1, 1, cfg.n_layers, cfg.dspark_n_routed_experts)
    optim = build_optimizers(drafter, cfg, c.optim, lr=1e-2)
    runner = DSparkRunner(drafter, backbone, DSparkLossConfig(), dims.grad_reducer(drafter), 1,
                          device=torch.device("cpu"), loss_tile_tokens=64, mixed_precision=False, counts_data=True,
                          op=Operation())
    batch = fixed_batch(cfg)
    loss, _ = runner.micro_batch(batch, StepStats(), 1.0)
    leaves = _autograd_leaves(loss)
    assert leaves and leaves <= {id(p) for p in drafter.parameters()}
    assert not leaves & {id(p) for p in backbone.parameters()}
    loss.backward()
    drafter.zero_grad(set_to_none=True)
    objective, draft_ce = [], []
    for _ in range(12):
        sums, _ = runner.run([batch])
        optim.step()
        v = sums.read()
        objective.append(v["loss"])
        draft_ce.append(read_stats(v["dspark"], cfg.dspark_block_size, 10)["draft_loss"])
    assert isinstance(sums, StepValues)
    assert objective[-1] < 0.9 * objective[0] and draft_ce[-1] < draft_ce[0] - 0.5, (objective, draft_ce)
    after = backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(not p.requires_grad and p.grad is None for p in backbone.parameters())
    held = {id(p) for o in optim.optimizers.values() for p, *_ in o.owned_state()}  # what holds state
    names = {id(p): n for n, p in drafter.named_parameters()}
    assert not held & {id(p) for p in backbone.parameters()}
    assert held == set(names), sorted(names[i] for i in set(names) - held)


# ----------------------------------------------------------------------------------------- end to end
STAGE = ["+exp=flash_tiny_dspark", *FOUR_LAYERS, *TARGETS, "logging.wandb.mode=disabled", "logging.progress=false",
         "logging.heatmap_interval=0", "data.mix=[1,1]", "train.checkpoint.interval=1", "train.checkpoint.keep=4"]


def write_backbone(path: Path, overrides: list[str], seed: int) -> Path:
    """A weights-only backbone checkpoint (as launch/import_official.py writes one) of a seeded flash_tiny."""
    from omegaconf import OmegaConf

    from flashtrain.train.checkpoint import _blob
    from flashtrain.train.official.dcp_parts import PartsWriter

    run_config = OmegaConf.to_container(compose(overrides), resolve=True)
    model = Transformer(model_config(compose(overrides)), seed=seed)
    writer = PartsWriter(path)
    writer.add({"model": model.state_dict()})
    writer.add({"meta": _blob({"step": 0, "tokens_seen": 0, "config": run_config, "weights_only": True})})
    writer.close()
    return path


def stage(run_dir, corpus_args, backbone, *overrides, check=True, procs=1):
    """launch/pretrain.py with the stage (torchrun --standalone with `procs` > 1)."""
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}"]
           if procs > 1 else [sys.executable])
    cmd += [str(ROOT / "launch" / "pretrain.py"), *STAGE, f"hydra.run.dir={run_dir}", f"train.backbone={backbone}",
            *corpus_args, *overrides]
    out = warm_launch.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def corpus_args(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    return [f"data.corpus_dir={d}", "data.corpus_text_bytes=1500000", "data.corpus_mm_docs=800", "data.corpus_shards=8"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_args):
    """A backbone checkpoint and the stage's straight run against it: one process, 2 loader workers (the global
    batch of 2 data-parallel readers), 3 steps, a checkpoint after each."""
    d = tmp_path_factory.mktemp("dspark_reference")
    backbone = write_backbone(d / "backbone", ["+exp=flash_tiny", *FOUR_LAYERS], seed=11)
    stage(d / "straight", corpus_args, backbone, "train.max_steps=3", "data.num_workers=2")
    return d, backbone


@pytest.mark.slow
@pytest.mark.xdist_group("dspark_reference")
def test_stage_resumes_exactly_and_refuses_another_backbone(tmp_path, corpus_args, reference):
    """launch/pretrain.py with train.stage=dspark: 3 straight steps against 2 + 1 resumed, bit for bit (records,
    drafter and optimizer state); the backbone checkpoint's files unchanged; a resume against a backbone with
    other weights refused, naming both; checkpoints hold the drafter's mtp.* tensors and no backbone tensor."""
    from test_trainer import final_model, records

    from flashtrain.train.dspark.stage import backbone_pointer

    d, backbone = reference
    other = write_backbone(tmp_path / "other", ["+exp=flash_tiny", *FOUR_LAYERS], seed=12)
    fingerprint = backbone_pointer(backbone)
    straight, resumed = d / "straight", tmp_path / "resumed"
    stage(resumed, corpus_args, backbone, "train.max_steps=2", "data.num_workers=2")
    refused = stage(resumed, corpus_args, other, "train.max_steps=3", "data.num_workers=2", check=False)
    assert refused.returncode != 0
    line = refused.stderr.strip().splitlines()[-1]
    assert str(backbone) in line and str(other) in line and "different checkpoint" in line
    again = stage(resumed, corpus_args, backbone, "train.max_steps=3", "data.num_workers=2")
    assert f"resumed from {resumed}/checkpoints/step_00000002 at step 2" in again.stdout
    a, b = records(straight), records(resumed)
    assert [r["step"] for r in a] == [1, 2, 3] == [r["step"] for r in b]
    for key in ("loss", "draft_loss", "draft_loss_per_position", "acceptance_length", "confidence_ece", "grad_norm",
                "expert_load"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    ma, oa = final_model(straight, 3)
    mb, ob = final_model(resumed, 3)
    assert ma.keys() == mb.keys() and all(k.startswith("mtp.") for k in ma) and "mtp.0.main_proj.weight" in ma
    assert all(torch.equal(ma[k], mb[k]) for k in ma) and oa.keys() == ob.keys()
    assert all(torch.equal(oa[k], ob[k]) for k in oa)
    assert any(ma[k].abs().sum() > 0 for k in ma if k.endswith("ffn.gate.bias"))  # the drafter's biases moved
    assert backbone_pointer(backbone) == fingerprint  # the backbone's files are untouched
    # launch/eval_dspark.py on the stage's checkpoint (in this process): its JSON, and the verified output is
    # the backbone's greedy decoding for the drafter and both baselines
    import contextlib
    import io
    import json

    sys.path.insert(0, str(ROOT / "launch"))
    import eval_dspark

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert eval_dspark.main([str(straight / "checkpoints" / "step_00000003"), "--prompts", "2", "--prompt-len",
                                 "16", "--new-tokens", "6", "--check-greedy", "--json"]) == 0
    result = json.loads(buf.getvalue().strip().splitlines()[-1])
    assert result["equals_greedy"] and result["outputs_agree"] and result["backbone"] == str(backbone)
    for r in (result, result["baselines"]["untrained"], result["baselines"]["block_1"]):
        assert 1.0 <= r["mean_accepted_length"] and len(r["acceptance_per_position"]) in (1, 5)
        assert r["confidence_ece"] is None or 0.0 <= r["confidence_ece"] <= 1.0
    assert result["baselines"]["block_1"]["mean_accepted_length"] <= 2.0


@pytest.mark.slow
@pytest.mark.xdist_group("dspark_reference")
@pytest.mark.parametrize("layout", [["parallel.ep=2", "data.num_workers=1"],
                                    ["parallel.cp=2", "parallel.ep=2", "data.num_workers=2"],
                                    ["parallel.pp=2", "parallel.stage_layers=[2,2]", "data.num_workers=2"]],
                         ids=["dp2_ep2", "cp2_ep2", "pp2"])
def test_stage_parity_with_one_process(tmp_path, corpus_args, reference, layout):
    """The same global batch in 2 processes: data parallel with the drafter's (and the backbone's) experts
    sharded over the 2 ranks; context parallel (each sequence's anchors split, the drafter's window halo and
    the target distribution exchanged) with experts over the cp ranks; the backbone in 2 pipeline stages of 2
    blocks each, the drafter on the second, target layer 1's hc-mean travelling with the carry. Losses, draft
    metrics and grad norms to rounding, expert loads as the reference's, for 2 steps."""
    from test_trainer import records

    d, backbone = reference
    stage(tmp_path / "run", corpus_args, backbone, "train.max_steps=2", *layout, procs=2)
    a, b = records(d / "straight")[:2], records(tmp_path / "run")
    assert [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        for key in ("loss", "draft_loss", "l1_loss", "confidence_loss"):
            assert y[key] == pytest.approx(x[key], rel=1e-5), key
        assert y["draft_loss_per_position"] == pytest.approx(x["draft_loss_per_position"], rel=1e-5)
        assert y["acceptance_length"]["expected"] == pytest.approx(x["acceptance_length"]["expected"], rel=1e-5)
        assert y["balance_loss"] == pytest.approx(x["balance_loss"], rel=1e-5)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
        assert y["expert_load"] == x["expert_load"] and y["tokens_seen"] == x["tokens_seen"]


def test_frozen_backbone_in_low_precision_keeps_the_release_fp32_tensors(cfg):
    """On CUDA the frozen backbone needs no fp32 master weights: bf16, but for what the release keeps in FP32
    (sinks, mHC); buffers (RoPE tables, gate biases) untouched."""
    from flashtrain.train.dspark.stage import freeze

    model = freeze(Transformer(cfg, seed=1), low_precision=True)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert dtypes["layers.0.attn.attn_sink"] == dtypes["layers.0.hc_attn_fn"] == torch.float32
    assert dtypes["layers.0.attn.wq_a.weight"] == dtypes["embed.weight"] == dtypes["head.weight"] == torch.bfloat16
    assert dtypes["layers.2.ffn.experts.w1"] == dtypes["layers.0.attn_norm.weight"] == torch.bfloat16
    assert model.layers[0].attn.rope_freqs.dtype == model.layers[0].ffn.gate.bias.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
