"""Job claims: at most one live holder of each rank of a job on a store.

Theory of operation. A job name on a store is shared state — its generation counter, each
rank's last joined generation — so two processes that both believe they are rank r of job
``j`` (a second job started with the same name, or a zombie of an old incarnation still
connected) would purge each other's generations, join each other's rounds, and move each
other's weights. A claim fences that: before it touches anything of the job, a rank takes a
ticket from the store (``add`` on ``{job}/claims/seq``: one order every process agrees on)
and writes ``{job}/claims/{rank}/{ticket}`` as an *ephemeral* key holding who it is (host,
pid, since when, and once joined, its generation). The live entry with the lowest ticket
holds the rank; the others wait for it to go — a clean release when its engine closes, or
the end of its session when its process dies — and give up after ``wait_s`` with
``JobClaimedError`` naming the holder. Nothing of the job is read or written by a rank that
does not hold its claim, so it can neither receive nor send the other's weights. Trainer
rank 0's claim also says which generation the job is in: the other ranks join only the
generation its live holder names (``rank_holder``; ``_engine._generation``), so a generation
whose rank 0 is gone is never joined.

Claim keys are not under a generation (``{job}/claims/...`` has no number in its second
segment), so a new generation does not purge them; they vanish with their sessions.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from dataclasses import dataclass
from typing import Final

import anyio
import msgspec

from m2n_async._proto.errors import StoreError
from m2n_async._store._api import Store
from m2n_async._store._core import generation_key

__all__ = ["Claim", "JobClaim", "JobClaimedError", "claim_rank", "rank_holder"]

_POLL_S: Final[float] = 0.1  # how often a waiting claimant looks whether the holder left


class JobClaim(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Who holds (or waits for) rank ``rank`` of job ``job``."""

    job: str
    rank: int
    ticket: int  # from the store's counter: the lowest live ticket holds the rank
    host: str
    pid: int
    since: float  # the holder's wall clock when it claimed (for people, not for ordering)
    generation: int  # the generation it joined; 0 until it joined one

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        gen = f", generation {self.generation}" if self.generation else ""
        return f"pid {self.pid} on host {self.host!r} since {when}{gen}"


class JobClaimedError(StoreError):
    """Rank ``rank`` of job ``job`` is held by another live process (``holder``)."""

    def __init__(self, message: str, *, job: str, rank: int, holder: JobClaim | None) -> None:
        self.job = job
        self.rank = rank
        self.holder = holder
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        # The keywords through the constructor (it has no default for them; calling the class
        # with the message alone failed to unpickle), every attribute and note as state.
        return (functools.partial(type(self), job=self.job, rank=self.rank, holder=self.holder),
                (self.args[0],), dict(vars(self)))


_decoder = msgspec.msgpack.Decoder(JobClaim)
_encoder = msgspec.msgpack.Encoder()


@dataclass
class Claim:
    """A held claim: ``joined(generation)`` records the generation, ``release()`` lets go."""

    store: Store
    key: str
    record: JobClaim

    async def joined(self, generation: int) -> None:
        """Say in the claim which generation the holder joined: the next claimant's message
        names it, and trainer rank 0's is the generation the job's other ranks join (only a
        live claim names one). Cancellation: the claim stays held, with or without it."""
        self.record = msgspec.structs.replace(self.record, generation=generation)
        await self.store.set(self.key, _encoder.encode(self.record), ephemeral=True)

    async def release(self) -> None:
        """A clean release: the next claimant (if any) holds the rank now.
        Cancellation: the claim may stay until this session ends."""
        await self.store.delete(self.key)


async def claim_rank(store: Store, job: str, rank: int, *, wait_s: float) -> Claim:
    """Hold rank ``rank`` of ``job`` on ``store`` (module docstring).

    Waits up to ``wait_s`` seconds for a live holder to release it, then raises
    ``JobClaimedError`` naming the holder (who, since when, which generation).

    Cancellation: this claimant's entry may remain until its session ends; it holds nothing
    unless it was the lowest live ticket.
    """
    generation_key(job)  # validates the job name
    prefix = f"{job}/claims/{rank}/"
    ticket = await store.add(f"{job}/claims/seq", 1)
    record = JobClaim(job, rank, ticket, socket.gethostname(), os.getpid(), time.time(), 0)
    key = f"{prefix}{ticket}"
    await store.set(key, _encoder.encode(record), ephemeral=True)
    holder: JobClaim | None = None
    try:
        with anyio.move_on_after(wait_s):
            while True:
                holder = _lowest(await store.gather(prefix, 0))
                if holder is None or holder.ticket == ticket:
                    return Claim(store, key, record)
                await anyio.sleep(_POLL_S)
    except BaseException:
        with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
            await store.delete(key)
        raise
    with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
        await store.delete(key)
    who = holder.describe() if holder is not None else "another process"
    raise JobClaimedError(
        f"job {job!r} rank {rank} on this store is held by {who}, and was not released "
        f"within {wait_s:g} s: another job with the same name, or a process of an earlier run "
        f"still connected. Give this job another EngineConfig.job, or stop that process",
        job=job, rank=rank, holder=holder)


async def rank_holder(store: Store, job: str, rank: int) -> JobClaim | None:
    """The live claim that holds rank ``rank`` of ``job`` now (the lowest live ticket), or
    None when no live process claims it. One read.

    Cancellation: nothing to undo (it only reads).
    """
    generation_key(job)  # validates the job name
    return _lowest(await store.gather(f"{job}/claims/{rank}/", 0))


def _lowest(entries: dict[str, bytes]) -> JobClaim | None:
    best: JobClaim | None = None
    for raw in entries.values():
        try:
            claim = _decoder.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue  # not ours to judge: a foreign value cannot hold the rank
        if best is None or claim.ticket < best.ticket:
            best = claim
    return best
