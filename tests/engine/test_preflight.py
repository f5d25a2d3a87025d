"""The preflight driver with ranks as tasks of one event loop over the in-memory store.

The phase-failure suite is parametrized over phase x failing rank (first/last trainer,
first/last worker) x kind (local exception, disagreeing envelope, hang, disconnect) x topology
(1+1, 2+3): every surviving rank must raise the same error naming the phase and the failing
rank(s) within the phase deadline + 1 s, and nothing of the data plane may exist.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest

from m2n_async import LocalProtocolError, PeerLostError, PreflightError
from m2n_async._engine import _faults
from m2n_async._engine._preflight import (
    PreflightInputs,
    PreflightOutcome,
    run_preflight,
)
from m2n_async._proto.handshake import Handshake, PreflightPlan
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.messages import DataPlaneIdentity
from m2n_async._proto.params import ParamSpec
from m2n_async._store import ControlGroup, StoreClient, StoreServer
from m2n_async.testing import Fault as FaultPoint
from m2n_async.testing import MemoryStore

GEN = 3
PHASES = ["hello", "source", "destination", "data_plane", "runtime_ready"]
KINDS = ["local", "disagree", "hang", "disconnect"]
HANG_TIMEOUT = 0.5  # the hang cases wait this out; everything else is far from any deadline
LONG_TIMEOUT = 30.0  # disconnects must be seen long before this


def specs(t: int) -> list[ParamSpec]:
    mesh = Mesh((t, 1))
    return [ParamSpec("w", "float32", (12, 6), Layout(mesh, (0, REPLICATE))),
            ParamSpec("b", "bfloat16", (12,), Layout(mesh, None))]


def placements() -> dict[str, tuple[int, int] | None]:
    return {"w": (REPLICATE, 1), "b": None}


class Disconnected(Exception):
    """The injected 'process exit' of a failing rank (its store session is closed)."""


@dataclass
class Fault:
    phase: str
    rank: int
    kind: str


@dataclass
class Log:
    """What happened, per rank, with loop times."""

    fault_at: float | None = None
    prepared: list[int] = field(default_factory=list)
    communicators: list[int] = field(default_factory=list)
    outcome: dict[int, PreflightOutcome | BaseException] = field(default_factory=dict)
    done_at: dict[int, float] = field(default_factory=dict)

    def mark(self) -> None:
        if self.fault_at is None:
            self.fault_at = time.monotonic()


def tamper(phase: str, rank: int, t: int, n: int, payload: bytes) -> bytes:
    """A well-formed envelope that disagrees with the others (see expected_disagreers)."""
    d = msgspec.msgpack.decode(payload)
    trainer = rank < t
    if phase == "hello":
        d["role"] = "worker" if trainer else "trainer"
    elif phase == "source":
        d["digest"] = "0" * 64
    elif phase == "destination":
        if trainer:
            d["capabilities"] = ["warp"]
        else:
            d["mesh_dims"] = [n, 1] if n > 1 else [2, 1]
    elif phase == "data_plane":
        d["identity"]["env"] = [["NCCL_RESHARD_X", "2"]]
    else:
        d["plan_digest"] = "0" * 64
    return msgspec.msgpack.encode(d)


def expected_disagreers(phase: str, rank: int, t: int, n: int) -> set[int]:
    """Who a disagreement must name: the odd rank, or every holder when there is no majority."""
    if phase == "source" and rank < t and t == 2:
        return {0, 1}  # two trainers, two digests: no majority
    if phase == "data_plane" and t + n == 2:
        return {0, 1}  # one rank against one
    return {rank}


class FaultyGroup:
    """A ControlGroup that injects a fault at one phase's gather of one rank."""

    def __init__(self, inner: ControlGroup, fault: Fault | None, log: Log, t: int, n: int
                 ) -> None:
        self.inner, self.fault, self.log, self.t, self.n = inner, fault, log, t, n
        self.rank, self.world_size = inner.rank, inner.world_size
        self.namespace = inner.namespace
        self.calls = 0

    async def join(self) -> None:
        await self.inner.join()

    async def missing_ranks(self) -> list[int]:
        return await self.inner.missing_ranks()

    async def arrived(self) -> dict[int, bytes]:
        return await self.inner.arrived()

    async def all_gather_open(self, payload: bytes,
                              settled: Callable[[Mapping[int, bytes]], bool]
                              ) -> dict[int, bytes]:
        payload = await self._fault_at_gather(payload)
        return await self.inner.all_gather_open(payload, settled)

    async def all_gather_bytes(self, payload: bytes) -> list[bytes]:
        payload = await self._fault_at_gather(payload)
        return await self.inner.all_gather_bytes(payload)

    async def _fault_at_gather(self, payload: bytes) -> bytes:
        phase = PHASES[self.calls] if self.calls < len(PHASES) else "after"
        self.calls += 1
        f = self.fault
        if f is not None and f.rank == self.rank and f.phase == phase and f.kind != "local":
            self.log.mark()
            if f.kind == "hang":
                await anyio.sleep_forever()
            if f.kind == "disconnect":
                await self.inner.store.aclose()
                raise Disconnected(f"rank {self.rank} exits")
            payload = tamper(phase, self.rank, self.t, self.n, payload)
        return payload


