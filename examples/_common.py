"""Shared pieces of the examples: the toy policy, its TP plan, digests, the failure line.

Kept small on purpose — each example file reads top to bottom on its own, launching its ranks
itself; this only holds what would otherwise be copied between them.
"""

from __future__ import annotations

import ctypes
import hashlib
import sys

import torch
from torch import nn

VOCAB, DIM, HIDDEN = 64, 32, 64

# How the inference workers shard the policy, in torch's tensor-parallel vocabulary:
# vocab-parallel embedding, column-parallel up/head, row-parallel down, replicated norm.
TP_PLAN = {"embed": "rowwise", "up": "colwise", "down": "rowwise", "head": "colwise"}


class Policy(nn.Module):
    """A tiny language-model-shaped policy. ``tp > 1`` builds one TP rank's local shards."""

    def __init__(self, tp: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB // tp, DIM)
        self.up = nn.Linear(DIM, HIDDEN // tp)
        self.down = nn.Linear(HIDDEN // tp, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB // tp, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.relu(self.up(h)))
        logits: torch.Tensor = self.head(self.norm(h))
        return logits


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (dtype-exact: bf16 is hashed as its raw 2 bytes)."""
    # One memcpy of the bytes (no numpy needed). bytes(untyped_storage()) walks them one
    # element at a time in Python, ~5 s per 1.5 MB holding the GIL: in a worker that
    # stalls the engine's event loop and stretches its rounds by as much.
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(ctypes.string_at(flat.data_ptr(), flat.numel())).hexdigest()[:32]


def boxed(full: torch.Tensor, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """The region ``box`` (global coordinates) of ``full``."""
    return full[tuple(slice(lo, hi) for lo, hi in box)]


def fail(message: str) -> int:
    print(f"FAILED: {message}", file=sys.stderr)
    return 1
