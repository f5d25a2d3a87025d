"""Fixtures every test directory shares."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Allocations(TorchDispatchMode):
    """Bytes of every tensor an op creates on this thread while active (no view, no in-place
    or out= result): what a pack or a stage really allocates."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for ret, t in zip(func._schema.returns, outs, strict=False):
            if ret.alias_info is None and isinstance(t, torch.Tensor):
                self.nbytes += t.untyped_storage().nbytes()
        return out


@pytest.fixture
def allocations() -> type[Allocations]:
    """``with allocations() as alloc: ...; alloc.nbytes``: what the block allocated."""
    return Allocations
