"""The ``m2n_async`` vLLM backend used wrongly, as a demanding vLLM user might (no vLLM needed).

Each case says what the backend must do: ``init_info`` values out of range refused by
``parse_init_info`` naming the key; a store address that never answers refused within the
configured bound, naming the address; a worker rank outside the job explained in vLLM's
terms; a declared shape that the model's parameter contradicts refused at init, naming the
parameter and both shapes, before the model is touched; a ``load_weights`` failure naming the
tensor it was loading and saying the model may be partly updated; ``TrainerInitInfo`` values of
the wrong type refused naming the field; and the hook orders vLLM's GPU worker allows.
Same stub, model and GPU worker as ``test_vllm_backend.py`` (``_vllm_world``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any

import pytest
import torch

from m2n_async import PlanError, StoreError, TransferError
from m2n_async.integrations import vllm as backend

from ._vllm_world import (
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    FanOutClient,
    GPUWorker,
    ParamMeta,
    Shard,
    ShardedSource,
    TinyLlama,
    checkpoint_shapes,
    expected_locals,
    free_port,
    lagging_listener,
    stubbed_backend,
    vllm_config,
)

T, TP = 2, 2
TOKEN = "vllm-misuse-tests"
GOOD = {"store_address": "127.0.0.1:1", "trainer_ranks": T, "world_size": T + TP,
        "params": [{"name": "w", "dtype": "bfloat16", "shape": [4, 4]}]}
O_PROJ = "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture(scope="module", autouse=True)
def _stub_and_token() -> Iterator[None]:
    with stubbed_backend(TOKEN):
        yield


def _backend(tp_rank: int = 0) -> backend.VLLMWorkerBackend:
    return backend.VLLMWorkerBackend(object(), vllm_config(tp_rank, TP), torch.device("cpu"),
                                     TinyLlama(tp_rank, TP))


def _bounded(call: Callable[[], Any], limit: float) -> tuple[BaseException | None, float]:
    """Run ``call`` on a daemon thread for at most ``limit`` s: (its error, seconds taken);
    a call still running then fails the test instead of hanging the suite."""
    out: dict[str, BaseException] = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            out["error"] = exc

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"still waiting after {limit} s: the wait is unbounded"
    return out.get("error"), time.monotonic() - start


# -- init_info values ------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [
    ("bucket_bytes", -1), ("bucket_bytes", 0), ("transport", "ncl"), ("job", ""),
    ("job", "a/b"), ("store_address", "localhost"), ("store_address", "host:http"),
    ("store_address", "127.0.0.1:70000"), ("token_env", ""), ("rank_offset", -1),
    ("host", ""), ("params", []),
])
def test_init_info_values_out_of_range_are_refused_by_parse(key: str, value: object) -> None:
    # vLLM runs parse_init_info first: a value that cannot work fails there, naming the key,
    # not later inside init (after the destinations were resolved) or at the store.
    with pytest.raises(ValueError, match=f"init_info.*{key}"):
        _backend().parse_init_info({**GOOD, key: value})


@pytest.mark.parametrize("param", [
    {"name": "w", "dtype": "bfloat16", "shape": [-4, 4]},
    {"name": "", "dtype": "bfloat16", "shape": [4]},
])
def test_init_info_params_out_of_range_are_refused_by_parse(param: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"params\[0\]"):
        _backend().parse_init_info({**GOOD, "params": [param]})


def test_every_init_info_option_parses() -> None:
    # Every key the backend documents, at a valid value, in one init_info.
    every = {**GOOD, "rank_offset": T, "job": "rl", "transport": "gloo",
             "token_env": backend.TOKEN_ENV, "bucket_bytes": 1 << 20, "phase_timeout": 5,
             "round_timeout": 7.5, "connect_timeout": 3, "receive_timeout": None,
             "host": "127.0.0.1"}
    info = _backend().parse_init_info(every)
    assert (info.bucket_bytes, info.round_timeout, info.receive_timeout) == (1 << 20, 7.5, None)


@pytest.mark.parametrize(("dp_index", "tp_rank", "offset"), [(1, 0, None), (0, 1, T + TP - 1)])
def test_a_worker_rank_outside_the_job_is_explained(dp_index: int, tp_rank: int,
                                                    offset: int | None) -> None:
    # world_size (or rank_offset) wrong for this deployment: the rank vLLM's numbering gives
    # this worker is not in [trainer_ranks, world_size). The error says how it was composed,
    # before connecting.
    be = backend.VLLMWorkerBackend(object(), vllm_config(tp_rank, TP, dp_index),
                                   torch.device("cpu"), TinyLlama(tp_rank, TP))
    init_info = {**GOOD, "rank_offset": offset} if offset is not None else GOOD
    info = be.parse_init_info(init_info)
    shown = offset if offset is not None else T
    with pytest.raises(ValueError, match=rf"worker rank {T + TP} \(rank_offset {shown} \+ "
                                         rf"data_parallel_index {dp_index} x {TP} \+ rank "
                                         rf"{tp_rank}\).*\[{T}, {T + TP}\)"):
        be.init_transfer_engine(info)
    assert be.engine is None


# -- the store address -----------------------------------------------------------------------


@pytest.mark.parametrize("bound", ["connect_timeout", "phase_timeout"])
def test_a_store_that_never_answers_fails_the_worker_init_in_bounded_time(bound: str) -> None:
    be = _backend()
    with lagging_listener(None) as address:
        info = be.parse_init_info({**GOOD, "store_address": address, bound: 1})
        err, took = _bounded(lambda: be.init_transfer_engine(info), 30)
    assert isinstance(err, TimeoutError), err
    assert address in str(err) and bound in str(err), err
    assert took < 10, took
    assert be.engine is None
    be.shutdown()


def test_a_store_that_never_answers_fails_the_trainer_init_in_bounded_time() -> None:
    class NoWorkers(FanOutClient):
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            raise AssertionError("the init RPC must not be sent before the store answered")

    with lagging_listener(None) as address:
        info = backend.TrainerInitInfo(rank=0, trainer_ranks=1, world_size=1 + TP,
                                       store_address=address, transport="gloo",
                                       phase_timeout=1)
        err, took = _bounded(lambda: backend.VLLMTrainerEngine.trainer_init(
            info, client=NoWorkers([]), source=ShardedSource(0, 1)), 30)
    assert isinstance(err, TimeoutError), err
    assert address in str(err), err
    assert took < 10, took


@pytest.mark.parametrize("address", ["127.0.0.1:1", "no-such-host.invalid:29500"])
def test_a_store_that_refuses_or_does_not_resolve_fails_at_once_naming_it(address: str) -> None:
    be = _backend()
    info = be.parse_init_info({**GOOD, "store_address": address, "phase_timeout": 30})
    err, took = _bounded(lambda: be.init_transfer_engine(info), 30)
    assert isinstance(err, StoreError) and address in str(err), err
    assert took < 10, took
    assert be.engine is None


# -- the model's parameters ------------------------------------------------------------------


class _Source(ShardedSource):
    """``ShardedSource`` declaring ``shapes`` instead of the checkpoint's (fp32, ``Shard(0)``
    over every trainer rank)."""

    def __init__(self, rank: int, trainers: int, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__(rank, trainers)
        self.shapes = shapes

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, torch.float32, s, owners=tuple(range(self.trainers)),
                          mesh_shape=(self.trainers,), placements=(Shard(0),))
                for n, s in self.shapes.items()]

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, (name, shape) in enumerate(self.shapes.items()):
            g = torch.Generator().manual_seed(1000 * self.version + i)
            full = torch.randn(shape, generator=g)
            yield name, torch.chunk(full, self.trainers, 0)[self.rank].contiguous()


class _Job:
    """2 trainer ranks declaring ``shapes``, 2 TP workers of ``TinyLlama``."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], job: str) -> None:
        self.models = [TinyLlama(r, TP) for r in range(TP)]
        self.before = [{n: t.clone() for n, t in m.state_dict().items()} for m in self.models]
        self.backends = [backend.VLLMWorkerBackend(object(), vllm_config(r, TP),
                                                   torch.device("cpu"), self.models[r])
                         for r in range(TP)]
        self.workers = [GPUWorker(b, r, vllm_config(r, TP)) for r, b in enumerate(self.backends)]
        self.client = FanOutClient(self.workers)
        self.sources = [_Source(r, T, shapes) for r in range(T)]
        self.port, self.job = free_port(), job
        self.trainers: list[backend.VLLMTrainerEngine] = []

    def init(self, phase_timeout: float = 10) -> None:
        """``trainer_init`` on every trainer rank; raises rank 0's error (the sender's: it
        has the workers' answer), else the first."""

        def one(r: int) -> backend.VLLMTrainerEngine:
            info = backend.TrainerInitInfo(rank=r, trainer_ranks=T, world_size=T + TP,
                                           store_port=self.port, job=self.job,
                                           dtype="bfloat16", transport="gloo",
                                           phase_timeout=phase_timeout,
                                           round_timeout=10)
            return backend.VLLMTrainerEngine.trainer_init(info, client=self.client,
                                                          source=self.sources[r])

        with ThreadPoolExecutor(T) as ex:
            futs = [ex.submit(one, r) for r in range(T)]
            errors = [f.exception(60) for f in futs]
            self.trainers = [f.result() for f in futs if f.exception() is None]
        if any(errors):
            raise next(e for e in errors if e is not None)

    def send(self) -> list[BaseException | None]:
        with ThreadPoolExecutor(T) as ex:
            futs = [ex.submit(t.send_weights) for t in self.trainers]
            return [f.exception(60) for f in futs]

    def changed(self, r: int) -> list[str]:
        return [n for n, t in self.models[r].state_dict().items()
                if not torch.equal(t, self.before[r][n])]

    def close(self) -> None:
        for t in self.trainers:
            t.shutdown()
        for w in self.workers:
            w.shutdown()