def make_inputs(r: int, t: int, n: int, log: Log, fault: Fault | None = None, *,
                transport: str = "auto", generation: int = GEN,
                capabilities: Callable[[], list[str]] | None = None) -> PreflightInputs:
    local = fault if fault is not None and fault.kind == "local" and fault.rank == r else None

    def caps() -> list[str]:
        if local and local.phase == "destination":
            log.mark()
            raise RuntimeError(f"injected capability probe failure on rank {r}")
        return ["gloo"]

    def identity(transport: str) -> DataPlaneIdentity:
        if local and local.phase == "data_plane":
            log.mark()
            raise RuntimeError(f"injected identity failure on rank {r}")
        return DataPlaneIdentity(None, None, (("NCCL_RESHARD_X", "1"),))

    async def prepare(plan: PreflightPlan) -> None:
        await anyio.lowlevel.checkpoint()
        if local and local.phase == "runtime_ready":
            log.mark()
            raise RuntimeError(f"injected runtime failure on rank {r}")
        log.prepared.append(r)

    trainer = r < t
    return PreflightInputs(
        role="trainer" if trainer else "worker", rank=r, world_size=t + n, trainer_ranks=t,
        generation=generation, params=specs(t) if trainer else None,
        mesh_dims=None if trainer else (1, n), dst_placements=None if trainer else placements(),
        transport=transport, capabilities=capabilities or caps, data_plane_identity=identity,
        prepare_runtime=prepare)


def patch_local_fault(monkeypatch: pytest.MonkeyPatch, fault: Fault | None, log: Log) -> None:
    """hello and source have no callback to fail: make the machine's local step raise."""
    if fault is None or fault.kind != "local" or fault.phase not in ("hello", "source"):
        return
    original = getattr(Handshake, fault.phase)

    def failing(self: Handshake, *args: Any) -> Any:
        if self.rank == fault.rank:
            log.mark()
            raise RuntimeError(f"injected {fault.phase} failure on rank {self.rank}")
        return original(self, *args)

    monkeypatch.setattr(Handshake, fault.phase, failing)


async def run_world(t: int, n: int, *, fault: Fault | None = None, phase_timeout: float,
                    stores: list[Any] | None = None,
                    inputs: Mapping[int, PreflightInputs] | None = None,
                    log: Log | None = None, timeouts: Mapping[int, float] | None = None,
                    leave_as_lost: bool = False) -> Log:
    """Every rank's preflight as a task; ``timeouts`` overrides ``phase_timeout`` per rank,
    and with ``leave_as_lost`` a rank that failed leaves as the engine's release does."""
    log = log if log is not None else Log()
    w = t + n
    if stores is None:
        root = MemoryStore()
        stores = [root.session() for _ in range(w)]
    ns = f"job/{GEN}/preflight"

    async def rank_main(r: int) -> None:
        group = FaultyGroup(ControlGroup(stores[r], r, w, ns), fault, log, t, n)
        inp = (inputs or {}).get(r) or make_inputs(r, t, n, log, fault)
        limit = (timeouts or {}).get(r, phase_timeout)
        try:
            out = await run_preflight(group, inp, phase_timeout=limit)  # type: ignore[arg-type]
            log.communicators.append(r)  # what an engine would do next
            log.outcome[r] = out
        except Exception as e:
            log.outcome[r] = e
            if leave_as_lost:
                await group.inner.aclose(lost=True)
        log.done_at[r] = time.monotonic()

    with anyio.fail_after(phase_timeout * 2 + 15):
        async with anyio.create_task_group() as tg:
            for r in range(w):
                tg.start_soon(rank_main, r)
    return log


