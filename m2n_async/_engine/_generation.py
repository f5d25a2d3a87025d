"""Joining a generation: how every rank of a (re)connect lands in the same ``{job}/{g}``.

Theory of operation. ``next_generation`` advances the job's counter (and makes every older
generation stale in the store), so exactly one rank may call it per connect: trainer rank 0,
once it holds rank 0's job claim (``_store._claims``). The others must join the generation
rank 0 opened for *this* connect: not an older one (stale), not by racing rank 0 to the
counter, and not one that an earlier attempt opened and abandoned. A rank that missed an
attempt (rank 0 opened g, the attempt failed, the rank last joined g - 1) finds g opened when
everyone reconnects; joining it would leave rank 0 waiting in g + 1's handshake for that rank
until the phase timeout.

So a rank joins only a generation that the *live* rank 0 holds. Rank 0 writes the generation
it opened into its claim (an ephemeral key: it vanishes when that process's connection to
the store ends, and a connect that fails releases it), and only then writes
``{job}/open/{g}``. Every other rank remembers, in the store, the last generation it joined
(``{job}/joined/{rank}``; it survives the process, so a replacement process of a killed rank
continues from it) and joins the generation that the holder of rank 0's claim (its lowest
live ticket) names, once that is newer than its last. Until then it waits in the store, on
the open key of the generation it expects next: since the claim names a generation before
its open key exists, the key wakes the rank when one more read of the claim can tell. An open
key whose generation the holder does not name belongs to an abandoned attempt (its opener no
longer holds the claim, and tickets only grow, so it never will again), and so does every
generation below the counter; the rank then waits on the next one, or on the counter's own,
which rank 0 may be opening right now. A rank 0 that went between advancing the counter and
writing the open key leaves a generation whose key never comes: the wait re-reads the claim
every ``_RECHECK_S`` and finds the next holder's generation there. Rank 0 deletes the older
open keys before it writes its own, so the job keeps one.

If rank 0 has moved on again meanwhile, the stale generation fails at once in the store and
the rank simply reconnects.
"""

from __future__ import annotations

from typing import Final

import anyio

from m2n_async._proto.errors import PhaseTimeoutError
from m2n_async._store import (
    Claim,
    JobClaim,
    Store,
    current_generation,
    next_generation,
    rank_holder,
)

__all__ = ["join_generation"]

#: How often a rank waiting to join re-reads rank 0's claim without an open key to wake it
#: (a rank 0 that went between advancing the counter and opening): two reads each.
_RECHECK_S: Final[float] = 1.0


async def join_generation(store: Store, job: str, rank: int, *, claim: Claim,
                          wait_s: float) -> int:
    """The generation this rank's connect joins (rank 0 opens a new one); ``claim`` is this
    rank's held claim of the job, which then names that generation.

    Raises ``PhaseTimeoutError`` (phase ``hello``, ``ranks`` (0,)) naming the job and who
    holds rank 0's claim if rank 0 did not open a generation newer than this rank's last
    within ``wait_s`` seconds: the same text on every rank that waited.

    Cancellation: nothing to undo; at worst rank 0 opened a generation nobody joins (the next
    connect opens another; the ranks join that one, since rank 0's claim goes with its
    failed connect).
    """
    joined_key = f"{job}/joined/{rank}"
    if rank == 0:
        generation = await next_generation(store, job)
        # The claim first: a rank that the open key wakes must find the generation named.
        await claim.joined(generation)
        # One open key per job, not one per connect: older ones are only wake-ups, and the
        # claim already names this generation, so a rank still waiting on an older key
        # finds it at its next read of the claim (``_RECHECK_S``). All of them: a rank 0
        # that went before writing its own left the one before it.
        await store.delete_prefix(f"{job}/open/")
        await store.set(f"{job}/open/{generation}", b"1")
        await store.set(joined_key, str(generation).encode())
        return generation
    raw = await store.get(joined_key)
    last = int(raw) if raw else 0
    target = last + 1  # the generation whose open key the wait is for
    opened = False  # whether target's open key exists
    holder: JobClaim | None = None
    try:
        with anyio.fail_after(wait_s):
            while True:
                holder = await rank_holder(store, job, 0)
                if holder is not None and holder.generation > last:
                    break
                # Not named by the live rank 0: an opened target was abandoned, and so was
                # every generation below the counter; the counter's own may be opening now.
                # (Read after the claim: a rank 0 that advanced the counter since is opening
                # the counter's generation, and the wait below is for its open key.)
                counter = await current_generation(store, job)
                target = max(target + 1 if opened else target, counter)
                opened = False
                with anyio.move_on_after(_RECHECK_S):
                    await store.get(f"{job}/open/{target}", wait=True)
                    opened = True
    except TimeoutError:
        seen = (f"rank 0 of the job is held by {holder.describe()}" if holder is not None
                else "no live process holds rank 0 of the job")
        # One text on every rank that waited (as a phase's timeout): rank 0 did not arrive
        # for hello; which rank waited, and how long, goes in a note.
        err = PhaseTimeoutError(
            f"job {job!r}: trainer rank 0 did not open generation {last + 1} or later "
            f"({seen}; is rank 0 connecting to the same store and job?)",
            phase="hello", ranks=(0,))
        err.add_note(f"rank {rank} waited {wait_s:g} s for it")
        raise err from None
    generation = holder.generation
    await store.set(joined_key, str(generation).encode())
    await claim.joined(generation)
    return generation
