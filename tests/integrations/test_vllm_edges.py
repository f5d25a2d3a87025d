"""The ``m2n_async`` vLLM backend at its edges, as an RL framework drives it from docs/vllm.md.

- ``connect_timeout`` bounds a whole connect: the store probe, the wait for rank 0's
  listener, the engine's connect and its retries share one deadline, never twice the bound.
- Timeouts a thread cannot wait (above ``threading.TIMEOUT_MAX``) are refused naming the key;
  values of the wrong type are named with the value (a token's never shown); engine settings
  out of range are refused where ``TrainerInitInfo`` is built; an ``init_info`` that is no
  JSON object is refused by ``init_transfer_engine`` as by ``parse_init_info``.
- Every client RPC of the trainer (init, start, update, finish, shutdown) is bounded by
  ``update_timeout``; a failed start RPC or a source that raises at once fails the round on
  every trainer rank now, naming it, not at the round deadline.
- Rank 0 shares its store address without pickle; a trainer killed mid-round ends the
  worker's ``update_weights`` at once.

Same stub, model and GPU worker as ``test_vllm_backend.py`` (``_vllm_world``); every wait
that could hang runs on a daemon thread with a generous limit.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
import torch

from m2n_async import EngineState, StoreError, TransferError
from m2n_async.integrations import vllm as backend

from ._vllm_world import (
    FanOutClient,
    GPUWorker,
    ShardedSource,
    TinyLlama,
    expected_locals,
    free_port,
    lagging_listener,
    stubbed_backend,
    vllm_config,
)

T, TP = 2, 2
TOKEN = "vllm-edge-tests"
GOOD = {"store_address": "127.0.0.1:1", "trainer_ranks": T, "world_size": T + TP,
        "params": [{"name": "w", "dtype": "bfloat16", "shape": [4, 4]}]}


@pytest.fixture(scope="module", autouse=True)
def _stub_and_token() -> Iterator[None]:
    with stubbed_backend(TOKEN):
        yield


def _backend(tp_rank: int = 0) -> backend.VLLMWorkerBackend:
    return backend.VLLMWorkerBackend(object(), vllm_config(tp_rank, TP), torch.device("cpu"),
                                     TinyLlama(tp_rank, TP))


def _bounded(call: Callable[[], Any], limit: float = 30) -> BaseException | None:
    """Run ``call`` on a daemon thread for at most ``limit`` s and return its error; a call
    still running then fails the test instead of hanging the suite."""
    out: dict[str, BaseException] = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"still waiting after {limit} s: the wait is unbounded"
    return out.get("error")


class _Connected(Exception):
    """What the spied connect raises once it recorded its timeout."""


# -- connect_timeout: one deadline for the whole connect -------------------------------------


def test_the_worker_connect_gets_what_the_store_probe_left_of_connect_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe waits for the store's first byte; the engine's connect after it must get
    # only the rest of connect_timeout, not a fresh one (init would take up to twice it).
    limit, delay = 5.0, 1.0
    seen: list[float | None] = []

    class Worker:
        @staticmethod
        def connect(*args: Any, timeout: float | None = None, **kw: Any) -> Any:
            seen.append(timeout)
            raise _Connected

    monkeypatch.setattr(backend, "BlockingWorker", Worker)
    be = _backend()
    with lagging_listener(delay) as address:
        info = be.parse_init_info({**GOOD, "store_address": address,
                                   "connect_timeout": limit})
        err = _bounded(lambda: be.init_transfer_engine(info))
    assert isinstance(err, _Connected), err
    assert len(seen) == 1 and seen[0] is not None, seen
    assert 0 < seen[0] <= limit - delay, seen  # the probe took >= delay of the bound


def test_a_worker_probe_that_spent_connect_timeout_fails_naming_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing left after the probe: no connect with a bound <= 0 (or a fresh one), the
    # TimeoutError names connect_timeout.
    limit = 0.3
    seen: list[float | None] = []

    class Worker:
        @staticmethod
        def connect(*args: Any, timeout: float | None = None, **kw: Any) -> Any:
            seen.append(timeout)
            raise _Connected

    def slow_probe(*args: Any) -> None:
        time.sleep(limit + 0.2)  # answered, but only once the bound was spent

    monkeypatch.setattr(backend, "BlockingWorker", Worker)
    monkeypatch.setattr(backend, "_await_store_answer", slow_probe)
    be = _backend()
    info = be.parse_init_info({**GOOD, "connect_timeout": limit})
    err = _bounded(lambda: be.init_transfer_engine(info))
    assert isinstance(err, TimeoutError) and "connect_timeout" in str(err), err
    assert seen == []
    assert be.engine is None


def test_the_trainer_connect_gets_what_the_store_probe_left_of_connect_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    limit, delay = 5.0, 1.0
    seen: list[float | None] = []

    class Trainer:
        @staticmethod
        def start_connect(*args: Any, timeout: float | None = None, **kw: Any) -> Any:
            seen.append(timeout)
            raise _Connected

    monkeypatch.setattr(backend, "BlockingTrainer", Trainer)
    with lagging_listener(delay) as address:
        info = backend.TrainerInitInfo(rank=0, trainer_ranks=1, world_size=1 + TP,
                                       store_address=address, connect_timeout=limit)
        err = _bounded(lambda: backend.VLLMTrainerEngine.trainer_init(
            info, client=FanOutClient([]), source=ShardedSource(0, 1)))
    assert isinstance(err, _Connected), err
    assert len(seen) == 1 and seen[0] is not None and 0 < seen[0] <= limit - delay, seen


class _LostStore:
    """A connect that fails ``after`` s with the ``StoreError`` of a store lost mid-connect
    (what rank 1 sees when rank 0 closes its old store under it)."""

    def __init__(self, after: float) -> None:
        self.future: Future[Any] = Future()
        self.after = after

    def result(self, timeout: float | None = None) -> Any:
        time.sleep(self.after)
        self.future.set_exception(StoreError("the store closed the connection"))
        return self.future.result()

    def done(self) -> bool:
        return self.future.done()

    def cancel(self) -> None:
        pass


def test_a_trainer_connecting_again_stays_inside_one_connect_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 (fixed store port) loses rank 0's store mid-connect and connects again: each
    # attempt gets what is left of connect_timeout, and the retries end inside it.
    limit, each = 2.0, 0.4
    seen: list[tuple[float, float | None]] = []

    class Trainer:
        @staticmethod
        def start_connect(*args: Any, timeout: float | None = None, **kw: Any) -> Any:
            seen.append((time.monotonic(), timeout))
            return _LostStore(each)

    monkeypatch.setattr(backend, "BlockingTrainer", Trainer)
    with socket.socket() as listener:  # rank 0's store port, accepting
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        info = backend.TrainerInitInfo(rank=1, trainer_ranks=T, world_size=T + TP,
                                       store_port=listener.getsockname()[1],
                                       connect_timeout=limit, phase_timeout=30)
        err = _bounded(lambda: backend.VLLMTrainerEngine.trainer_init(
            info, client=FanOutClient([]), source=ShardedSource(1, T)))
    assert isinstance(err, StoreError | TimeoutError), err
    timeouts = [t for _, t in seen if t is not None]
    assert len(timeouts) == len(seen) >= 2 and all(t > 0 for t in timeouts), seen
    assert timeouts[0] <= limit, seen
    for before, after in itertools.pairwise(timeouts):
        assert after <= before - each, seen  # each attempt took at least that long


# -- timeouts a thread cannot wait -----------------------------------------------------------

BEYOND = threading.TIMEOUT_MAX * 2  # finite, but longer than a thread's wait can be


@pytest.mark.parametrize("key", ["update_timeout", "connect_timeout", "phase_timeout",
                                 "round_timeout"])
def test_a_trainer_timeout_longer_than_a_thread_can_wait_is_refused_naming_it(key: str) -> None:
    # Accepted, update_timeout=1e10 made a round that succeeded raise OverflowError from
    # the wait on its RPC, the version unpublished.
    with pytest.raises(ValueError, match=f"TrainerInitInfo.*{key}"):
        backend.TrainerInitInfo(rank=0, world_size=3, **{key: BEYOND})
    assert backend.TrainerInitInfo(rank=0, world_size=3, **{key: 86400 * 365}) is not None


@pytest.mark.parametrize("key", ["receive_timeout", "connect_timeout", "phase_timeout",
                                 "round_timeout"])
def test_an_init_info_timeout_longer_than_a_thread_can_wait_is_refused_naming_it(
        key: str) -> None:
    with pytest.raises(ValueError, match=f"init_info.*{key}"):
        _backend().parse_init_info({**GOOD, key: BEYOND})


def test_an_update_info_timeout_longer_than_a_thread_can_wait_is_refused() -> None:
    with pytest.raises(ValueError, match=r"update_info.*timeout"):
        _backend().parse_update_info({"timeout": BEYOND})
    assert _backend().parse_update_info({"timeout": 86400.0}).timeout == 86400.0


# -- values of the wrong type: the error names the key and the value -------------------------


@pytest.mark.parametrize(("key", "value", "shown"), [
    ("trainer_ranks", "2", "'2'"), ("phase_timeout", None, "None"),
    ("world_size", True, "True"), ("round_timeout", "300", "'300'"),
])
def test_an_init_info_value_of_the_wrong_type_is_named_with_its_value(
        key: str, value: object, shown: str) -> None:
    with pytest.raises(ValueError, match=f"init_info.*{key}") as err:
        _backend().parse_init_info({**GOOD, key: value})
    assert f"{key}={shown}" in str(err.value), err.value


def test_a_trainer_init_info_value_of_the_wrong_type_is_named_with_its_value() -> None:
    with pytest.raises(ValueError, match="TrainerInitInfo") as err:
        backend.TrainerInitInfo(rank=0, world_size=3, store_port="29500")  # type: ignore[arg-type]
    assert "store_port='29500'" in str(err.value), err.value


def test_a_token_of_the_wrong_type_is_named_but_never_shown() -> None:
    with pytest.raises(ValueError, match="token") as err:
        backend.TrainerInitInfo(rank=0, world_size=3, token=b"s3cret")  # type: ignore[arg-type]
    assert "s3cret" not in str(err.value), err.value


# -- a job: 2 trainer ranks, 2 TP workers ----------------------------------------------------


class _Job:
    def __init__(self, job: str, client: type[FanOutClient] = FanOutClient) -> None:
        self.models = [TinyLlama(r, TP) for r in range(TP)]
        self.backends = [backend.VLLMWorkerBackend(object(), vllm_config(r, TP),
                                                   torch.device("cpu"), self.models[r])
                         for r in range(TP)]
        self.workers = [GPUWorker(b, r, vllm_config(r, TP)) for r, b in enumerate(self.backends)]
        self.client = client(self.workers)
        self.sources = [ShardedSource(r, T) for r in range(T)]
        self.port, self.job = free_port(), job
        self.trainers: list[backend.VLLMTrainerEngine] = []

    def init(self, **kw: Any) -> None:
        def one(r: int) -> backend.VLLMTrainerEngine:
            info = backend.TrainerInitInfo(rank=r, trainer_ranks=T, world_size=T + TP,
                                           store_port=self.port, job=self.job,
                                           dtype="bfloat16", transport="gloo",
                                           **{"phase_timeout": 10, "round_timeout": 10, **kw})
            return backend.VLLMTrainerEngine.trainer_init(info, client=self.client,
                                                          source=self.sources[r])

        with ThreadPoolExecutor(T) as ex:
            self.trainers = list(ex.map(one, range(T), timeout=60))

    def send(self, version: int = 1) -> list[BaseException | None]:
        for s in self.sources:
            s.version = version
        with ThreadPoolExecutor(T) as ex:
            futs = [ex.submit(t.send_weights) for t in self.trainers]
            return [f.exception(60) for f in futs]

    def check(self, version: int) -> None:
        for r, m in enumerate(self.models):
            got = dict(m.named_parameters())
            for name, want in expected_locals(version, r, TP).items():
                assert torch.equal(got[name], want), (r, name, version)

    def close(self) -> None:
        for t in self.trainers:
            t.shutdown()
        for w in self.workers:
            w.shutdown()


# -- the sender's start_weight_update RPC fails ----------------------------------------------


class _StartFailsOnce(FanOutClient):
    """A client whose first ``start_weight_update`` fails before reaching any worker (an
    HTTP 502 from a router, a Ray actor restarting)."""

    failed = False

    def start_weight_update(self) -> None:
        if not self.failed:
            self.failed = True
            raise ConnectionError("502 Bad Gateway (injected)")
        super().start_weight_update()


def test_a_failed_start_rpc_fails_the_round_on_every_trainer_rank_at_once() -> None:
    # Rank 0's start_weight_update fails while rank 1 is already in the round. Rank 1 must
    # not wait out the round deadline for rank 0 and then blame a frozen rank 0: the round
    # fails on every rank now, naming the RPC's error; every rank is POISONED (rank 0 was
    # left READY, and its next round waited for the poisoned rank 1); shutdown + init
    # recovers.
    job = _Job("vllm-start-fails", _StartFailsOnce)
    try:
        job.init(round_timeout=3)
        before = [{n: p.clone() for n, p in m.named_parameters()} for m in job.models]
        errors = job.send(1)
        assert isinstance(errors[0], ConnectionError), errors
        assert any("failed on every rank" in n for n in errors[0].__notes__), errors[0]
        assert isinstance(errors[1], TransferError), errors
        assert "start_weight_update" in str(errors[1]) and "502" in str(errors[1]), errors[1]
        notes = " ".join(errors[1].__notes__)  # no worker was updating: none received
        assert "models are untouched" in notes and "partly updated" not in notes, notes
        for m, held in zip(job.models, before, strict=True):
            assert all(torch.equal(p, held[n]) for n, p in m.named_parameters())
        assert [t.engine.state for t in job.trainers if t.engine is not None] == [
            EngineState.POISONED] * T
        for t in job.trainers:
            t.shutdown()
        job.init()
        assert job.send(2) == [None, None]
        job.check(2)
    finally:
        job.close()


class _Unreadable(ShardedSource):
    """A ``WeightSource`` whose ``iter_local`` is a plain method that raises (a checkpoint
    shard that cannot be read, an FSDP unshard that failed) before returning an iterator."""

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise OSError("shard file unreadable (injected)")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_source_that_raises_at_once_fails_the_round_on_every_rank_naming_it(rank: int) -> None:
    # One trainer rank's iter_local raises before the round: the others must not wait out
    # the round deadline for it; every rank's TransferError names the source's error, the
    # workers' update RPC ends, and shutdown + init recovers.
    job = _Job(f"vllm-source-raises-{rank}")
    try:
        job.init(round_timeout=3)
        good = job.sources[rank]
        job.sources[rank] = _Unreadable(rank, T)
        job.trainers[rank].source = job.sources[rank]
        errors = job.send(1)
        for err in errors:
            assert isinstance(err, TransferError) and "unreadable" in str(err), errors
        for t in job.trainers:
            t.shutdown()
        job.sources[rank] = good
        job.init()
        assert job.send(2) == [None, None]
        job.check(2)
    finally:
        job.close()


# -- the init RPC is bounded by update_timeout -----------------------------------------------


class _Connected1:
    """A connect that succeeded on this trainer rank at once (its engine closable)."""

    def __init__(self) -> None:
        self.closed = False
        self.future: Future[Any] = Future()
        self.future.set_result(self)

    def result(self, timeout: float | None = None) -> Any:
        return self

    def done(self) -> bool:
        return True

    def cancel(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_an_init_rpc_that_never_returns_is_bounded_by_update_timeout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The handshake completed on the trainer, the workers' init RPC never returns (a lost
    # reply): trainer_init fails after update_timeout, saying so, not after a fixed 300 s.
    release = threading.Event()
    connected = _Connected1()

    class Trainer:
        @staticmethod
        def start_connect(*args: Any, **kw: Any) -> Any:
            return connected

    class LostReply(FanOutClient):
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            release.wait(60)

    monkeypatch.setattr(backend, "BlockingTrainer", Trainer)
    info = backend.TrainerInitInfo(rank=0, trainer_ranks=1, world_size=1 + TP,
                                   update_timeout=0.5)
    try:
        err = _bounded(lambda: backend.VLLMTrainerEngine.trainer_init(
            info, client=LostReply([]), source=ShardedSource(0, 1)))
    finally:
        release.set()
    assert isinstance(err, TimeoutError), err
    assert "init_weight_transfer_engine" in str(err) and "update_timeout" in str(err), err
    assert connected.closed  # its claim released: the next trainer_init is not blocked


# -- start and finish RPCs are bounded by update_timeout --------------------------------------


@pytest.mark.parametrize("hung", ["start_weight_update", "finish_weight_update"])
def test_a_start_or_finish_rpc_that_never_returns_is_bounded_by_update_timeout(
        hung: str) -> None:
    # A worker that never answers rank 0's start or finish (a lost reply, a finalize that
    # wedged): send_weights fails after update_timeout naming the call; with start, the
    # round is failed on every rank at once; with finish, the other rank's round committed.
    release = threading.Event()

    class Hangs(FanOutClient):
        def start_weight_update(self) -> None:
            if hung == "start_weight_update" and not release.is_set():
                release.wait(20)  # before the fix: the test ends, failed, instead of hanging
            super().start_weight_update()

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            if hung == "finish_weight_update" and not release.is_set():
                release.wait(20)
            super().finish_weight_update(weight_version)

    job = _Job(f"vllm-hung-{hung}", Hangs)
    try:
        job.init(update_timeout=1)
        errors = job.send(1)
        release.set()
        assert isinstance(errors[0], TimeoutError), errors
        assert hung in str(errors[0]) and "update_timeout" in str(errors[0]), errors[0]
        if hung == "start_weight_update":
            assert isinstance(errors[1], TransferError) and hung in str(errors[1]), errors
        else:
            assert errors[1] is None, errors
    finally:
        release.set()
        job.close()


@pytest.mark.parametrize("hung", ["start_weight_update", "update_weights",
                                  "finish_weight_update"])
def test_a_failed_send_is_bounded_by_one_update_timeout_plus_the_grace(
        hung: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A call that never answers is given up on after update_timeout; the cleanup finish,
    # queued behind it, is waited for only what the failure's grace leaves (before: another
    # whole update_timeout), then runs once the hung call returns, before shutdown's release.
    limit, grace = 3.0, 0.2
    monkeypatch.setattr(backend, "_FAILURE_GRACE_S", grace, raising=False)
    release = threading.Event()

    class Hangs(FanOutClient):
        def start_weight_update(self) -> None:
            if hung == "start_weight_update" and not release.is_set():
                release.wait(30)
            super().start_weight_update()

        def update_weights(self, update_info: Any) -> None:
            super().update_weights(update_info)
            if hung == "update_weights" and not release.is_set():
                release.wait(30)  # the workers received: a lost reply

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            if hung == "finish_weight_update" and not release.is_set():
                release.wait(30)
            super().finish_weight_update(weight_version)

    job = _Job(f"vllm-bound-{hung[:6]}", Hangs)
    try:
        job.init(update_timeout=limit)
        began = time.monotonic()
        errors = job.send(1)
        took = time.monotonic() - began
        release.set()
        assert isinstance(errors[0], TimeoutError) and hung in str(errors[0]), errors
        notes = " ".join(getattr(errors[0], "__notes__", ()))
        assert "cleanup finish_weight_update()" in notes and "had not returned" in notes, notes
        assert took < 2 * limit - 1, f"{took:.1f} s: the cleanup waited a second bound"
        deadline = time.monotonic() + 30
        while job.client.calls[-1] != "finish_weight_update" or any(
                w._weight_update_active for w in job.workers):  # the queued cleanup ran
            assert time.monotonic() < deadline, job.client.calls
            time.sleep(0.01)
    finally:
        release.set()
        job.close()


def test_a_shutdown_rpc_that_never_returns_is_bounded_by_update_timeout() -> None:
    release = threading.Event()

    class Hangs(FanOutClient):
        def shutdown_weight_transfer_engine(self) -> None:
            if not release.is_set():
                release.wait(20)  # before the fix: the test ends, failed, instead of hanging
            super().shutdown_weight_transfer_engine()

    job = _Job("vllm-hung-shutdown", Hangs)
    try:
        job.init(update_timeout=1)
        assert job.send(1) == [None, None]
        err = _bounded(job.trainers[0].shutdown, 10)  # logged, not raised: shutdown ends
        assert err is None, err
        assert job.trainers[0].engine is None
    finally:
        release.set()
        job.close()


# -- TrainerInitInfo refuses what the engine would, where it is built --------------------------


@pytest.mark.parametrize(("key", "value"), [
    ("transport", "ncl"), ("job", ""), ("job", "a/b"), ("bucket_bytes", 0),
    ("bucket_bytes", -1),
])
def test_a_trainer_init_info_engine_setting_out_of_range_is_refused_where_built(
        key: str, value: object) -> None:
    # As the workers' parse_init_info refuses the same values: not later in trainer_init,
    # after rank 0 served a store and the other ranks waited for it.
    with pytest.raises(ValueError, match=f"TrainerInitInfo.*{key}") as err:
        backend.TrainerInitInfo(rank=0, world_size=3, **{key: value})
    assert repr(value) in str(err.value), err.value


# -- init_info that is not a JSON object ------------------------------------------------------


@pytest.mark.parametrize("value", [[1, 2], "{}", None, 3])
def test_an_init_info_that_is_no_object_is_refused_naming_it_by_parse_and_by_init(
        value: object) -> None:
    # Called with the raw value (a framework driving the backend itself): the same
    # ValueError as parse_init_info's, not dict()'s TypeError about update sequences.
    be = _backend()
    for call in (be.parse_init_info, be.init_transfer_engine):
        with pytest.raises(ValueError, match="init_info must be a JSON object"):
            call(value)  # type: ignore[arg-type]
    assert be.engine is None


# -- rank 0 shares its store address without pickle ------------------------------------------

_SHARE = """
import sys
import torch.distributed as dist

