"""The ``nccl`` and ``m2n`` transports end to end on CPU over the FAKE nccl runtime.

What this covers without a GPU: the transports issue identical collective calls on every rank
(the fake raises where real M2N would hang), bytes land bit-exactly for every layout pair and
dtype, zero-copy/in-place paths are taken where the layout allows, byte counts equal the plan,
M2N grouping is decided identically on every rank (including a GIN-less host and a host where
only some ranks fail), and abort/deadline end every rank promptly. The real runtime is covered
by ``tests/gpu`` on the H200.
"""

from __future__ import annotations

import contextvars
import threading
import time
from typing import Any

import anyio
import pytest
import torch

from m2n_async._data import _cuda
from m2n_async._data._transport import Transport
from m2n_async._proto.errors import LocalProtocolError, TransferError
from m2n_async._proto.plan import M2N_MAX_CALL_BYTES
from m2n_async._proto.stacking import COALESCE_BELOW_BYTES, bucket_calls

from . import fake_nccl
from ._world import (
    R,
    drive,
    expected,
    forms_after_two_rounds,
    launched_form,
    make_plan,
    raise_first,
    run_world,
    sources,
    targets,
)

pytestmark = pytest.mark.asyncio

# (src dims, dst dims, [(src placements, dst placements)]): the CPU suite's layout pairs
LAYOUTS = {
    "1+1": ((1, 1), (1, 1), [(None, None)]),
    "2+2": ((1, 2), (1, 2), [((R, 0), (R, 1)), ((R, 1), (R, 1)), (None, (R, 0)),
                            ((R, 0), None)]),
    "2+3": ((2, 1), (3, 1), [((0, R), (1, R)), ((0, R), None), (None, (1, R))]),
    "2x2+2x1": ((2, 2), (2, 1), [((0, R), (0, R)), ((R, 1), (1, R)), (None, None)]),
}


def defs_for(pairs, dtypes):
    out = []
    for k, (sp, dp) in enumerate(pairs):
        for j, dt in enumerate(dtypes):
            out.append((f"p{k}.{j}.{str(dt).split('.')[-1]}", (12, 6, 4) if j % 2 else (24, 12),
                        dt, sp, dp))
    return out


#: Big enough for several buckets per plan, each holding repeats of a geometry.
BUCKET = 12_000


def m2n_calls(plan, bucket_bytes, coalesce_below):
    """Reshards one round issues per rank, from the pure stacking function."""
    return sum(len(bucket_calls(plan, b, coalesce_below=coalesce_below,
                                max_call_bytes=M2N_MAX_CALL_BYTES))
               for b in plan.buckets(bucket_bytes))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", ["nccl", "m2n", "m2n-single"])
async def test_bit_exact_every_layout(fake_world, name, layout):
    # Every def three times (same geometry, interleaved with the others), so that m2n
    # stacks them; "m2n-single" is the same with coalescing off.
    src, dst, pairs = LAYOUTS[layout]
    dtypes = [torch.bfloat16, torch.float32, torch.int8, torch.float8_e4m3fn]
    if name == "nccl":
        dtypes += [torch.bool, torch.int16]
    defs = [(f"{n}.{c}", *rest) for c in range(3) for n, *rest in defs_for(pairs, dtypes)]
    plan = make_plan(defs, src, dst)
    coalesce = name == "m2n"
    name = name.removesuffix("-single")
    results = await run_world(name, plan, bucket_bytes=BUCKET, rounds=2, coalesce=coalesce)
    raise_first(results)
    for res in results:
        role_bytes = (plan.send_bytes(res.rank) if res.rank < plan.trainer_ranks
                      else plan.recv_bytes(res.rank))
        if name == "nccl" or res.rank >= plan.trainer_ranks:
            # bytes moved == plan bytes, every round (a silent zero-byte success fails here)
            assert res.moved == 2 * role_bytes, (res.rank, res.moved, role_bytes)
    if name == "m2n":
        calls = set(fake_world.reshard_calls.values())
        per_round = m2n_calls(plan, BUCKET, COALESCE_BELOW_BYTES if coalesce else 0)
        assert calls == {2 * per_round + 2}, fake_world.reshard_calls  # + probe
        if coalesce:  # per bucket: each 3-d param alone, one call per 2-d geometry
            want = 0
            for b in plan.buckets(BUCKET):
                ps = [plan.params[i] for i in range(b.start, b.stop)]
                want += sum(len(p.spec.shape) > 2 for p in ps)
                want += len({(p.spec.shape, p.spec.dtype, p.src, p.dst) for p in ps
                             if len(p.spec.shape) <= 2})
            assert per_round == want < len(plan.params), (per_round, want)
        else:
            assert per_round == len(plan.params)


