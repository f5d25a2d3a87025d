"""Plan builders and reference data shared by the engine tests (not a test module)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamSpec, ParamTransfer
from m2n_async._proto.plan import TransferPlan

# (name, shape, dtype, source placements, destination placements) — placements on the
# (dims) meshes given separately; None = fully replicated.
ParamDef = tuple[str, tuple[int, ...], torch.dtype, tuple[int, int] | None,
                 tuple[int, int] | None]


def make_plan(defs: Sequence[ParamDef], src_dims: tuple[int, int],
              dst_dims: tuple[int, int]) -> TransferPlan:
    t = src_dims[0] * src_dims[1]
    n = dst_dims[0] * dst_dims[1]
    smesh, dmesh = Mesh(src_dims, 0), Mesh(dst_dims, t)
    params = [ParamTransfer(ParamSpec(name, dtype, shape, Layout(smesh, sp)),
                            Layout(dmesh, dp))
              for name, shape, dtype, sp, dp in defs]
    return TransferPlan(params, trainer_ranks=t, world_size=t + n)


def random_defs(draw: Any, dtypes: Any, placements: Any, *, params: tuple[int, int],
                ndims: tuple[int, int] = (1, 3)) -> list[ParamDef]:
    """For hypothesis strategies: ``params`` (min, max) parameters of ``ndims`` dimensions of
    size 6 or 12, each with a dtype drawn from ``dtypes`` and source and destination
    placements drawn from ``placements`` that name existing dimensions."""
    from hypothesis import strategies as st

    defs: list[ParamDef] = []
    for k in range(draw(st.integers(*params))):
        nd = draw(st.integers(*ndims))
        shape = tuple(draw(st.sampled_from([6, 12])) for _ in range(nd))

        def fits(p: tuple[int, int] | None, nd: int = nd) -> bool:
            return p is None or max(p) < nd
        defs.append((f"p{k}", shape, draw(dtypes), draw(placements.filter(fits)),
                     draw(placements.filter(fits))))
    return defs


def global_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  version: int = 0) -> torch.Tensor:
    """Deterministic content with every byte pattern likely (random bits, seeded by name)."""
    g = torch.Generator().manual_seed((hash_name(name) * 1000003 + version) % (2**63))
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (max(nbytes, 1),), dtype=torch.uint8, generator=g)[:nbytes]
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape).clone()


def hash_name(name: str) -> int:
    h = 1469598103934665603
    for ch in name.encode():
        h = ((h ^ ch) * 1099511628211) % (2**64)
    return h


def local_shard(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    box = layout.box(tuple(full.shape), rank)
    return full[tuple(slice(lo, hi) for lo, hi in box)].contiguous()


def source_shards(plan: TransferPlan, rank: int, version: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    for p in plan.params:
        s = p.spec
        full = global_tensor(s.name, s.shape, getattr(torch, s.dtype), version)
        out[s.name] = local_shard(full, s.layout, rank)
    return out


def expected_shards(plan: TransferPlan, rank: int, version: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    for p in plan.params:
        s = p.spec
        full = global_tensor(s.name, s.shape, getattr(torch, s.dtype), version)
        out[s.name] = local_shard(full, p.dst, rank)
    return out


def empty_targets(plan: TransferPlan, rank: int) -> dict[str, torch.Tensor]:
    return {p.spec.name: torch.zeros(p.dst.local_shape(p.spec.shape, rank),
                                     dtype=getattr(torch, p.spec.dtype))
            for p in plan.params}


R = REPLICATE