@pytest.mark.parametrize(("name", "shape", "local"), [
    # A row-parallel weight (written in place) declared twice as wide: its loader would
    # take only the first half of the columns, silently.
    (O_PROJ, (HIDDEN, 2 * HEADS * HEAD_DIM), (HIDDEN, HEADS * HEAD_DIM // TP)),
    # Its rows (not the sharded dim) wrong: the loader would fail mid-round.
    ("model.layers.0.mlp.down_proj.weight", (2 * HIDDEN, FFN), (HIDDEN, FFN // TP)),
])
def test_a_declared_shape_the_model_contradicts_refuses_init_naming_both(
        name: str, shape: tuple[int, ...], local: tuple[int, ...]) -> None:
    job = _Job({**checkpoint_shapes(), name: shape}, "vllm-shape-init")
    try:
        err, _ = _bounded(lambda: job.init(phase_timeout=2), 60)
        assert err is not None
        assert name in str(err) and str(shape) in str(err) and str(local) in str(err), err
        assert job.changed(0) == [] and job.changed(1) == []
        assert all(b.engine is None for b in job.backends)
        # The worker refuses before connecting: nothing of the job is touched on its side.
        be = _backend()
        info = be.parse_init_info(backend._worker_payload(
            backend.TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP),
            "127.0.0.1:1", backend.specs_from_source(job.sources[0], T, "bfloat16")))
        with pytest.raises(ValueError, match=rf"{name}.*{shape}.*{local}".replace(
                "(", r"\(").replace(")", r"\)")):
            be.init_transfer_engine(info)
    finally:
        job.close()


def test_a_load_weights_failure_names_the_tensor_it_was_loading() -> None:
    # The norm's declared shape is wrong; it has no loader of vLLM's known-safe ones, so it
    # goes through load_weights, which raises mid-round. Every rank's error names that
    # parameter (not the last one delivered) with both shapes, and says the model may now
    # be partly updated.
    name = "model.norm.weight"
    job = _Job({**checkpoint_shapes(), name: (2 * HIDDEN,)}, "vllm-shape-load")
    try:
        job.init()
        errors = job.send()
        for err in errors:
            assert isinstance(err, TransferError), errors
            assert f"{name!r}" in str(err) and f"{(2 * HIDDEN,)}" in str(err), err
            assert f"{(HIDDEN,)}" in str(err), err
            assert any("partly updated" in n for n in err.__notes__), err.__notes__
        for be in job.backends:
            poison = be._poison
            assert poison is not None
            text = f"{poison}\n" + "\n".join(getattr(poison, "__notes__", ()))
            assert name in text and "partly updated" in text, text
    finally:
        job.close()


@pytest.mark.parametrize("how", ["returns", "closes"])
def test_a_load_weights_that_stops_early_fails_the_round_at_once_saying_so(how: str) -> None:
    # load_weights takes one tensor and then returns, or closes the iterator first (as a
    # ``yield from`` that stops, or ``contextlib.closing``, does): what it left unread would
    # be lost. Either way the round fails at once on every rank saying so -- a closed
    # iterator reads as exhausted, and the round waited out its deadline naming no cause
    # while the unpack thread kept a tensor waiting past shutdown.
    job = _Job(checkpoint_shapes(), f"vllm-stops-early-{how}")
    try:
        job.init()
        for m in job.models:
            real = m.load_weights

            def first_only(weights: Any, real: Any = real) -> Any:
                it = iter(weights)
                first = next(it)
                if how == "closes":
                    it.close()
                return real([first])

            m.load_weights = first_only  # type: ignore[method-assign]
        errors = job.send()
        for err in errors:  # the worker's own step, not a deadline it was blamed for
            assert isinstance(err, TransferError) and err.cause == "error", errors
        says = ("closed its iterator after 1 of" if how == "closes"
                else "returned before consuming every received tensor")
        for be in job.backends:
            assert says in str(be._poison), be._poison
    finally:
        job.close()


def test_a_name_the_model_does_not_have_fails_the_round_saying_so() -> None:
    # A name load_weights does not know (a renamed or extra checkpoint tensor): the model's
    # loader raises mid-round; the error names it and says the model may be partly updated.
    extra = "model.layers.0.mlp.extra_proj.weight"
    job = _Job({extra: (8, HIDDEN), **checkpoint_shapes()}, "vllm-unknown-name")
    try:
        job.init()
        errors = job.send()
        for err in errors:
            assert isinstance(err, TransferError) and extra in str(err), errors
            assert any("partly updated" in n for n in err.__notes__), err.__notes__
        for w in job.workers:
            with pytest.raises(RuntimeError, match="poisoned"):
                w.start_weight_update()
    finally:
        job.close()


# -- TrainerInitInfo -------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "value"), [
    ("store_port", "29500"), ("rank", True), ("trainer_ranks", "2"), ("world_size", None),
    ("bucket_bytes", 1.5), ("store_address", 29500), ("phase_timeout", "60"),
    ("round_timeout", float("nan")), ("worker_rank_offset", "2"), ("job", None),
])
def test_trainer_init_info_values_of_the_wrong_type_name_the_field(key: str,
                                                                   value: object) -> None:
    with pytest.raises(ValueError, match=f"TrainerInitInfo.*{key}"):
        backend.TrainerInitInfo(**{"rank": 0, "world_size": T + TP, "trainer_ranks": T,
                                   key: value})


def test_trainer_init_info_dtype_is_checked_where_it_is_given() -> None:
    with pytest.raises(ValueError, match=r"TrainerInitInfo.*dtype.*'bf16'"):
        backend.TrainerInitInfo(rank=0, world_size=3, dtype="bf16")
    assert backend.TrainerInitInfo(rank=0, world_size=3, dtype=torch.bfloat16).dtype is not None


@pytest.mark.parametrize(("kw", "named"), [
    ({"rank": -1}, "rank must be in [0, trainer_ranks) = [0, 2), got -1"),
    ({"rank": 2}, "rank must be in [0, trainer_ranks) = [0, 2), got 2"),
    ({"trainer_ranks": 0}, "trainer_ranks must be >= 1, got 0"),
    ({"world_size": 1}, "must be > trainer_ranks = 2, got 1"),
    ({"world_size": 2}, "must be > trainer_ranks = 2, got 2"),
    ({"worker_rank_offset": 1}, "worker_rank_offset (the workers' first rank) must be in "
                                "[trainer_ranks, world_size) = [2, 4), got 1"),
    ({"worker_rank_offset": 4}, "[trainer_ranks, world_size) = [2, 4), got 4"),
])
def test_trainer_init_info_ranks_the_engine_refuses_are_refused_where_built(
        kw: dict[str, int], named: str) -> None:
    # TrainerEngine.connect's rule (0 <= rank < trainer_ranks < world_size) and the workers'
    # rank_offset range, checked when the info is built, naming the field and its value.
    args = {"rank": 0, "trainer_ranks": T, "world_size": T + TP, **kw}
    with pytest.raises(ValueError, match="TrainerInitInfo") as err:
        backend.TrainerInitInfo(**args)
    assert named in str(err.value), err.value


@pytest.mark.parametrize(("key", "named"), [
    ("token", "token is empty"), ("token_env", "token_env must name an environment variable"),
    ("store_host", "store_host must be a host name or address, got ''"),
    ("host", "host must be a host name or address, got ''"),
    ("worker_host", "worker_host must be a host name or address, got ''"),
])
def test_trainer_init_info_empty_strings_are_refused_naming_the_field(key: str,
                                                                      named: str) -> None:
    # An empty token is the caller's, not a missing environment variable's; the hosts have no
    # meaning for "" (the workers refuse an empty host and token_env too).
    with pytest.raises(ValueError, match="TrainerInitInfo") as err:
        backend.TrainerInitInfo(rank=0, world_size=3, **{key: ""})
    assert named in str(err.value) and "environment variable M2N" not in str(err.value)


def test_an_empty_token_reaching_trainer_init_names_the_token_not_the_environment() -> None:
    info = backend.TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP, token="x")
    info.token = ""  # changed after it was built: trainer_init says what it is
    with pytest.raises(ValueError, match=r"TrainerInitInfo\.token is empty") as err:
        backend.VLLMTrainerEngine.trainer_init(info, client=FanOutClient([]),
                                               source=ShardedSource(0, T))
    assert backend.TOKEN_ENV not in str(err.value)