@pytest.mark.parametrize("name", ["nccl", "m2n"])
async def test_zero_copy_and_in_place_when_aligned(fake_world, name):
    # Shard(0) -> Shard(0) with equal meshes, one param per bucket: every peer buffer is one
    # contiguous range of the source and of the target.
    plan = make_plan([("w", (64, 8), torch.bfloat16, (0, R), (0, R)),
                      ("b", (64,), torch.float32, (0, R), (0, R))], (2, 1), (2, 1))
    results = await run_world(name, plan, bucket_bytes=1)
    raise_first(results)
    for res in results:
        assert [st.zero_copy for st in res.stagings] == [1, 1], res.rank
        assert [st.nbytes for st in res.stagings] == [0, 0], res.rank  # no staging memory


@pytest.mark.parametrize("name", ["nccl", "m2n"])
async def test_fp32_master_cast_to_bf16_wire(fake_world, name):
    plan = make_plan([("w", (32, 16), torch.bfloat16, (R, 0), (R, 1)),
                      ("v", (16,), torch.bfloat16, None, (R, 0))], (1, 2), (1, 2))
    results = await run_world(name, plan, src_dtype=torch.float32)
    raise_first(results)
    trainer = results[0].stagings[0]
    assert trainer.nbytes > 0  # cast copies are extra memory and are reported


@pytest.mark.parametrize("name", ["nccl", "m2n"])
async def test_load_callbacks_in_plan_order(fake_world, name):
    plan = make_plan([(f"p{i}", (8, 4), torch.float32, (R, 0), (R, 1)) for i in range(5)],
                     (1, 2), (1, 2))
    calls: dict[int, list[tuple[str, torch.Tensor]]] = {2: [], 3: []}

    def sinks_for(rank, rnd):
        def cb(name, tensor):
            calls[rank].append((name, tensor.clone()))
        return {p.spec.name: cb for p in plan.params}

    results = await run_world(name, plan, bucket_bytes=200, sinks_for=sinks_for)
    raise_first(results)
    for rank in (2, 3):
        assert [n for n, _ in calls[rank]] == [p.spec.name for p in plan.params]
        want = expected(plan, rank)
        for n, got in calls[rank]:
            assert torch.equal(got, want[n])


async def test_m2n_groups_when_supported(fake_world):
    plan = make_plan([(f"p{i}", (16, 8), torch.bfloat16, (R, 0), (R, 1)) for i in range(6)],
                     (1, 2), (1, 2))
    results = await run_world("m2n", plan, bucket_bytes=1 << 20, coalesce=False)
    raise_first(results)
    for res in results:
        assert res.transport.grouped is True
        assert "succeeded on every rank" in res.transport.grouping_reason
        assert res.transport.detail == (f"m2n submission: {res.transport.grouping_reason}; "
                                        f"coalescing off")
    # probe group (2 per rank) + one group of 6 per rank
    assert sorted(set(fake_world.group_sizes)) == [2, 6]