def refuse(*args, **kwargs):
    raise AssertionError("broadcast_object_list pickles: not on the wire")

dist.broadcast_object_list = refuse
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
from m2n_async.integrations import vllm as backend

info = backend.TrainerInitInfo(rank=rank, trainer_ranks=2, world_size=3)
store, address = backend._share_store(info, "tok")
print("ADDRESS", address, flush=True)
dist.barrier()
if store is not None:
    store.close()
dist.destroy_process_group()
"""


def _two_trainer_ranks(script: str) -> list[str]:
    """``script`` run as ranks 0 and 1 of a gloo ``torch.distributed`` world (argv: rank,
    port), each in a process of its own; their stdouts, once both exited 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), port], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err[-2000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def test_trainer_rank_0_shares_its_store_address_without_pickle() -> None:
    # trainer_ranks > 1, store_port 0: rank 0 picks the port and tells the others through
    # the default torch.distributed group, as bytes in a tensor (broadcast_object_list
    # would make every other rank unpickle what arrives).
    outs = [[line.split()[1] for line in out.splitlines() if line.startswith("ADDRESS")]
            for out in _two_trainer_ranks(_SHARE)]
    assert outs[0] == outs[1] and len(outs[0]) == 1 and outs[0][0].startswith("127.0.0.1:")


_SHARE_REFUSED = """
import os, sys
import torch.distributed as dist
from tests.integrations._vllm_world import ShardedSource, stub_vllm

rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                        world_size=2)
with stub_vllm():
    from m2n_async.integrations import vllm as backend

    info = backend.TrainerInitInfo(rank=rank, trainer_ranks=2, world_size=4, transport="gloo",
                                   token="tok", connect_timeout=5, phase_timeout=5)
    client = object()  # not a VLLMWeightSyncClient: rank 0 refuses it before the store
    try:
        backend.VLLMTrainerEngine.trainer_init(info, client=client,
                                               source=ShardedSource(rank, 2))
    except ValueError as exc:
        print("REFUSED", rank, str(exc).replace("\\n", " "), flush=True)
dist.barrier()  # rank 0 stays up until rank 1 is done: it did not fail by exiting
"""


def test_a_trainer_rank_0_refused_before_its_store_lets_the_other_ranks_go() -> None:
    # trainer_ranks > 1, store_port 0: the other trainer ranks wait in the broadcast of
    # rank 0's address. Rank 0 refusing before it serves the store must still take part
    # (sharing none), or they waited there until torch.distributed's own timeout (30 min).
    outs = _two_trainer_ranks(_SHARE_REFUSED)
    assert "REFUSED 0 m2n_async trainer_init: trainer rank 0's client must be" in outs[0]
    assert "REFUSED 1 m2n_async: trainer rank 0 shared no store address" in outs[1], outs[1]
    assert "its trainer_init failed before it served the store" in outs[1]


# -- the trainer process dies mid-update -----------------------------------------------------

_TRAINER = """
import sys, time
from tests.integrations._vllm_world import ShardedSource, stub_vllm
with stub_vllm():
    from m2n_async import BlockingTrainer, EngineConfig, StoreServer
    from m2n_async.integrations import vllm as backend

    served = StoreServer(token=sys.argv[1]).in_thread()  # rank 0 serves the store
    print(served.address, flush=True)
    specs = backend.specs_from_source(ShardedSource(0, 1), 1, "bfloat16")
    cfg = EngineConfig(transport="gloo", phase_timeout=10, round_timeout=60, job="vllm-dies")
    trainer = BlockingTrainer.connect(served.address, token=sys.argv[1], rank=0,
                                      trainer_ranks=1, world_size=2, params=specs, config=cfg)

    def first_then_hang():
        for name, shard in ShardedSource(0, 1).iter_local():
            yield name, shard
            print("mid-round", flush=True)
            time.sleep(600)  # killed here

    if sys.argv[2] == "between":  # one whole round, then killed before the next
        trainer.sync_weights(ShardedSource(0, 1).iter_local())
        print("between", flush=True)
        time.sleep(600)
    trainer.sync_weights(first_then_hang())
"""


def test_a_trainer_killed_mid_update_ends_the_workers_update_rpc_with_a_clear_error() -> None:
    # SIGKILL of trainer rank 0 (which serves the store) while the round runs: the worker's
    # update_weights ends at once with the round's TransferError, long before round_timeout,
    # the backend poisoned, and shutdown then works.
    import os
    import subprocess
    import sys
    from pathlib import Path

    from m2n_async.integrations.vllm import TrainerInitInfo

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, TOKEN, "mid"], env=env,
                            cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, "the trainer did not start"
        specs = backend.specs_from_source(ShardedSource(0, 1), 1, "bfloat16")
        info = TrainerInitInfo(rank=0, trainer_ranks=1, world_size=2, job="vllm-dies",
                               transport="gloo", phase_timeout=10, round_timeout=60)
        be = backend.VLLMWorkerBackend(object(), vllm_config(0, 1), torch.device("cpu"),
                                       TinyLlama(0, 1))
        worker = GPUWorker(be, 0, vllm_config(0, 1))
        assert _bounded(lambda: worker.init_weight_transfer_engine(
            backend._worker_payload(info, address, specs)), 60) is None
        worker.start_weight_update()
        out: dict[str, BaseException] = {}

        def update() -> None:
            try:
                worker.update_weights({})
            except BaseException as exc:
                out["error"] = exc

        thread = threading.Thread(target=update, daemon=True)
        thread.start()
        assert proc.stdout.readline().strip() == "mid-round"
        engine = be.engine
        assert engine is not None
        deadline = time.monotonic() + 30
        while engine.last_began < 1:  # the worker's part began: the kill is mid-round here
            assert time.monotonic() < deadline, "the worker never began its part"
            time.sleep(0.01)
        proc.kill()
        thread.join(30)  # round_timeout is 60: ending before it is the point
        assert not thread.is_alive(), "update_weights still waits for a dead trainer"
        assert isinstance(out.get("error"), TransferError), out
        # Its part of the round began: the partial-update warning is the right one.
        notes = " ".join(getattr(out["error"], "__notes__", ()))
        assert "partly updated" in notes and "untouched" not in notes, notes
        with pytest.raises(RuntimeError, match="poisoned"):
            be.start_weight_update()
        assert _bounded(worker.shutdown, 30) is None and be.engine is None
    finally:
        proc.kill()
        proc.wait(30)