def test_an_empty_token_variable_is_said_to_be_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backend.TOKEN_ENV, "")
    with pytest.raises(ValueError, match=f"{backend.TOKEN_ENV} is empty"):
        backend.VLLMTrainerEngine.trainer_init(
            backend.TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP),
            client=FanOutClient([]), source=ShardedSource(0, T))
    monkeypatch.delenv(backend.TOKEN_ENV)
    with pytest.raises(ValueError, match=f"{backend.TOKEN_ENV} is not set"):
        _backend().init_transfer_engine(_backend().parse_init_info(GOOD))


@pytest.mark.parametrize(("kw", "named"), [
    ({"dtype": "int32"}, "dtype (the wire dtype of floating-point parameters) must be a "
                         "floating-point dtype, got int32"),
    ({"dtype": torch.bool}, "must be a floating-point dtype, got bool"),
    ({"device": "cdua"}, "device must be a torch device"),
])
def test_trainer_init_info_dtype_and_device_that_cannot_work_are_refused_where_built(
        kw: dict[str, Any], named: str) -> None:
    # Accepted, they failed late: a float master is never sent as int32 (every round fails
    # at its first parameter), and a device torch cannot parse failed the connect.
    with pytest.raises(ValueError, match="TrainerInitInfo") as err:
        backend.TrainerInitInfo(rank=0, world_size=3, **kw)
    assert named in str(err.value), err.value