async def test_m2n_falls_back_on_gin_less_host(fake_world):
    fake_world.fail_groups = True
    plan = make_plan([(f"p{i}", (16, 8), torch.bfloat16, (R, 0), (R, 1)) for i in range(6)],
                     (1, 2), (1, 2))
    results = await run_world("m2n", plan, bucket_bytes=1 << 20)
    raise_first(results)
    reasons = {res.transport.grouping_reason for res in results}
    assert len(reasons) == 1, reasons  # decided identically on every rank
    assert "fails on this host" in reasons.pop()
    assert all("ordered single reshards" in res.transport.detail for res in results)
    assert all(res.transport.grouped is False for res in results)
    assert fake_world.group_sizes == []


async def test_m2n_mixed_group_failure_aborts_everywhere(fake_world):
    fake_world.fail_groups = True
    fake_world.fail_group_ranks = {1}
    fake_world.timeout = 1.0  # the fake runs dst copies synchronously: dsts wait for rank 1
    plan = make_plan([("w", (16, 8), torch.bfloat16, (R, 0), (R, 1))], (1, 2), (1, 2))
    t0 = time.monotonic()
    results = await run_world("m2n", plan)
    assert time.monotonic() - t0 < 15
    for res in results:
        assert isinstance(res.error, TransferError), (res.rank, res.error)
        assert "failed on ranks [1" in str(res.error), res.error
        assert "M2N_ASYNC_M2N_GROUPING=off" in str(res.error)


async def test_m2n_grouping_on_but_unsupported_is_an_error(fake_world, monkeypatch):
    monkeypatch.setenv(_cuda.GROUPING_ENV, "on")
    fake_world.fail_groups = True
    plan = make_plan([("w", (16, 8), torch.bfloat16, (R, 0), (R, 1))], (1, 2), (1, 2))
    results = await run_world("m2n", plan)
    for res in results:
        assert isinstance(res.error, LocalProtocolError), res.error
        assert "M2N_ASYNC_M2N_GROUPING=on" in str(res.error)


async def test_m2n_grouping_off_skips_probe(fake_world, monkeypatch):
    monkeypatch.setenv(_cuda.GROUPING_ENV, "off")
    plan = make_plan([(f"p{i}", (16, 8), torch.bfloat16, (R, 0), (R, 1)) for i in range(3)],
                     (1, 2), (1, 2))
    results = await run_world("m2n", plan, bucket_bytes=1 << 20)
    raise_first(results)
    assert fake_world.group_sizes == []
    assert all("off" in res.transport.grouping_reason for res in results)


@pytest.mark.parametrize("name", ["nccl", "m2n"])
async def test_abort_wakes_a_rank_waiting_on_a_silent_peer(fake_world, name):
    # Worker rank 3 never takes part: rank 2 waits for trainer data that rank 1 sends, but
    # in M2N every dst waits for all sources; for nccl rank 3's recv is simply never posted,
    # so make trainer 1 the silent one instead.
    plan = make_plan([("w", (16, 8), torch.float32, (R, 0), (R, 1))], (1, 2), (1, 2))
    silent = 1

    async def body(rank: int, t: Transport) -> None:
        if rank == silent:
            await anyio.sleep(3)
            return
        t.begin_round(0, time.monotonic() + 30)
        b = t.ctx.buckets[0]
        if rank < plan.trainer_ranks:
            st = await t.stage(b, sources=sources(plan, rank))
        else:
            st = await t.stage(b, sinks=targets(plan, rank))
        c = t.transfer(st)
        if rank >= plan.trainer_ranks:
            async with anyio.create_task_group() as tg:
                async def watchdog() -> None:
                    await anyio.sleep(0.3)
                    t.abort("watchdog: peer rank 1 lost")
                tg.start_soon(watchdog)
                t0 = time.monotonic()
                with pytest.raises(TransferError, match="peer rank 1 lost"):
                    await c.wait()
                assert time.monotonic() - t0 < 5
        else:
            await c.wait()

    results = await run_world(name, plan, body=body)
    raise_first(results)
    assert all(res.transport.aborted for res in results if res.rank >= 2)


