"""RMSNorm computed in fp32 (V41_SPEC §1: eps 1e-20 in the text model, 1e-6 in the ViT); its weight is
stored in BF16 by the release (model/formats.py: rounded to BF16 under `model.qat.weights_bf16`)."""

from __future__ import annotations

import torch
from torch import nn

from flashtrain.model.config import QATConfig
from flashtrain.model.formats import Stored, as_trained


class RMSNorm(nn.Module):
    STORED = {"weight": Stored.BF16}

    def __init__(self, dim: int, eps: float, qat: QATConfig | None = None):
        super().__init__()
        self.eps = eps
        self.qat = qat or QATConfig()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return (as_trained(self.weight, self.STORED["weight"], self.qat).float() * x).to(dtype)