def test_a_wire_dtype_a_master_cannot_be_cast_to_is_refused_by_trainer_init() -> None:
    # fp8 masters, bf16 on the wire: the packing cast is refused mid-round (the engine
    # POISONED after the workers' init); trainer_init refuses it first, naming the parameter.
    class Fp8(ShardedSource):
        @cached_property
        def metadata(self) -> list[Any]:
            first, *rest = super().metadata
            return [ParamMeta(first.name, torch.float8_e4m3fn, first.shape, first.owners,
                              first.mesh_shape, first.placements), *rest]

    info = backend.TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP,
                                   dtype="bfloat16", phase_timeout=2, connect_timeout=2)
    with pytest.raises(ValueError, match=r"TrainerInitInfo\.dtype bfloat16 cannot") as err:
        backend.VLLMTrainerEngine.trainer_init(info, client=FanOutClient([]),
                                               source=Fp8(0, T))
    assert "'model.embed_tokens.weight' (float8_e4m3fn)" in str(err.value), err.value


def test_a_source_that_declares_no_parameters_is_refused_by_trainer_init() -> None:
    class Empty(ShardedSource):
        metadata: list[Any] = []  # noqa: RUF012 - one empty list, never changed

    with pytest.raises(ValueError, match="declares no parameters"):
        backend.VLLMTrainerEngine.trainer_init(
            backend.TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP),
            client=FanOutClient([]), source=Empty(0, T))