async def test_m2n_reuses_descriptors_by_address_and_holds_no_tensor(fake_world):
    # Building DistTensor descriptors costs as much as a small reshard between GPUs, so the
    # m2n transport reuses them across rounds while the buffer is at the same address. A
    # descriptor describes the address (a raw pointer), so it holds no tensor: the lane
    # never keeps one the caller dropped (a lazy cast per round), and never uses a stale
    # address.
    import gc
    import weakref

    plan = make_plan([("w", (32, 16), torch.bfloat16, (R, 0), (R, 1)),
                      ("v", (16,), torch.bfloat16, None, (R, 0))], (1, 2), (1, 2))
    names = [p.spec.name for p in plan.params]

    async def round_(t: Transport, rank: int, rnd: int, mine: dict) -> None:
        trainer = rank < plan.trainer_ranks
        await drive(t, round=rnd, deadline=time.monotonic() + 30,
                    sources=mine if trainer else None, sinks=None if trainer else mine,
                    max_inflight=2)
        if not trainer:
            for k, v in expected(plan, rank, rnd).items():
                assert torch.equal(mine[k].view(torch.uint8), v.view(torch.uint8)), (rank, k)

    def described(t: Transport) -> dict[int, Any]:
        assert all(type(d.buffer) is int and d.buffer == ptr for ptr, d in t._own_side.values())
        return {i: d for i, (_, d) in t._own_side.items()}

    async def body(rank: int, t: Transport) -> None:
        trainer = rank < plan.trainer_ranks
        mine = sources(plan, rank, 0) if trainer else targets(plan, rank)
        kept = []
        for rnd in range(4):
            if trainer:
                for k, v in sources(plan, rank, rnd).items():
                    mine[k].copy_(v)  # new weights in place: the same tensor objects
            await round_(t, rank, rnd, mine)
            kept.append(described(t))
        # built in round 0, the same descriptors since
        assert sorted(kept[0]) == [0, 1]
        assert all(kept[r][i] is kept[0][i] for r in (1, 2, 3) for i in (0, 1))
        # new storage behind the same tensor objects: the old descriptors are not used again
        if trainer:
            for k, v in sources(plan, rank, 4).items():
                mine[k].data = v.clone()
        else:
            for k in names:
                mine[k].data = torch.zeros_like(mine[k])
        await round_(t, rank, 4, mine)
        now = described(t)
        assert all(now[i] is not kept[0][i] for i in (0, 1))
        assert [now[i].buffer for i in (0, 1)] == [mine[n].data_ptr() for n in names]
        # a fresh tensor every round (a lazy cast) is never retained
        refs = []
        for rnd in range(5, 8):
            fresh = sources(plan, rank, rnd) if trainer else targets(plan, rank)
            refs.append([weakref.ref(x) for x in fresh.values()])
            await round_(t, rank, rnd, fresh)
            del fresh
            gc.collect()
            assert all(r() is None for rs in refs for r in rs), (rank, rnd)
            described(t)

    results = await run_world("m2n", plan, body=body)
    raise_first(results)


