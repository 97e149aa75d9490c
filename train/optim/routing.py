"""Parameter routing for the three-optimizer split (V41_SPEC §7), and the optimizer set built from it.

Every parameter is assigned (and checked by shape) by its kind (model/param_kinds.py) where the kind
decides, else by name, by the first matching rule:

| rule | parameters | optimizer |
|---|---|---|
| sinkhorn        | kinds EMBEDDING and HEAD (`embed.weight`, `head.weight`) | SinkhornBalanced |
| sinkhorn_engram | kind ENGRAM_TABLE (`layers.*.engram.embed.weight`) | SinkhornBalanced, lr x `engram_lr_mult` |
| adamw_norm      | RMSNorm weights (`*norm.weight`, `norm1/norm2`, `q_norm`, `kv_norm`, `k_norm`, ...) | AdamW, weight decay |
| sinkhorn_markov | the DSpark Markov head's `mtp.*.markov_head.embed.weight` / `head.weight` ([vocab, rank]: a token embedding and an output head, like `embed` / `head`; our choice) | SinkhornBalanced |
| adamw_probe     | the DSpark confidence head's `mtp.*.confidence_head.proj.weight` ([1, dim + rank]: a linear probe to one logit, where Muon's orthogonalisation would only normalise the row; our choice) | AdamW, no weight decay |
| muon_q_heads    | `layers.*.attn.wq_b.weight`, the drafter's `mtp.*.attn.wq_b.weight` | head-wise Muon, `n_heads` heads |
| muon_index_heads| `layers.*.attn.indexer.wq_b.weight` | head-wise Muon, `index_n_heads` heads |
| adamw           | biases, `attn_sink`, mHC `hc_*_base` / `hc_*_scale`, Engram `q_weight` / `k_weight`, image START / NEWLINE / END vectors | AdamW, no weight decay |
| muon            | kind ROUTED_EXPERT (stacked `experts.w1/w2/w3` [E, out, in]); every other `.weight` matrix, mHC `hc_*_fn` | Muon |
| adamw_matrix    | what `muon` / `muon_q_heads` / `muon_index_heads` would take, under `optim.matrices: adamw` (the Muon ablation, docs/training.md) | AdamW, weight decay `optim.adamw.weight_decay` |

Key weights: the report names "query and key weights" for head-wise Muon, but in V4.1 every key
projection produces a single head -- the attention key is the one shared 512-d latent (`attn.wkv`,
`compressor.wkv`/`wgate`, MQA-like) and the indexer key is one shared 128-d vector (`indexer.wk`).
Head-wise Muon with one head *is* plain Muon, so those stay in the `muon` rule. The query weights are
the only multi-head projections and are the ones treated head-wise. Engram `q_weight` / `k_weight` are
element-wise gate scales (used only as their product), not projections, so they go to AdamW.

The ViT body (`vision.*` except its final norm) gets `optim.vision_lr_mult`; frozen parameters are
routed like all others (they receive no gradient, so no optimizer state, until unfrozen). MoE
selection biases are buffers and belong to no optimizer. A parameter matching no rule is an error.

Every group carries `lr_mult`; `group["lr"] = lr * lr_mult`, and the LR schedule keeps that relation.
"""  # noqa: E501 - markdown table rows cannot be wrapped

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn

from flashtrain.config.errors import ConfigError
from flashtrain.model.config import ModelConfig
from flashtrain.model.param_kinds import ParamKind, parameter_kinds
from flashtrain.model.vision import is_vision_body
from flashtrain.train.optim.adamw import ShardedAdamW
from flashtrain.train.optim.config import OptimConfig
from flashtrain.train.optim.muon import Muon, _as_matrices
from flashtrain.train.optim.sinkhorn import SinkhornBalanced

KIND_RULES: dict[ParamKind, str] = {ParamKind.EMBEDDING: "sinkhorn", ParamKind.HEAD: "sinkhorn",
                                    ParamKind.ENGRAM_TABLE: "sinkhorn_engram", ParamKind.ROUTED_EXPERT: "muon"}