def test_a_worker_rank_offset_changed_after_build_is_refused_by_trainer_init() -> None:
    info = backend.TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP)
    info.worker_rank_offset = 1  # the info is a plain dataclass: trainer_init checks again
    with pytest.raises(ValueError, match=r"worker_rank_offset"):
        backend.VLLMTrainerEngine.trainer_init(info, client=FanOutClient([]),
                                               source=ShardedSource(0, T))


# -- the hook orders vLLM's GPU worker allows ------------------------------------------------


def test_the_hook_orders_vllm_allows() -> None:
    # vLLM's worker guarantees start before update and finish, one update at a time, no
    # shutdown_weight_transfer_engine during an update; it allows start then finish with no
    # update, and its own shutdown() (process teardown) at any time. Each leaves the backend
    # consistent: no layer mid-reload, the model as it was, init possible again.
    from vllm.model_executor.model_loader import reload

    shapes = checkpoint_shapes()
    job = _Job(shapes, "vllm-hook-order")
    try:
        job.init()
        w0 = job.workers[0]
        for w in job.workers:  # start, then finish with no update: nothing changed
            w.start_weight_update()
        for w in job.workers:
            w.finish_weight_update()
        assert not reload.OPEN and job.changed(0) == []
        with pytest.raises(RuntimeError, match="during a weight update"):
            w0.start_weight_update()
            w0.shutdown_weight_transfer_engine()  # refused by vLLM itself
        assert w0._weight_update_active
        w0.shutdown()  # teardown between start and finish: its open reload is finalized
        assert not reload.OPEN and job.backends[0].engine is None
        job.close()
        job.trainers = []
        for w in job.workers:
            w._weight_update_active = False  # a new vLLM process would start clear
        job.init()  # init works again after shutdown
        assert job.send() == [None, None]
        for r, m in enumerate(job.models):
            got = dict(m.named_parameters())
            for pname, want in expected_locals(1, r, TP).items():
                assert torch.equal(got[pname], want), pname
    finally:
        job.close()


