"""The bucket pipeline: stage bucket i+1 while bucket i transfers and bucket i-1 unpacks.

Theory of operation (DESIGN §7). The calling task produces; one drain task consumes, joined by
a small in-order channel:

    caller:  take a slot → resolve sources(i) → await stage(i) → transfer(i) (returns at once) ──▶
    drain:   await completion(i).wait() → await unpack(i) → release(i) → give the slot back

A semaphore of ``max_inflight`` slots is taken before a bucket is staged and given back after
it is released, so at most ``max_inflight`` stagings exist at once: extra memory is bounded
by ``max_inflight x (largest bucket staging)``, and the peak actually held is reported.
Buckets go through every stage in plan order on every rank; the transport's native thread
runs the transfers one after another in that order, which is what keeps the ranks' native
calls matched. The pipeline decides nothing that must agree between ranks: the buckets are
the agreed ones.

Why the caller produces and one task drains (not three tasks): the first transfer is the
round's critical path, and each task an anyio task group starts costs tens of microseconds
before it runs — measured between two H200s, the first bucket was submitted 0.37 ms into a
3.6 ms round with three tasks. Waiting for bucket i+1 while bucket i unpacks gains nothing,
because transfers progress on the transport's own threads whether or not anyone awaits them.
Free slots are taken without yielding (``acquire_nowait``) for the same reason.

Errors: the first failure cancels the other side and propagates (as the single original
exception, not a group); the round layer then aborts the transport, which unblocks any native
call still in flight. Stagings still referenced by pending completions are freed by
``close``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio

from m2n_async._data._transport import Completion, SinkLike, Staging, Transport
from m2n_async._engine import _faults

if TYPE_CHECKING:
    import torch

    from m2n_async._proto.plan import Bucket

__all__ = ["PipelineStats", "run_pipeline", "unwrap_group"]


@dataclass
class PipelineStats:
    """What one pass over the buckets did on this rank."""

    nbytes: int = 0
    buckets: int = 0
    busy: dict[str, float] = field(default_factory=lambda: {"pack": 0.0, "transfer": 0.0,
                                                            "unpack": 0.0})
    wall: float = 0.0
    peak_extra_bytes: int = 0
    live_extra_bytes: int = 0
    #: wire-dtype bytes the transport produced by casting sources while packing (trainer)
    cast_bytes: int = 0


SourceResolver = Callable[["Bucket"], Awaitable[Mapping[str, "torch.Tensor"]]]
#: A worker's check of a bucket's targets before it is staged (raises what is wrong).
SinkCheck = Callable[["Bucket"], Awaitable[None]]
Progress = Callable[[int, int], None]


def unwrap_group(exc: BaseException) -> BaseException:
    """The first non-cancellation leaf of a (nested) exception group, else ``exc``."""
    cancelled = anyio.get_cancelled_exc_class()
    while isinstance(exc, BaseExceptionGroup):
        leaves = [e for e in exc.exceptions if not isinstance(e, cancelled)]
        exc = leaves[0] if leaves else exc.exceptions[0]
    return exc


async def run_pipeline(transport: Transport, buckets: Sequence[Bucket], *, max_inflight: int,
                       sources: SourceResolver | None = None,
                       sinks: Mapping[str, SinkLike] | None = None,
                       check_sinks: SinkCheck | None = None,
                       progress: Progress | None = None,
                       total_bytes: int = 0) -> PipelineStats:
    """Move every bucket through ``transport`` (see module docstring); return the stats.

    Trainer: pass ``sources`` (called once per bucket, in order, for its local shards).
    Worker: pass ``sinks`` (name -> ``Sink``: the engine's, built at connect; or a bare
    target tensor or load callback, as ``Transport.stage`` accepts), and ``check_sinks``
    (called once per bucket, in order, before it is staged: the engine's target check).
    ``progress(bytes_done, total_bytes)`` is called on the event loop after each bucket.

    Cancellation: stops at once; buckets in flight stay with the transport, which the caller
    must abort (the round layer does) — the transport is then never reused.
    """
    stats = PipelineStats()
    slots = anyio.Semaphore(max_inflight)
    to_wait_tx, to_wait_rx = anyio.create_memory_object_stream[tuple[Staging, Completion]](
        max_inflight)
    clock = time.perf_counter
    started = clock()

    async def drain() -> None:
        async with to_wait_rx:
            async for staging, completion in to_wait_rx:
                t0 = clock()
                await completion.wait()
                stats.busy["transfer"] += staging.seconds.get("transfer", clock() - t0)
                if sinks is not None:
                    t0 = clock()
                    await transport.unpack(staging, sinks)
                    stats.busy["unpack"] += staging.seconds.get("unpack", clock() - t0)
                transport.release(staging)
                stats.live_extra_bytes -= staging.nbytes
                stats.nbytes += staging.nbytes_moved
                stats.buckets += 1
                slots.release()
                if progress is not None:
                    progress(stats.nbytes, total_bytes)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(drain, name="m2n-pipeline-drain")
            async with to_wait_tx:
                for bucket in buckets:
                    if _faults.armed:  # tests only (m2n_async.testing)
                        await _faults.hit("round.bucket", rank=transport.ctx.rank,
                                          round=transport._round, bucket=bucket.index)
                    try:
                        slots.acquire_nowait()
                    except anyio.WouldBlock:
                        await slots.acquire()
                    src = await sources(bucket) if sources is not None else None
                    if check_sinks is not None:
                        await check_sinks(bucket)
                    t0 = clock()
                    staging = await transport.stage(bucket, sources=src, sinks=sinks)
                    stats.busy["pack"] += staging.seconds.get("pack", clock() - t0)
                    stats.cast_bytes += staging.cast_bytes
                    stats.live_extra_bytes += staging.nbytes
                    stats.peak_extra_bytes = max(stats.peak_extra_bytes,
                                                 stats.live_extra_bytes)
                    completion = transport.transfer(staging)
                    await to_wait_tx.send((staging, completion))
    except BaseExceptionGroup as group:
        leaf = unwrap_group(group)
        raise leaf from leaf.__cause__  # keeps the leaf's own cause; hides the group
    stats.wall = clock() - started
    return stats