# -- an RPC that never returns does not hold the process at exit ------------------------------

_HUNG_EXIT = """
import os, sys, threading
from tests.integrations._vllm_world import stubbed_backend
with stubbed_backend("tok"):
    from tests.integrations import test_vllm_edges as edges

    class Hangs(edges.FanOutClient):
        def start_weight_update(self):
            threading.Event().wait()  # a worker that never answers

    job = edges._Job("vllm-hung-exit", Hangs)
    job.init(update_timeout=0.5)
    errors = job.send(1)
    print("ERRORS", [type(e).__name__ for e in errors], flush=True)
    job.close()
print("EXITING", flush=True)
"""


def test_an_rpc_that_never_returns_does_not_hold_the_trainer_process_at_exit() -> None:
    # send_weights gave up on the RPC after update_timeout and shutdown() returned; the
    # thread still inside the client's call must not keep the interpreter from exiting.
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, "-c", _HUNG_EXIT], cwd=root,
                            env={**os.environ, "PYTHONPATH": root},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the process did not exit: {out[-2000:]}") from None
    assert "EXITING" in out and "TimeoutError" in out, (out, err[-3000:])
    assert proc.returncode == 0, err[-3000:]


# -- the trainer ends between rounds -----------------------------------------------------------


class _FourMethods(FanOutClient):
    """vLLM's four-method ``VLLMWeightSyncClient``: the trainer's ``shutdown()`` leaves the
    workers' engines up (no ``shutdown_weight_transfer_engine``)."""

    shutdown_weight_transfer_engine = None