class _Event:
    """A stand-in CUDA event for the stream-order test (CPU: Streams records none)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@pytest.mark.parametrize("grouping", ["off", "on"])
async def test_m2n_transfer_waits_only_for_its_own_cast_chunk(fake_world, monkeypatch,
                                                              grouping):
    # fp32 master -> bf16 wire: the trainer casts on the pack stream. The transfer must wait
    # for the producer once, then for each chunk's casts just before that chunk's first
    # reshard (grouped: before the group) — not for the whole bucket before the first one.
    import threading

    from m2n_async._data import m2n as m2n_plane

    monkeypatch.setenv("M2N_ASYNC_M2N_GROUPING", grouping)
    # 6 params cast to (8, 16) bf16 = 256 bytes each on a trainer: 2 per chunk
    monkeypatch.setattr(m2n_plane, "GATE_BYTES", 512)
    log: list[tuple[str, str, object]] = []
    lock = threading.Lock()

    def record(self, stream):
        ev = _Event()
        with lock:
            log.append((threading.current_thread().name, "record", ev))
        return ev

    def wait(self, stream, ev):
        if ev is not None:
            with lock:
                log.append((threading.current_thread().name, "wait", ev))

    real_reshard = fake_nccl.Handle.reshard

    def reshard(self, comm, src, dst, *, stream=None):
        if src.local_shape == (8, 16):  # not the grouping probe's tensors
            with lock:
                log.append((threading.current_thread().name, "reshard", src.buffer))
        return real_reshard(self, comm, src, dst, stream=stream)

    monkeypatch.setattr(_cuda.Streams, "record", record)
    monkeypatch.setattr(_cuda.Streams, "wait", wait)
    monkeypatch.setattr(fake_nccl.Handle, "reshard", reshard)
    plan = make_plan([(f"p{i}", (16, 16), torch.bfloat16, (R, 0), (R, 1)) for i in range(6)],
                     (1, 2), (1, 2))
    results = await run_world("m2n", plan, bucket_bytes=1 << 20, src_dtype=torch.float32,
                              coalesce=False)  # single reshards: one per param to watch
    raise_first(results)  # bytes bit-exact on the workers
    assert results[0].transport.grouped is (grouping == "on")
    native = [(kind, x) for who, kind, x in log if who == "m2n-native-test-r0"]
    native = native[[kind for kind, _ in native].index("wait"):]  # after the grouping probe
    kinds = "".join({"wait": "W", "reshard": "R", "record": "E"}[kind] for kind, _ in native)
    # W: the producer's event, then each 2-param chunk's gate; E: the bucket's transfer event
    assert kinds == ("WWRRWRRWRRE" if grouping == "off" else "WWWWRRRRRRE"), kinds
    gates = [x for kind, x in native if kind == "wait"][1:]
    # the gates are the pack stream's events, in the order the casts recorded them
    recorded = [ev for _who, kind, ev in log if kind == "record" and ev in gates]
    assert recorded == gates


async def test_round_deadline_raises_timeout(fake_world):
    plan = make_plan([("w", (16, 8), torch.float32, (R, 0), (R, 1))], (1, 2), (1, 2))

    async def body(rank: int, t: Transport) -> None:
        if rank != 2:
            await anyio.sleep(1.5)
            return
        t.begin_round(0, time.monotonic() + 0.3)
        st = await t.stage(t.ctx.buckets[0], sinks=targets(plan, rank))
        with pytest.raises(TimeoutError, match="round deadline"):
            await t.transfer(st).wait()
        t.abort("deadline")

    results = await run_world("nccl", plan, body=body)
    raise_first(results)


async def test_aborted_transport_is_never_reused(fake_world):
    plan = make_plan([("w", (16, 8), torch.float32, (R, 0), (R, 1))], (1, 2), (1, 2))

    async def body(rank: int, t: Transport) -> None:
        t.abort("test")
        with pytest.raises(TransferError, match="aborted"):
            t.begin_round(0, time.monotonic() + 5)

    results = await run_world("m2n", plan, body=body)
    raise_first(results)
    assert all(not c.valid for c in fake_world.comms)
    assert all(res.transport.teardown_finished for res in results)


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_fake_detects_mismatched_collectives(fake_world):
    # The fake itself must fail where real M2N would hang, or the suite proves nothing.
    m = fake_nccl
    w = fake_world
    a, b = m.Comm(2, 0, b"u"), m.Comm(2, 1, b"u")
    mesh0, mesh1 = m.Mesh((1, 1), 0), m.Mesh((1, 1), 1)
    x = torch.ones(4)
    m._reshard_now(a, m.DistTensor(x, (4,), torch.float32, mesh=mesh0, placements=(m.Replicate(),)),
                   m.DistTensor(None, (4,), torch.float32, mesh=mesh1,
                                placements=(m.Replicate(),)))
    with pytest.raises(m.FakeNcclError, match="would hang"):
        m._reshard_now(b, m.DistTensor(None, (8,), torch.float32, mesh=mesh0,
                                       placements=(m.Replicate(),)),
                       m.DistTensor(torch.ones(8), (8,), torch.float32, mesh=mesh1,
                                    placements=(m.Replicate(),)))
    assert w.reshard_calls == {0: 1, 1: 1}


@pytest.mark.parametrize("name", ["nccl", "m2n"])
async def test_trainer_staging_keeps_its_sources_alive(fake_world: fake_nccl.FakeWorld,
                                                       name: str) -> None:
    """On CUDA ``stage`` only enqueues the pack copies: the staging must hold the source
    tensors until the bucket is done, or a lazy source dropped by the pipeline could be reused
    by the producer's next cast before the pack kernel read it. (Two params to one peer: the
    peer's buffer is packed, not sent zero-copy.)"""
    import gc
    import weakref

    from m2n_async._data._native import NativeThread
    from m2n_async._data._transport import TransportContext, TransportSettings, create_transport

    plan = make_plan([("a", (64, 8), torch.bfloat16, (R, 0), (R, 0)),
                      ("b", (64, 8), torch.bfloat16, (R, 0), (R, 0))], (1, 1), (1, 1))
    native = NativeThread("r0")
    settings = TransportSettings(max_inflight=3, device="cpu")
    buckets = plan.buckets(1 << 20)
    t = create_transport(name, TransportContext(plan=plan, rank=0, generation=1,
                                                settings=settings, native=native,
                                                buckets=buckets))
    try:
        await t.prepare()
        src = {k: torch.randn(64, 8).to(torch.bfloat16) for k in ("a", "b")}
        refs = {k: weakref.ref(v) for k, v in src.items()}
        staging = await t.stage(buckets[0], sources=src)
        del src
        gc.collect()
        assert {k: r() is not None for k, r in refs.items()} == {"a": True, "b": True}
        del staging
    finally:
        t.abort("test done")
        await t.close()
        native.close(1.0)


