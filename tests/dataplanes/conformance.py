"""The ``Transport`` contract as one set of checks every lane must pass (``_data/_transport``).

Each check is a coroutine ``check(rank, transport)`` that every rank of a world runs on its
own transport, prepared and connected over the world's store; it raises on a breach. The
checks create their tensors on the transport's device (``settings.device``: CPU for gloo and
the fake runtime, CUDA on a GPU host) and drive buckets the way the engine does (``drive``:
stage → transfer → wait → unpack → release, ``max_inflight`` in flight), so one suite covers
every lane on every runtime: ``tests/dataplanes/test_conformance.py`` runs it on gloo and on
the nccl and m2n lanes over the fake runtime, ``tests/gpu/test_gpu_conformance.py`` on the
real one.

What they hold a lane to: a round moves every byte of the plan bit-exact for every layout
pair (and counts exactly the plan's bytes); ``abort`` wakes a completion that waits on peers
who never come, from another thread, with ``TransferError`` naming the reason, and nothing is
usable afterwards; ``close`` is idempotent and lets go of every tensor it was handed; later
rounds reuse what the first one cached (views, descriptors, arenas) only where it is still
right — new source tensors, sources updated in place, a new sinks mapping with new targets;
sources and targets that are parameters requiring grad move like plain tensors; sources and
targets swapped between rounds by ``torch.utils.swap_tensors`` (``Module.to`` under
swap-on-conversion) stay swappable and are followed.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import anyio.to_thread
import torch

from m2n_async._data._transport import Transport
from m2n_async._proto.errors import TransferError
from m2n_async._proto.plan import TransferPlan

from ._world import R, drive, expected, make_plan, sources

Check = Callable[[int, Transport], Awaitable[None]]

#: (src dims, dst dims, [(src placements, dst placements)]): a few layout pairs per topology.
LAYOUTS: dict[str, tuple[tuple[int, int], tuple[int, int], list[tuple[Any, Any]]]] = {
    "1+1": ((1, 1), (1, 1), [(None, None), ((R, 0), (R, 0))]),
    "2+2": ((1, 2), (1, 2), [((R, 0), (R, 1)), ((R, 1), (R, 1)), (None, (R, 0)),
                            ((R, 0), None)]),
    "2+3": ((2, 1), (3, 1), [((0, R), (1, R)), ((0, R), None), (None, (1, R))]),
}
#: Every layout pair in these (M2N carries them all), 2-D and 3-D.
DTYPES = (torch.bfloat16, torch.float32, torch.int8)
#: A few parameters per bucket, several buckets per round.
BUCKET_BYTES = 2048
MAX_INFLIGHT = 2
#: What every target byte holds before a round: a byte the round did not write shows.
SENTINEL = 0xA5
#: How long the ranks that stay out of ``abort_wakes_a_pending_completion`` keep their
#: transports open: well past the abort (0.3 s) and its bound (5 s are allowed below).
QUIET_S = 3.0


def plan_for(layout: str) -> TransferPlan:
    src, dst, pairs = LAYOUTS[layout]
    defs = [(f"p{k}.{str(dt).split('.')[-1]}", (12, 6, 4) if j % 2 else (24, 12), dt, sp, dp)
            for k, (sp, dp) in enumerate(pairs) for j, dt in enumerate(DTYPES)]
    return make_plan(defs, src, dst)


def topology(layout: str) -> tuple[int, int]:
    """(trainer ranks, world size) of ``layout``."""
    src, dst, _ = LAYOUTS[layout]
    t = src[0] * src[1]
    return t, t + dst[0] * dst[1]


# -- helpers --------------------------------------------------------------------------------


def _device(t: Transport) -> torch.device:
    return torch.device(t.ctx.settings.device or "cpu")


def _sync(t: Transport) -> None:
    if _device(t).type == "cuda":
        torch.cuda.synchronize(_device(t))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1).view(torch.uint8).cpu()


def _sources(t: Transport, version: int) -> dict[str, torch.Tensor]:
    return {k: v.to(_device(t)) for k, v in sources(t.ctx.plan, t.ctx.rank, version).items()}


def _targets(t: Transport) -> dict[str, torch.Tensor]:
    plan, rank = t.ctx.plan, t.ctx.rank
    out = {}
    for p in plan.params:
        x = torch.empty(p.dst.local_shape(p.spec.shape, rank), dtype=getattr(torch, p.spec.dtype),
                        device=_device(t))
        x.view(torch.uint8).fill_(SENTINEL)
        out[p.spec.name] = x
    return out


def _refill(targets: Mapping[str, torch.Tensor]) -> None:
    for x in targets.values():
        x.view(torch.uint8).fill_(SENTINEL)


def _check_landed(t: Transport, got: Mapping[str, torch.Tensor], version: int,
                  what: str) -> None:
    _sync(t)
    want = expected(t.ctx.plan, t.ctx.rank, version)
    bad = [k for k, v in want.items() if not torch.equal(_bytes(got[k]), _bytes(v))]
    assert not bad, f"{t.name} rank {t.ctx.rank} {what}: wrong bytes in {bad}"


def _plan_bytes(t: Transport) -> int:
    plan, rank = t.ctx.plan, t.ctx.rank
    return plan.send_bytes(rank) if rank < plan.trainer_ranks else plan.recv_bytes(rank)


async def _round(t: Transport, round: int, *, sources: Mapping[str, Any] | None = None,
                 sinks: Mapping[str, Any] | None = None) -> int:
    return await drive(t, round=round, deadline=time.monotonic() + 60.0, sources=sources,
                       sinks=sinks, max_inflight=MAX_INFLIGHT)


# -- the checks -----------------------------------------------------------------------------


async def moves_bytes_bit_exact(rank: int, t: Transport) -> None:
    """One round moves every byte of the plan into the targets, bit-exact, and counts exactly
    the bytes the plan says this rank sends or receives."""
    if rank < t.ctx.trainer_ranks:
        moved = await _round(t, 0, sources=_sources(t, 0))
    else:
        targets = _targets(t)
        moved = await _round(t, 0, sinks=targets)
        _check_landed(t, targets, 0, "round 0")
    assert moved == _plan_bytes(t), (t.name, rank, moved, _plan_bytes(t))


async def abort_wakes_a_pending_completion(rank: int, t: Transport) -> None:
    """The first worker submits a bucket that no peer takes part in; ``abort`` from another
    thread wakes its completion with ``TransferError`` naming the reason, promptly; abort is
    idempotent and the transport is never usable again. The other ranks stay out of the
    round with their transports open."""
    if rank != t.ctx.trainer_ranks:
        await anyio.sleep(QUIET_S)
        return
    reason = "conformance: a peer was lost"
    t.begin_round(0, time.monotonic() + 60.0)
    staging = await t.stage(t.ctx.buckets[0], sinks=_targets(t))
    completion = t.transfer(staging)
    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        async def watchdog() -> None:
            await anyio.sleep(0.3)
            await anyio.to_thread.run_sync(t.abort, reason)  # any thread may abort

        tg.start_soon(watchdog)
        try:
            with anyio.fail_after(10.0):  # a breach fails the check, not the whole run
                await completion.wait()
        except TransferError as exc:
            assert reason in str(exc), exc
        else:
            raise AssertionError(f"{t.name}: a completion nobody could finish returned")
    assert time.monotonic() - t0 < 5.0, time.monotonic() - t0
    assert completion.done() and t.aborted and t.abort_reason == reason
    t.abort("a second abort")  # idempotent: no error, the first reason stays
    assert t.abort_reason == reason
    t.release(staging)
    t.end_round()
    for attempt in (t.check_usable, lambda: t.begin_round(1, time.monotonic() + 60.0)):
        try:
            attempt()
        except TransferError as exc:
            assert reason in str(exc), exc
        else:
            raise AssertionError(f"{t.name}: an aborted transport is usable again")


async def close_is_idempotent_and_releases(rank: int, t: Transport) -> None:
    """After a round, ``close`` (twice: the second returns at once) drops every tensor the
    transport was handed: sources, targets, and what it cached from them."""
    handed: list[weakref.ref[torch.Tensor]] = []
    if rank < t.ctx.trainer_ranks:
        src = _sources(t, 0)
        handed += [weakref.ref(x) for x in src.values()]
        await _round(t, 0, sources=src)
        del src
    else:
        targets = _targets(t)
        handed += [weakref.ref(x) for x in targets.values()]
        await _round(t, 0, sinks=targets)
        _check_landed(t, targets, 0, "round 0")
        del targets
    await t.close()
    t0 = time.monotonic()
    await t.close()
    assert time.monotonic() - t0 < 1.0, "a second close did work again"
    gc.collect()
    alive = [ref() for ref in handed if ref() is not None]
    assert not alive, (f"{t.name} rank {rank}: {len(alive)} of {len(handed)} tensors are still "
                       "referenced after close")


async def second_round_reuses_state(rank: int, t: Transport) -> None:
    """Rounds after the first reuse the cached per-bucket state only where it still holds:
    new source tensors, the same ones updated in place, a load callback beside tensor
    targets, then a new sinks mapping of new targets (the old ones are not written)."""
    plan = t.ctx.plan
    if rank < t.ctx.trainer_ranks:
        await _round(t, 0, sources=_sources(t, 0))
        src = _sources(t, 1)  # new tensor objects
        await _round(t, 1, sources=src)
        for rnd in (2, 3):  # the same objects, updated in place
            for k, v in _sources(t, rnd).items():
                src[k].copy_(v)
            await _round(t, rnd, sources=src)
        return
    called = plan.params[len(plan.params) // 2].spec.name
    loaded: dict[str, torch.Tensor] = {}

    def load(name: str, tensor: torch.Tensor) -> None:
        loaded[name] = tensor.detach().clone()  # valid only during the call

    first = _targets(t)
    sinks: dict[str, Any] = {**first, called: load}
    for rnd in range(3):
        _refill(first)
        loaded.clear()
        await _round(t, rnd, sinks=sinks)
        _check_landed(t, {**first, **loaded}, rnd, f"round {rnd}")
        assert list(loaded) == [called], (t.name, rank, list(loaded))
    second = _targets(t)  # a new mapping of new targets: cached views must not be reused
    _refill(first)
    await _round(t, 3, sinks=second)
    _check_landed(t, second, 3, "round 3 (new targets)")
    _sync(t)
    stale = [k for k, x in first.items()
             if k != called and not bool((_bytes(x) == SENTINEL).all())]
    assert not stale, f"{t.name} rank {rank}: round 3 wrote the old targets of {stale}"


def _requiring_grad(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The floating tensors as parameters requiring grad (an ``nn.Module``'s, as users hand
    them over); the others as they are (autograd takes floating dtypes only)."""
    return {k: torch.nn.Parameter(v) if v.is_floating_point() else v
            for k, v in tensors.items()}


