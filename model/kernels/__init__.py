"""Triton kernels of the model's training path (issue: GPU kernels), each beside the plain-PyTorch
reference it is checked against:

| kernel | reference |
|---|---|
| `sparse_attention.py`: CSA2 window band + selected compressed slots + sink, fwd/bwd | `model/sparse_attention.py` |
| `index_topk.py`: fused indexer scoring and top-k per query block | `model/attention.py` `_select` |
| `mhc.py`: mHC mixes (Sinkhorn in registers), collapse, expand | `model/mhc.py` |

`select.py` decides which path runs: the kernels on CUDA (or CPU tensors under TRITON_INTERPRET=1), the
references elsewhere; `model.use_triton=false` forces the references for debugging.
"""
