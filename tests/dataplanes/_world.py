"""A one-process world of ranks for CPU tests of the GPU transports over the fake runtime.

Every rank is a task in ONE event loop with its own ``NativeThread`` (as in the engine); the
fake ``nccl`` blocks those threads, never the loop. ``drive`` is a minimal bucket pipeline
(stage → transfer → wait → unpack → release, ``max_inflight`` buckets in flight) so the
transports are exercised exactly as the engine uses them.
"""

from __future__ import annotations

import contextvars
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from m2n_async._data._kernels import Form, address_align
from m2n_async._data._native import NativeThread
from m2n_async._data._transport import (
    CheckedSources,
    Rendezvous,
    Staging,
    Transport,
    TransportContext,
    TransportSettings,
    create_transport,
)
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamSpec, ParamTransfer
from m2n_async._proto.plan import TransferPlan
from m2n_async.testing import MemoryStore

R = REPLICATE
ParamDef = tuple[str, tuple[int, ...], torch.dtype, "tuple[int, int] | None",
                 "tuple[int, int] | None"]


def make_plan(defs: Sequence[ParamDef], src_dims: tuple[int, int],
              dst_dims: tuple[int, int]) -> TransferPlan:
    t, n = src_dims[0] * src_dims[1], dst_dims[0] * dst_dims[1]
    smesh, dmesh = Mesh(src_dims, 0), Mesh(dst_dims, t)
    return TransferPlan([ParamTransfer(ParamSpec(name, dt, shape, Layout(smesh, sp)),
                                       Layout(dmesh, dp)) for name, shape, dt, sp, dp in defs],
                        trainer_ranks=t, world_size=t + n)


def global_tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                  version: int = 0) -> torch.Tensor:
    """Random bytes seeded by (name, version): every bit pattern, so a wrong byte shows."""
    seed = (sum(name.encode()) * 7919 + len(name) * 104729 + version * 15485863) % (2**31)
    g = torch.Generator().manual_seed(seed)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    if dtype.is_floating_point:  # no NaN payloads: casts in the tests must round-trip
        if torch.empty((), dtype=dtype).element_size() == 1:
            raw[(raw & 0x7F) >= 0x7C] = 0  # fp8 NaN/Inf-ish codes (both e4m3fn and e5m2)
            return raw.view(dtype).reshape(shape).clone()
        t = raw.view(dtype).reshape(shape)
        return torch.where(t.float().isfinite(), t, torch.zeros((), dtype=dtype)).clone()
    return raw.view(dtype).reshape(shape).clone()


def local(full: torch.Tensor, layout: Layout, rank: int) -> torch.Tensor:
    box = layout.box(tuple(full.shape), rank)
    return full[tuple(slice(lo, hi) for lo, hi in box)].contiguous()