def _assert_untouched(error: BaseException | None, why: str, version: int) -> None:
    notes = " ".join(getattr(error, "__notes__", ()))
    assert why in notes and "before this update started" in notes, notes
    assert "nothing was received in this call" in notes, notes
    assert f"holds version {version}" in notes and "untouched by this call" in notes, notes
    assert "restarted trainer" in notes and "shutdown_weight_transfer_engine()" in notes, notes
    assert "partly updated" not in notes, notes


@pytest.mark.parametrize("store", ["rank 0's", "external"])
def test_a_trainer_that_closed_between_rounds_says_the_model_is_untouched(
        store: str, caplog: pytest.LogCaptureFixture) -> None:
    # The trainer's shutdown() ran (its client could not shut the workers down): the next
    # update_weights receives nothing, so its error says the trainer ended before the update
    # started and the model still holds the last update, not that it may be partly updated.
    from m2n_async import StoreServer

    served = StoreServer(token=TOKEN).in_thread() if store == "external" else None
    job = _Job(f"vllm-closed-{store[:3]}", _FourMethods)
    try:
        kw = {} if served is None else {"store_address": served.address}
        job.init(**kw)
        assert job.send(1) == [None, None]
        for t in job.trainers:
            t.shutdown()
        errors: list[BaseException | None] = []
        for w in job.workers:
            w.start_weight_update()
            errors.append(_bounded(lambda w=w: w.update_weights({}), 30))
        why = "the trainer job ended" if served is not None else "the trainer was lost"
        for err in errors:
            _assert_untouched(err, why, 1)
        job.check(1)  # untouched indeed
        with pytest.raises(RuntimeError, match="untouched by this call") as refused:
            job.backends[0].start_weight_update()
        assert "may mix" not in str(refused.value)
        with caplog.at_level("WARNING", logger="m2n_async.vllm"):
            job.backends[0].finish_weight_update()  # a finish after the failure: it says so
        assert "the model is untouched" in caplog.text, caplog.text
        # What the error says to do recovers: shut down, init against a restarted trainer.
        for w in job.workers:
            assert _bounded(w.shutdown, 30) is None
        job.init(**kw)
        assert job.send(2) == [None, None]
        job.check(2)
    finally:
        job.close()
        if served is not None:
            served.close()


