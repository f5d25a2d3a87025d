"""A worker target given new storage between rounds: the same dtype, shape and layout is
written there; anything else fails the round on every rank naming the parameter, before a
byte lands (it used to commit garbage as a valid version, or abort the worker process).
The trainer's side too: a source whose storage was freed under its shape fails the round
naming it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch

from m2n_async import TransferError
from m2n_async.testing import MemoryStore

from ._plans import make_plan, source_shards
from .test_engine_local import DEFS, _check, _close, _connect_all, _round, _same

PLAN = make_plan(DEFS[:1], (1, 1), (1, 1))  # w_row: (12, 6) float32, whole on the worker


def _renew(t: torch.Tensor, how: str) -> None:
    with torch.no_grad():
        if how == "same":  # what Module.to(device) of the same dtype does
            t.data = torch.empty_like(t)
        elif how == "float64":  # Module.to(torch.float64)
            t.data = t.data.to(torch.float64)
        elif how == "bfloat16":
            t.data = t.data.to(torch.bfloat16)
        elif how == "smaller":
            t.data = torch.zeros(4, 6)
        elif how == "strided":  # the same shape, not contiguous
            t.data = torch.zeros(12, 12)[:, :6]
        elif how == "swapped-nested":  # the very object made nested (no .data = can)
            import warnings

            with warnings.catch_warnings():  # torch.nested says it is a prototype
                warnings.simplefilter("ignore")
                nested = torch.nested.nested_tensor([torch.zeros(6), torch.zeros(6)])
            torch.utils.swap_tensors(t, nested)
        else:
            raise AssertionError(how)


async def _side(got: dict[str, Any], name: str, call: Callable[[], Any]) -> None:
    """``call``'s result or error into ``got[name]``, for the test to compare."""
    try:
        got[name] = await call()
    except Exception as exc:
        got[name] = exc


async def _both(trainer: Any, worker: Any, version: int) -> dict[str, Any]:
    """One round of ``PLAN`` at ``version``: the trainer's and the worker's outcome."""
    got: dict[str, Any] = {}
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(_side, got, "trainer",
                          lambda: trainer.sync_weights(source_shards(PLAN, 0, version)))
            tg.start_soon(_side, got, "worker", worker.receive)
    return got


async def _two_rounds(how: str) -> tuple[Any, Any, tuple[int, str]]:
    """Round 1, the worker's target renewed ``how``, round 2: (trainer's, worker's outcome
    of round 2, the worker engine's version and state after it)."""
    trainers, workers = await _connect_all(MemoryStore(), PLAN)
    try:
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(PLAN, 0, 1)))
        _renew(workers[0]._sinks["w_row"].tensor, how)
        got = await _both(trainers[0], workers[0], 2)
        if how == "same":
            _check(PLAN, workers, 2)
        return got["trainer"], got["worker"], (workers[0].version, workers[0].state.value)
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_new_storage_of_the_planned_kind_is_written() -> None:
    trainer, worker, _ = await _two_rounds("same")  # _check: bit-exact in the new storage
    assert trainer.version == worker.version == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("how, says", [
    ("float64", "tensor dtype float64 != planned dtype float32"),
    ("bfloat16", "tensor dtype bfloat16 != planned dtype float32"),
    ("smaller", "tensor shape (4, 6) != local shard shape (12, 6)"),
    ("strided", "contiguous"),
    ("swapped-nested", "a nested tensor"),
])
async def test_new_storage_of_another_kind_fails_the_round_naming_the_parameter(
        how: str, says: str) -> None:
    trainer, worker, engine = await _two_rounds(how)
    for exc in (trainer, worker):
        assert isinstance(exc, TransferError), exc
        assert (exc.rank, exc.cause) == (1, "error"), exc
        assert "parameter 'w_row' (destination side, rank 1)" in str(exc), exc
        assert says in str(exc) and "the target changed after connect" in str(exc), exc
    assert str(trainer) == str(worker)
    assert engine == (1, "poisoned")