def ranks_of(t: int, n: int) -> dict[str, int]:
    return {"first_trainer": 0, "last_trainer": t - 1, "first_worker": t,
            "last_worker": t + n - 1}


def matrix() -> list[Any]:
    cases = []
    for topo, (t, n) in (("1+1", (1, 1)), ("2+3", (2, 3))):
        seen: set[int] = set()
        for who, rank in ranks_of(t, n).items():
            if rank in seen:
                continue  # in 1+1 the first trainer is the last one
            seen.add(rank)
            for phase in PHASES:
                for kind in KINDS:
                    cases.append(pytest.param(t, n, phase, rank, kind,
                                              id=f"{topo}-{phase}-{who}-{kind}"))
    return cases


@pytest.mark.asyncio
@pytest.mark.parametrize("t,n,phase,bad,kind", matrix())
async def test_phase_failure(monkeypatch: pytest.MonkeyPatch, t: int, n: int, phase: str,
                             bad: int, kind: str) -> None:
    fault = Fault(phase, bad, kind)
    timeout = {"hang": HANG_TIMEOUT, "disconnect": LONG_TIMEOUT}.get(kind, 5.0)
    log = Log()
    patch_local_fault(monkeypatch, fault, log)
    await run_world(t, n, fault=fault, phase_timeout=timeout, log=log)
    fault_at = log.fault_at
    assert fault_at is not None, "the fault was never injected"

    survivors = [r for r in range(t + n) if kind in ("local", "disagree") or r != bad]
    errors = {r: log.outcome[r] for r in survivors}
    for r, e in errors.items():
        assert isinstance(e, Exception), f"rank {r} did not fail: {e}"
        # within the phase deadline + 1 s of the fault (a disconnect: at once)
        limit = 2.0 if kind == "disconnect" else timeout + 1.0
        assert log.done_at[r] - fault_at <= limit, (r, log.done_at[r] - fault_at)

    if kind in ("local", "disagree"):
        first = errors[survivors[0]]
        assert isinstance(first, PreflightError) and first.phase == phase
        for e in errors.values():
            assert isinstance(e, PreflightError)
            assert (e.phase, e.failures, e.generation) == (phase, first.failures, GEN)
        if kind == "local":
            assert list(first.failures) == [bad]
            assert first.failures[bad].startswith("local step failed: RuntimeError: injected")
            # the failing rank's own error is chained to what its local step raised
            cause = errors[bad].__cause__
            assert isinstance(cause, RuntimeError) and str(cause).startswith("injected")
        else:
            assert set(first.failures) == expected_disagreers(phase, bad, t, n), first
    elif kind == "hang":
        for e in errors.values():
            assert isinstance(e, TimeoutError), repr(e)
            assert f"preflight phase {phase!r}" in str(e)
            assert f"rank(s) [{bad}] did not arrive" in str(e)
            # What to check: a rank missing from hello was never in this generation.
            hint = ("(not started, crashed, or connected to another store address or "
                    "EngineConfig.job?)" if phase == "hello" else
                    "(frozen, or its event loop blocked?)")
            assert f"did not arrive {hint}" in str(e), e
    else:
        for e in errors.values():
            assert isinstance(e, PeerLostError), repr(e)
            assert e.ranks == (bad,) and f"preflight phase {phase!r}" in str(e)
        assert isinstance(log.outcome[bad], Disconnected)
    if kind in ("hang", "disconnect"):
        # One text on every rank that saw it; who saw it is a note of each rank's own.
        assert len({str(e) for e in errors.values()}) == 1, errors
        for r, e in errors.items():
            assert f"seen by rank {r}" in "".join(getattr(e, "__notes__", [])), (r, e)

    # Nothing of the data plane exists: no communicator anywhere, and no local preparation
    # at all unless the failing phase was runtime_ready itself.
    assert log.communicators == []
    if phase != "runtime_ready":
        assert log.prepared == []


# -- the happy path and the rest of the driver -------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("t,n", [(1, 1), (2, 3)])
async def test_all_ranks_agree(t: int, n: int) -> None:
    log = await run_world(t, n, phase_timeout=5.0)
    outs = [log.outcome[r] for r in range(t + n)]
    assert all(isinstance(o, PreflightOutcome) for o in outs), outs
    digests = {o.digest for o in outs if isinstance(o, PreflightOutcome)}
    assert len(digests) == 1
    o0 = outs[0]
    assert isinstance(o0, PreflightOutcome)
    assert o0.transport == "gloo" and "m2n is not available" in o0.reason
    assert [p.name for p in o0.plan.params] == ["w", "b"]
    assert list(o0.seconds) == PHASES
    assert sorted(log.prepared) == list(range(t + n))
    assert o0.preflight_plan.digest == o0.digest


