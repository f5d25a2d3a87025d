"""Job namespaces and generations: ``{job}/{generation}/...``.

Theory of operation: each (re)connect of a job takes a fresh generation with one atomic ``add``
on ``{job}/generation``, and scopes all of its keys under ``{job}/{generation}/``. The store
itself enforces freshness (see ``_core``): once the counter advances, the older generations'
keys are purged, their waiters fail, and any later operation on them raises
``StaleGenerationError`` — so a rank left over from a failed attempt cannot read or overwrite
the new attempt's state, whichever store implementation is in use.
"""

from __future__ import annotations

from m2n_async._proto.errors import StoreError
from m2n_async._store._api import Store
from m2n_async._store._core import generation_key

__all__ = ["current_generation", "generation_namespace", "next_generation"]


async def next_generation(store: Store, job: str) -> int:
    """Advance ``job`` to a new generation (1, 2, ...) and return it.

    Every older generation of ``job`` becomes stale at once. Call it on one rank and share the
    number (e.g. ranks read it with ``current_generation`` after a barrier outside the job's
    namespace), or let every rank call it when each connect is its own job.

    Cancellation: the generation may or may not have advanced.
    """
    return await store.add(generation_key(job), 1)


async def current_generation(store: Store, job: str) -> int:
    """``job``'s current generation, 0 if it never started.

    Cancellation: a read; safe to cancel.
    """
    key = generation_key(job)
    value = await store.get(key)
    if value is None:
        return 0
    try:
        return int(value)
    except ValueError:
        raise StoreError(f"job {job!r}: its generation counter {key!r} holds a non-integer "
                         f"value ({value[:32]!r}); the store's counter is corrupt") from None


def generation_namespace(job: str, generation: int, *parts: str) -> str:
    """``"{job}/{generation}/part/..."`` — the namespace for keys of that generation."""
    generation_key(job)  # validates the job name
    if generation < 0:
        raise ValueError(f"generation must be >= 0, got {generation}")
    for part in parts:
        if not part or "/" in part:
            raise ValueError(f"namespace parts must be non-empty without '/', got {part!r}")
    return "/".join((job, str(generation), *parts))