# -- the trainer engine misused --------------------------------------------------------------


def test_a_second_trainer_init_beside_a_live_one_is_refused_and_the_first_still_works() -> None:
    # The workers' engine is initialized already: their init RPC refuses, naming the way
    # out, and the first trainer engine is untouched.
    job = _Job(checkpoint_shapes(), "vllm-double-init")
    try:
        job.init()
        info = backend.TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP,
                                       store_port=free_port(), job="vllm-double-init",
                                       transport="gloo", phase_timeout=2)
        with pytest.raises(RuntimeError, match="shutdown_weight_transfer_engine"):
            backend.VLLMTrainerEngine.trainer_init(info, client=job.client,
                                                   source=job.sources[0])
        assert job.send() == [None, None]
    finally:
        job.close()


def test_send_weights_twice_at_once_on_one_engine_is_refused_before_any_rpc() -> None:
    # A second send_weights while the first is still in its start_weight_update RPC: the
    # second must not reach the workers (its cleanup finish would end the first's update).
    entered, release = threading.Event(), threading.Event()

    class SlowStart(FanOutClient):
        def start_weight_update(self) -> None:
            entered.set()
            release.wait(30)
            super().start_weight_update()

    job = _Job(checkpoint_shapes(), "vllm-two-sends")
    job.client = SlowStart(job.workers)
    try:
        job.init()
        sender = job.trainers[0]
        with ThreadPoolExecutor(T + 1) as ex:
            first = [ex.submit(t.send_weights) for t in job.trainers]
            assert entered.wait(30)
            calls = list(job.client.calls)
            second = ex.submit(sender.send_weights)
            err = second.exception(5)
            release.set()
            assert [f.exception(60) for f in first] == [None, None]
        assert err is not None and "one send_weights at a time" in str(err), err
        # The first call's three RPCs (its start is recorded once released), no others.
        assert job.client.calls == [*calls, "start_weight_update", "update_weights",
                                    "finish_weight_update"], job.client.calls
    finally:
        release.set()
        job.close()


