"""A pipeline stage that holds only the boundary tensors a schedule needs right now (DESIGN.md
"Parallelism", "Memory").

torch.distributed.pipelining's `PipelineStage` allocates, when a schedule first runs, one receive
buffer per micro-batch for every stage input and one for every output gradient, and keeps them for
the life of the stage: a stage of a round of M micro-batches holds M x (its input carry + its output
carry) at all times, the optimizer step included, however few micro-batches are in flight (at 64K
tokens the residual `h` alone is 4 GiB per micro-batch). It also keeps each forward output for the
backward call although only its autograd node is needed once the output is sent.

`LeanPipelineStage` changes three things and nothing else:
- receive buffers are allocated when the receive is posted (`get_fwd_recv_ops` / `get_bwd_recv_ops`)
  and dropped by the stage once consumed (after the micro-batch's forward, resp. backward): the
  forward input lives on only as the autograd input the backward needs, the output gradient until the
  backward has used it;
- the stage's sent outputs named in `release_outputs` (the residual `h`) give their storage up once
  the send is posted (Megatron-LM's `deallocate_output_tensor`): the tensor keeps its shape and
  autograd node and becomes a stride-0 view of one element, so `backward(outputs, grads)` still checks
  and routes; the send holds its own alias of the data until it completes. Only outputs that are
  produced by the stage's last operation and read by nothing else in the stage may be listed (an
  autograd-saved original would lose its values): `h` is the block chain's final value;
- the gradient of a received input is handed to the send and not kept on the buffer's `.grad`
  until the next step;
- the last stage's loss is detached once its backward has run: the schedule keeps every
  micro-batch's loss until the round ends (for `losses`), and a loss still attached to its graph keeps
  the graph's leaves alive -- the received inputs among them, M x the stage's input carry (80 GiB for
  16 micro-batches of exp=flash at 64K, measured with launch/estimate.py).
It also calls `before_last_backward(stage)` (when set) before the backward the schedule marks as the
round's last, and `before_last_forward(stage)` before the round's last forward (on the last stage its
loss computes the head's gradient), so the data-parallel gradient reduction (parallel/grad_reduce.py)
starts buckets as those passes complete them.
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.stage import _RecvInfo


def _empty_like_meta(meta, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device=device)


def _release_graph(loss: torch.Tensor) -> None:
    """Keep the loss's value, drop its reference to the (already back-propagated) graph."""
    if loss.grad_fn is not None and not loss._is_view():
        loss.detach_()


class LeanPipelineStage(PipelineStage):
    def __init__(self, *args, release_outputs: tuple[int, ...] = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.release_outputs = tuple(release_outputs)
        # called with the stage before the backward that completes its parameters' gradients for the
        # round (the schedule's `last_backward`): the data-parallel reduction starts as they arrive
        self.before_last_backward = None
        # called with the stage before the round's last forward: on the last stage, the forward whose loss
        # accumulates the head's gradient (train/loss.py back-propagates the head inside the loss)
        self.before_last_forward = None
        self._pending_loss: dict[int, torch.Tensor] = {}  # last stage: losses awaiting their weight backward

    # --- receive buffers: allocated on demand ----------------------------------------------------
    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        if self.is_first:
            return super()._setup_forward_recv_info(num_microbatches, has_backward)
        for chunk in range(num_microbatches):
            self.args_recv_info[chunk] = tuple(
                _RecvInfo(f"recv_for_{self.stage_index}_from_{self.stage_index - 1}", self.stage_index - 1,
                          None, meta) for meta in self._stage_meta.inputs)

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple[_RecvInfo, ...]:
        if self.is_last:
            return ()
        grads = self._stage_meta.output_grads
        return tuple(_RecvInfo(f"recv_grad_for_{self.stage_index}_from_{dst[0]}", dst[0], None, grads[idx])
                     for idx, dst in act_send_info.items())

    def _allocate(self, infos: tuple[_RecvInfo, ...]) -> None:
        for info in infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                info.buffer = _empty_like_meta(info.tensor_meta, self.device)

    @staticmethod
    def _drop(infos: tuple[_RecvInfo, ...]) -> None:
        for info in infos:
            if not info.is_root_arg:
                info.buffer = None

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._allocate(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            self._allocate(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index: int) -> None:
        # a V-schedule's local hand-over: a None gradient zero-fills the (now on-demand) buffer
        self._allocate(tuple(info for info, g in zip(self.grad_recv_info[mb_index], next_stage_bwd_outputs)
                             if g is None))
        super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    # --- consumption -----------------------------------------------------------------------------
    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        self.submod.microbatch = fwd_chunk_id  # the stage module's per-micro-batch prefetches
        if self.before_last_forward is not None and fwd_chunk_id == self.chunks - 1:
            self.before_last_forward(self)
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if not self.is_first:  # the received input lives on in fwd_cache (the autograd input)
            self._drop(self.args_recv_info[fwd_chunk_id])
        return out

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        if full_backward and last_backward and self.before_last_backward is not None:
            self.before_last_backward(self)
        input_values = self.fwd_cache[bwd_chunk_id][1] if bwd_chunk_id in self.fwd_cache else []
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        if self.has_backward and not self.is_last:
            self._drop(self.grad_recv_info[bwd_chunk_id])
        if full_backward and not self.is_first:  # the input gradient now lives in bwd_cache (to be sent)
            for t in input_values:
                if isinstance(t, torch.Tensor) and t.is_leaf:
                    t.grad = None
        if self.is_last and isinstance(loss, torch.Tensor):
            if full_backward:
                _release_graph(loss)
            else:  # the weight backward still walks the graph
                self._pending_loss[bwd_chunk_id] = loss

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        if last_backward and self.before_last_backward is not None:
            self.before_last_backward(self)
        super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
        loss = self._pending_loss.pop(bwd_chunk_id, None)
        if loss is not None:
            _release_graph(loss)

    # --- sent outputs: storage released ----------------------------------------------------------
    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)  # each op holds its own alias of the data
        outputs, _ = self.fwd_cache[fwd_chunk_id]
        for idx in self.release_outputs:
            t = outputs[idx]
            if t.grad_fn is not None and not t._is_view():
                t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)
        return ops
