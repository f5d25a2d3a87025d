"""The preflight with ranks as separate (spawned) processes against a TCP store.

A small subset of the phase-failure matrix where process boundaries matter: the happy path,
a real local error (invalid specs) seen identically by every process, a rank that hangs, and
a rank killed with SIGKILL mid-phase — the survivors must name it at once, not after the
deadline. The ranks are the processes of the session's 1 + 2 ``LocalWorld``
(``m2n_world``): each connects its own ``StoreClient`` to the world's store and runs
``run_preflight`` on a ``ControlGroup`` under the run's job name. A rank reaching its fault
says so with ``ctx.event("reached")``, on which the test SIGKILLs it where the case asks.
Each rank returns a JSON-able dict of how it ended (no pickle of exceptions); the killed
rank comes back as a ``"dead"`` ``RankResult``.

One case runs the engines themselves (``_engine_rank``): a worker given a malformed target
must fail the first phase on every process at once, not leave its peers waiting out the
phase for it.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio
import pytest

from m2n_async import PeerLostError, PreflightError
from m2n_async._engine._preflight import run_preflight
from m2n_async._proto.handshake import PreflightPlan
from m2n_async._store import ControlGroup, StoreClient
from m2n_async.testing import LocalWorld, RankContext, WorldResult, assert_same_failure

from .test_preflight import GEN, Log, make_inputs, specs

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL is POSIX")

T, N = 1, 2
RUN_TIMEOUT = 60.0  # the whole run, the kill included


async def _rank(ctx: RankContext, *, fault: str, phase_timeout: float) -> dict[str, Any]:
    """One rank: its preflight on a ``ControlGroup`` of the world; how it ended, as a dict."""
    rank, t, n = ctx.rank, ctx.trainer_ranks, ctx.world_size - ctx.trainer_ranks
    result: dict[str, Any] = {"rank": rank}

    def mark() -> None:
        result["fault_at"] = time.time()
        ctx.event("reached", result["fault_at"])

    inputs = make_inputs(rank, t, n, Log())
    if fault == "bad_specs" and rank == 0:
        twice = [*specs(t), specs(t)[0]]
        inputs = replace(inputs, params=twice)
    elif fault == "hang" and rank == t + n - 1:
        async def hang(plan: PreflightPlan) -> None:
            mark()
            await anyio.sleep_forever()
        inputs = replace(inputs, prepare_runtime=hang)
    elif fault == "sigkill" and rank == t + n - 1:
        def stuck() -> list[str]:
            mark()
            time.sleep(60)  # the test kills this process here, mid-phase 'destination'
            return ["gloo"]
        inputs = replace(inputs, capabilities=stuck)
    client = await StoreClient.connect(ctx.address, token=ctx.token)
    try:
        group = ControlGroup(client, rank, t + n, f"{ctx.job}/{GEN}/preflight")
        out_come = await run_preflight(group, inputs, phase_timeout=phase_timeout)
        result.update(ok=True, digest=out_come.digest, transport=out_come.transport)
    except (PreflightError, PeerLostError, TimeoutError) as e:
        result.update(ok=False, type=type(e).__name__, message=str(e),
                      phase=getattr(e, "phase", None),
                      failures={str(k): v for k, v in getattr(e, "failures", {}).items()},
                      ranks=list(getattr(e, "ranks", ())))
    finally:
        result["done"] = time.time()
        with anyio.move_on_after(2):
            await client.aclose()
    return result


def _run(world: LocalWorld, fault: str, phase_timeout: float, kill_rank: int | None = None
         ) -> tuple[dict[int, dict[str, Any]], WorldResult, float]:
    """Every rank's dict (those that returned), the world's results, and when the test
    killed ``kill_rank`` (on its ``"reached"`` event; 0.0 without one)."""
    deadline = time.monotonic() + RUN_TIMEOUT
    run = world.start(_rank, kwargs={"fault": fault, "phase_timeout": phase_timeout})
    killed_at = 0.0
    for ev in world.events(run, timeout=RUN_TIMEOUT):
        if ev.name == "reached" and kill_rank is not None:
            assert ev.rank == kill_rank, ev
            killed_at = time.time()
            world.kill(kill_rank)
    res = world.collect(run, timeout=max(1.0, deadline - time.monotonic()))
    if kill_rank is not None:
        assert killed_at, f"rank {kill_rank} never reached its fault: {res}"
    for r in res:
        if r.rank != kill_rank:
            assert r.ok, (r.rank, r.status, r.error, r.traceback)
    return {r.rank: r.value for r in res if r.ok}, res, killed_at


World = Callable[[int, int], LocalWorld]


@pytest.mark.slow
def test_processes_agree(m2n_world: World) -> None:
    results, _, _ = _run(m2n_world(T, N), "none", 10.0)
    assert sorted(results) == [0, 1, 2]
    assert all(r["ok"] for r in results.values()), results
    assert len({r["digest"] for r in results.values()}) == 1


@pytest.mark.slow
def test_processes_report_one_local_error_identically(m2n_world: World) -> None:
    results, _, _ = _run(m2n_world(T, N), "bad_specs", 10.0)
    assert sorted(results) == [0, 1, 2]
    first = results[0]
    assert first["type"] == "PreflightError" and first["phase"] == "source"
    assert list(first["failures"]) == ["0"] and "appears twice" in first["failures"]["0"]
    for r in results.values():
        assert (r["type"], r["phase"], r["failures"]) == ("PreflightError", "source",
                                                          first["failures"])


@pytest.mark.slow
def test_processes_name_a_hanging_rank(m2n_world: World) -> None:
    timeout = 1.0
    started = time.time()
    results, _, _ = _run(m2n_world(T, N), "hang", timeout)
    # The hanging rank reports its own overrun before the phase deadline: one diagnosis on
    # every rank, itself included, and no peer sees it leave first.
    for r in (0, 1, 2):
        res = results[r]
        assert (res["type"], res["phase"], list(res["failures"])) == (
            "PreflightError", "runtime_ready", ["2"]), (r, results)
        assert res["message"] == results[0]["message"]
        assert "TimeoutError: did not finish within" in res["failures"]["2"]
    fault_at = results[2]["fault_at"]
    for r in (0, 1):
        # bounded by the phase deadline, not the hung rank (slack for a loaded box)
        assert results[r]["done"] - fault_at <= timeout + 3.0, (r, results)
    assert results[0]["done"] - started < 30


@pytest.mark.slow
def test_sigkilled_rank_is_named_at_once(m2n_world: World) -> None:
    timeout = 30.0  # far beyond the bound below: the survivors must not wait for it
    results, res, killed_at = _run(m2n_world(T, N), "sigkill", timeout, kill_rank=2)
    assert 2 not in results  # it never got to return anything
    assert (res[2].status, res[2].signal) == ("dead", signal.SIGKILL), res[2]
    for r in (0, 1):
        out = results[r]
        assert out["type"] == "PeerLostError", out
        assert out["ranks"] == [2]
        assert "preflight phase 'destination'" in out["message"]
        # PeerLostError already says the session end was seen, not the deadline; the bound
        # only rules out waiting for the 30 s deadline, with room for a loaded 2-core box
        # (3 s failed there twice while other jobs ran).
        assert out["done"] - killed_at < 10.0, out["done"] - killed_at


BARE_TARGET_RANK = 2
BARE_TARGET_BOUND = 2.0  # after the worker's error; room for a loaded 2-core box


async def _engine_rank(ctx: RankContext) -> None:
    """One rank connects its engine; rank ``BARE_TARGET_RANK`` passes a bare tensor as its
    target. Says when it failed (``"failed"``, wall time), then raises."""
    import torch

    from m2n_async import Layout, Mesh, ParamSpec, TrainerEngine, WorkerEngine

    # Far beyond the test's bound: a peer waiting out the phase fails the test.
    cfg = ctx.config(phase_timeout=60.0)
    try:
        if ctx.is_trainer:
            spec = ParamSpec("w", torch.float32, (16,), Layout(Mesh((1, 1)), None))
            e: Any = await TrainerEngine.connect(**ctx.connect_kwargs, params=[spec],
                                                 config=cfg)
        else:
            w = torch.zeros(16)
            target = w if ctx.rank == BARE_TARGET_RANK else (w, None)
            e = await WorkerEngine.connect(**ctx.connect_kwargs, targets={"w": target},
                                           config=cfg)
    except Exception:
        ctx.event("failed", time.time())
        raise
    await e.close()


@pytest.mark.slow
def test_a_worker_with_a_bare_tensor_target_fails_every_process_at_once(
        m2n_world: World) -> None:
    world = m2n_world(T, N)
    # fail_grace: a rank still waiting this long after the first one raised is killed, and
    # the test fails on it (as it did while the peers waited out the phase for the worker).
    run = world.start(_engine_rank)
    failed = {ev.rank: ev.payload for ev in world.events(run, timeout=30.0, fail_grace=5.0)
              if ev.name == "failed"}
    res = world.collect(run, timeout=30.0, fail_grace=5.0)
    err = assert_same_failure(res, PreflightError, culprit=BARE_TARGET_RANK, phase="hello")
    assert isinstance(err, PreflightError)
    assert err.failures[BARE_TARGET_RANK] == (
        "local step failed: LocalProtocolError: target for parameter 'w' must be (tensor, "
        "placements) or a LoadTarget, got Tensor; e.g. (t, None) for a replicated tensor, "
        "(t, (REPLICATE, d)) for a shard of dim d along the TP axis")
    for r in res:
        assert f"rank {BARE_TARGET_RANK}: " in str(r.error) and "'w'" in str(r.error), r
    assert sorted(failed) == [0, 1, 2], failed
    for r, at in failed.items():
        assert at - failed[BARE_TARGET_RANK] < BARE_TARGET_BOUND, (r, failed)