@pytest.mark.asyncio
async def test_all_ranks_agree_over_tcp_store() -> None:
    async with StoreServer(token="s3cret") as server:
        clients = [await StoreClient.connect(server.address, token="s3cret") for _ in range(3)]
        try:
            log = await run_world(1, 2, phase_timeout=5.0, stores=clients)
        finally:
            for c in clients:
                await c.aclose()
    assert all(isinstance(log.outcome[r], PreflightOutcome) for r in range(3)), log.outcome


@pytest.mark.asyncio
async def test_stale_generation_rank_is_named_by_everyone() -> None:
    t, n = 2, 3
    log0 = Log()
    inputs = {r: make_inputs(r, t, n, log0, generation=GEN - 1 if r == 3 else GEN)
              for r in range(t + n)}
    log = await run_world(t, n, phase_timeout=5.0, inputs=inputs)
    for r in range(t + n):
        e = log.outcome[r]
        assert isinstance(e, PreflightError) and e.phase == "hello"
        if r != 3:
            assert list(e.failures) == [3] and "stale generation 2" in e.failures[3]


def identical_errors(log: Log, w: int, phase: str) -> PreflightError:
    """Every rank's outcome is the same PreflightError of ``phase``; that error."""
    errors = [log.outcome[r] for r in range(w)]
    first = errors[0]
    assert isinstance(first, PreflightError) and first.phase == phase, first
    for e in errors:
        assert isinstance(e, PreflightError), repr(e)
        assert (e.phase, e.failures, e.generation) == (phase, first.failures, GEN)
    assert log.communicators == [] and log.prepared == []
    return first


@pytest.mark.asyncio
@pytest.mark.parametrize("store_kind", ["memory", "tcp"])
async def test_a_renamed_or_reshaped_param_is_named_with_its_field_by_every_rank(
        store_kind: str) -> None:
    t, n = 4, 2
    mesh = Mesh((t, 1))
    log = Log()
    inputs = {r: make_inputs(r, t, n, log) for r in range(t + n)}
    inputs[2] = dataclasses.replace(inputs[2], params=[
        ParamSpec("w", "float32", (12, 6), Layout(mesh, (0, REPLICATE))),
        ParamSpec("b.renamed", "bfloat16", (12,), Layout(mesh, None))])
    inputs[1] = dataclasses.replace(inputs[1], params=[
        ParamSpec("w", "float32", (24, 6), Layout(mesh, (0, REPLICATE))),
        ParamSpec("b", "bfloat16", (12,), Layout(mesh, None))])
    if store_kind == "tcp":
        async with StoreServer(token="s3cret") as server:
            clients = [await StoreClient.connect(server.address, token="s3cret")
                       for _ in range(t + n)]
            try:
                await run_world(t, n, phase_timeout=5.0, stores=clients, inputs=inputs,
                                log=log)
            finally:
                for c in clients:
                    await c.aclose()
    else:
        await run_world(t, n, phase_timeout=5.0, inputs=inputs, log=log)
    err = identical_errors(log, t + n, "source")
    assert sorted(err.failures) == [1, 2]
    assert ("the first difference is parameter #0 'w', in its shape (12, 6) on rank(s) "
            "[0, 2, 3], (24, 6) on rank(s) [1]") in err.failures[1], err.failures[1]
    assert ("the first difference is parameter #1, in its name 'b' on rank(s) [0, 1, 3], "
            "'b.renamed' on rank(s) [2]") in err.failures[2], err.failures[2]


@pytest.mark.asyncio
async def test_a_worker_asking_another_placement_is_named_with_it_by_every_rank() -> None:
    t, n = 2, 3
    log = Log()
    inputs = {r: make_inputs(r, t, n, log) for r in range(t + n)}
    inputs[3] = dataclasses.replace(inputs[3], dst_placements={"w": (REPLICATE, 0), "b": None})
    await run_world(t, n, phase_timeout=5.0, inputs=inputs, log=log)
    err = identical_errors(log, t + n, "destination")
    assert sorted(err.failures) == [3]
    assert ("the first difference is parameter #0 'w', in its placements (REPLICATE, 1) on "
            "rank(s) [2, 4], (REPLICATE, 0) on rank(s) [3]") in err.failures[3], err.failures


