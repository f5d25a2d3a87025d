"""A rank started with another topology than its peers (``world_size`` or ``trainer_ranks``):
every rank, that one included, raises the same ``PreflightError`` for ``hello`` at once.

The ranks run as tasks of one event loop over the in-memory store, each with the group of
the world it was given (as the engine builds it), under a phase deadline far beyond the
test's bound: waiting it out, or failing on another text, is the defect these tests catch.
"""

from __future__ import annotations

import dataclasses
import time

import anyio
import pytest

from m2n_async import PhaseTimeoutError, PreflightError
from m2n_async._engine._preflight import PreflightInputs, PreflightOutcome, run_preflight
from m2n_async._store import ControlGroup
from m2n_async.testing import MemoryStore

from .test_preflight import GEN, Log, make_inputs

LONG = 60.0  # the phase deadline: nobody may wait it out
BOUND = 5.0  # the whole world must be done by then
SPREAD = 1.0  # and every rank within this of the others
NS = f"job/{GEN}/preflight"


async def _preflight_rank(root: MemoryStore, inputs: PreflightInputs,
                          out: dict[int, BaseException | PreflightOutcome],
                          phase_timeout: float = LONG) -> None:
    """One rank's handshake as the engine runs it: a group of the world it was given, left
    as lost after a failure."""
    group = ControlGroup(root.session(), inputs.rank, inputs.world_size, NS)
    try:
        out[inputs.rank] = await run_preflight(group, inputs, phase_timeout=phase_timeout)
    except Exception as exc:
        out[inputs.rank] = exc
        await group.aclose(lost=True)


async def world(t: int, n: int, wrong: dict[int, dict[str, int]], phase_timeout: float = LONG
                ) -> tuple[dict[int, BaseException | PreflightOutcome], dict[int, float]]:
    """``t + n`` ranks; rank r of ``wrong`` passes those inputs (world_size, trainer_ranks)."""
    root = MemoryStore()
    out: dict[int, BaseException | PreflightOutcome] = {}
    done: dict[int, float] = {}

    async def rank_main(r: int) -> None:
        inputs = dataclasses.replace(make_inputs(r, t, n, Log()), **wrong.get(r, {}))
        await _preflight_rank(root, inputs, out, phase_timeout)
        done[r] = time.monotonic()

    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            for r in range(t + n):
                tg.start_soon(rank_main, r)
    return out, done


