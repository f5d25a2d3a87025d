"""The trainer's call API under pressure: ``sync_weights`` and ``BlockingTrainer.sync_weights``
against what their docstrings promise.

Timeout and version values that are refused (and the tiny deadline that is not), every kind of
``weights`` and how each fails (refused before the round with nothing sent, or failing the round on
every rank naming the parameter), progress callbacks that raise or are no callables, cancellation at
each point of a round, concurrent calls, calls after ``close()``, ``close()`` beside a running call
and trainer rank 0 ending the job under a waiting trainer. Every rank is a task of one event loop
over a ``MemoryStore`` (real Gloo underneath), 1 trainer + 1 worker unless a case needs more; the
blocking cases use the session's TCP store, for the facade runs its own loop thread.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from types import MappingProxyType
from typing import Any

import anyio
import pytest
import torch

from m2n_async import (
    BlockingTrainer,
    BlockingWorker,
    EnginePoisonedError,
    EngineState,
    LocalProtocolError,
    PeerLostError,
    PlanError,
    SyncResult,
    TrainerEngine,
    TransferError,
)
from m2n_async._engine._round import RoundDriver
from m2n_async._engine._sources import _Sources
from m2n_async.testing import MemoryStore

from ._matrix import CFG, DEFS, LIMIT, World, _outcome, _targets, started, until, waiting, world
from ._plans import ParamDef, R, make_plan
from ._world import TOKEN

#: two parameters of one bucket each (512 bytes): a lazy source can fail after the first
TWO: list[ParamDef] = [("a", (8, 16), torch.float32, (R, 0), (R, 1)),
                       ("b", (8, 16), torch.float32, (R, 0), (R, 1))]


def one_failure(errors: Mapping[int, Any]) -> TransferError:
    """The round's ``TransferError``, the same on every rank in ``errors`` (the text too)."""
    assert all(isinstance(e, TransferError) for e in errors.values()), errors
    assert len({str(e) for e in errors.values()}) == 1, errors
    return next(iter(errors.values()))  # type: ignore[no-any-return]


async def deliver(w: World, v: int, **kw: Any) -> None:
    """One round of version ``v`` (rank 0's default when ``kw`` has no version), committed on
    every rank (bounded)."""
    got: dict[int, Any] = {}
    with anyio.fail_after(LIMIT):
        async with anyio.create_task_group() as tg:
            w.receive_all(tg, got)
            for r in range(len(w.trainers)):
                tg.start_soon(_outcome, lambda r=r: w.send(v, r, **kw), r, got)
    assert all(isinstance(g, SyncResult) for g in got.values()), got
    assert w.holds(v) and all(e.state is EngineState.READY
                              for e in [*w.trainers, *w.workers])


# -- timeout= ------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_timeout_that_is_no_round_deadline_is_refused_and_the_round_still_comes(
        ) -> None:
    async with world() as w:
        tr, wk = w.trainers[0], w.workers[0]
        got: dict[int, Any] = {}
        async with anyio.create_task_group() as tg:
            w.receive_all(tg, got)  # waits through every refusal: none starts a round
            bad: list[Any] = [0, 0.0, -1, -math.inf, math.nan, math.inf, True, False, "5",
                              b"5", [5]]
            for value in bad:
                with anyio.fail_after(LIMIT), pytest.raises(LocalProtocolError,
                                                            match="timeout must be"):
                    await w.send(1, timeout=value)
                assert tr.state is EngineState.READY and tr._busy is None, value
            assert waiting(wk) and not got
            # Any real number of seconds is a deadline, as receive(timeout=) takes one.
            with anyio.fail_after(LIMIT):
                sent = await w.send(1, timeout=Fraction(LIMIT))
        assert sent.version == 1 and got[wk.rank].version == 1 and w.holds(1)


@pytest.mark.asyncio
async def test_a_tiny_round_deadline_fails_the_round_everywhere_as_a_deadline() -> None:
    async with world() as w:
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.send(1, timeout=1e-9), 0, got)
        exc = one_failure(got)
        # The deadline passed before any rank's part was done: not a store that was lost.
        assert (exc.cause, exc.round) == ("deadline", 1), exc
        assert all(e.state is EngineState.POISONED and e.version == 0
                   for e in [*w.trainers, *w.workers])


@pytest.mark.asyncio
async def test_a_round_deadline_centuries_away_is_a_deadline() -> None:
    async with world() as w:
        # Beyond what a thread's wait or Gloo's clock takes: the round must still run.
        await deliver(w, 1, timeout=1e12)
        await deliver(w, 2, timeout=1e300)
        with anyio.fail_after(LIMIT), pytest.raises(LocalProtocolError, match="timeout"):
            await w.send(3, timeout=10**400)  # no float holds it: no finite deadline
        got: dict[int, Any] = {}
        wk = w.workers[0]
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                # As many seconds on the worker: no bound (not an OverflowError).
                tg.start_soon(_outcome, lambda: wk.receive(timeout=10**400), wk.rank, got)
                sent = await w.send(3)
        assert sent.version == got[wk.rank].version == 3 and w.holds(3)


