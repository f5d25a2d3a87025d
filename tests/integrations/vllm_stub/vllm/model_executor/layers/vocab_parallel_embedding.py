"""vLLM's vocab-parallel embedding and LM head (rows sharded by TP rank)."""

from __future__ import annotations

import torch
from torch import nn


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, *, tp_rank: int, tp_size: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.zeros(vocab // tp_size, dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.output_dim = 0  # type: ignore[attr-defined]
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class ParallelLMHead(VocabParallelEmbedding):
    pass