@pytest.mark.parametrize("case", ["connect timed out", "aborted during init"])
async def test_a_communicator_created_after_connect_gave_up_is_aborted(
        fake_world: fake_nccl.FakeWorld, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Communicator.init outlives its connect (timed out, or the transport was aborted while
    it ran): the communicator it returns late must be aborted, never left alive."""
    from m2n_async._data._native import NativeThread
    from m2n_async._data._transport import (
        Rendezvous,
        TransportContext,
        TransportSettings,
        create_transport,
    )
    from m2n_async.testing import MemoryStore

    released = threading.Event()
    entered: list[int] = []  # ranks whose init is running
    original = fake_nccl.Comm.init.__func__  # type: ignore[attr-defined]

    def slow_init(cls: Any, *args: Any, **kwargs: Any) -> Any:
        entered.append(kwargs.get("rank", -1))
        released.wait(10)  # a slow (but alive) init: returns once the connect gave up
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(fake_nccl.Comm, "init", classmethod(slow_init))
    plan = make_plan([("w", (8,), torch.float32, (R, 0), (R, 0))], (1, 1), (1, 1))
    timeout = 0.2 if case == "connect timed out" else 30.0
    settings = TransportSettings(max_inflight=1, device="cpu")
    store = MemoryStore()
    raised: dict[int, BaseException] = {}
    transports: dict[int, Transport] = {}

    async def rank(r: int) -> None:
        native = NativeThread(f"r{r}")
        t = transports[r] = create_transport(
            "nccl", TransportContext(plan=plan, rank=r, generation=1, settings=settings,
                                     native=native, buckets=plan.buckets(1 << 20)))
        await t.prepare()
        try:
            # the connect's one bound, the communicator init's included
            await t.connect(Rendezvous(store.session(), "j/1/data/", rank=r, world_size=2,
                                       timeout=timeout))
        except Exception as exc:
            raised[r] = exc
        released.set()
        t.abort("test: connect over")  # what the engine's release does
        with anyio.CancelScope(shield=True):
            await t.close()
        await anyio.to_thread.run_sync(native.close, 5.0)

    async def abort_during_init() -> None:
        while len(entered) < 2:  # noqa: ASYNC110 - set by the native threads
            await anyio.sleep(0.01)
        for t in transports.values():
            t.abort("test: a peer failed during connect")
        released.set()

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for r in range(2):
                tg.start_soon(rank, r)
            if case == "aborted during init":
                tg.start_soon(abort_during_init)
    assert sorted(raised) == [0, 1], raised
    deadline = time.monotonic() + 5
    while len(fake_world.comms) < 2 or any(c.valid for c in fake_world.comms):
        assert time.monotonic() < deadline, [(c.rank, c.valid) for c in fake_world.comms]
        await anyio.sleep(0.01)


@pytest.mark.parametrize("name", ["m2n", "nccl"])
async def test_close_is_bounded_by_close_timeout_when_the_abort_hangs(
        fake_world: fake_nccl.FakeWorld, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """A communicator abort that never returns (a peer died inside a kernel) holds ``close``
    for the settings' ``close_timeout`` (the engine's ``abort_grace``) and no longer: the
    abort is left on its thread (``teardown_finished`` False), the transport is torn down."""
    import threading

    release = threading.Event()
    monkeypatch.setattr(fake_nccl.Comm, "abort", lambda self: release.wait(30))
    plan = make_plan([("w", (16, 8), torch.float32, (R, 0), (R, 1))], (1, 1), (1, 1))

    async def body(rank: int, t: Transport) -> None:
        t.abort("a peer died")

    try:
        # A hang guard well under the 10 s the close used to wait whatever its caller allowed.
        with anyio.fail_after(6):
            results = await run_world(name, plan, body=body, close_timeout=0.5)
        raise_first(results)
        assert all(res.transport._torn_down for res in results)
        assert not any(res.transport.teardown_finished for res in results)
    finally:
        release.set()


async def test_bootstrap_advice_only_for_a_local_job_without_an_interface():
    advice = _cuda.bootstrap_advice
    assert "NCCL_SOCKET_IFNAME=lo" in (advice("127.0.0.1", {}) or "")
    assert advice("127.0.0.1", {"NCCL_SOCKET_IFNAME": " "}) is not None  # blank: unset
    assert advice("::1", {}) is not None
    assert advice("127.0.0.1", {"NCCL_SOCKET_IFNAME": "lo"}) is None
    assert advice("10.0.0.5", {}) is None  # a remote store: peers on other hosts
    assert advice(None, {}) is None


@pytest.mark.parametrize("name", ["nccl", "m2n"])
async def test_connect_warns_once_when_a_local_job_leaves_nccl_unpinned(
        fake_world, name, monkeypatch, caplog):
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(_cuda, "_advised", False)
    plan = make_plan([("w", (8, 4), torch.float32, (0, R), (0, R))], (2, 1), (2, 1))
    with caplog.at_level("WARNING", logger="m2n_async"):
        raise_first(await run_world(name, plan, host="127.0.0.1"))
        raise_first(await run_world(name, plan, host="127.0.0.1"))
    said = [r for r in caplog.records if "NCCL_SOCKET_IFNAME" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]  # once per process, not per rank
    assert said[0].getMessage().startswith(f"{name}: ")

    caplog.clear()
    monkeypatch.setattr(_cuda, "_advised", False)
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    with caplog.at_level("WARNING", logger="m2n_async"):
        raise_first(await run_world(name, plan, host="127.0.0.1"))
    assert not [r for r in caplog.records if "NCCL_SOCKET_IFNAME" in r.getMessage()]


async def test_nccl_copy_forms_are_the_copies_the_round_launches(fake_world, monkeypatch):
    # What the nccl lane compiles at connect (``_copy_forms``, over meta tensors; warmed on
    # a GPU with Triton) must be every kernel-sized group of the pack and scatter copies a
    # round makes (a copy of at least MIN_PIECES pieces of one geometry), with the pieces'
    # alignment, for wire-dtype sources and fp32 masters: else they compile in the round.
    from m2n_async._data import nccl as nccl_plane
    from m2n_async._data._kernels import MIN_PIECES, Form

    defs = [(f"col{i}", (16, 64), torch.bfloat16, (R, 0), (R, 1)) for i in range(10)]
    defs += [(f"odd{i}", (4, 6), torch.bfloat16, (R, 0), (R, 1)) for i in range(9)]
    defs += [(f"norm{i}", (64,), torch.float32, None, None) for i in range(9)]
    plan = make_plan(defs, (1, 2), (1, 2))
    # load callbacks on the workers: shards that arrive whole (two norms: handed views of
    # the arena, no copy; the 7 others scatter one by one, too few for the kernel) and
    # shards gathered from both trainers (two odds: into a temporary, by the kernel)
    callback = {"norm0", "norm1", "odd0", "odd1"}
    in_place = frozenset(i for i, p in enumerate(plan.params) if p.spec.name not in callback)
    calls: dict[int, list[tuple[list[Any], list[Any]]]] = {}
    real = nccl_plane.foreach_copy
    rank_of: contextvars.ContextVar[int] = contextvars.ContextVar("rank")  # a task per rank

    def recording(dsts, srcs, **kw):
        calls.setdefault(rank_of.get(), []).append((list(dsts), list(srcs)))
        return real(dsts, srcs, **kw)

    monkeypatch.setattr(nccl_plane, "foreach_copy", recording)
    got: dict[int, list[Form]] = {}

    body = forms_after_two_rounds(plan, callback, rank_of, got)
    raise_first(await run_world("nccl", plan, bucket_bytes=1 << 20, body=body,
                                in_place={2: in_place, 3: in_place}))
    assert sorted(got) == sorted(calls) == [0, 1, 2, 3]
    for r, forms in got.items():
        launched = set()
        for dsts, srcs in calls[r]:
            groups: dict[Any, list[tuple[Any, Any]]] = {}
            for d, s in zip(dsts, srcs, strict=True):
                groups.setdefault((d.dtype, s.dtype, tuple(d.shape), d.stride(), s.stride()),
                                  []).append((d, s))
            for g in groups.values():
                if len(g) >= MIN_PIECES:
                    launched.add(launched_form([d for d, _ in g], [s for _, s in g]))
        assert launched, r  # the plan really makes kernel-sized copies
        assert len(forms) == len(set(forms))
        assert set(forms) == launched, (r, set(forms) ^ launched)


async def test_m2n_refuses_a_buffer_its_descriptor_does_not_describe(fake_world):
    # Own-side descriptors name an address only: a buffer of another size, dtype or layout
    # than the reshard moves would be overrun by M2N, so the lane refuses it by name.
    from m2n_async._proto.errors import LocalProtocolError

    plan = make_plan([("w", (32, 16), torch.bfloat16, (R, 0), (R, 1))], (1, 2), (1, 2))

    async def body(rank: int, t: Transport) -> None:
        trainer = rank < plan.trainer_ranks
        mine = sources(plan, rank, 0) if trainer else targets(plan, rank)
        await drive(t, round=0, deadline=time.monotonic() + 30,
                    sources=mine if trainer else None, sinks=None if trainer else mine,
                    max_inflight=2)
        (call,) = t._calls[0]
        good = mine["w"]
        assert t._own_side_of(call, good, trainer) is t._own_side[call.key][1]
        for bad in (good.float(), good[:1].clone(), good.t().contiguous().t(),
                    torch.zeros(good.numel() + 1, dtype=good.dtype)):
            with pytest.raises(LocalProtocolError, match="the buffer of reshard 'w' is"):
                t._own_side_of(call, bad, trainer)

    raise_first(await run_world("m2n", plan, body=body))