CASES = [
    pytest.param(2, 2, {3: {"world_size": 5}}, id="bigger-world-last-rank"),
    pytest.param(2, 2, {2: {"world_size": 3}}, id="smaller-world-first-worker"),
    pytest.param(2, 2, {0: {"world_size": 5}}, id="bigger-world-rank0"),
    pytest.param(2, 2, {1: {"world_size": 9}}, id="much-bigger-world-trainer"),
    pytest.param(2, 3, {2: {"world_size": 4}}, id="smaller-world-by-one"),
    pytest.param(2, 2, {3: {"trainer_ranks": 1}}, id="other-trainer-ranks"),
    # Two against two: no majority, so every rank is named (the handshake's rule).
    pytest.param(2, 2, {2: {"world_size": 5}, 3: {"world_size": 5}}, id="two-bigger-tied"),
    pytest.param(2, 3, {3: {"world_size": 6}, 4: {"world_size": 6}}, id="two-bigger"),
    # Two wrong ones of different worlds: the first rank to decide records the view, so a
    # rank whose own view would settle on fewer envelopes still raises the same text.
    pytest.param(2, 3, {2: {"world_size": 3}, 4: {"world_size": 7}}, id="smaller-and-bigger"),
    pytest.param(3, 4, {1: {"world_size": 4}, 2: {"world_size": 4}}, id="two-smaller"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("t,n,wrong", CASES)
async def test_every_rank_raises_the_same_hello_error_at_once(
        t: int, n: int, wrong: dict[int, dict[str, int]]) -> None:
    out, done = await world(t, n, wrong)
    errors = [out[r] for r in range(t + n)]
    for r, e in enumerate(errors):
        assert isinstance(e, PreflightError), (r, repr(e))
    first = errors[0]
    assert isinstance(first, PreflightError) and first.phase == "hello"
    for e in errors:
        assert type(e) is type(first) and str(e) == str(first), (str(e), str(first))
    # The culprits, and what they were started with, are named.
    tied = 2 * len(wrong) == t + n
    assert set(first.failures) == (set(range(t + n)) if tied else set(wrong)), first
    for r, changed in wrong.items():
        for name, value in changed.items():
            assert f"{name}={value}" in first.failures[r], first.failures[r]
    assert max(done.values()) - min(done.values()) <= SPREAD, done


@pytest.mark.asyncio
async def test_the_text_names_the_culprit_and_the_majority() -> None:
    out, _ = await world(2, 2, {3: {"world_size": 5}})
    e = out[3]
    assert isinstance(e, PreflightError)
    assert e.failures == {3: "topology world_size=5, trainer_ranks=2 differs: 3 rank(s) "
                             "[0, 1, 2] have (4, 2)"}



@pytest.mark.asyncio
@pytest.mark.parametrize("right", [3, 0], ids=["last-rank-right", "rank0-right"])
async def test_a_majority_started_with_too_big_a_world_times_out_with_one_text(
        right: int) -> None:
    # Three of four ranks say world_size=5: they wait for a rank 4 that may yet come, so
    # this is a timeout, not an early error. The one rank started right waits for it too,
    # and every rank says why: the rank missing, and who was started with which world.
    wrong = {r: {"world_size": 5} for r in range(4) if r != right}
    out, _ = await world(2, 2, wrong, phase_timeout=1.0)
    texts = set()
    for r in range(4):
        e = out[r]
        assert isinstance(e, PhaseTimeoutError) and e.phase == "hello", (r, repr(e))
        assert e.ranks == (4,), (r, e.ranks)
        texts.add(str(e))
    assert len(texts) == 1, texts
    text = texts.pop()
    others = [r for r in range(4) if r != right]
    assert "rank(s) [4] did not arrive" in text, text
    assert f"rank(s) {others} were started with world_size=5, trainer_ranks=2" in text, text
    assert f"rank(s) [{right}] were started with world_size=4, trainer_ranks=2" in text, text


async def stray_world(t: int, n: int, late: int, after: int
                      ) -> dict[int, BaseException | PreflightOutcome]:
    """``t + n`` ranks of one job and a stray one more, rank ``t + n`` of a world of
    ``t + n + 1`` (a launcher that started one process too many); rank ``late`` starts
    ``after`` turns of the event loop behind the others."""
    root = MemoryStore()
    out: dict[int, BaseException | PreflightOutcome] = {}
    stray = t + n

    async def rank_main(r: int) -> None:
        if r == late:
            for _ in range(after):
                await anyio.lowlevel.checkpoint()
        inputs = make_inputs(r, t, n, Log())
        if r == stray:
            inputs = dataclasses.replace(make_inputs(r - 1, t, n, Log()), rank=r,
                                         world_size=t + n + 1)
        await _preflight_rank(root, inputs, out)

    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            for r in range(t + n + 1):
                tg.start_soon(rank_main, r)
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("after", range(0, 40, 4))
@pytest.mark.parametrize("late", [4, 3], ids=["stray-late", "member-late"])
async def test_a_stray_rank_gets_one_outcome_on_every_member(late: int, after: int) -> None:
    # However the stray's hello lands among the members', the members decide on one view:
    # all pass (the first of them decided before it landed) or all raise one text naming
    # it. The stray is refused either way, at once, never waiting for keys of a world of 5
    # (the members' keys of hello are gone once they are two phases on).
    out = await stray_world(2, 2, late, after)
    stray = out[4]
    assert isinstance(stray, PreflightError) and stray.phase == "hello", repr(stray)
    assert set(stray.failures) == {4}, stray.failures
    members = [out[r] for r in range(4)]
    if all(isinstance(m, PreflightOutcome) for m in members):
        assert "is not in the group: ranks [0, 1, 2, 3] agreed" in stray.failures[4]
        return
    assert all(isinstance(m, PreflightError) for m in members), [repr(m) for m in members]
    assert len({str(m) for m in members} | {str(stray)}) == 1, [str(m) for m in members]
    assert stray.failures == {4: "topology world_size=5, trainer_ranks=2 differs: 4 rank(s) "
                                 "[0, 1, 2, 3] have (4, 2)"}


@pytest.mark.asyncio
async def test_every_hello_a_failure_and_another_world_is_one_error() -> None:
    # No envelope of the view is a topology (both ranks refused their own arguments), and
    # rank 1 was given a world of 3: it decides on the view rank 0 recorded, whatever its
    # own rule says, and raises rank 0's text at once instead of waiting for a third rank.
    root = MemoryStore()
    out: dict[int, BaseException | PreflightOutcome] = {}

    async def rank_main(r: int, world: int) -> None:
        inputs = dataclasses.replace(make_inputs(r, 1, 1, Log()), world_size=world,
                                     argument_error=ValueError(f"bad argument on rank {r}"))
        if r == 1:
            await anyio.sleep(0.05)  # rank 0 records first
        await _preflight_rank(root, inputs, out)

    with anyio.fail_after(BOUND):
        async with anyio.create_task_group() as tg:
            tg.start_soon(rank_main, 0, 2)
            tg.start_soon(rank_main, 1, 3)
    assert all(isinstance(e, PreflightError) for e in out.values()), out
    assert len({str(e) for e in out.values()}) == 1, out
    first = out[0]
    assert isinstance(first, PreflightError) and set(first.failures) == {0, 1}, first
