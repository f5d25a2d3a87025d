"""The ``m2n_async`` vLLM backend driven as vLLM 0.33's GPU worker drives it (no vLLM needed).

2 trainer ranks (FSDP2-like ``WeightSource``: fp32 masters, ``Shard(0)``) and 2 vLLM worker
ranks (TP = 2, a Llama-shaped bf16 model with fused qkv/gate_up and a vocab-parallel
embedding), every rank a thread of this process over CPU/Gloo: 3 rounds bit-exact, which
parameters go in place and which through ``load_weights`` (with the layerwise reload hooks),
and the misuse cases — bad ``init_info``, calls out of order, double init, shutdown and init
again, a failed round (poisoned, reported, recovered by shutdown + init), a round that never
started (previous weights kept).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from m2n_async import EnginePoisonedError, TransferError
from m2n_async.integrations import vllm as backend

from ._vllm_world import (
    FanOutClient,
    GPUWorker,
    ShardedSource,
    TinyLlama,
    expected_locals,
    free_port,
    stubbed_backend,
    vllm_config,
)

T, TP = 2, 2
TOKEN = "vllm-backend-tests"
IN_PLACE = {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"}


@pytest.fixture(scope="module", autouse=True)
def _stub_and_token() -> Iterator[None]:
    with stubbed_backend(TOKEN):
        yield


@dataclass
class Job:
    models: list[TinyLlama]
    backends: list[backend.VLLMWorkerBackend]
    workers: list[GPUWorker]
    client: FanOutClient
    sources: list[ShardedSource]
    port: int
    trainers: list[backend.VLLMTrainerEngine] | None = None

    def init_one(self, r: int, job: str, **kw: Any) -> backend.VLLMTrainerEngine:
        info = backend.TrainerInitInfo(rank=r, trainer_ranks=T, world_size=T + TP,
                                       store_port=self.port, job=job, dtype="bfloat16",
                                       transport="gloo", phase_timeout=20, round_timeout=20,
                                       **kw)
        return backend.VLLMTrainerEngine.trainer_init(info, client=self.client,
                                                      source=self.sources[r])

    def init_trainers(self, job: str, **kw: Any) -> None:
        with ThreadPoolExecutor(T) as ex:
            self.trainers = list(ex.map(lambda r: self.init_one(r, job, **kw), range(T)))

    def send(self, version: int, weight_version: str | None = None) -> list[Any]:
        assert self.trainers is not None
        for s in self.sources:
            s.version = version
        with ThreadPoolExecutor(T) as ex:
            futs = [ex.submit(t.send_weights, weight_version) for t in self.trainers]
            return [f.result(60) for f in futs]

    def shutdown_trainers(self) -> None:
        for t in self.trainers or ():
            t.shutdown()

    def close(self) -> None:
        """Every trainer and worker shut down (a test's last step, whatever happened)."""
        self.shutdown_trainers()
        for w in self.workers:
            w.shutdown()

    def check(self, version: int) -> None:
        for r, m in enumerate(self.models):
            got = dict(m.named_parameters())
            for name, want in expected_locals(version, r, TP).items():
                assert torch.equal(got[name], want), (r, name, version)


def _job() -> Job:
    models = [TinyLlama(r, TP) for r in range(TP)]
    backends = [backend.VLLMWorkerBackend(object(), vllm_config(r, TP), torch.device("cpu"),
                                          models[r]) for r in range(TP)]
    workers = [GPUWorker(b, r, vllm_config(r, TP)) for r, b in enumerate(backends)]
    return Job(models, backends, workers, FanOutClient(workers),
               [ShardedSource(r, T) for r in range(T)], free_port())


def test_three_rounds_bit_exact_in_place_and_through_load_weights() -> None:
    from vllm.model_executor.model_loader import reload

    job = _job()
    job.init_trainers("vllm-rounds")
    try:
        be = job.backends[0]
        assert set(be.loaded_names) == {
            n for n in job.sources[0].owned_names(0) if n not in IN_PLACE}
        assert [w.weight_transfer_engine.rank for w in job.workers] == [2, 3]
        ptrs = {n: p.data_ptr() for n, p in job.models[0].named_parameters()}
        reload.CALLS.clear()
        for v in (1, 2, 3):
            results = job.send(v, weight_version=f"step-{v}")
            assert [r.version for r in results] == [v, v]
            job.check(v)
        # In place means the live storage: the same tensors, written by the engine.
        assert {n: p.data_ptr() for n, p in job.models[0].named_parameters()} == ptrs
        assert job.client.calls == ["init_weight_transfer_engine"] + [
            "start_weight_update", "update_weights", "finish_weight_update"] * 3
        assert job.client.versions == ["step-1", "step-2", "step-3"]  # vLLM's, not ours
        # One load_weights call per round per worker, between initialize and finalize.
        assert [m.load_calls for m in job.models] == [3, 3]
        ids = {id(m) for m in job.models}
        assert sorted(k for k, i in reload.CALLS if i in ids) == ["finalize"] * 6 + [
            "initialize"] * 6
        assert not reload.OPEN
    finally:
        job.close()


def test_init_info_keys_and_types_are_checked() -> None:
    be = _job().backends[0]
    good = {"store_address": "127.0.0.1:1", "trainer_ranks": 2, "world_size": 4,
            "params": [{"name": "w", "dtype": "bfloat16", "shape": [4, 4]}]}
    # Timeouts are seconds, finite and > 0, as EngineConfig takes them (null: the default).
    for key in ("receive_timeout", "connect_timeout"):
        for bad in (0, -1, float("nan"), float("inf")):
            with pytest.raises(ValueError, match=key):
                be.parse_init_info({**good, key: bad})
        assert getattr(be.parse_init_info({**good, key: None}), key) is None
    for bad in (0, -1.5, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            be.parse_update_info({"timeout": bad})
    for key, bad in (("update_timeout", 0), ("connect_timeout", float("nan")),
                     ("update_timeout", -3)):
        with pytest.raises(ValueError, match=key):
            backend.TrainerInitInfo(rank=0, world_size=2, **{key: bad})
    info = be.parse_init_info(good)
    assert info.params[0].shape == (4, 4) and info.rank_offset is None
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        be.parse_init_info({**good, "bogus": 1})
    with pytest.raises(ValueError, match=r"missing keys \['params', 'world_size'\]"):
        be.parse_init_info({"store_address": "x:1", "trainer_ranks": 2})
    with pytest.raises(ValueError, match=r"wrong type: trainer_ranks='2' \(str\)"):
        be.parse_init_info({**good, "trainer_ranks": "2"})
    with pytest.raises(ValueError, match="params\\[0\\]"):
        be.parse_init_info({**good, "params": [{"name": "w", "shape": [4]}]})
    with pytest.raises(ValueError, match="declared twice"):
        be.parse_init_info({**good, "params": good["params"] * 2})
    with pytest.raises(ValueError, match="unknown keys"):
        be.parse_update_info({"names": ["w"]})
    # Out of order before any init: a clear error, nothing started.
    with pytest.raises(RuntimeError, match="before init_weight_transfer_engine"):
        be.start_weight_update()
    be.shutdown()  # idempotent, in any state
    be.shutdown()


def test_misuse_failure_and_recovery() -> None:
    from vllm.model_executor.model_loader import reload

    job = _job()
    job.init_trainers("vllm-misuse")
    try:
        w0, b0 = job.workers[0], job.backends[0]
        job.send(1)
        job.check(1)
        # Double init: refused, the running engine untouched.
        with pytest.raises(RuntimeError, match="already initialized"):
            b0.init_transfer_engine(b0._info)  # type: ignore[arg-type]
        # Update before start (bypassing the vLLM worker's own flag): refused, nothing read.
        with pytest.raises(RuntimeError, match="start_weight_update must be called"):
            b0.update_weights({})
        # A round that never starts: the model keeps its weights, the backend stays usable.
        w0.start_weight_update()
        with pytest.raises(TimeoutError, match="previous weights"):
            w0.update_weights({"timeout": 0.3})
        assert not w0._weight_update_active and not reload.OPEN
        job.check(1)
        # A bad update_info ends the session on both sides (vLLM's worker drops its own).
        w0.start_weight_update()
        with pytest.raises(ValueError, match="unknown keys"):
            w0.update_weights({"names": ["x"]})
        assert not w0._weight_update_active and not b0._session and not reload.OPEN
        job.send(2)
        job.check(2)

        # A failed round: worker 0's load_weights raises. Every rank fails the round; the
        # workers are poisoned (told why), no layer is left mid-reload.
        job.models[0].fail_load = True
        with pytest.raises(TransferError):
            job.send(3)
        assert not reload.OPEN
        for w in job.workers:
            with pytest.raises(RuntimeError, match="poisoned"):
                w.start_weight_update()
        assert job.trainers is not None
        with pytest.raises(EnginePoisonedError):
            job.trainers[1].send_weights()
        # The sender checks its own state before any RPC: no start_weight_update is sent.
        calls = list(job.client.calls)
        with pytest.raises(EnginePoisonedError, match="poisoned") as info:
            job.trainers[0].send_weights()
        assert isinstance(info.value.__cause__, TransferError)
        assert job.client.calls == calls
        # Recovery: shut down (the trainer asks the workers to shut down too) and init again.
        job.models[0].fail_load = False
        job.shutdown_trainers()
        assert job.client.calls[-1] == "shutdown_weight_transfer_engine"
        job.shutdown_trainers()  # idempotent
        job.init_trainers("vllm-misuse")
        job.send(4)
        job.check(4)
    finally:
        job.close()


def test_a_load_failure_names_the_worker_and_its_error_on_every_trainer_rank() -> None:
    # Worker rank 3's load_weights raises mid-round: the round fails on every rank with
    # that worker and the load error as its cause (not as a cancellation), so each trainer
    # rank's TransferError says which worker failed and why; the worker raises the load
    # error itself, with the round's failure in a note.
    job = _job()
    job.init_trainers("vllm-load-fails")
    try:
        job.send(1)
        job.models[1].fail_load = True
        assert job.trainers is not None
        with ThreadPoolExecutor(T) as ex:
            futs = [ex.submit(t.send_weights) for t in job.trainers]
            errors = [f.exception(60) for f in futs]
        for err in errors:
            assert isinstance(err, TransferError), errors
            assert "rank 3 (worker)" in str(err) and "load_weights failed (injected)" in str(
                err), err
            assert "cancelled" not in str(err), err
        poison = job.backends[1]._poison
        assert isinstance(poison, RuntimeError) and "injected" in str(poison)
        assert any("rank 3" in n for n in getattr(poison, "__notes__", ())), poison
        job.models[1].fail_load = False
        job.shutdown_trainers()
        job.init_trainers("vllm-load-fails")
        job.send(2)
        job.check(2)
    finally:
        job.close()


def test_a_load_failure_after_the_last_tensor_fails_the_round() -> None:
    # load_weights consumed every tensor, then raised (a layer's processing after loading):
    # this worker's part of the round had not ended yet, so the round fails everywhere with
    # that error instead of committing on the other ranks.
    from vllm.model_executor.model_loader import reload

    job = _job()
    job.init_trainers("vllm-post-load")
    try:
        job.send(1)
        job.models[0].fail_after_load = True
        with pytest.raises(TransferError, match=r"rank 2 \(worker\).*post-load processing"):
            job.send(2)
        job.models[0].fail_after_load = False
        assert not any(w._weight_update_active for w in job.workers)
        assert not reload.OPEN
        assert job.client.versions == [None]  # round 1's; the failed round's finish raised
        job.shutdown_trainers()
        job.init_trainers("vllm-post-load")
        job.send(3)
        job.check(3)
    finally:
        job.close()


def test_a_worker_failing_after_the_round_ends_every_session_and_recovery_works(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Worker 0's update_weights raises after the round itself committed (a failure after
    # the receive, e.g. the device synchronize): send_weights raises. The other worker's
    # update succeeded, so vLLM still has its session open; the sender ends it (no version
    # published), so that shutdown and init recover. Otherwise vLLM refuses
    # shutdown_weight_transfer_engine there, and the layerwise reload of that worker stays
    # open (every layer on the meta device).
    from vllm.model_executor.model_loader import reload

    job = _job()
    job.init_trainers("vllm-post-commit")
    be = job.backends[0]
    real = be._receive
    boom = {"on": False}

    def receive(worker: Any, timeout: float | None) -> Any:
        result = real(worker, timeout)
        if boom["on"]:
            raise RuntimeError("after the receive (injected)")
        return result

    monkeypatch.setattr(be, "_receive", receive)
    try:
        job.send(1)
        boom["on"] = True
        with pytest.raises(RuntimeError, match="injected"):
            job.send(2)
        boom["on"] = False
        assert not any(w._weight_update_active for w in job.workers)
        assert not reload.OPEN
        assert job.client.versions == [None]  # the failed update published no version
        job.shutdown_trainers()
        job.init_trainers("vllm-post-commit")
        job.send(3)
        job.check(3)
    finally:
        job.close()


def test_a_failed_finish_is_ended_and_recovery_works(monkeypatch: pytest.MonkeyPatch) -> None:
    # finalize_layerwise_reload raises on worker 0 inside finish_weight_update. vLLM keeps
    # its session open when finish raises; the sender's second finish ends it (the backend
    # stays poisoned), so shutdown and init recover.
    from vllm.model_executor.model_loader import reload

    job = _job()
    real = reload.finalize_layerwise_reload
    boom = {"on": False}

    def finalize(model: Any, cfg: Any) -> None:
        real(model, cfg)
        if boom["on"] and model is job.models[0]:
            boom["on"] = False
            raise RuntimeError("process_weights_after_loading failed (injected)")

    monkeypatch.setattr(reload, "finalize_layerwise_reload", finalize)
    job.init_trainers("vllm-finish-fails")
    try:
        boom["on"] = True
        with pytest.raises(RuntimeError, match="injected"):
            job.send(1)
        assert not any(w._weight_update_active for w in job.workers)
        with pytest.raises(RuntimeError, match="poisoned"):
            job.workers[0].start_weight_update()
        job.shutdown_trainers()
        job.init_trainers("vllm-finish-fails")
        job.send(2)
        job.check(2)
    finally:
        job.close()


def test_the_update_rpc_is_bounded_by_update_timeout() -> None:
    # This rank's part of the round succeeded, the workers' update_weights RPC never
    # returns (a lost reply): send_weights fails after update_timeout, saying so.
    import threading
    from concurrent.futures import Future

    class Done:  # a round that succeeded on this trainer rank
        def __init__(self) -> None:
            self.future: Future[str] = Future()
            self.future.set_result("ok")

        def done(self) -> bool:
            return True

        def result(self) -> str:
            return self.future.result()

        def cancel(self) -> None:
            pass

    rpc: Future[None] = Future()
    out: dict[str, BaseException | str] = {}

    def call() -> None:
        try:
            out["result"] = backend._wait_with_rpc(Done(), rpc, "update_weights", grace=0.3)
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10.0)
    rpc.set_result(None)  # lets a hung call go
    assert not thread.is_alive(), "send_weights waited for the RPC without a bound"
    err = out.get("error")
    assert isinstance(err, TimeoutError) and "update_timeout" in str(err), out


class _FakePending:
    """A test double of ``blocking.Pending``: a future the test ends, and a cancel flag."""

    def __init__(self) -> None:
        from concurrent.futures import Future

        self.future: Future[str] = Future()
        self.cancelled = False

    def done(self) -> bool:
        return self.future.done()

    def result(self) -> str:
        return self.future.result()

    def cancel(self) -> None:
        self.cancelled = True
        if not self.future.done():
            self.future.set_exception(RuntimeError("cancelled by the test"))


def test_a_failed_rpc_raises_the_rounds_diagnosis_when_the_round_fails_too() -> None:
    # The workers' update_weights fails (a load_weights error) a moment before the round
    # reports that worker's failure on this rank: the round's TransferError, naming the
    # rank, is what send_weights raises, not a cancellation and the RPC's bare error.
    import threading
    from concurrent.futures import Future

    pending, rpc = _FakePending(), Future[None]()
    rpc.set_exception(RuntimeError("load_weights failed (injected)"))
    diagnosis = TransferError("round 3 failed: worker rank 2: load_weights failed")
    threading.Timer(0.2, pending.future.set_exception, (diagnosis,)).start()
    with pytest.raises(TransferError, match="worker rank 2") as info:
        backend._wait_with_rpc(pending, rpc, "update_weights", grace=30.0, settle=10.0)
    assert not pending.cancelled
    assert any("injected" in note for note in info.value.__notes__)


def test_a_round_that_fails_first_carries_the_rpcs_error_as_a_note() -> None:
    # The round fails on this rank while the workers' update_weights is still running; the
    # RPC then fails too: send_weights raises the round's error, the RPC's in a note.
    from concurrent.futures import Future

    rpc = Future[None]()

    class FailsThenRPCFails(_FakePending):
        def result(self) -> str:
            if not rpc.done():
                rpc.set_exception(RuntimeError("the loader raised (injected)"))
            return super().result()

    pending = FailsThenRPCFails()
    pending.future.set_exception(TransferError("round 2 failed: rank 3 (worker)"))
    with pytest.raises(TransferError, match="rank 3") as info:
        backend._wait_with_rpc(pending, rpc, "update_weights", grace=30.0)
    assert any("update_weights failed too" in n and "injected" in n
               for n in info.value.__notes__), info.value.__notes__


def test_a_failed_rpc_cancels_a_round_that_does_not_end() -> None:
    # The RPC failed and this rank's round goes on (its workers never began): after
    # ``settle`` the round is cancelled and the RPC's error raised.
    from concurrent.futures import Future

    pending, rpc = _FakePending(), Future[None]()
    rpc.set_exception(ValueError("bad update_info (injected)"))
    with pytest.raises(RuntimeError, match=r"update_weights failed.*injected"):
        backend._wait_with_rpc(pending, rpc, "update_weights", grace=30.0, settle=0.2)
    assert pending.cancelled


def test_a_failed_rpc_after_this_ranks_round_committed_raises_the_rpcs_error() -> None:
    from concurrent.futures import Future

    pending, rpc = _FakePending(), Future[None]()
    pending.future.set_result("ok")
    rpc.set_exception(RuntimeError("finish failed (injected)"))
    with pytest.raises(RuntimeError, match=r"update_weights failed.*injected"):
        backend._wait_with_rpc(pending, rpc, "update_weights", grace=30.0, settle=0.2)
    assert not pending.cancelled


def test_a_failed_handshake_waits_only_a_short_settle_for_the_init_rpc(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # No worker joins and the workers' init RPC never returns: trainer_init raises the
    # handshake's error after phase_timeout plus the short settle (here 0.1 s), saying the
    # RPC had not returned, instead of waiting for the RPC as long again.
    import threading

    from m2n_async import PhaseTimeoutError

    monkeypatch.setattr(backend, "_RPC_SETTLE_S", 0.1)
    release = threading.Event()

    class HungInit(FanOutClient):
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            release.wait(60)

    job = _job()
    info = backend.TrainerInitInfo(rank=0, trainer_ranks=1, world_size=1 + TP,
                                   store_port=job.port, job="vllm-hung-init",
                                   transport="gloo", phase_timeout=0.5, round_timeout=5)
    out: dict[str, BaseException] = {}

    def init() -> None:
        try:
            backend.VLLMTrainerEngine.trainer_init(info, client=HungInit(job.workers),
                                                   source=ShardedSource(0, 1))
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=init, daemon=True)
    thread.start()
    thread.join(20.0)  # the old bound was 30 s after the handshake failed
    release.set()
    assert not thread.is_alive(), "trainer_init waited for the init RPC past its settle"
    err = out.get("error")
    assert isinstance(err, PhaseTimeoutError), out
    assert any("init_weight_transfer_engine had not returned" in n for n in err.__notes__)


def test_worker_ranks_that_never_join_are_explained_on_the_trainer() -> None:
    # world_size counts two worker ranks no instance starts (as when two independent
    # instances claim the same ranks): the handshake's PhaseTimeoutError names them, and a
    # note says how worker ranks are numbered and what to do.
    from m2n_async import PhaseTimeoutError

    job = _job()
    info = backend.TrainerInitInfo(rank=0, trainer_ranks=1, world_size=1 + TP + 2,
                                   store_port=job.port, job="vllm-missing-ranks",
                                   dtype="bfloat16", transport="gloo", phase_timeout=1,
                                   round_timeout=5)
    try:
        with pytest.raises(PhaseTimeoutError) as err:
            backend.VLLMTrainerEngine.trainer_init(info, client=job.client,
                                                   source=ShardedSource(0, 1))
        notes = "\n".join(err.value.__notes__)
        assert "worker rank(s) [3, 4] never joined" in notes, notes
        assert "data_parallel_index" in notes and "exactly once" in notes, notes
    finally:
        for w in job.workers:
            w.shutdown()


def test_two_workers_claiming_one_rank_say_so() -> None:
    # A second vLLM instance with the same rank_offset and data_parallel_index: its worker
    # computes a rank another live worker holds, and its init names the clash.
    from m2n_async import JobClaimedError

    job = _job()
    job.init_trainers("vllm-clash")
    try:
        info = backend.TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP,
                                       job="vllm-clash", dtype="bfloat16", transport="gloo",
                                       phase_timeout=0.3)
        specs = backend.specs_from_source(job.sources[0], T, "bfloat16")
        payload = backend._worker_payload(info, f"127.0.0.1:{job.port}", specs)
        twin = backend.VLLMWorkerBackend(object(), vllm_config(0, TP), torch.device("cpu"),
                                         TinyLlama(0, TP))
        with pytest.raises(JobClaimedError, match=r"two processes claim worker rank 2 .*"
                                                  r"data_parallel_index 0") as err:
            twin.init_transfer_engine(twin.parse_init_info(payload))
        assert "data-parallel ranks of one deployment" in str(err.value)
        assert twin.engine is None
        job.send(1)  # the job itself is untouched
        job.check(1)
    finally:
        job.close()


def test_a_connect_that_succeeded_beside_a_failed_init_rpc_is_closed() -> None:
    # The engine it made holds this rank's claim: left open, the next trainer_init of the
    # rank would wait for that claim.
    class Engine:
        closed = False

        def close(self) -> None:
            self.closed = True

    engine = Engine()
    pending = _FakePending()
    pending.future.set_result(engine)  # type: ignore[arg-type]
    backend._close_connected(pending)
    assert engine.closed
    failed = _FakePending()
    failed.future.set_exception(RuntimeError("connect failed"))
    backend._close_connected(failed)  # nothing to close
    backend._close_connected(_FakePending())  # still running: nothing to close


def test_a_trainer_that_reached_rank_0s_old_store_connects_again(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Shutdown and init again on every trainer rank, with a fixed store port, in the order
    that loses: rank 1's new ``trainer_init`` reaches rank 0's old store (still open), then
    rank 0 shuts down and closes it mid-handshake. Rank 1 connects again to the store rank
    0 opens next, and the round after is bit-exact."""
    import logging
    import time

    from m2n_async import _store

    servers: list[Any] = []

    class Accepted(set[Any]):  # counts every connection accepted, whatever closed since
        count = 0

        def add(self, item: Any) -> None:
            self.count += 1
            super().add(item)

    class Recorded(_store.StoreServer):  # the stores rank 0 serves, to watch connections
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self._protocols = Accepted()
            servers.append(self)

    monkeypatch.setattr(_store, "StoreServer", Recorded)
    caplog.set_level(logging.INFO, logger="m2n_async.vllm")
    job = _job()
    job.init_trainers("vllm-reinit")
    try:
        assert job.trainers is not None
        job.send(1)
        old = servers[-1]
        rank0, rank1 = job.trainers
        rank1.shutdown()
        # Connections accepted, not open: the count of open ones may still hold rank 1's
        # closed one when read, and then its new one would not show.
        before = old._protocols.count
        with ThreadPoolExecutor(1) as ex:
            again = ex.submit(job.init_one, 1, "vllm-reinit")
            deadline = time.monotonic() + 20
            while old._protocols.count <= before:  # rank 1 is in rank 0's old store
                assert time.monotonic() < deadline, "rank 1 never reached the old store"
                assert not again.done(), again.exception()
                time.sleep(0.01)
            rank0.shutdown()  # closes the old store under rank 1's handshake
            new0 = job.init_one(0, "vllm-reinit")
            job.trainers = [new0, again.result(60)]
        assert any("connecting again" in r.getMessage() for r in caplog.records)
        job.send(2)
        job.check(2)
    finally:
        job.close()


def test_a_trainer_init_info_registers_the_backend_where_vllms_factory_is_loaded() -> None:
    # A plain trainer process runs no vLLM general plugins: building the init info
    # registers the backend, so vLLM's trainer factory dispatches to it.
    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory in (WeightTransferEngineFactory, WeightTransferTrainerFactory):
        factory._registry.pop(backend.BACKEND, None)
    info = backend.TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP)
    assert backend.BACKEND in WeightTransferTrainerFactory._registry
    assert backend.BACKEND in WeightTransferEngineFactory._registry
    with pytest.raises(ValueError, match="needs a WeightSource"):  # ours, dispatched
        WeightTransferTrainerFactory.trainer_init(info, client=_job().client)
    backend.TrainerInitInfo(rank=1, trainer_ranks=T, world_size=T + TP)  # idempotent
    backend.register()


def test_trainer_init_rejects_what_it_cannot_send() -> None:
    job = _job()
    info = backend.TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP,
                                   store_port=job.port)
    with pytest.raises(ValueError, match="needs a WeightSource"):
        backend.VLLMTrainerEngine.trainer_init(info, client=job.client)
    with pytest.raises(ValueError, match=r"VLLMWeightSyncClient.*'update_weights'"):
        backend.VLLMTrainerEngine.trainer_init(info, client=object(), source=job.sources[0])
    changed = backend.TrainerInitInfo(rank=1, trainer_ranks=T, world_size=T + TP)
    changed.rank = 2  # refused where built; trainer_init checks again
    with pytest.raises(ValueError, match="rank < trainer_ranks"):
        backend.VLLMTrainerEngine.trainer_init(changed, client=job.client,
                                               source=job.sources[0])
    specs = backend.specs_from_source(job.sources[0], T, "bfloat16")
    assert specs[0].dtype == "bfloat16" and specs[0].layout.placements == (0, -1)
    assert specs[0].layout.mesh.dims == (T, 1)


def test_a_handshake_failing_just_after_the_init_rpc_raises_its_own_diagnosis(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The workers' init RPC fails a moment before the trainer's handshake times out on the
    # same missing ranks (each side's phase timer ran out; theirs was reported first): the
    # trainer raises its own PhaseTimeoutError, explained, the RPC's error a note.
    from m2n_async import PhaseTimeoutError

    monkeypatch.setattr(backend, "_INIT_SETTLE_S", 5.0)  # wide: the order is the test

    class EarlyTimeout(FanOutClient):
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            time.sleep(0.2)
            raise RuntimeError("the workers' handshake timed out")

    job = _job()
    info = backend.TrainerInitInfo(rank=0, trainer_ranks=1, world_size=1 + TP + 2,
                                   store_port=job.port, job="vllm-early-timeout",
                                   transport="gloo", phase_timeout=1, round_timeout=5)
    try:
        with pytest.raises(PhaseTimeoutError) as err:
            backend.VLLMTrainerEngine.trainer_init(info, client=EarlyTimeout(job.workers),
                                                   source=ShardedSource(0, 1))
        notes = "\n".join(err.value.__notes__)
        assert "worker rank(s) [1, 2, 3, 4] never joined" in notes, notes
        assert "init_weight_transfer_engine failed too" in notes, notes
    finally:
        for w in job.workers:
            w.shutdown()
