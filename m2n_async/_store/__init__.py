"""Control-plane I/O: the store (framing, auth, server, client) and ``ControlGroup``.

See DESIGN.md §4. ``_core`` holds the sans-IO semantics; ``_server``/``_client`` and
``m2n_async.testing.MemoryStore`` are drivers over it, and ``_thread`` serves a server from a
thread of its own; ``_group`` builds collectives on the ``Store`` protocol (``_api``) and the
departure rule its gathers apply (``drop_departed``, ``gather_past_departures``: the round
outcome applies it too); ``_namespace`` scopes keys per job generation; ``_claims`` fences a
job name to one live holder per rank; ``_sockets`` is what the server and the client share
(addresses, socket options, the loop).
"""

from m2n_async._store._api import Store, SupportsExchange
from m2n_async._store._claims import (
    Claim,
    JobClaim,
    JobClaimedError,
    claim_rank,
    rank_holder,
)
from m2n_async._store._client import StoreClient
from m2n_async._store._core import StaleGenerationError, StoreLimitError, generation_key
from m2n_async._store._group import ControlGroup, drop_departed, gather_past_departures
from m2n_async._store._namespace import (
    current_generation,
    generation_namespace,
    next_generation,
)
from m2n_async._store._server import StoreServer
from m2n_async._store._thread import StoreThread

__all__ = [
    "Claim",
    "ControlGroup",
    "JobClaim",
    "JobClaimedError",
    "StaleGenerationError",
    "Store",
    "StoreClient",
    "StoreLimitError",
    "StoreServer",
    "StoreThread",
    "SupportsExchange",
    "claim_rank",
    "current_generation",
    "drop_departed",
    "gather_past_departures",
    "generation_key",
    "generation_namespace",
    "next_generation",
    "rank_holder",
]
