"""vLLM's ``default_weight_loader``: a plain copy."""

from __future__ import annotations

import torch


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    assert param.shape == loaded_weight.shape, (param.shape, loaded_weight.shape)
    param.data.copy_(loaded_weight)