@pytest.mark.asyncio
async def test_an_identity_giving_a_variable_twice_is_named_by_every_rank_at_once() -> None:
    # Rank 2's identity gives NCCL_RESHARD_X twice: compared as a mapping, its last value
    # ("1", the others' value) would have hidden the "0".
    t, n = 2, 3
    log = Log()
    inputs = {r: make_inputs(r, t, n, log) for r in range(t + n)}
    twice = (("NCCL_RESHARD_X", "0"), ("NCCL_RESHARD_X", "1"))
    inputs[2] = dataclasses.replace(
        inputs[2], data_plane_identity=lambda name: DataPlaneIdentity(None, None, twice))
    t0 = time.monotonic()
    await run_world(t, n, phase_timeout=5.0, inputs=inputs, log=log)
    err = identical_errors(log, t + n, "data_plane")
    assert sorted(err.failures) == [2]
    assert "local step failed: PlanError" in err.failures[2], err.failures
    assert "more than once (NCCL_RESHARD_X: '0', '1')" in err.failures[2], err.failures
    assert max(log.done_at.values()) - t0 < 2.5  # a failed step, not a deadline


def trainer_1_differs(t: int, n: int, log: Log) -> dict[int, Any]:
    """Every rank's inputs, trainer 1's source plan other than the rest (a source-phase
    disagreement that the records exchange then locates)."""
    inputs = {r: make_inputs(r, t, n, log) for r in range(t + n)}
    mesh = Mesh((t, 1))
    inputs[1] = dataclasses.replace(inputs[1], params=[
        ParamSpec("w", "float32", (12, 6), Layout(mesh, (0, REPLICATE))),
        ParamSpec("b", "float32", (12,), Layout(mesh, None))])
    return inputs


@pytest.mark.asyncio
async def test_a_rank_lost_to_the_records_exchange_leaves_the_chunk_diagnosis() -> None:
    # Trainer 1 differs; worker 4 hangs in the gather of the records (the third call of its
    # group): every rank still raises one PreflightError, the one the chunk digests allow.
    t, n = 2, 3
    log = Log()
    inputs = trainer_1_differs(t, n, log)
    await run_world(t, n, phase_timeout=HANG_TIMEOUT, inputs=inputs, log=log,
                    fault=Fault("destination", 4, "hang"))
    err = identical_errors(log, t + n, "source")
    assert sorted(err.failures) == [0, 1]
    assert "the first difference from rank 0 is within parameters #0..#15" in err.failures[1]
    for r in range(t + n):
        notes = getattr(log.outcome[r], "__notes__", [])
        assert any("could not be exchanged" in note for note in notes), (r, notes)


@pytest.mark.asyncio
async def test_the_records_exchange_gets_what_is_left_of_the_phase_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A disagreement in source: the records gather that names the parameter is part of the
    # phase, so it gets the phase's remaining time, not a fresh phase_timeout (a rank slow
    # in the first gather and stuck in the second made every peer wait twice as long).
    from m2n_async._engine import _preflight

    t, n = 2, 2
    log = Log()
    inputs = trainer_1_differs(t, n, log)
    given: list[float] = []
    real = _preflight._exchange_records

    async def exchange(group: Any, machine: Any, phase: Any, generation: int,
                       deadline: float) -> None:
        given.append(deadline)
        await real(group, machine, phase, generation, deadline)

    monkeypatch.setattr(_preflight, "_exchange_records", exchange)
    await run_world(t, n, phase_timeout=HANG_TIMEOUT, inputs=inputs, log=log)
    identical_errors(log, t + n, "source")
    # The phase's own deadline, per-parameter allowance included: what is left of it is less.
    whole = max(_preflight.phase_deadline(HANG_TIMEOUT, i.n_params) for i in inputs.values())
    assert len(given) == t + n and all(0 < d < whole for d in given), (given, whole)