@pytest.mark.asyncio
async def test_sources_and_targets_swapped_between_rounds_are_followed() -> None:
    # ``torch.utils.swap_tensors`` (what ``Module.to`` does under swap-on-conversion, and for
    # wrapper subclasses) refuses a tensor anything holds a weak reference to: the engine and
    # the lane hold none, so the caller's very objects can be swapped between rounds, and the
    # next round reads and writes the storage they hold then.
    trainers, workers = await _connect_all(MemoryStore(), PLAN)
    try:
        shards = source_shards(PLAN, 0, 1)
        for _ in range(2):  # the second round re-checks with the guards the first recorded
            await _round(trainers, workers, lambda e: e.sync_weights(shards))
        _check(PLAN, workers, 1)
        target = workers[0]._sinks["w_row"].tensor
        torch.utils.swap_tensors(target, torch.zeros(12, 6))
        torch.utils.swap_tensors(shards["w_row"], source_shards(PLAN, 0, 2)["w_row"].clone())
        assert workers[0]._sinks["w_row"].tensor is target  # the same object, new storage
        await _round(trainers, workers, lambda e: e.sync_weights(shards))
        _check(PLAN, workers, 2)
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_module_target_given_new_storage_is_followed() -> None:
    # targets_from_module hands the engine the module's parameter itself, so storage the
    # module gets later (``param.data = ...``, ``Module.to``) is what the next round writes,
    # or refuses: never a stale alias of the old storage that leaves the module untouched.
    from m2n_async import targets_from_module

    module = torch.nn.Module()
    module.w_row = torch.nn.Parameter(torch.zeros(12, 6))  # requires grad, as a module's do
    trainers, workers = await _connect_all(
        MemoryStore(), PLAN, targets={1: targets_from_module(module)})
    try:
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(PLAN, 0, 1)))
        assert _same(module.w_row.detach(), source_shards(PLAN, 0, 1)["w_row"])
        with torch.no_grad():
            module.w_row.data = torch.zeros(12, 6)  # new storage, the planned kind
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(PLAN, 0, 2)))
        assert _same(module.w_row.detach(), source_shards(PLAN, 0, 2)["w_row"])
        module.to(torch.float64)
        with pytest.raises(BaseExceptionGroup) as info:  # both sides raise it
            await _round(trainers, workers,
                         lambda e: e.sync_weights(source_shards(PLAN, 0, 3)))
        assert info.group_contains(TransferError, match="tensor dtype float64 != planned")
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_non_contiguous_module_target_given_new_storage_is_followed() -> None:
    # A transposed parameter is filled through a callback: it copies into the parameter as
    # it is then, not into a view of its storage at connect; another dtype is refused.
    from m2n_async import targets_from_module

    module = torch.nn.Module()
    module.w_row = torch.nn.Parameter(torch.zeros(6, 12).t())  # (12, 6), not contiguous
    trainers, workers = await _connect_all(
        MemoryStore(), PLAN, targets={1: targets_from_module(module)})
    try:
        for version in (1, 2):
            await _round(trainers, workers,
                         lambda e, v=version: e.sync_weights(source_shards(PLAN, 0, v)))
            assert _same(module.w_row.detach().contiguous(),
                         source_shards(PLAN, 0, version)["w_row"])
            with torch.no_grad():
                module.w_row.data = torch.zeros(6, 12).t()  # new storage, the planned kind
        module.to(torch.float64)
        with pytest.raises(BaseExceptionGroup) as info:  # both sides raise it
            await _round(trainers, workers,
                         lambda e: e.sync_weights(source_shards(PLAN, 0, 3)))
        assert info.group_contains(TransferError, match="the target changed after connect")
    finally:
        await _close(*trainers, *workers)


async def _renewed_while_waiting(monkeypatch: pytest.MonkeyPatch, fresh: float,
                                 how: str) -> tuple[Any, Any, int]:
    """Round 1; then the worker calls ``receive`` (its targets pass the check made before it
    waits), the target is renewed ``how`` while it waits, and round 2 starts 0.3 s later.
    Returns the trainer's and worker's outcome of round 2 and how many fast passes the
    worker ran in the round itself (not counting ``receive``'s own, before the wait)."""
    from m2n_async._engine import _targets

    monkeypatch.setattr(_targets, "FRESH_S", fresh)
    trainers, workers = await _connect_all(MemoryStore(), PLAN)
    in_round = 0
    fast = _targets.TargetCheck._fast

    async def counted(self: Any, bucket: Any, *, explain: bool = False) -> bool:
        nonlocal in_round
        in_round += explain  # the round's passes explain; ``precheck``'s do not
        return await fast(self, bucket, explain=explain)

    monkeypatch.setattr(_targets.TargetCheck, "_fast", counted)
    try:
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(PLAN, 0, 1)))
        in_round = 0
        got: dict[str, Any] = {}
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(_side, got, "worker", workers[0].receive)
                await anyio.sleep(0.1)  # the worker checked its targets and waits
                if how != "unchanged":
                    _renew(workers[0]._sinks["w_row"].tensor, how)
                await anyio.sleep(0.2)
                tg.start_soon(_side, got, "trainer",
                              lambda: trainers[0].sync_weights(source_shards(PLAN, 0, 2)))
        if how in ("unchanged", "same") and not isinstance(got["worker"], Exception):
            _check(PLAN, workers, 2)  # bit-exact, in the new storage too
        return got["trainer"], got["worker"], in_round
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_prompt_round_uses_the_check_made_before_the_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The check runs while the trainers start the round, off its path: not again in it.
    trainer, worker, in_round = await _renewed_while_waiting(monkeypatch, 30.0, "unchanged")
    assert trainer.version == worker.version == 2
    assert in_round == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("fresh", [30.0, 0.05], ids=["prompt", "late"])