RULES: tuple[tuple[str, str], ...] = (  # the matrices and vectors, by name
    ("adamw_norm", r"(^|\.)(\w*norm\d?)\.weight$"),
    ("sinkhorn_markov", r"\.markov_head\.(embed|head)\.weight$"),
    ("adamw_probe", r"\.confidence_head\.proj\.weight$"),
    ("muon_q_heads", r"^(layers|mtp)\.\d+\.attn\.wq_b\.weight$"),
    ("muon_index_heads", r"^layers\.\d+\.attn\.indexer\.wq_b\.weight$"),
    ("adamw", r"(\.bias|(^|\.)attn_sink|\.hc_(attn|ffn)_(base|scale)|\.engram\.[qk]_weight"
              r"|^image_(start|newline|end))$"),
    ("muon", r"(\.weight|\.hc_(attn|ffn)_fn)$"),
)
OPTIMIZER_OF = {"sinkhorn": "sinkhorn", "sinkhorn_engram": "sinkhorn", "sinkhorn_markov": "sinkhorn",
                "adamw_probe": "adamw", "adamw_norm": "adamw", "adamw": "adamw", "adamw_matrix": "adamw",
                "muon": "muon", "muon_q_heads": "muon", "muon_index_heads": "muon"}


class RoutingError(ConfigError):
    """A parameter that no routing rule places (or that a rule cannot take)."""


def route_name(name: str, shape: torch.Size, kind: ParamKind) -> str:
    """The rule of a parameter: its kind's where KIND_RULES has one, else the first RULES pattern its name
    matches."""
    rule = KIND_RULES.get(kind) or next((r for r, pattern in RULES if re.search(pattern, name)), None)
    if rule is None:
        raise RoutingError(f"parameter {name!r} (shape {tuple(shape)}) matches no optimizer routing rule; add it to "
                           f"train/optim/routing.py RULES")
    if OPTIMIZER_OF[rule] != "adamw" and len(shape) not in (2, 3):
        raise RoutingError(f"parameter {name!r} matches rule {rule!r} but has shape {tuple(shape)}; "
                           f"{OPTIMIZER_OF[rule]} takes matrices")
    if OPTIMIZER_OF[rule] == "sinkhorn" and len(shape) != 2:
        raise RoutingError(f"parameter {name!r}: the Sinkhorn update takes [rows, features], got {tuple(shape)}")
    return rule


@dataclass
class RoutedGroup:
    optimizer: str
    rule: str
    lr_mult: float
    options: dict
    names: list[str] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)


def route_parameters(model: nn.Module, model_cfg: ModelConfig, optim_cfg: OptimConfig) -> list[RoutedGroup]:
    """Param groups for every parameter of `model` (frozen ones included), keyed by
    (rule, lr multiplier)."""
    groups: dict[tuple[str, float], RoutedGroup] = {}
    kinds = parameter_kinds(model)
    for name, p in model.named_parameters():
        rule = route_name(name, p.shape, kinds[name])
        if optim_cfg.matrices == "adamw" and OPTIMIZER_OF[rule] == "muon":
            rule = "adamw_matrix"
        lr_mult = optim_cfg.vision_lr_mult if is_vision_body(name) else 1.0
        if rule == "sinkhorn_engram":
            lr_mult *= optim_cfg.sinkhorn.engram_lr_mult
        options: dict = {}
        if rule == "muon_q_heads":
            options["num_heads"] = model_cfg.n_heads
        elif rule == "muon_index_heads":
            options["num_heads"] = model_cfg.index_n_heads
        elif rule in ("adamw_norm", "adamw_matrix"):
            options["weight_decay"] = optim_cfg.adamw.weight_decay
        elif rule in ("adamw", "adamw_probe"):
            options["weight_decay"] = 0.0
        key = (rule, lr_mult)
        if key not in groups:
            groups[key] = RoutedGroup(OPTIMIZER_OF[rule], rule, lr_mult, options)
        groups[key].names.append(name)
        groups[key].params.append(p)
    return list(groups.values())


def routing_summary(groups: list[RoutedGroup]) -> dict:
    """{optimizer: {"params": count, "tensors": count, "rules": {rule: count}}} for `launch/plan.py`."""
    out: dict = {}
    for g in groups:
        o = out.setdefault(g.optimizer, {"params": 0, "tensors": 0, "rules": {}})
        n = sum(p.numel() for p in g.params)
        o["params"] += n
        o["tensors"] += len(g.params)
        o["rules"][g.rule] = o["rules"].get(g.rule, 0) + n
    return out


