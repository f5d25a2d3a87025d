"""Where the Gloo data plane listens by default: loopback for a local job, and for a remote
store the interface this rank reaches the store through (the data plane is unauthenticated:
docs/security.md), never whatever the host name resolves to."""

from __future__ import annotations

import pytest

from m2n_async import EngineConfig, StoreClient, StoreServer, TrainerEngine
from m2n_async.testing import MemoryStore

pytestmark = pytest.mark.asyncio


def _engine(store, **cfg):
    return TrainerEngine(params=[], store=store, owns_store=False, rank=0, trainer_ranks=1,
                         world_size=2, config=EngineConfig(**cfg))


async def test_default_bind_address() -> None:
    assert _engine(MemoryStore())._settings().host == "127.0.0.1"
    async with StoreServer("127.0.0.1", 0, token="t") as server:
        async with await StoreClient.connect(server.address, token="t") as client:
            assert client.local_host == "127.0.0.1"
            assert _engine(client)._settings().host == "127.0.0.1"
            # a store reached over another interface: listen on that interface
            client.address = "10.1.2.3:29500"
            client.local_host = "10.1.2.9"
            assert _engine(client)._settings().host == "10.1.2.9"
            # an explicit host always wins
            assert _engine(client, host="0.0.0.0")._settings().host == "0.0.0.0"