@pytest.mark.asyncio
async def test_blocking_sync_callback_cannot_freeze_the_loop() -> None:
    t, n = 1, 2
    release = threading.Event()
    log0 = Log()

    def stuck() -> list[str]:
        release.wait(10)  # a wedged driver query; blocks its thread, not the loop
        return ["gloo"]

    inputs = {r: make_inputs(r, t, n, log0, capabilities=stuck if r == 2 else None)
              for r in range(t + n)}
    started = time.monotonic()
    try:
        log = await run_world(t, n, phase_timeout=HANG_TIMEOUT, inputs=inputs)
    finally:
        release.set()
    assert time.monotonic() - started < HANG_TIMEOUT + 3
    # The stuck rank reports its own overrun before the deadline: one diagnosis everywhere.
    err = identical_errors(log, t + n, "destination")
    assert list(err.failures) == [2]
    assert "local step failed: TimeoutError: did not finish within" in (
        err.failures[2])
    assert isinstance(log.outcome[2].__cause__, TimeoutError)


@pytest.mark.asyncio
@pytest.mark.parametrize("phase", PHASES)
async def test_a_hung_step_is_its_ranks_failure_even_when_its_deadline_passes_first(
        phase: str) -> None:
    # The race of a hung local step, forced: the hung rank's phase deadline passes first
    # (here by 0.2 s; in a job by the milliseconds it saw the previous phase end earlier),
    # and a rank that gave up leaves as lost, as the engine does. Every rank still raises
    # one PreflightError naming the hung rank, never PeerLostError on some ranks and
    # TimeoutError on others.
    t, n, bad = 1, 2, 1
    _faults.arm([FaultPoint("handshake.phase", "hang", rank=bad, phase=phase)])
    try:
        log = await run_world(t, n, phase_timeout=HANG_TIMEOUT + 0.2,
                              timeouts={bad: HANG_TIMEOUT}, leave_as_lost=True)
    finally:
        _faults.disarm()
    errors = [log.outcome[r] for r in range(t + n)]
    assert all(isinstance(e, PreflightError) for e in errors), errors
    assert len({str(e) for e in errors}) == 1, errors
    err = errors[0]
    assert isinstance(err, PreflightError) and err.phase == phase
    assert list(err.failures) == [bad], err
    assert "did not finish within 0.375 s (the phase deadline of 0.5 s less 0.125 s" in (
        err.failures[bad])
    assert log.communicators == []


@pytest.mark.asyncio
async def test_an_argument_refused_before_the_handshake_fails_hello_on_every_rank() -> None:
    t, n, bad = 2, 3, 3
    log0 = Log()
    refused = LocalProtocolError("target for parameter 'w' must be (tensor, placements) or "
                                 "a LoadTarget, got Tensor")
    inputs = {r: make_inputs(r, t, n, log0) for r in range(t + n)}
    inputs[bad] = dataclasses.replace(inputs[bad], argument_error=refused)
    started = time.monotonic()
    # Far beyond the bound below: nobody may wait out the phase for the refusing rank.
    log = await run_world(t, n, phase_timeout=60.0, inputs=inputs)
    first = identical_errors(log, t + n, "hello")
    assert first.failures == {bad: f"local step failed: LocalProtocolError: {refused}"}
    assert log.outcome[bad].__cause__ is refused
    assert log0.prepared == []
    done = log.done_at.values()
    assert max(done) - started < 5.0 and max(done) - min(done) < 1.0, log.done_at


@pytest.mark.asyncio
async def test_inputs_that_do_not_match_the_group_fail_before_sending() -> None:
    store = MemoryStore()
    group = ControlGroup(store, 0, 2, "job/1/x")
    inp = make_inputs(1, 1, 1, Log())
    with pytest.raises(ValueError, match="rank 1 of 2 but the control group is rank 0"):
        await run_preflight(group, inp, phase_timeout=1.0)
    with pytest.raises(ValueError, match="phase_timeout must be > 0"):
        await run_preflight(group, make_inputs(0, 1, 1, Log()), phase_timeout=0)
    assert await store.gather("job/", 0) == {}


@pytest.mark.asyncio
async def test_explicit_transport_nobody_can_run_names_every_rank() -> None:
    t, n = 1, 2
    log0 = Log()
    inputs = {r: make_inputs(r, t, n, log0, transport="nccl") for r in range(t + n)}
    log = await run_world(t, n, phase_timeout=5.0, inputs=inputs)
    for r in range(t + n):
        e = log.outcome[r]
        assert isinstance(e, PreflightError) and e.phase == "destination"
        assert sorted(e.failures) == [0, 1, 2]
        assert "cannot run the requested transport 'nccl'" in e.failures[1]
    assert log0.prepared == [] and log.prepared == []
