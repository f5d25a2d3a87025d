"""The pytest plugin's fixtures from pytest-asyncio (strict mode) and anyio's plugin, and a
``MemoryStore`` job on the Gloo lane with no host configured."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest
import torch

from m2n_async import EngineConfig, Layout, Mesh, ParamSpec, TrainerEngine, WorkerEngine
from m2n_async.testing import LocalWorld, MemoryStore
from m2n_async.testing.pytest_plugin import LocalStore

from ._ranks import returns_rank


async def _one_round_in_one_loop(store: MemoryStore) -> torch.Tensor:
    """A trainer and a worker as tasks of this loop; no ``host`` in the config."""
    cfg = EngineConfig(transport="gloo", phase_timeout=20, round_timeout=20, abort_grace=2)
    assert cfg.host is None
    spec = ParamSpec("w", torch.float32, (4, 2), Layout(Mesh((1, 1), 0), None))
    sent = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    got = torch.zeros(4, 2)
    engines: dict[str, object] = {}

    async def trainer() -> None:
        async with await TrainerEngine.connect(store=store.session(), rank=0, trainer_ranks=1,
                                               world_size=2, params=[spec],
                                               config=cfg) as engine:
            engines["t"] = engine
            await engine.sync_weights({"w": sent}, version=1)

    async def worker() -> None:
        async with await WorkerEngine.connect(store=store.session(), rank=1, trainer_ranks=1,
                                              world_size=2, targets={"w": (got, None)},
                                              config=cfg) as engine:
            assert (await engine.receive()).version == 1

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer)
            tg.start_soon(worker)
    assert torch.equal(got, sent)
    return got


@pytest.mark.asyncio
async def test_memory_store_and_gloo_need_no_host_under_pytest_asyncio(
        m2n_memory_store: MemoryStore) -> None:
    await _one_round_in_one_loop(m2n_memory_store)


@pytest.mark.anyio
async def test_fixtures_under_anyio(m2n_store: LocalStore,
                                    m2n_world: Callable[[int, int], LocalWorld]) -> None:
    client = await m2n_store.connect()
    try:
        await client.set("plugin-test/k", b"v")
        assert await client.get("plugin-test/k") == b"v"
    finally:
        await client.aclose()
    res = await m2n_world(2, 2).arun(returns_rank)
    assert res.values == [0, 1, 2, 3]