async def test_storage_given_while_the_worker_waited_is_checked_in_the_round(
        monkeypatch: pytest.MonkeyPatch, fresh: float) -> None:
    # Prompt: the round sees the target's new address and checks it whole. Late (the start
    # came more than FRESH_S after the early check): the round checks every bucket whole.
    # Either way, storage of another dtype given while the worker waited fails the round
    # naming the parameter, and nothing is written into it.
    trainer, worker, in_round = await _renewed_while_waiting(monkeypatch, fresh, "bfloat16")
    for exc in (trainer, worker):
        assert isinstance(exc, TransferError), exc
        assert "parameter 'w_row' (destination side, rank 1)" in str(exc), exc
        assert "tensor dtype bfloat16 != planned dtype float32" in str(exc), exc
    assert in_round == 1


@pytest.mark.asyncio
async def test_storage_of_the_planned_kind_given_while_the_worker_waited_is_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    trainer, worker, in_round = await _renewed_while_waiting(monkeypatch, 30.0, "same")
    assert trainer.version == worker.version == 2
    assert in_round == 1  # the new address: checked whole, then written


@pytest.mark.asyncio
async def test_a_target_that_fails_the_early_check_fails_the_round_not_the_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Renewed before receive: the early check fails, nothing is raised before the round
    # (the trainers would wait it out), and the round's own check fails it on every rank.
    from m2n_async._engine import _targets

    monkeypatch.setattr(_targets, "FRESH_S", 30.0)
    trainer, worker, engine = await _two_rounds("smaller")
    for exc in (trainer, worker):
        assert isinstance(exc, TransferError), exc
        assert "tensor shape (4, 6) != local shard shape (12, 6)" in str(exc), exc
    assert engine == (1, "poisoned")