async def moves_parameters_requiring_grad(rank: int, t: Transport) -> None:
    """Sources and targets that are parameters requiring grad move like plain tensors: no
    refusal of an in-place write into a leaf, no autograd graph recorded (it would tie the
    staging to the sources), the targets still leaves; and ``close`` lets go of them all."""
    handed: list[weakref.ref[torch.Tensor]] = []
    if rank < t.ctx.trainer_ranks:
        src = _requiring_grad(_sources(t, 0))
        handed += [weakref.ref(x) for x in src.values()]
        await _round(t, 0, sources=src)
        with torch.no_grad():  # an optimizer step: the same parameters, updated in place
            for k, v in _sources(t, 1).items():
                src[k].copy_(v)
        await _round(t, 1, sources=src)
        del src
    else:
        targets = _requiring_grad(_targets(t))
        handed += [weakref.ref(x) for x in targets.values()]
        for rnd in (0, 1):
            with torch.no_grad():
                _refill(targets)
            await _round(t, rnd, sinks=targets)
            _check_landed(t, targets, rnd, f"round {rnd} (parameters requiring grad)")
        leaves = [k for k, x in targets.items() if x.grad_fn is not None]
        assert not leaves, f"{t.name} rank {rank}: targets given a grad_fn: {leaves}"
        del targets
    await t.close()
    gc.collect()
    alive = [ref() for ref in handed if ref() is not None]
    assert not alive, (f"{t.name} rank {rank}: {len(alive)} of {len(handed)} parameters are "
                       "still referenced after close")