def test_a_weight_version_that_is_no_string_is_refused_before_any_rpc() -> None:
    job = _Job(checkpoint_shapes(), "vllm-version-type")
    try:
        job.init()
        calls = list(job.client.calls)
        with pytest.raises(ValueError, match="weight_version"):
            job.trainers[0].send_weights(5)  # type: ignore[arg-type]
        assert job.client.calls == calls
        assert job.send() == [None, None]
    finally:
        job.close()


class _Metas:
    def __init__(self, *metas: ParamMeta) -> None:
        self.metadata = list(metas)


@pytest.mark.parametrize(("meta", "words"), [
    (ParamMeta("w", torch.float32, (4, 4), owners=()), "no owners"),
    (ParamMeta("w", torch.float32, (4, 4), owners=(0, 1, 2)), "not all trainer ranks"),
    (ParamMeta("w", torch.float32, (4, 4), owners=(0, 1), mesh_shape=(4,)),
     "holds 4 ranks, its owners 2"),
    (ParamMeta("w", torch.float32, (4, 4), owners=(0, 1), mesh_shape=()), "a 0-D mesh"),
    (ParamMeta("w", torch.float32, (4, 4), owners=(0, 1), mesh_shape=(2,),
               placements=(Shard(0), Shard(0))), "2 placements"),
    (ParamMeta("w", torch.float32, (4, 4), owners=(0, 1), mesh_shape=(2,),
               placements=(Shard(2),)), "shards dim 2 of a 2-D tensor"),
    (ParamMeta("w", torch.float32, (4, 4), owners=(0, 1), mesh_shape=(2,),
               placements=(Shard(-3),)), "shards dim -3 of a 2-D tensor"),
    (ParamMeta("w", torch.float32, (4.5, 4)), "not a tuple of ints"),  # type: ignore[arg-type]
], ids=["no-owners", "owners-past-trainers", "mesh-of-another-size", "0-d-mesh",
        "placements-past-axes", "dim-out-of-range", "negative-dim-out-of-range",
        "float-shape"])
def test_metadata_that_contradicts_itself_is_refused_naming_the_parameter(
        meta: ParamMeta, words: str) -> None:
    # Before: an IndexError, or a wrong layout without a word (Shard(-3) of a 2-D tensor
    # read as replicated, a third placement dropped, 4.5 read as 4).
    with pytest.raises(PlanError, match="parameter 'w'") as info:
        backend.specs_from_source(_Metas(meta), 2)
    assert words in str(info.value), info.value