class OptimizerSet:
    """The three optimizers stepped together. Checkpoints and rollback snapshots read and restore each
    optimizer's own pieces of state (`optimizers[name].owned_state()` / `install_state`, train/optim/base.py;
    train/checkpoint.py, train/stability/spike.py), not a state_dict."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers.values() for g in o.param_groups]

    def step(self) -> None:
        for o in self.optimizers.values():
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=set_to_none)

    def set_lr(self, lr: float) -> None:
        """Set the base learning rate: every group gets lr * its lr_mult."""
        for g in self.param_groups:
            g["lr"] = lr * g["lr_mult"]


OPTIMIZERS = {"muon": Muon, "sinkhorn": SinkhornBalanced, "adamw": ShardedAdamW}


def zero_inputs(groups: list[RoutedGroup]) -> tuple[dict[str, str], dict[str, tuple[int, int, int]]]:
    """What ZeRO-1 ownership needs (parallel/dims.py `zero_plan`): how each parameter's optimizer splits it
    (its `ZERO_SPLIT`: "matrices", "rows" or "flat"), and for a split by matrices the matrices it sees,
    (n, rows, cols)."""
    splits, matrices = {}, {}
    for g in groups:
        split = OPTIMIZERS[g.optimizer].ZERO_SPLIT
        for n, p in zip(g.names, g.params):
            splits[n] = split
            if split == "matrices":
                matrices[n] = tuple(_as_matrices(p, g.options.get("num_heads")).shape)
    return splits, matrices


def state_buffers(groups: list[RoutedGroup]) -> dict[str, int]:
    """Each parameter's optimizer state in values per parameter value (its optimizer's `STATE_BUFFERS`), for the
    partitioner's cost model (parallel/partition.py)."""
    return {n: OPTIMIZERS[g.optimizer].STATE_BUFFERS for g in groups for n in g.names}


def build_optimizers(model: nn.Module, model_cfg: ModelConfig, optim_cfg: OptimConfig,
                     zero_of=None, row_group_of=None, *, lr: float) -> OptimizerSet:
    """`lr`: the base learning rate to start from; the LR schedule is its only source (the trainer passes
    the schedule's value at the current step and sets it again before every step, `set_lr`).
    zero_of(param) -> its ZeRO-1 Ownership (None: optimizer state replicated, every rank updates every
    parameter it holds, Newton-Schulz included); row_group_of(param) -> the group a row-sharded table
    is split over."""
    groups = route_parameters(model, model_cfg, optim_cfg)

    def pg(g: RoutedGroup) -> dict:
        return {"params": g.params, "lr": lr * g.lr_mult, "lr_mult": g.lr_mult, "rule": g.rule, **g.options}

    by_opt: dict[str, list[dict]] = {"muon": [], "sinkhorn": [], "adamw": []}
    for g in groups:
        by_opt[g.optimizer].append(pg(g))
    m, s, a = optim_cfg.muon, optim_cfg.sinkhorn, optim_cfg.adamw
    opts: dict[str, torch.optim.Optimizer] = {}
    if by_opt["muon"]:
        opts["muon"] = Muon(by_opt["muon"], lr=lr, momentum=m.momentum, weight_decay=m.weight_decay,
                            nesterov=m.nesterov, rms_scale=m.rms_scale, ns_coefficients=m.coefficients(),
                            ns_eps=m.ns_eps, ns_dtype=m.torch_ns_dtype(), use_triton=optim_cfg.use_triton,
                            zero_of=zero_of)
    if by_opt["sinkhorn"]:
        opts["sinkhorn"] = SinkhornBalanced(by_opt["sinkhorn"], lr=lr, momentum=s.momentum, num_steps=s.num_steps,
                                            tau=s.tau, eps=s.eps, gamma=s.gamma, use_triton=optim_cfg.use_triton,
                                            chunk_elems=s.chunk_elems, row_group_of=row_group_of, zero_of=zero_of)
    if by_opt["adamw"]:
        opts["adamw"] = ShardedAdamW(by_opt["adamw"], zero_of, lr=lr, betas=tuple(a.betas), eps=a.eps,
                                     weight_decay=0.0)
    return OptimizerSet(opts)
