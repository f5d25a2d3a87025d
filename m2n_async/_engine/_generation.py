"""Joining a generation: how every rank of a (re)connect lands in the same ``{job}/{g}``.

Theory of operation. ``next_generation`` advances the job's counter (and makes every older
generation stale in the store), so exactly one rank may call it per connect: trainer rank 0.
The others must join the generation rank 0 opened for *this* connect, not an older one
(stale) and without a race on who reads the counter first. Each rank therefore remembers, in
the store, the last generation it joined (``{job}/joined/{rank}``; it survives the process,
so a replacement process of a killed rank continues from it) and waits for rank 0 to open a
newer one (``{job}/open/{g}`` is written for every generation rank 0 opens). It then joins the
job's current generation. If rank 0 has moved on again meanwhile, the stale generation fails
at once in the store and the rank simply reconnects.
"""

from __future__ import annotations

import anyio

from m2n_async._store import Store, current_generation, next_generation

__all__ = ["join_generation"]


async def join_generation(store: Store, job: str, rank: int, *, wait_s: float) -> int:
    """The generation this rank's connect joins (rank 0 opens a new one).

    Raises ``TimeoutError`` naming the job if rank 0 did not open a generation newer than
    this rank's last within ``wait_s`` seconds.

    Cancellation: nothing to undo; at worst rank 0 opened a generation nobody joins (the next
    connect opens another).
    """
    joined_key = f"{job}/joined/{rank}"
    if rank == 0:
        generation = await next_generation(store, job)
        await store.set(f"{job}/open/{generation}", b"1")
    else:
        raw = await store.get(joined_key)
        last = int(raw) if raw else 0
        try:
            with anyio.fail_after(wait_s):
                await store.get(f"{job}/open/{last + 1}", wait=True)
        except TimeoutError:
            raise TimeoutError(
                f"job {job!r}: rank {rank} waited {wait_s:g} s for trainer rank 0 to open "
                f"generation {last + 1} or later (is rank 0 connecting to the same store and "
                f"job?)") from None
        generation = await current_generation(store, job)
    await store.set(joined_key, str(generation).encode())
    return generation
