"""A model's forward alone over pipeline stages (DESIGN.md "Parallelism"): the DSpark stage's frozen backbone
(train/dspark/stage.py), which has no backward, so nothing travels back and no schedule is needed."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashtrain.model.carry import Carry, SharedKV
from flashtrain.model.layer_plan import layer_plan
from flashtrain.parallel.pipeline import FieldSpec, boundary_specs


class ForwardPipeline:
    """The frozen backbone's forward over pipeline stages (`parallel.pp`, one stage per rank): every rank of a
    pipeline reads the same micro-batches (its dp rank's); stage r receives the carry of each micro-batch from
    stage r - 1, runs its blocks without gradients and sends the carry on; nothing travels back (the backbone
    has no backward). What crosses a boundary before block l: the carry's fields as in pre-training
    (parallel/pipeline.py `boundary_specs`: h, pre_mix, the live CSA2 fields; not the tokens, which every stage
    has), plus the hc-mean of every target layer before l (`dspark_target_layer_ids`), [b, L, dim] fp32 each:
    the drafter on the last stage reads them. With the published targets 37, 38, 39 the last stage normally
    holds all three and no capture crosses a boundary."""

    def __init__(self, cfg, stage, dims, micro_batch: int, seq_len: int):
        self.stage, self.group = stage, dims.pp_group
        self.first, self.last = stage.is_first, stage.is_last
        local = -(-seq_len // dims.cp) if dims.cp > 1 else None
        L = local or seq_len

        def specs(boundary: int):
            carry = boundary_specs(cfg, layer_plan(cfg), boundary, micro_batch, seq_len, local)[2:]  # not tokens
            return carry + [FieldSpec(f"capture{t}", (micro_batch, L, cfg.dim), torch.float32)
                            for t in cfg.dspark_target_layer_ids if t < boundary]

        self.recv_specs = None if self.first else specs(stage.start)
        self.send_specs = None if self.last else specs(stage.end)
        rank = dims.pp_rank
        self.prev = None if self.first else dist.get_global_rank(self.group, rank - 1)
        self.next = None if self.last else dist.get_global_rank(self.group, rank + 1)

    def receive(self, device) -> tuple[Carry, dict]:
        """The carry and the captures of the previous stage."""
        got = {}
        for s in self.recv_specs:
            t = torch.empty(s.shape, dtype=s.dtype, device=device)
            dist.recv(t, src=self.prev, group=self.group)
            got[s.name] = t
        captures = {int(k[len("capture"):]): got.pop(k) for k in list(got) if k.startswith("capture")}
        h, pre = got.pop("h"), got.pop("pre_mix")
        return Carry(h, pre, SharedKV(**got)), captures

    def send(self, carry: Carry, captures: dict) -> None:
        for s in self.send_specs:
            t = captures[int(s.name[len("capture"):])] if s.name.startswith("capture") else carry.get(s.name)
            dist.send(t.to(s.dtype).contiguous(), dst=self.next, group=self.group)
