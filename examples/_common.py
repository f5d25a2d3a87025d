"""Shared pieces of the examples: the toy policy, its TP plan, process launching, digests.

Kept small on purpose — each example file reads top to bottom on its own; this only holds what
would otherwise be copied between them.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

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
        return self.head(self.norm(h))


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


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, sort_keys=True))
    tmp.replace(path)  # atomic: the parent never reads half a file


def child(fn: Callable[..., None], *args: Any) -> None:
    """Process entry: one torch thread (the host is shared), then ``fn(*args)``."""
    torch.set_num_threads(1)
    fn(*args)


def launch(targets: Mapping[str, tuple[Callable[..., None], tuple[Any, ...]]],
           timeout: float) -> dict[str, int]:
    """Start one spawned process per entry, wait (bounded), kill leftovers; name -> exit code.

    ``spawn`` (not ``fork``): torch and threads in the parent must not leak into children.
    """
    ctx = mp.get_context("spawn")
    procs = {name: ctx.Process(target=child, args=(fn, *args), name=name, daemon=True)
             for name, (fn, args) in targets.items()}
    for p in procs.values():
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs.values():
        p.join(max(0.0, deadline - time.monotonic()))
    codes: dict[str, int] = {}
    for name, p in procs.items():
        if p.is_alive():
            p.kill()
            p.join()
            codes[name] = -9
        else:
            codes[name] = p.exitcode if p.exitcode is not None else -1
    return codes


def new_token() -> str:
    """A fresh shared secret for the store (every process of the job gets the same one)."""
    return os.environ.get("M2N_TOKEN") or secrets.token_hex(16)


def fail(message: str) -> int:
    print(f"FAILED: {message}", file=sys.stderr)
    return 1