def _swap_all(tensors: Mapping[str, torch.Tensor], fresh: Mapping[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
    """Swap every tensor of ``tensors`` with its ``fresh`` counterpart (a parameter with a
    parameter) by ``torch.utils.swap_tensors``, as ``Module.to`` does under swap-on-
    conversion. The objects keep their names and take the new storage; returned: the
    counterparts, which now hold the old storage."""
    old = {}
    for k, x in tensors.items():
        y = fresh[k]
        if isinstance(x, torch.nn.Parameter):
            y = torch.nn.Parameter(y, requires_grad=x.requires_grad)
        torch.utils.swap_tensors(x, y)  # refused if anything holds x by a weak reference
        old[k] = y
    return old


async def follows_tensors_swapped_between_rounds(rank: int, t: Transport) -> None:
    """Sources and targets (parameters requiring grad where floating, as a module's) are
    swapped with ``torch.utils.swap_tensors`` for tensors of new storage after round 0 and
    again after round 2, with what a lane builds from them in one round, or caches over
    consecutive ones, in place. A lane that keeps a weak reference to one, or a view that
    has one as its base, makes the swap raise. The rounds after a swap read and
    write the new storage, and a worker's swapped-out storage is not written again."""
    swaps = (0, 2)  # after these rounds
    if rank < t.ctx.trainer_ranks:
        src = _requiring_grad(_sources(t, 0))
        for rnd in range(4):
            if rnd - 1 in swaps:
                _sync(t)
                _swap_all(src, _sources(t, rnd))
            else:
                with torch.no_grad():  # an optimizer step: the same parameters, in place
                    for k, v in _sources(t, rnd).items():
                        src[k].copy_(v)
            await _round(t, rnd, sources=src)
        return
    targets = _requiring_grad(_targets(t))
    old: dict[str, torch.Tensor] = {}
    for rnd in range(4):
        if rnd - 1 in swaps:
            _sync(t)
            old = _swap_all(targets, _targets(t))
            with torch.no_grad():
                _refill(old)
        with torch.no_grad():
            _refill(targets)
        await _round(t, rnd, sinks=targets)
        _check_landed(t, targets, rnd, f"round {rnd}")
        _sync(t)
        stale = [k for k, x in old.items() if not bool((_bytes(x) == SENTINEL).all())]
        assert not stale, (f"{t.name} rank {rank}: round {rnd} wrote the swapped-out "
                           f"storage of {stale}")


def _let_go(tensors: Mapping[str, torch.Tensor]) -> list[Any]:
    """Give every tensor of ``tensors`` storage of its own through ``.data`` (weights
    offloaded between rounds and brought back, the caller's old memory freed); returned:
    weak references to the old storages."""
    from torch.multiprocessing.reductions import StorageWeakRef

    old = []
    for x in tensors.values():
        old.append(StorageWeakRef(x.untyped_storage()))
        x.data = x.data.clone()
    return old


async def holds_no_storage_between_rounds(rank: int, t: Transport) -> None:
    """After two rounds with the same tensors (whatever a lane caches from them is cached),
    each source and target is given new storage through ``.data``: the old storage is freed
    at once, held by no lane between rounds (by a view, a descriptor or a table). The one
    exception is the gloo lane's worker: it receives into views of its targets kept from
    round to round, which go when the next round finds the targets' new addresses. The
    next round reads and writes the new storage."""
    trainer = rank < t.ctx.trainer_ranks
    late = t.name == "gloo" and not trainer
    # clones: a shard that is a view of the whole tensor would hold it as its base
    mine = {k: v.clone() for k, v in _sources(t, 0).items()} if trainer else _targets(t)
    old: list[Any] = []

    def held() -> list[str]:
        gc.collect()
        return [k for k, ref in zip(mine, old, strict=True) if not ref.expired()]

    for rnd in range(3):
        if rnd == 2:
            _sync(t)
            old = _let_go(mine)
            assert late or not held(), (f"{t.name} rank {rank}: storage held between rounds: "
                                        f"{held()}")
        if trainer:
            for k, v in _sources(t, rnd).items():
                mine[k].copy_(v)
        else:
            _refill(mine)
        await _round(t, rnd, **({"sources": mine} if trainer else {"sinks": mine}))
        if not trainer:
            _check_landed(t, mine, rnd, f"round {rnd}")
    assert not held(), f"{t.name} rank {rank}: storage held after the next round: {held()}"


CHECKS: dict[str, Check] = {
    "bit_exact": moves_bytes_bit_exact,
    "abort": abort_wakes_a_pending_completion,
    "close": close_is_idempotent_and_releases,
    "reuse": second_round_reuses_state,
    "grad": moves_parameters_requiring_grad,
    "swap": follows_tensors_swapped_between_rounds,
    "let_go": holds_no_storage_between_rounds,
}