def test_a_trainer_killed_between_rounds_says_the_model_is_untouched() -> None:
    # SIGKILL of trainer rank 0 (which serves the store) after a completed round: the next
    # update_weights fails at once, saying the trainer was lost before it started and the
    # model holds the round it completed.
    import os
    import subprocess
    import sys
    from pathlib import Path

    from m2n_async.integrations.vllm import TrainerInitInfo

    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, TOKEN, "between"],
                            env={**os.environ, "PYTHONPATH": root}, cwd=root,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address, "the trainer did not start"
        specs = backend.specs_from_source(ShardedSource(0, 1), 1, "bfloat16")
        info = TrainerInitInfo(rank=0, trainer_ranks=1, world_size=2, job="vllm-dies",
                               transport="gloo", phase_timeout=10, round_timeout=60)
        be = backend.VLLMWorkerBackend(object(), vllm_config(0, 1), torch.device("cpu"),
                                       TinyLlama(0, 1))
        worker = GPUWorker(be, 0, vllm_config(0, 1))
        assert _bounded(lambda: worker.init_weight_transfer_engine(
            backend._worker_payload(info, address, specs)), 60) is None
        worker.start_weight_update()
        assert _bounded(lambda: worker.update_weights({}), 60) is None
        worker.finish_weight_update()
        assert proc.stdout.readline().strip() == "between"
        proc.kill()
        proc.wait(30)
        worker.start_weight_update()
        err = _bounded(lambda: worker.update_weights({}), 30)
        assert isinstance(err, TransferError), err
        _assert_untouched(err, "the trainer was lost", 1)
        assert _bounded(worker.shutdown, 30) is None and be.engine is None
    finally:
        proc.kill()
        proc.wait(30)