@pytest.mark.asyncio
async def test_every_receive_call_checks_its_targets_polling_ones_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker polling with short timeouts checks its targets at each call, however recent
    # the last pass (a target may change between two calls at its address: see the test
    # above); after the first, a pass is one guard call per chunk (_sources.Recheck).
    from m2n_async._engine import _targets

    trainers, workers = await _connect_all(MemoryStore(), PLAN)
    passes = 0
    fast = _targets.TargetCheck._fast

    async def counted(self: Any, bucket: Any, *, explain: bool = False) -> bool:
        nonlocal passes
        passes += 1
        return await fast(self, bucket, explain=explain)

    monkeypatch.setattr(_targets.TargetCheck, "_fast", counted)
    try:
        for _ in range(5):
            with pytest.raises(TimeoutError):
                await workers[0].receive(timeout=0.01)
        assert passes == 5 * len(workers[0]._transport.ctx.buckets)
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(PLAN, 0, 1)))
        _check(PLAN, workers, 1)
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_targets_that_passed_are_rechecked_without_the_fast_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Once a chunk of targets passed, later rounds re-check it with one C call (torch's
    # TensorGuards); a target given new storage of another kind goes through the fast pass
    # again, which refuses it.
    from m2n_async._engine import _targets

    calls = [0]
    real = _targets.laid_out

    def counted(*args: Any) -> bool:
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(_targets, "laid_out", counted)
    trainers, workers = await _connect_all(MemoryStore(), PLAN)
    try:
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(PLAN, 0, 1)))
        first = calls[0]
        assert first >= 1
        for version in (2, 3):
            await _round(trainers, workers,
                         lambda e, v=version: e.sync_weights(source_shards(PLAN, 0, v)))
        _check(PLAN, workers, 3)
        assert calls[0] == first
        _renew(workers[0]._sinks["w_row"].tensor, "strided")
        with pytest.raises(BaseExceptionGroup) as info:
            await _round(trainers, workers,
                         lambda e: e.sync_weights(source_shards(PLAN, 0, 4)))
        assert info.group_contains(TransferError, match="contiguous")
        assert calls[0] > first
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["unchanged", "same"])
async def test_the_lane_takes_the_addresses_the_round_check_read(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A prompt round reads each target's address once, in the engine's check: the Gloo
    lane compares what the check read (``CheckedTargets``) instead of reading it again.
    New storage given while the worker waited is not handed over (the check explains it
    whole) and the lane, reading the address itself, writes into the new storage."""
    from m2n_async._data import gloo

    reads: list[int] = []
    real = gloo._DATA_PTR

    def counted(t: torch.Tensor) -> int:
        reads.append(id(t))
        return real(t)

    monkeypatch.setattr(gloo, "_DATA_PTR", counted)
    handed: list[Any] = []
    from m2n_async._data._transport import Transport

    use = Transport.use_checked_targets

    def spying(self: Transport, bucket: int, checked: Any) -> None:
        handed.append(checked)
        use(self, bucket, checked)

    monkeypatch.setattr(Transport, "use_checked_targets", spying)
    trainer, worker, _ = await _renewed_while_waiting(monkeypatch, 30.0, how)
    assert trainer.version == worker.version == 2  # and bit-exact (the helper checks)
    target = id(handed[0].sinks["w_row"].tensor)  # round 1 was checked before it too
    assert handed[0].params == (0,)
    if how == "unchanged":
        assert len(handed) == 2  # both rounds: the lane read the address once, to build
        assert reads.count(target) == 1
    else:
        assert len(handed) == 1  # not round 2's: the lane read the new address and rebuilt
        assert reads.count(target) == 3


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["same storage", "overlapping view"])
async def test_targets_made_to_share_memory_after_connect_fail_the_next_round(how: str) -> None:
    # Connect refuses two targets sharing memory; one given the other's storage later
    # (``b.data = a.data``: parameters tied after connect) fails the next round on every
    # rank naming both, as at connect, instead of committing whichever landed last.
    plan = make_plan([("a", (12, 6), torch.float32, None, None),
                      ("b", (12, 6), torch.float32, None, None)], (1, 1), (1, 1))
    trainers, workers = await _connect_all(MemoryStore(), plan)
    try:
        await _round(trainers, workers, lambda e: e.sync_weights(source_shards(plan, 0, 1)))
        a, b = (workers[0]._sinks[n].tensor for n in "ab")
        with torch.no_grad():
            if how == "same storage":
                b.data = a.data
            else:  # rows 0..11 and 1..12 of one 13-row buffer
                base = torch.zeros(13, 6)
                a.data, b.data = base[:12], base[1:]
        with pytest.raises(BaseExceptionGroup) as info:  # both sides raise it
            await _round(trainers, workers, lambda e: e.sync_weights(source_shards(plan, 0, 2)))
        assert info.group_contains(TransferError, match="parameters 'a' and 'b' share memory")
        assert info.group_contains(TransferError, match="the targets changed after connect")
        assert workers[0].version == 1
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["dtype view", "shorter slice"])
async def test_a_target_changed_between_two_receive_calls_at_its_address_is_checked(
        how: str) -> None:
    # A receive that timed out made its pass; the caller then changes the target keeping
    # its address, and calls again at once: the new call's pass must see it (a pass of the
    # call before was kept, and the round compared only addresses: it committed an int32
    # target, or, before any round, Gloo aborted the process on a receive too small).
    trainers, workers = await _connect_all(MemoryStore(), PLAN)
    try:
        with pytest.raises(TimeoutError):
            await workers[0].receive(timeout=0.01)
        target = workers[0]._sinks["w_row"].tensor
        before = target.data_ptr()
        with torch.no_grad():
            if how == "dtype view":
                target.data = target.data.view(torch.int32)
            else:
                target.data = target.data.view(-1)[:18].view(3, 6)
        assert target.data_ptr() == before
        got = await _both(trainers[0], workers[0], 1)
        says = ("tensor dtype int32 != planned dtype float32" if how == "dtype view"
                else "tensor shape (3, 6) != local shard shape (12, 6)")
        for exc in got.values():
            assert isinstance(exc, TransferError) and says in str(exc), got
        assert workers[0].version == 0
    finally:
        await _close(*trainers, *workers)


@pytest.mark.asyncio
async def test_a_source_whose_storage_was_freed_fails_the_round_naming_it() -> None:
    # FSDP frees a parameter's storage under its shape (untyped_storage().resize_(0)); the
    # shape, dtype and strides the guards compare are unchanged. A shard sent zero-copy
    # (a message of its own) would have Gloo send from address 0 and abort the process.
    trainers, workers = await _connect_all(MemoryStore(), PLAN)
    try:
        shards = source_shards(PLAN, 0, 1)
        await _round(trainers, workers, lambda e: e.sync_weights(shards))
        shards["w_row"].untyped_storage().resize_(0)
        with pytest.raises(BaseExceptionGroup) as info:  # both sides raise it
            await _round(trainers, workers, lambda e: e.sync_weights(shards))
        assert info.group_contains(
            TransferError, match=r"parameter 'w_row': its local shard holds no storage "
            r"\(freed under its shape")
        assert workers[0].version == 1
    finally:
        await _close(*trainers, *workers)
