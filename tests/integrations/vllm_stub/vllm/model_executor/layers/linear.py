"""vLLM's TP linear layers, reduced to their parameters and weight loaders."""

from __future__ import annotations

import torch
from torch import nn


class _Linear(nn.Module):
    def __init__(self, weight_shape: tuple[int, int], tp_rank: int, tp_size: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.zeros(weight_shape, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)


class ReplicatedLinear(_Linear):
    def __init__(self, n_in: int, n_out: int, *, tp_rank: int = 0, tp_size: int = 1,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__((n_out, n_in), tp_rank, tp_size, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)


class ColumnParallelLinear(_Linear):
    def __init__(self, n_in: int, n_out: int, *, tp_rank: int, tp_size: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__((n_out // tp_size, n_in), tp_rank, tp_size, dtype)
        self.weight.output_dim = 0  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))

    def weight_loader_v2(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self.weight_loader(param, loaded)


class RowParallelLinear(_Linear):
    def __init__(self, n_in: int, n_out: int, *, tp_rank: int, tp_size: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__((n_out, n_in // tp_size), tp_rank, tp_size, dtype)
        self.weight.input_dim = 1  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def weight_loader_v2(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        self.weight_loader(param, loaded)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """``gate_up_proj``: parts concatenated along dim 0, each TP-sharded."""

    def __init__(self, n_in: int, parts: list[int], *, tp_rank: int, tp_size: int,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__(n_in, sum(parts), tp_rank=tp_rank, tp_size=tp_size, dtype=dtype)
        self.parts = parts

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,  # type: ignore[override]
                      shard_id: int | None = None) -> None:
        assert shard_id is not None
        sizes = [p // self.tp_size for p in self.parts]
        offset, size = sum(sizes[:shard_id]), sizes[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """``qkv_proj``: q, k and v rows of this TP rank's heads, concatenated."""

    def __init__(self, hidden: int, head_dim: int, heads: int, kv_heads: int, *,
                 tp_rank: int, tp_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(hidden, (heads + 2 * kv_heads) * head_dim, tp_rank=tp_rank,
                         tp_size=tp_size, dtype=dtype)
        self.q, self.kv = heads * head_dim // tp_size, kv_heads * head_dim // tp_size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,  # type: ignore[override]
                      shard_id: str | None = None) -> None:
        offset, size = {"q": (0, self.q), "k": (self.q, self.kv),
                        "v": (self.q + self.kv, self.kv)}[str(shard_id)]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))