@pytest.mark.asyncio
async def test_a_timeout_on_a_trainer_other_than_0_is_checked_and_not_applied() -> None:
    async with world(trainers=2) as w:
        t1 = w.trainers[1]
        with anyio.fail_after(LIMIT), pytest.raises(LocalProtocolError, match="timeout"):
            await w.send(1, 1, timeout=math.nan)
        assert t1.state is EngineState.READY
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.send(1, 0), 0, got)
                # Rank 1's tiny timeout is no deadline of the round: rank 0's is.
                tg.start_soon(_outcome, lambda: w.send(1, 1, timeout=1e-9), 1, got)
        assert all(isinstance(g, SyncResult) and g.version == 1 for g in got.values()), got
        assert w.holds(1)


# -- version= --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_version_that_does_not_advance_or_is_no_int_is_refused() -> None:
    async with world() as w:
        tr, wk = w.trainers[0], w.workers[0]
        await deliver(w, 5, version=5)
        got: dict[int, Any] = {}
        async with anyio.create_task_group() as tg:
            w.receive_all(tg, got)
            bad: list[Any] = [5, 4, 0, -1, 6.0, True, "6", 2**64, 2**200]
            for value in bad:
                with anyio.fail_after(LIMIT), pytest.raises(LocalProtocolError,
                                                            match="version"):
                    await w.send(6, version=value)
                assert tr.state is EngineState.READY and tr.version == 5, value
            assert waiting(wk) and not got
            with anyio.fail_after(LIMIT):
                sent = await w.send(6, version=2**64 - 1)  # the largest the start carries
        assert sent.version == got[wk.rank].version == tr.version == wk.version == 2**64 - 1
        assert w.holds(6)


@pytest.mark.asyncio
async def test_version_on_a_trainer_other_than_0_is_not_applied() -> None:
    async with world(trainers=2) as w:
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.send(1, 0, version=7), 0, got)
                # Rank 0's version commits: rank 1's (lower, or not advancing) is not used.
                tg.start_soon(_outcome, lambda: w.send(1, 1, version=3), 1, got)
        assert {g.version for g in got.values()} == {7}, got
        got.clear()
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.send(2, 0), 0, got)
                tg.start_soon(_outcome, lambda: w.send(2, 1, version=0), 1, got)
        assert {g.version for g in got.values()} == {8}, got
        assert w.holds(2)


@pytest.mark.asyncio
async def test_a_trainer_other_than_0_refused_calls_again_and_joins_the_round() -> None:
    async with world(trainers=2) as w:
        t1 = w.trainers[1]
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.send(1, 0), 0, got)
                await started(w, 1)  # rank 0 is in round 1, waiting for rank 1
                with pytest.raises(LocalProtocolError, match="version must be an int"):
                    await w.send(1, 1, version=True)
                with pytest.raises(PlanError, match=r"'w' \(rank 1\)"):
                    await t1.sync_weights({})
                assert t1.state is EngineState.READY
                got[1] = await w.send(1, 1)  # fixed: it joins the round rank 0 began
        assert all(isinstance(g, SyncResult) and g.version == 1 for g in got.values()), got
        assert w.holds(1)


# -- weights kinds ---------------------------------------------------------------------------


class _Lazy(Mapping[str, torch.Tensor]):
    """A Mapping that may compute on lookup; ``fail`` raises on the lookup of ``on``."""

    def __init__(self, shards: dict[str, torch.Tensor], fail: BaseException | None = None,
                 on: str = "") -> None:
        self.shards, self.fail, self.on = shards, fail, on

    def __getitem__(self, name: str) -> torch.Tensor:
        if self.fail is not None and name == self.on:
            raise self.fail
        return self.shards[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shards)

    def __len__(self) -> int:
        return len(self.shards)


def _module(shards: dict[str, torch.Tensor]) -> torch.nn.Module:
    m = torch.nn.Module()
    for n, t in shards.items():
        m.register_parameter(n, torch.nn.Parameter(t.clone(), requires_grad=False))
    return m


KINDS: dict[str, Callable[[dict[str, torch.Tensor]], Any]] = {
    "dict": lambda s: s,
    "MappingProxyType": MappingProxyType,
    "module": _module,
    "callable": lambda s: (lambda names: {n: s[n] for n in names}),
    "pairs": lambda s: list(s.items()),
    "pairs as lists": lambda s: [[n, t] for n, t in s.items()],
    "generator": lambda s: ((n, t) for n, t in s.items()),
    "lazy Mapping": _Lazy,
}


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_every_kind_of_weights_delivers_the_round(kind: str) -> None:
    async with world(defs=TWO) as w:
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                sent = await w.trainers[0].sync_weights(KINDS[kind](w.shards(1)))
        assert sent.version == got[w.workers[0].rank].version == 1 and w.holds(1)