def sources(plan: TransferPlan, rank: int, version: int = 0,
            dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for p in plan.params:
        s = p.spec
        full = global_tensor(s.name, s.shape, getattr(torch, s.dtype), version)
        t = local(full, s.layout, rank)
        out[s.name] = t if dtype is None else t.to(dtype)
    return out


def expected(plan: TransferPlan, rank: int, version: int = 0,
             via: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    out = {}
    for p in plan.params:
        s = p.spec
        full = global_tensor(s.name, s.shape, getattr(torch, s.dtype), version)
        t = local(full, p.dst, rank)
        out[s.name] = t if via is None else t.to(via).to(getattr(torch, s.dtype))
    return out


def targets(plan: TransferPlan, rank: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    return {p.spec.name: torch.zeros(p.dst.local_shape(p.spec.shape, rank),
                                     dtype=getattr(torch, p.spec.dtype), device=device)
            for p in plan.params}


@dataclass
class RankResult:
    rank: int
    transport: Transport | None = None
    error: BaseException | None = None
    stagings: list[Staging] = field(default_factory=list)
    moved: int = 0
    seconds: float = 0.0
    connected: bool = False  # its connect returned
    connect_s: float = 0.0  # how long its connect took (returned or failed)


async def drive(t: Transport, *, round: int, deadline: float,
                sources: Mapping[str, torch.Tensor] | None,
                sinks: Mapping[str, Any] | None, max_inflight: int,
                keep: list[Staging] | None = None, checked: bool = False) -> int:
    """One round of the bucket pipeline on one rank; returns bytes moved. ``checked``: the
    trainer hands the transport ``CheckedSources`` of ``sources``, as the engine does."""
    t.begin_round(round, deadline)
    if checked and sources is not None:
        shards = [sources[p.spec.name] for p in t.ctx.plan.params]
        t.use_checked(CheckedSources(sources, shards, [s.dtype for s in shards]))
    moved = 0
    pending: deque[tuple[Staging, Any]] = deque()

    async def finish() -> None:
        nonlocal moved
        st, c = pending.popleft()
        await c.wait()
        if sinks is not None:
            await t.unpack(st, sinks)
        moved += st.nbytes_moved
        if keep is not None:
            keep.append(st)
        t.release(st)

    try:
        for b in t.ctx.buckets:
            st = await t.stage(b, sources=sources, sinks=sinks)
            pending.append((st, t.transfer(st)))
            if len(pending) >= max_inflight:
                await finish()
        while pending:
            await finish()
    finally:
        t.use_checked(None)
        t.end_round()
    return moved


#: The store prefix ``run_world``'s ranks rendezvous under.
DATA_PREFIX = "job/1/data/"


async def run_world(name: str, plan: TransferPlan, *, bucket_bytes: int = 1 << 12,
                    max_inflight: int = 2, rounds: int = 1, device: str = "cpu",
                    src_dtype: torch.dtype | None = None,
                    sinks_for: Callable[[int, int], Mapping[str, Any]] | None = None,
                    body: Callable[[int, Transport], Any] | None = None,
                    deadline: float = 30.0, coalesce: bool = True,
                    coalesce_below: int | None = None,
                    host: str | None = None, close_timeout: float = 10.0,
                    connect_timeout: float = 20.0,
                    wrap_session: Callable[[Any], Any] | None = None,
                    in_place: Mapping[int, frozenset[int]] | None = None,
                    checked: bool = False) -> list[RankResult]:
    """Run ``rounds`` rounds on every rank; returns per-rank results (errors captured).
    ``host``: where gloo binds (its ranks here share one process, so 127.0.0.1).
    ``connect_timeout``: the rendezvous timeout; ``wrap_session(session)``: what each rank
    connects through instead of its store session (to watch or tamper with the rendezvous);
    ranks rendezvous under ``DATA_PREFIX``. ``in_place``: per worker rank, the parameters
    whose targets are tensors (``TransportContext.in_place``, as the engine passes it).
    ``checked``: the trainers hand their transports ``CheckedSources`` (``drive``)."""
    store = MemoryStore()
    extra = {} if coalesce_below is None else {"coalesce_below": coalesce_below}
    settings = TransportSettings(max_inflight=max_inflight, device=device, coalesce=coalesce,
                                 host=host, close_timeout=close_timeout, **extra)
    buckets = plan.buckets(bucket_bytes)
    results = [RankResult(r) for r in range(plan.world_size)]
    tsinks: dict[int, Mapping[str, Any]] = {}

    async def rank_main(r: int) -> None:
        res = results[r]
        native = NativeThread(f"test-r{r}")
        ctx = TransportContext(plan=plan, rank=r, generation=1, settings=settings,
                               native=native, buckets=buckets,
                               in_place=None if in_place is None else in_place.get(r))
        t = create_transport(name, ctx)
        res.transport = t
        try:
            await t.prepare()
            session = store.session()
            t0 = time.monotonic()
            try:
                await t.connect(Rendezvous(
                    wrap_session(session) if wrap_session is not None else session,
                    DATA_PREFIX, rank=r, world_size=plan.world_size, timeout=connect_timeout))
            finally:
                res.connect_s = time.monotonic() - t0
            res.connected = True
            if body is not None:
                await body(r, t)
                return
            t0 = time.monotonic()
            for rnd in range(rounds):
                if r < plan.trainer_ranks:
                    res.moved += await drive(
                        t, round=rnd, deadline=time.monotonic() + deadline,
                        sources=sources(plan, r, rnd, src_dtype), sinks=None,
                        max_inflight=max_inflight, keep=res.stagings, checked=checked)
                else:
                    sinks = sinks_for(r, rnd) if sinks_for else tsinks.setdefault(
                        r, targets(plan, r, device))
                    res.moved += await drive(
                        t, round=rnd, deadline=time.monotonic() + deadline, sources=None,
                        sinks=sinks, max_inflight=max_inflight, keep=res.stagings)
                    want = expected(plan, r, rnd, via=src_dtype)
                    if sinks_for is None:
                        for k, v in want.items():
                            got = sinks[k]
                            assert torch.equal(got.view(torch.uint8) if got.dim() else got,
                                               v.view(torch.uint8) if v.dim() else v), (
                                f"rank {r} round {rnd}: {k} differs")
            res.seconds = time.monotonic() - t0
        except BaseException as exc:
            res.error = exc
            t.abort(f"rank {r} failed: {exc!r}")
        finally:
            with anyio.CancelScope(shield=True):
                await t.close()
            native.close(2.0)

    async with anyio.create_task_group() as tg:
        for r in range(plan.world_size):
            tg.start_soon(rank_main, r)
    return results


def forms_after_two_rounds(plan: TransferPlan, callback: set[str],
                           rank_of: contextvars.ContextVar[int], got: dict[int, Any]
                           ) -> Callable[[int, Transport], Any]:
    """A ``run_world`` body for the copy-form tests: two rounds, from sources in the wire
    dtype and then from fp32 masters (fresh, so 16-byte aligned), with load callbacks for
    the workers' ``callback`` names; then the lane's ``_copy_forms()`` into ``got[rank]``.
    ``rank_of`` holds the rank in its task, for recorders of the lane's copies."""

    async def body(r: int, t: Any) -> None:
        rank_of.set(r)
        trainer = r < plan.trainer_ranks
        sinks: dict[str, Any] | None = None
        if not trainer:
            sinks = dict(targets(plan, r))
            for n in callback:
                sinks[n] = lambda name, tensor: None
        for rnd, dtype in ((0, None), (1, torch.float32)):
            srcs = ({k: v.clone() for k, v in sources(plan, r, rnd, dtype).items()}
                    if trainer else None)
            await drive(t, round=rnd, deadline=time.monotonic() + 30, sources=srcs,
                        sinks=sinks, max_inflight=2)
        got[r] = t._copy_forms()

    return body


def launched_form(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> Form:
    """The copy kernel's form of one launch over real tensors: the pairs ``(dsts[k],
    srcs[k])``, of one shape, dtype pair and strides, aligned as all their addresses."""
    d0, s0 = dsts[0], srcs[0]
    return Form(s0.dtype, d0.dtype, tuple(d0.shape), s0.stride(), d0.stride(),
                address_align([t.data_ptr() for t in (*dsts, *srcs)]))


def raise_first(results: list[RankResult]) -> None:
    for res in results:
        if res.error is not None:
            raise AssertionError(f"rank {res.rank} failed: {res.error!r}") from res.error