def test_a_round_that_fails_after_shutdown_keeps_its_own_error() -> None:
    # shutdown() from another thread while update_weights waits: the update's error is the
    # round's (the engine closed), with a note saying so -- not "rank before init", raised
    # while writing the note -- and it poisons nothing: a later init starts clean.
    be = _backend()
    assert be._info is None  # never initialised, or shut down meanwhile
    exc = TransferError("receive on rank 1: the engine was closed while waiting")
    be._fail(exc)
    assert be._poison is None
    assert any("shut down during this update" in n for n in exc.__notes__), exc.__notes__


def test_a_trainer_engine_dropped_without_shutdown_ends_its_rpc_thread() -> None:
    import gc

    def rpc_threads() -> int:
        return sum(t.name == "m2n-async-vllm-rpc" and t.is_alive()
                   for t in threading.enumerate())

    before = rpc_threads()
    info = backend.TrainerInitInfo(rank=0, trainer_ranks=1, world_size=2)
    eng = backend.VLLMTrainerEngine(info=info, client=object(), source=object(),
                                    trainer=None,  # type: ignore[arg-type]
                                    store=None, executor=backend._RPCThread("m2n-async-vllm-rpc"))
    assert rpc_threads() == before + 1
    del eng
    gc.collect()
    deadline = time.monotonic() + 5
    while rpc_threads() > before:
        assert time.monotonic() < deadline, "the RPC thread outlived its engine"
        time.sleep(0.01)