def _noncontiguous(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


#: weights refused before the round: (what to pass, the error, what its text must say)
REFUSED: dict[str, tuple[Callable[[dict[str, torch.Tensor]], Any], type[Exception], str]] = {
    "missing": (lambda s: {}, PlanError, r"no local shard for parameter 'w' \(rank 0\)"),
    "shape": (lambda s: {"w": torch.zeros(3, 3)}, PlanError, r"'w' \(source side, rank 0\)"
              r".*shape"),
    "dtype": (lambda s: {"w": s["w"].to(torch.int32)}, PlanError,
              r"'w' \(source side, rank 0\).*int32"),
    "device": (lambda s: {"w": s["w"].to("meta")}, PlanError,
               r"'w' \(source side, rank 0\).*device meta"),
    "non-contiguous": (lambda s: {"w": _noncontiguous(s["w"])}, PlanError,
                       r"'w' \(source side, rank 0\).*not contiguous"),
    "not a tensor": (lambda s: {"w": 5}, PlanError, r"'w' \(rank 0\) is a int"),
    "proxy of a failing lookup": (
        lambda s: MappingProxyType(_Lazy(s, RuntimeError("no such shard"), "w")), PlanError,
        r"parameter 'w' \(rank 0\) raised RuntimeError\('no such shard'\)"),
    "module missing": (lambda s: _module({"v": s["w"]}), PlanError, r"'w'"),
    "module dtype": (lambda s: _module({"w": s["w"].to(torch.int32)}), PlanError,
                     r"'w' \(source side, rank 0\).*int32"),
    "str": (lambda s: "w", LocalProtocolError, "weights must be"),
    "bare tensor": (lambda s: s["w"], LocalProtocolError, "a bare tensor"),
    "int": (lambda s: 5, LocalProtocolError, "weights must be"),
    "None": (lambda s: None, LocalProtocolError, "weights must be"),
}


@pytest.mark.asyncio
async def test_weights_refused_before_the_round_leave_every_rank_ready() -> None:
    async with world() as w:
        tr, wk = w.trainers[0], w.workers[0]
        got: dict[int, Any] = {}
        async with anyio.create_task_group() as tg:
            w.receive_all(tg, got)  # waits through every refusal: none starts a round
            for what, (make, error, text) in REFUSED.items():
                with anyio.fail_after(LIMIT), pytest.raises(error, match=text):
                    await tr.sync_weights(make(w.shards(1)))
                assert tr.state is EngineState.READY and tr._busy is None, what
            assert waiting(wk) and not got
            with anyio.fail_after(LIMIT):
                sent = await w.send(1)
        assert sent.version == got[wk.rank].version == 1 and w.holds(1)


def _raising_generator(s: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    yield "a", s["a"]
    raise RuntimeError("the checkpoint reader broke")


#: lazy sources that fail the round: (what to pass, what the round's text must say)
FAILING: dict[str, tuple[Callable[[dict[str, torch.Tensor]], Any], str]] = {
    "generator raising midway": (_raising_generator,
                                 r"RuntimeError\('the checkpoint reader broke'\).*\['b'\]"),
    "pairs ending early": (lambda s: [("a", s["a"])],
                           r"iterator ended without parameters \['b'\] \(rank 0\)"),
    "pairs of another arity": (lambda s: [("a", s["a"], 1)], r"not a \(name, tensor\) pair"),
    "pairs naming a parameter twice": (lambda s: [("a", s["a"]), ("a", s["a"]), ("b", s["b"])],
                                       r"yielded parameter 'a' twice \(rank 0\)"),
    "callable returning a list": (lambda s: (lambda names: [s[n] for n in names]),
                                  r"returned list for parameters \['a'\] \(rank 0\)"),
    "callable raising": (lambda s: (lambda names: {}[names[0]] if names == ["b"]
                                    else {n: s[n] for n in names}),
                         r"KeyError\('b'\) \(rank 0, called for parameters \['b'\]\)"),
    "lookup raising KeyError": (lambda s: _Lazy(s, KeyError("b"), "b"),
                                r"no local shard for parameter 'b' \(rank 0\)"),
    "lookup raising another error": (lambda s: _Lazy(s, OSError("disk gone"), "b"),
                                     r"OSError\('disk gone'\).*parameter 'b'"),
    "shape": (lambda s: (lambda names: {n: torch.zeros(2) for n in names}),
              r"'a' \(source side, rank 0\).*shape"),
    "non-contiguous": (lambda s: [("a", s["a"]), ("b", _noncontiguous(s["b"]))],
                       r"'b' \(source side, rank 0\).*not contiguous"),
    "not a tensor": (lambda s: _Lazy({**s, "b": "b"}), r"'b' \(rank 0\) is a str"),
    "module shape": (lambda s: _module({"a": s["a"], "b": torch.zeros(3)}),
                     r"'b' \(source side, rank 0\).*shape"),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("what", list(FAILING))
async def test_a_lazy_source_that_fails_fails_the_round_everywhere_naming_the_parameter(
        what: str) -> None:
    make, text = FAILING[what]
    async with world(defs=TWO) as w:
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.trainers[0].sync_weights(make(w.shards(1))),
                              0, got)
        exc = one_failure(got)
        assert (exc.rank, exc.cause, exc.round) == (0, "error", 1), exc
        assert re.search(text, str(exc)), exc
        for e in [*w.trainers, *w.workers]:
            assert e.state is EngineState.POISONED and e.version == 0
        with pytest.raises(EnginePoisonedError) as info:
            await w.send(2)
        assert info.value.__cause__ is got[0]


# -- progress= -------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["progress", "source"])
@pytest.mark.parametrize("raised", [ValueError, TimeoutError, KeyboardInterrupt, SystemExit])
async def test_a_callback_that_raises_fails_the_round_everywhere_naming_this_rank(
        where: str, raised: type[BaseException]) -> None:
    error = raised("it broke")
    async with world(defs=TWO) as w:
        def progress(done: int, total: int) -> None:
            raise error

        def source(names: list[str]) -> dict[str, torch.Tensor]:
            if names == ["b"]:  # the second bucket: mid-round
                raise error
            return {n: w.shards(1)[n] for n in names}

        got: dict[int, Any] = {}
        caught: list[BaseException] = []

        async def trainer() -> None:
            try:
                if where == "progress":
                    await w.send(1, progress=progress)
                else:
                    await w.trainers[0].sync_weights(source)
            except BaseException as exc:  # the interrupt itself is what is checked
                caught.append(exc)

        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                tg.start_soon(trainer)
        [exc] = got.values()
        assert isinstance(exc, TransferError)
        assert (exc.rank, exc.cause, exc.round) == (0, "error", 1), exc
        [mine] = caught
        if isinstance(error, Exception):
            assert isinstance(mine, TransferError) and str(mine) == str(exc)
            assert "it broke" in str(exc)
        else:
            # The interrupt itself, its context the round's error (the same as the worker's).
            assert mine is error and str(mine.__context__) == str(exc)
            what = "the progress callback" if where == "progress" else "the weights source"
            assert f"{what} raised {raised.__name__}" in str(exc)
        assert all(e.state is EngineState.POISONED for e in [*w.trainers, *w.workers])


@pytest.mark.asyncio
async def test_a_progress_that_is_no_callable_is_refused_on_either_side() -> None:
    async with world() as w:
        tr, wk = w.trainers[0], w.workers[0]
        for value in (5, "progress"):
            with anyio.fail_after(LIMIT), pytest.raises(LocalProtocolError, match="progress"):
                await w.send(1, progress=value)
            assert tr.state is EngineState.READY
            with anyio.fail_after(LIMIT), pytest.raises(LocalProtocolError, match="progress"):
                await wk.receive(progress=value)  # type: ignore[arg-type]
            assert wk.state is EngineState.READY
        calls: list[tuple[int, int]] = []
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                sent = await w.send(1, progress=lambda d, t: calls.append((d, t)))
        assert sent.version == got[wk.rank].version == 1 and w.holds(1)
        assert calls and calls[-1][0] == calls[-1][1] == sent.bytes


# -- cancellation ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_cancelled_before_the_round_starts_nothing_happened() -> None:
    async with world(trainers=2) as w:
        t0, t1 = w.trainers
        with anyio.CancelScope() as scope:  # rank 0: cancelled before it publishes
            scope.cancel()
            await w.send(1, 0)
        assert scope.cancelled_caught and t0.state is EngineState.READY and t0._busy is None
        async with anyio.create_task_group() as tg:  # rank 1: while it waits for the start
            with anyio.CancelScope() as scope:
                async def cancel_when_waiting() -> None:
                    await until(lambda: waiting(t1))
                    scope.cancel()
                tg.start_soon(cancel_when_waiting)
                await w.send(1, 1)
        assert scope.cancelled_caught and t1.state is EngineState.READY and t1._busy is None
        assert all(e.version == 0 and e.state is EngineState.READY
                   for e in [*w.trainers, *w.workers])
        start = t1._rounds.core(1).keys.start  # type: ignore[union-attr]
        assert await w.store.get(start) is None  # no round was published
        await deliver(w, 1)  # round 1 happens: none of it had started


@pytest.mark.asyncio
@pytest.mark.parametrize(("where", "rank"), [("publish", 0), ("start", 0), ("start", 1),
                                              ("mid", 0), ("mid", 1)])
async def test_cancelled_in_the_round_fails_it_everywhere_naming_this_rank(
        where: str, rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    async with world(trainers=2, defs=TWO) as w:
        scope = anyio.CancelScope()
        progress = None
        if where == "publish":
            publish = RoundDriver.publish_start

            async def cancelled_publish(self: RoundDriver, *a: Any, **kw: Any) -> Any:
                scope.cancel()  # lands in the shielded publish: takes effect just after
                return await publish(self, *a, **kw)
            monkeypatch.setattr(RoundDriver, "publish_start", cancelled_publish)
        elif where == "start":
            run = RoundDriver.run

            async def cancelled_run(self: RoundDriver, *a: Any, **kw: Any) -> Any:
                if self.rank == rank:  # the round began on this trainer: cancel it now
                    scope.cancel()
                return await run(self, *a, **kw)
            monkeypatch.setattr(RoundDriver, "run", cancelled_run)
        else:
            def progress(done: int, total: int) -> None:  # a bucket went: mid-round
                scope.cancel()
        got: dict[int, Any] = {}

        async def cancelled() -> None:
            with scope:
                await w.send(1, rank, progress=progress)

        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                other = 1 - rank
                tg.start_soon(_outcome, lambda: w.send(1, other), other, got)
                tg.start_soon(cancelled)
        assert scope.cancelled_caught
        exc = one_failure(got)
        assert (exc.rank, exc.cause, exc.round) == (rank, "cancelled", 1), exc
        me = w.trainers[rank]
        assert me.state is EngineState.POISONED
        assert all(e.version == 0 and e.state is EngineState.POISONED
                   for e in [*w.trainers, *w.workers])
        with pytest.raises(EnginePoisonedError) as info:
            await w.send(2, rank)
        assert info.value.__cause__ is not None


#: a round deadline far beyond every bound here: a round these tests see fail failed at once,
#: not at its deadline
FAR = 60
#: how long the peers of a rank cancelled in a started round may take to fail (generous: they
#: fail within milliseconds; the deadline is FAR)
PROMPT = 15


@pytest.mark.asyncio
@pytest.mark.parametrize("when", ["published", "publishing"])
async def test_cancelled_waiting_once_the_round_started_fails_it_at_once_naming_this_rank(
        when: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async with world(trainers=2) as w:
        t1 = w.trainers[1]
        scope = anyio.CancelScope()
        if when == "published":
            wait_start = RoundDriver.wait_start

            async def cancelled_wait(self: RoundDriver, k: int, **kw: Any) -> Any:
                if self.rank != t1.rank:
                    return await wait_start(self, k, **kw)
                await started(w, k)  # rank 0 published round k; the wait has not seen it
                scope.cancel()
                await anyio.sleep_forever()  # the cancel lands here, in the wait
            monkeypatch.setattr(RoundDriver, "wait_start", cancelled_wait)
        else:
            looked = RoundDriver.cancelled_waiting

            async def late_look(self: RoundDriver, k: int) -> Any:
                await started(w, k)  # the start lands between the cancel and the look
                return await looked(self, k)
            monkeypatch.setattr(RoundDriver, "cancelled_waiting", late_look)
        got: dict[int, Any] = {}

        async def cancelled() -> None:
            with scope:
                await w.send(1, 1)

        with anyio.fail_after(PROMPT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancelled)
                await until(lambda: waiting(t1))
                if when == "publishing":
                    scope.cancel()  # no start yet: rank 0 publishes while rank 1 is cancelled
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.send(1, 0, timeout=FAR), 0, got)
        assert scope.cancelled_caught
        exc = one_failure(got)  # rank 0 and the worker, at once
        assert (exc.rank, exc.cause, exc.round) == (1, "cancelled", 1), exc
        assert t1.state is EngineState.POISONED
        assert all(e.version == 0 and e.state is EngineState.POISONED
                   for e in [*w.trainers, *w.workers])
        with pytest.raises(EnginePoisonedError) as info:
            await w.send(2, 1)
        assert info.value.__cause__ is not None
        assert str(info.value.__cause__) == str(exc)  # the record that every rank raised


@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["call", "close", "nothing"])
async def test_cancelled_waiting_before_the_start_declines_nothing(
        then: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The look finds no start, and rank 0 publishes just after: this rank is READY with
    nothing posted, and the round waits for it — its next call joins the round, a close
    fails it at once (``left``), and otherwise the round deadline fails it naming this rank."""
    async with world(trainers=2) as w:
        t1 = w.trainers[1]
        looked = RoundDriver.cancelled_waiting
        seen: list[Any] = []

        async def look(self: RoundDriver, k: int) -> Any:
            seen.append(await looked(self, k))
            return seen[-1]
        monkeypatch.setattr(RoundDriver, "cancelled_waiting", look)
        got: dict[int, Any] = {}
        deadline = 2 if then == "nothing" else FAR  # "nothing": the deadline is the end
        with anyio.fail_after(PROMPT):
            async with anyio.create_task_group() as tg:
                with anyio.CancelScope() as scope:
                    async def cancel_when_waiting() -> None:
                        await until(lambda: waiting(t1))
                        scope.cancel()
                    tg.start_soon(cancel_when_waiting)
                    await w.send(1, 1)
                assert scope.cancelled_caught and seen == [None]
                assert t1.state is EngineState.READY and t1._busy is None
                keys = t1._rounds.core(1).keys  # type: ignore[union-attr]
                assert await w.store.get(keys.abort) is None  # nothing posted
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.send(1, 0, timeout=deadline), 0, got)
                await started(w, 1)  # the race's other half: the start lands after the look
                if then == "call":
                    tg.start_soon(_outcome, lambda: w.send(1, 1), 1, got)
                elif then == "close":
                    await t1.close()
        if then == "call":
            assert all(isinstance(g, SyncResult) and g.version == 1 for g in got.values()), got
            assert w.holds(1)
            return
        exc = one_failure(got)
        cause = "left" if then == "close" else "deadline"
        assert (exc.rank, exc.cause, exc.round) == (1, cause, 1), exc


@pytest.mark.asyncio
async def test_cancelled_waiting_with_a_store_that_does_not_answer_the_look_is_poisoned(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with world(trainers=2) as w:
        t1 = w.trainers[1]
        store = t1._rounds.store  # type: ignore[union-attr]
        gather = store.gather

        async def mute_look(prefix: str, count: int, **kw: Any) -> Any:
            if count == 0:  # the look after the cancel (the wait gathers one key or more)
                await anyio.sleep_forever()
            return await gather(prefix, count, **kw)
        monkeypatch.setattr(store, "gather", mute_look)
        with anyio.fail_after(PROMPT):  # the look is bounded by abort_grace
            async with anyio.create_task_group() as tg:
                with anyio.CancelScope() as scope:
                    async def cancel_when_waiting() -> None:
                        await until(lambda: waiting(t1))
                        scope.cancel()
                    tg.start_soon(cancel_when_waiting)
                    await w.send(1, 1)
        assert scope.cancelled_caught and t1.state is EngineState.POISONED
        with pytest.raises(EnginePoisonedError) as info:
            await w.send(1, 1)
        cause = info.value.__cause__
        assert isinstance(cause, TransferError) and (cause.rank, cause.cause) == (None, "store")


@pytest.mark.asyncio
async def test_cancelled_once_its_part_is_done_commits_and_loses_no_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with world() as w:
        tr = w.trainers[0]
        scope = anyio.CancelScope()
        outcome = RoundDriver._outcome

        async def cancelled_outcome(self: RoundDriver, *a: Any, **kw: Any) -> Any:
            if self.rank == tr.rank:  # this trainer's part is done: the outcome is shielded
                scope.cancel()
            return await outcome(self, *a, **kw)
        monkeypatch.setattr(RoundDriver, "_outcome", cancelled_outcome)
        got: dict[int, Any] = {}

        async def cancelled() -> None:
            with scope:
                await w.send(1)

        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                tg.start_soon(cancelled)
        assert scope.cancelled_caught  # the cancel took effect after the commit
        assert tr.state is EngineState.READY and tr.version == 1
        assert got[w.workers[0].rank].version == 1 and w.holds(1)
        monkeypatch.setattr(RoundDriver, "_outcome", outcome)
        await deliver(w, 2)  # the next call is the next round


# -- one call at a time, close ---------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_second_sync_weights_is_refused_and_the_first_unaffected() -> None:
    async with world(trainers=2) as w:
        t0, t1 = w.trainers
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_outcome, lambda: w.send(1, 1), 1, got)
                await until(lambda: waiting(t1))  # rank 1 waits for the start
                with pytest.raises(LocalProtocolError, match="already in sync_weights"):
                    await w.send(1, 1)
                tg.start_soon(_outcome, lambda: w.send(1, 0), 0, got)
                await started(w, 1)
                await until(lambda: t0.state is EngineState.UPDATING)  # waits for the worker
                with pytest.raises(LocalProtocolError, match=r"already in sync_weights.*round"):
                    await w.send(1, 0)
                assert t0.state is EngineState.UPDATING
                w.receive_all(tg, got)
        assert all(isinstance(g, SyncResult) and g.version == 1 for g in got.values()), got
        assert w.holds(1)


@pytest.mark.asyncio
async def test_sync_weights_after_close_is_refused_and_the_job_ended() -> None:
    async with world() as w:
        tr, wk = w.trainers[0], w.workers[0]
        await deliver(w, 1)
        await tr.close()
        for _ in range(2):
            with pytest.raises(LocalProtocolError, match="CLOSED"):
                await w.send(2)
        assert tr.state is EngineState.CLOSED and tr.version == 1
        with anyio.fail_after(LIMIT), pytest.raises(PeerLostError, match="closed the job"):
            await wk.receive()


@pytest.mark.asyncio
async def test_close_of_rank_0_before_it_published_the_round_happens_on_no_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with world() as w:
        tr, wk = w.trainers[0], w.workers[0]
        checking, closed = anyio.Event(), anyio.Event()
        precheck = _Sources.precheck

        async def slow_precheck(self: _Sources) -> None:
            checking.set()
            await closed.wait()  # close() runs while the weights are being checked
            await precheck(self)
        monkeypatch.setattr(_Sources, "precheck", slow_precheck)
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.send(1), 0, got)
                await checking.wait()
                await tr.close()
                closed.set()
        exc = got[0]
        assert isinstance(exc, TransferError), exc
        assert (exc.rank, exc.cause, exc.round) == (0, "left", 1), exc
        assert isinstance(got[wk.rank], PeerLostError), got  # the job ended, no round ran
        assert tr.state is EngineState.CLOSED and wk.version == 0


@pytest.mark.asyncio
async def test_close_of_rank_0_beside_its_published_round_fails_it_everywhere() -> None:
    async with world(workers=2) as w:
        tr = w.trainers[0]
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                first, second = w.workers
                tg.start_soon(_outcome, first.receive, first.rank, got)
                # The second worker is not receiving yet: the round waits for it.
                tg.start_soon(_outcome, lambda: w.send(1), 0, got)
                await started(w, 1)
                await tr.close()
                tg.start_soon(_outcome, second.receive, second.rank, got)
        exc = one_failure(got)
        assert (exc.rank, exc.cause, exc.round) == (0, "left", 1), exc
        assert tr.state is EngineState.CLOSED
        assert all(e.version == 0 for e in [*w.trainers, *w.workers])


@pytest.mark.asyncio
async def test_close_of_a_waiting_trainer_ends_its_call_and_fails_the_round_naming_it(
        ) -> None:
    async with world(trainers=2) as w:
        t1 = w.trainers[1]
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_outcome, lambda: w.send(1, 1), 1, got)
                await until(lambda: waiting(t1))
                await t1.close()
                await until(lambda: 1 in got)
                assert isinstance(got[1], LocalProtocolError), got
                assert "closed while waiting for round 1" in str(got[1])
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.send(1, 0), 0, got)
        del got[1]
        exc = one_failure(got)
        assert (exc.rank, exc.cause, exc.round) == (1, "left", 1), exc
        assert t1.state is EngineState.CLOSED


@pytest.mark.asyncio
async def test_rank_0_closing_between_rounds_ends_the_job_on_a_waiting_trainer() -> None:
    async with world(trainers=2) as w:
        t0, t1 = w.trainers
        await deliver(w, 1)
        got: dict[int, Any] = {}
        with anyio.fail_after(LIMIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_outcome, lambda: w.send(2, 1), 1, got)
                w.receive_all(tg, got)
                await until(lambda: waiting(t1) and all(waiting(e) for e in w.workers))
                await t0.close()
        exc = got[1]
        assert isinstance(exc, PeerLostError) and exc.ranks == (0,), exc
        assert "trainer rank 0 closed the job after round 1" in str(exc)
        assert t1.state is EngineState.POISONED and t1.version == 1
        with pytest.raises(EnginePoisonedError) as info:
            await w.send(2, 1)
        assert info.value.__cause__ is exc


# -- the blocking facade ---------------------------------------------------------------------


def _pair(address: str, job: str) -> tuple[BlockingTrainer, BlockingWorker, World]:
    plan = make_plan(DEFS, (1, 1), (1, 1))
    cfg = dataclasses.replace(CFG, job=job)
    with ThreadPoolExecutor(2) as ex:  # connect blocks until both ranks shook hands
        ft = ex.submit(BlockingTrainer.connect, address, token=TOKEN, rank=0,
                       trainer_ranks=1, world_size=2, params=[p.spec for p in plan.params],
                       config=cfg)
        fw = ex.submit(BlockingWorker.connect, address, token=TOKEN, rank=1,
                       trainer_ranks=1, world_size=2, targets=_targets(plan, 1),
                       mesh_dims=plan.params[0].dst.mesh.dims, config=cfg)
        trainer, worker = ft.result(LIMIT), fw.result(LIMIT)
    return trainer, worker, World(plan, MemoryStore(), [trainer.engine], [worker.engine])


@pytest.fixture
def pair(store_address: str, job: str) -> Iterator[tuple[BlockingTrainer, BlockingWorker,
                                                          World]]:
    trainer, worker, w = _pair(store_address, job)
    try:
        yield trainer, worker, w
    finally:
        trainer.close()
        worker.close()


def test_blocking_arguments_refused_as_the_coroutine_refuses_them(
        pair: tuple[BlockingTrainer, BlockingWorker, World]) -> None:
    trainer, worker, w = pair
    refused: list[tuple[dict[str, Any], type[Exception], str]] = [
        *((dict(timeout=v), LocalProtocolError, "timeout") for v in
          (0, -1.0, math.nan, math.inf, True, "5")),
        *((dict(version=v), LocalProtocolError, "version") for v in (0, True, 1.0, 2**64)),
        (dict(progress=5), LocalProtocolError, "progress"),
    ]
    for kw, error, text in refused:
        with pytest.raises(error, match=text):
            trainer.sync_weights(w.shards(1), **kw)
        assert trainer.state is EngineState.READY, kw
    with pytest.raises(PlanError, match=r"'w' \(rank 0\)"):
        trainer.sync_weights({})
    with ThreadPoolExecutor(1) as ex:
        got = ex.submit(worker.receive, timeout=LIMIT)
        sent = trainer.sync_weights(w.shards(1), timeout=LIMIT, version=3)
        assert got.result(LIMIT).version == sent.version == 3
    assert w.holds(1) and trainer.state is EngineState.READY


def test_blocking_lazy_source_failure_fails_the_round_on_both(
        pair: tuple[BlockingTrainer, BlockingWorker, World]) -> None:
    trainer, worker, w = pair
    with ThreadPoolExecutor(1) as ex:
        got = ex.submit(worker.receive, timeout=LIMIT)
        with pytest.raises(TransferError, match=r"OSError\('disk gone'\).*parameter 'w'") as info:
            trainer.sync_weights(_Lazy(w.shards(1), OSError("disk gone"), "w"))
        with pytest.raises(TransferError) as theirs:
            got.result(LIMIT)
    assert str(theirs.value) == str(info.value)
    assert trainer.state is worker.state is EngineState.POISONED


def test_blocking_call_cancelled_mid_round_aborts_it_on_every_rank(
        pair: tuple[BlockingTrainer, BlockingWorker, World]) -> None:
    trainer, worker, w = pair
    pending = trainer.start_sync_weights(w.shards(1))  # the worker does not receive yet
    for _ in range(int(LIMIT / 0.005)):  # bounded: until the trainer is in its round
        if trainer.state is EngineState.UPDATING:
            break
        time.sleep(0.005)
    assert trainer.state is EngineState.UPDATING
    ex = ThreadPoolExecutor(1)
    try:
        ex.submit(pending.cancel).result(LIMIT)  # bounded: cancel waits for the abort
    finally:
        ex.shutdown(wait=False)  # a cancel that hangs fails the test, not the run
    assert trainer.state is EngineState.POISONED
    with pytest.raises(LocalProtocolError, match="cancel"):
        pending.result(LIMIT)
    with pytest.raises(TransferError) as info:
        worker.receive(timeout=LIMIT)  # the round's abort record: at once, not a deadline
    assert (info.value.rank, info.value.cause, info.value.round) == (0, "cancelled", 1)
    assert worker.state is EngineState.POISONED and worker.version == 0


@pytest.mark.asyncio
async def test_names_an_iterator_yields_outside_the_plan_are_skipped_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    # As for a module's tensors the plan does not carry: not sent, not held for the round,
    # one warning per engine naming them (not one per round).
    import gc
    import weakref

    async with world() as w:
        extras: list[weakref.ref[torch.Tensor]] = []
        seen_in_round: list[bool] = []

        def pairs(v: int) -> Any:
            for i in range(7):
                extra = torch.zeros(3)
                extras.append(weakref.ref(extra))
                yield f"not.planned.{i}", extra
                del extra
            # Pulled again: the skipped tensors are held by nobody (the last one still by
            # the loop that just pulled it)
            gc.collect()
            seen_in_round.append(any(r() is not None for r in extras[-7:-1]))
            yield from w.shards(v).items()

        caplog.set_level("WARNING", logger="m2n_async")
        for v in (1, 2):
            got: dict[int, Any] = {}
            with anyio.fail_after(LIMIT):
                async with anyio.create_task_group() as tg:
                    w.receive_all(tg, got)
                    tg.start_soon(_outcome, lambda v=v: w.trainers[0].sync_weights(pairs(v)),
                                  0, got)
            assert all(isinstance(g, SyncResult) for g in got.values()), got
            assert w.holds(v)
        warned = [r.getMessage() for r in caplog.records if "plan does not carry" in r.message]
        assert len(warned) == 1, warned
        assert "yielded 7 name(s)" in warned[0] and "'not.planned.0'" in warned[0]
        assert "and 2 more" in warned[0]
        assert seen_in_round == [False, False]


@pytest.mark.asyncio
async def test_cancelled_in_its_checks_once_the_round_started_fails_it_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Trainer 1 is cancelled while it checks its sources, before its wait for the start,
    # with rank 0's start already published: as a cancel of the wait, the round fails at
    # once on every rank naming rank 1 (not at the round deadline).
    async with world(trainers=2) as w:
        t1 = w.trainers[1]
        scope = anyio.CancelScope()
        checked = TrainerEngine._checked_sources

        async def slow_checks(self: TrainerEngine, *a: Any, **kw: Any) -> Any:
            if self is t1:
                await started(w, 1)
                scope.cancel()
                await anyio.sleep_forever()  # the cancel lands here, in the checks
            return await checked(self, *a, **kw)

        monkeypatch.setattr(TrainerEngine, "_checked_sources", slow_checks)
        got: dict[int, Any] = {}

        async def cancelled() -> None:
            with scope:
                await w.send(1, 1)

        with anyio.fail_after(PROMPT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancelled)
                w.receive_all(tg, got)
                tg.start_soon(_outcome, lambda: w.send(1, 0, timeout=FAR), 0, got)
        assert scope.cancelled_caught
        exc = one_failure(got)
        assert (exc.rank, exc.cause, exc.round) == (1, "cancelled", 1), exc
        assert t1.state is EngineState.POISONED
