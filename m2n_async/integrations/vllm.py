"""vLLM weight-transfer backend ``m2n_async``: the worker engine, the trainer engine, ``register``.

Theory of operation. vLLM (0.33) has a pluggable weight-transfer subsystem: its GPU worker
builds one engine per worker process with ``WeightTransferEngineFactory.create_engine(config,
vllm_config, device, model)`` and drives it synchronously from ``collective_rpc``; trainers
build theirs with ``WeightTransferTrainerFactory.trainer_init(init_info, client=, source=)``.
``register()`` (entry point group ``vllm.general_plugins``, run by vLLM in every process of
its own before the engine is built; a trainer process runs no vLLM plugins, so it calls it,
or builds its ``TrainerInitInfo`` once ``vllm.distributed.weight_transfer`` is imported,
which registers) adds ``m2n_async`` to both registries, idempotently. Neither class
subclasses vLLM's ABCs (the factories check nothing), so this module imports no vLLM at
import time; what it needs from vLLM it imports inside the functions that use it.

Worker side (``VLLMWorkerBackend``), as the GPU worker calls it:

- ``init_transfer_engine(parse_init_info(d))``: the trainer's sender sends ``d`` (built by
  ``VLLMTrainerEngine``): the store address, ``trainer_ranks``, ``world_size`` and the
  parameter list (name, wire dtype, global shape). The worker's rank is vLLM's convention,
  ``rank_offset + data_parallel_index * world_size_per_replica + rank``; its mesh is
  ``(replicas, tp)``. Destinations come from the live model, by vLLM's own rule
  (``m2n_layout.resolve_parameter_destinations``): a name that maps 1:1 onto an unquantized
  parameter whose loader is a known-safe copy / column / row loader (PP = 1) is written **in
  place**, only this rank's shard crossing the wire; everything else — fused ``qkv_proj`` and
  ``gate_up_proj``, MoE ``w13``/``w2``, vocab-parallel embeddings, quantized layers — is a
  ``LoadTarget`` receiving the full tensor, handed to the model's ``load_weights``. A module
  holding any such parameter loads all its parameters that way (layerwise reload finalizes a
  module as a unit and would copy stale storage over an in-place write). Then
  ``BlockingWorker.connect`` joins the job (the engine runs on its own loop thread).
- ``start_weight_update()``: opens a session; with load targets, vLLM's
  ``initialize_layerwise_reload(model)``.
- ``update_weights(d)``: one m2n_async round, received inside this call (vLLM guarantees no
  forward pass between pause and resume, so the receive must not run free). In-place
  targets are written by the engine; load targets arrive on the engine's unpack thread and
  are cloned onto a small bounded queue that **this** thread drains through one
  ``model.load_weights(iterator)`` call (one invocation, as vLLM's own backends do: some
  loaders keep invocation-local state; and on vLLM's thread, where its context variables and
  CUDA stream are). This rank's part of the round ends only once that call returned, so a
  ``load_weights`` that raises fails the round on every rank with its error, naming this
  worker. Returns once every rank reported the round complete and the device is
  synchronized.
- ``finish_weight_update()``: ``finalize_layerwise_reload(model, model_config)``. The version
  vLLM publishes (``finish_weight_update(weight_version)``) is vLLM's; the backend publishes
  none (the engine's own round counter is internal).
- ``shutdown()``: closes the engine from any state; idempotent; ``init`` works again after.

Failure. The engine writes in place, so a round that fails (a peer died, a deadline, the
trainer aborted, ``load_weights`` raised) leaves the model **poisoned**: some parameters may
hold the new round, others the previous one. The backend then finalizes any layerwise
reload it opened (so no layer is left on the meta device), records the cause, and refuses
``start_weight_update`` with a ``RuntimeError`` naming it until ``shutdown()`` and a new
``init``; the next successful round is a full resync, after which the model is consistent.
Calls out of order (update before start, a second update in one session, a second init)
raise ``RuntimeError`` before anything is received or changed; so does, as ``ValueError``
at init, a declared shape that a parameter with a known-safe loader contradicts (that loader
would fail mid-round, or cut a slab of the wrong tensor). A ``load_weights`` failure names
the tensor it took last, and a failed round's error says the model may be partly updated,
unless the round failed before this rank's part of it began (the trainer ended or was lost
between rounds): then it says nothing was received and the model is untouched, and still
poisons (that connection takes no more rounds).

Trainer side (``VLLMTrainerEngine``): ``trainer_init`` on every trainer rank maps the
``WeightSource``'s ``ParamMeta`` (``owners``, ``mesh_shape``, ``placements``; vLLM's
``ModuleSource`` over an FSDP2/DTensor module fills them) onto ``ParamSpec``s; rank 0 serves
the job's store (unless given one), sends the workers' init RPC while every rank connects,
and ``send_weights()`` is one round: rank 0 calls ``start_weight_update``, sends
``update_weights`` on a thread while every rank's ``sync_weights(source.iter_local())`` runs,
then ``finish_weight_update``. A worker whose ``load_weights`` raises fails the round on
every rank with that error, naming the worker; if the update RPC fails and the round is
still running 5 s later, the round is cancelled (aborted everywhere) instead of waiting for
its deadline.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import operator
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from m2n_async._engine._config import EngineConfig, EngineState, SyncResult
from m2n_async._integrations.targets import LoadTarget
from m2n_async._proto.errors import (
    AuthenticationError,
    EnginePoisonedError,
    LocalProtocolError,
    PeerLostError,
    PhaseTimeoutError,
    PlanError,
    StoreError,
    TransferError,
)
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamSpec, dtype_name
from m2n_async.blocking import BlockingTrainer, BlockingWorker

if TYPE_CHECKING:
    import torch

    from m2n_async._store import StoreThread

__all__ = [
    "BACKEND",
    "TOKEN_ENV",
    "TrainerInitInfo",
    "UpdateInfo",
    "VLLMTrainerEngine",
    "VLLMWorkerBackend",
    "WorkerInitInfo",
    "register",
    "specs_from_source",
]

log = logging.getLogger("m2n_async.vllm")

BACKEND = "m2n_async"
"""The name both vLLM factories know this backend by (``{"backend": "m2n_async"}``)."""

TOKEN_ENV = "M2N_ASYNC_TOKEN"
"""Default environment variable holding the store's shared secret on every rank (the token
never travels in ``init_info``: vLLM's HTTP dev endpoints are unauthenticated)."""

# Loaders vLLM's m2n_layout accepts for in-place writes: (module, qualified name) -> kind.
# Compared by identity with the live functions (imported from vLLM), as vLLM does.
_COPY, _COLUMN, _ROW = "copy", "column", "row"
_SAFE_LOADERS: tuple[tuple[str, str, str], ...] = (
    ("vllm.model_executor.model_loader.weight_utils", "default_weight_loader", _COPY),
    ("vllm.model_executor.layers.linear", "ReplicatedLinear.weight_loader", _COPY),
    ("vllm.model_executor.layers.linear", "ColumnParallelLinear.weight_loader", _COLUMN),
    ("vllm.model_executor.layers.linear", "ColumnParallelLinear.weight_loader_v2", _COLUMN),
    ("vllm.model_executor.layers.linear", "RowParallelLinear.weight_loader", _ROW),
    ("vllm.model_executor.layers.linear", "RowParallelLinear.weight_loader_v2", _ROW),
)
# Parameter attributes that mean packing, a transform or pre-sharded storage (m2n_layout).
_METADATA_ATTRS = ("packed_dim", "packed_factor", "marlin_tile_size")
_FLAG_ATTRS = ("needs_scalar_to_array", "is_sharded_weight", "is_transposed")
# Model types whose load_weights preprocesses checkpoint tensors (m2n_layout's blocklist).
_DIRECT_BLOCKLIST = frozenset({"vllm.model_executor.models.gpt2.GPT2Model"})


# -- init and update info --------------------------------------------------------------------


@dataclass(frozen=True)
class WireParam:
    """One parameter as the trainer declares it to the workers: plan name, wire dtype name,
    global shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class WorkerInitInfo:
    """The worker's ``init_info`` (JSON), as ``VLLMTrainerEngine`` builds it.

    Required: ``store_address`` (``"host:port"`` of the job's store), ``trainer_ranks``
    (``T``), ``world_size`` (``T + N``: every trainer and every worker rank of the job),
    ``params`` (a list of ``{"name", "dtype", "shape"}``, in plan order). Optional:
    ``rank_offset`` (first worker rank of this deployment; default ``T``), ``job``,
    ``transport``, ``token_env`` (the environment variable holding the store token),
    ``bucket_bytes``, ``phase_timeout``, ``round_timeout``, ``connect_timeout``,
    ``receive_timeout`` (how long ``update_weights`` waits for the trainer to start the round),
    ``host`` (the address the CPU data plane binds).
    """

    store_address: str
    trainer_ranks: int
    world_size: int
    params: tuple[WireParam, ...]
    rank_offset: int | None = None
    job: str = "m2n"
    transport: str = "auto"
    token_env: str = TOKEN_ENV
    bucket_bytes: int | None = None
    phase_timeout: float = 60.0
    round_timeout: float = 300.0
    connect_timeout: float | None = None
    receive_timeout: float | None = 300.0
    host: str | None = None


@dataclass(frozen=True, kw_only=True)
class UpdateInfo:
    """The worker's ``update_info`` (JSON; all optional): ``timeout``, seconds to wait for
    the trainer to start this round (default: ``init_info``'s ``receive_timeout``)."""

    timeout: float | None = None


def _types_of(cls: type) -> dict[str, tuple[type, ...]]:
    kinds: dict[str, tuple[type, ...]] = {
        "str": (str,), "int": (int,), "float": (int, float), "str | None": (str, type(None)),
        "int | None": (int, type(None)), "float | None": (int, float, type(None)),
        "tuple[WireParam, ...]": (list, tuple)}
    return {f.name: kinds[str(f.type)] for f in dataclasses.fields(cls)}


def _parse(cls: type, what: str, d: object) -> dict[str, Any]:
    """Check ``d``'s keys and value types against dataclass ``cls``: ``ValueError`` naming
    every unknown key, every missing one and every value of the wrong type."""
    if not isinstance(d, Mapping):
        raise ValueError(f"m2n_async {what} must be a JSON object (dict), got "
                         f"{type(d).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - set(fields))
    missing = sorted(n for n, f in fields.items()
                     if n not in d and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    problems = []
    if unknown:
        problems.append(f"unknown keys {unknown}")
    if missing:
        problems.append(f"missing keys {missing}")
    problems += _value_problems(cls, d, "null")
    if problems:
        raise ValueError(f"m2n_async {what}: {'; '.join(problems)} (known keys: "
                         f"{sorted(fields)})")
    return dict(d)


def _value_problems(cls: type, d: Mapping[str, object], none: str,
                    skip: frozenset[str] = frozenset()) -> list[str]:
    """Values of ``d`` of the wrong type for dataclass ``cls`` (a bool is no int), and
    timeouts that are no finite seconds > 0 (``none``: how the caller spells None)."""
    types = _types_of(cls)
    wrong_keys = {k for k, v in d.items() if k in types and k not in skip
                  and (not isinstance(v, types[k]) or isinstance(v, bool))}
    problems = []
    if wrong_keys:
        wrong = sorted(f"{k}={_shown(k, d[k])} ({type(d[k]).__name__})" for k in wrong_keys)
        problems.append(f"values of the wrong type: {', '.join(wrong)}")
    # Seconds, as EngineConfig and sync_weights(timeout=) take them: finite and > 0.
    bad = sorted(f"{k}={v!r}" for k, v in d.items()
                 if k.endswith("timeout") and k not in wrong_keys and v is not None
                 and not _is_seconds(v))
    if bad:
        problems.append(f"timeouts must be finite numbers of seconds > 0 and at most "
                        f"{_MAX_SECONDS:.0f} (or {none}) {bad}")
    return problems


def _shown(key: str, value: object) -> str:
    """``value`` for an error message: its repr, shortened; a secret's never (errors reach
    logs and HTTP replies)."""
    if key == "token":
        return "<redacted>"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


# The longest wait a thread can make (Future.result, Event.wait): a longer one raises
# OverflowError where it waits, after the round it bounds may already have succeeded.
_MAX_SECONDS = threading.TIMEOUT_MAX


def _is_seconds(v: object) -> bool:
    """A timeout as EngineConfig and ``sync_weights(timeout=)`` take it: finite, > 0, and no
    longer than a thread can wait."""
    return (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            and 0 < v <= _MAX_SECONDS)


def _parse_params(raw: Sequence[object]) -> tuple[WireParam, ...]:
    out = []
    for i, p in enumerate(raw):
        if not isinstance(p, Mapping) or set(p) != {"name", "dtype", "shape"}:
            raise ValueError(f"m2n_async init_info params[{i}] must be an object with exactly "
                             f"the keys ['dtype', 'name', 'shape'], got {p!r}")
        name, dtype, shape = p["name"], p["dtype"], p["shape"]
        if (not isinstance(name, str) or not name or not isinstance(dtype, str)
                or not isinstance(shape, list | tuple)
                or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                           for n in shape)):
            raise ValueError(f"m2n_async init_info params[{i}]: name must be a non-empty "
                             f"string, dtype a string and shape a list of ints >= 0, got "
                             f"{p!r}")
        try:
            dtype = dtype_name(dtype)
        except PlanError as exc:
            raise ValueError(f"m2n_async init_info params[{i}] ({name!r}): {exc}") from None
        out.append(WireParam(name, dtype, tuple(shape)))
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"m2n_async init_info params: names declared twice: {dup}")
    return tuple(out)


def _worker_payload(info: TrainerInitInfo, address: str, specs: Sequence[ParamSpec]
                    ) -> dict[str, Any]:
    """The workers' ``init_info`` (JSON-safe) a trainer sends."""
    payload: dict[str, Any] = {
        "store_address": address, "trainer_ranks": info.trainer_ranks,
        "world_size": info.world_size,
        "params": [{"name": s.name, "dtype": s.dtype, "shape": list(s.shape)} for s in specs],
        "job": info.job, "transport": info.transport, "token_env": info.token_env,
        "phase_timeout": info.phase_timeout, "round_timeout": info.round_timeout,
        "receive_timeout": info.update_timeout,
    }
    optional = {"rank_offset": info.worker_rank_offset, "bucket_bytes": info.bucket_bytes,
                "connect_timeout": info.connect_timeout, "host": info.worker_host}
    payload.update({k: v for k, v in optional.items() if v is not None})
    return payload


def _engine_config(info: WorkerInitInfo, device: str | None) -> EngineConfig:
    """The worker's ``EngineConfig`` (``PlanError`` naming the field it refuses)."""
    return EngineConfig(transport=info.transport, bucket_bytes=info.bucket_bytes,
                        phase_timeout=info.phase_timeout, round_timeout=info.round_timeout,
                        device=device, host=info.host, job=info.job)


def _token(env: str, explicit: str | None = None) -> str:
    if explicit is not None:
        if not explicit:  # never the environment's fault: the caller gave this one
            raise ValueError("m2n_async: TrainerInitInfo.token is empty: give the store's "
                             "shared secret, or leave token None to read it from token_env")
        return explicit
    token = os.environ.get(env)
    if not token:
        how = "is not set" if token is None else "is empty"
        raise ValueError(f"m2n_async: no store token: the environment variable {env} {how}; "
                         f"set it to the job's shared secret on every trainer and worker "
                         f"process (it is never sent in init_info)")
    return token


# -- destinations from the live vLLM model ---------------------------------------------------


def _safe_loaders() -> dict[Any, str]:
    """vLLM's known-safe loader functions (identity -> kind); empty without vLLM."""
    import importlib

    out: dict[Any, str] = {}
    for module, qualname, kind in _SAFE_LOADERS:
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            continue  # fail closed: an unknown loader is never written in place
        out[obj] = kind
    return out


def _declared_shard(param: Any, tp: int, safe: Mapping[Any, str]) -> int | None:
    """A known-safe loader's declared shard dim (``REPLICATE`` for a plain copy), or None
    (m2n_layout's ``_base_loader_shard_dim``): wrappers, partials, packing and transform
    attributes and foreign loaders all fail closed."""
    import functools
    import inspect

    loader = getattr(param, "weight_loader", None)
    if loader is None or isinstance(loader, functools.partial):
        return None
    owner = loader.__self__ if inspect.ismethod(loader) else None
    fn = loader.__func__ if inspect.ismethod(loader) else loader
    if any(getattr(param, a, None) is not None for a in _METADATA_ATTRS):
        return None
    if any(bool(getattr(param, a, False)) for a in _FLAG_ATTRS):
        return None
    kind = safe.get(fn)
    if kind is None:
        return None
    if kind == _COPY:
        return REPLICATE
    if owner is None or getattr(owner, "tp_size", None) != tp:
        return None
    dim = getattr(param, "output_dim" if kind == _COLUMN else "input_dim", None)
    return dim if isinstance(dim, int) and not isinstance(dim, bool) and dim >= 0 else None


def _validated_shard(global_shape: Sequence[int], local_shape: Sequence[int], declared: int,
                     tp: int) -> int | None:
    if len(global_shape) != len(local_shape):
        return None
    if declared == REPLICATE:
        return REPLICATE if tuple(global_shape) == tuple(local_shape) else None
    if declared >= len(global_shape):
        return None
    ok = all(whole == (local * tp if d == declared else local)
             for d, (whole, local) in enumerate(zip(global_shape, local_shape, strict=True)))
    return declared if ok else None


def resolve_destinations(model: torch.nn.Module, params: Sequence[WireParam], *, tp: int,
                         allow_direct: bool) -> dict[str, tuple[torch.Tensor, Any] | None]:
    """Per plan name: ``(live tensor, placements)`` to write in place, or ``None`` for the
    ``load_weights`` path — vLLM's ``resolve_parameter_destinations`` rule (module docstring).
    ``ValueError`` naming every name that maps onto a parameter with a known-safe loader whose
    shape contradicts the declared global shape (that loader would fail mid-round, or cut a
    slab of the wrong tensor)."""
    import torch

    live = dict(model.named_parameters()) if allow_direct else {}
    blocked = {id(p) for m in model.modules()
               if f"{type(m).__module__}.{type(m).__name__}" in _DIRECT_BLOCKLIST
               for p in m.parameters()}
    safe = _safe_loaders() if live else {}
    out: dict[str, tuple[torch.Tensor, Any] | None] = {}
    contradicted: list[str] = []
    for p in params:
        param = live.get(p.name)
        dim = None
        declared = None
        if param is not None and id(param) not in blocked:
            declared = _declared_shard(param, tp, safe)
        if declared is not None:
            assert param is not None
            local = tuple(param.shape)
            dim = _validated_shard(p.shape, local, declared, tp)
            if dim is None and not (declared == REPLICATE and param.numel() == 1
                                    and math.prod(p.shape) == 1):
                # This loader copies (or cuts this rank's slab on its declared dim): any
                # other global shape fails mid-round or, larger on that dim, loads a slab
                # of the wrong tensor without a word. A scalar copy fills whatever its shape.
                whole = local if declared == REPLICATE else tuple(
                    n * tp if d == declared else n for d, n in enumerate(local))
                how = ("a copy" if declared == REPLICATE else
                       f"dim {declared} sharded over tensor-parallel size {tp}")
                contradicted.append(f"{p.name!r} declared {p.shape}, the model's parameter is "
                                    f"{local} ({how}: global {whole})")
            if param.dtype != getattr(torch, p.dtype) or not param.data.is_contiguous():
                dim = None  # a cast or a strided copy: load_weights does it
        if dim is None:
            out[p.name] = None
        else:
            assert param is not None
            out[p.name] = (param.data, None if dim == REPLICATE else (REPLICATE, dim))
    if contradicted:
        raise ValueError(f"m2n_async: the trainer's parameters do not match this vLLM "
                         f"model's: {'; '.join(contradicted)}. Nothing was received or "
                         f"changed; the trainer's model and the served one must be the same "
                         f"architecture and config")
    # A module with any loaded parameter loads all of them (layerwise reload finalizes a
    # module as a unit: an in-place write beside a loaded sibling would be overwritten).
    loaded_modules = {n.rpartition(".")[0] for n, d in out.items() if d is None and n in live}
    for n, d in out.items():
        if d is not None and n.rpartition(".")[0] in loaded_modules:
            out[n] = None
    return out


class _LoadFeed:
    """Load-target tensors from the engine's unpack thread to ``load_weights`` on vLLM's.

    ``put`` (unpack thread) clones the staged tensor (it is valid only during the callback,
    and layerwise reload keeps loaded tensors until a layer completes) onto a queue of a few
    items, waiting while it is full, so memory stays bounded by a few full tensors. ``items``
    (vLLM's thread) yields them until all ``expected`` were yielded, or the round has
    finished and the queue is empty.

    The round's part on this rank ends only once ``load_weights`` has returned: the
    ``expected``-th ``put`` waits for ``loaded()`` (``items`` ends after that tensor, so the
    call can return). A ``load_weights`` that raises therefore always has a ``put`` waiting
    or still to come: ``stop(error)`` makes it raise that error's text, which fails the
    round on this rank with the load error as its cause, the same text on every rank.
    """

    DEPTH = 2

    def __init__(self, expected: int = 0, where: str = "") -> None:
        self._q: queue.Queue[tuple[str, torch.Tensor, Any]] = queue.Queue(self.DEPTH)
        self._stopped = threading.Event()
        self._loaded = threading.Event()
        self._error: BaseException | None = None
        self._context = ""  # what load_weights was loading when it raised, for the error
        self.expected = expected
        self.where = where  # "worker rank N", for the error
        self.yielded = 0
        self.taken: str | None = None  # the last name load_weights took this round
        self.put_count = 0
        self.names: list[str] = []  # what ``put`` delivered this round, for the error
        self.closed_early = False  # load_weights closed ``items`` before taking them all

    def begin(self) -> None:
        """A new round: nothing delivered yet."""
        self.yielded = self.put_count = 0
        self.taken = None
        self.closed_early = False
        self._context = ""
        self.names.clear()
        self._loaded.clear()
        self._stopped.clear()
        self._error = None
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break

    def put(self, name: str, tensor: torch.Tensor) -> None:
        import torch

        copy = tensor.clone()
        done = None
        if copy.is_cuda:
            # The clone runs on this thread's current stream; vLLM's thread may read it on
            # another one: it waits for this event first (``items``).
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(torch.cuda.current_stream(copy.device))
        item = (name, copy, done)
        while True:
            if self._stopped.is_set():
                raise self._stopped_error(f"before {name!r} was delivered")
            try:
                self._q.put(item, timeout=0.05)
                break
            except queue.Full:
                continue
        self.put_count += 1
        self.names.append(name)
        if self.put_count < self.expected:
            return
        # The last one: this rank's part of the round ends when load_weights did.
        while not self._loaded.wait(0.05):
            if self._stopped.is_set():
                raise self._stopped_error(f"after {name!r} was delivered")

    def _stopped_error(self, when: str) -> RuntimeError:
        if self._error is None:
            return RuntimeError(f"m2n_async: {self.where}: load_weights stopped {when}")
        # The parameter the callback is for is whichever put waited; the context says
        # which tensor load_weights was on.
        return RuntimeError(f"m2n_async: {self.where}: model.load_weights raised "
                            f"{self._error!r}{self._context}")

    def stop(self, error: BaseException | None = None, context: str = "") -> None:
        """The consumer gave up (``error``: why; ``context``: what it was loading): a
        ``put`` waiting or to come raises."""
        if self._error is None:
            self._error = error
            self._context = context
        self._stopped.set()

    def loaded(self) -> None:
        """``load_weights`` returned having consumed every tensor: the last ``put`` returns."""
        self._loaded.set()

    def items(self, finished: Callable[[], bool]) -> Iterator[tuple[str, torch.Tensor]]:
        try:
            while self.yielded < self.expected:
                try:
                    item = self._q.get(timeout=0.02)
                except queue.Empty:
                    if finished() and self._q.empty():
                        return
                    continue
                self.yielded += 1
                name, tensor, done = item
                self.taken = name
                if done is not None:
                    import torch

                    torch.cuda.current_stream(tensor.device).wait_event(done)
                yield name, tensor
        except GeneratorExit:
            # Closed by its consumer (``it.close()``, a ``yield from`` that stopped): a
            # closed generator reads as exhausted, so the caller must be told (``_receive``).
            self.closed_early = self.yielded < self.expected
            raise


def _reload_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _mtp_unchecked() -> contextlib.AbstractContextManager[Any]:
    # vLLM wraps a partial load_weights call this way (its completeness check would refuse).
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()  # type: ignore[no-any-return]


class VLLMWorkerBackend:
    """vLLM worker-side weight-transfer engine ``m2n_async`` (duck-typed; module docstring).

    Built by vLLM's ``WeightTransferEngineFactory.create_engine(config, vllm_config, device,
    model)`` in each worker process; every method is called synchronously by the GPU worker.
    States: uninitialized → (init) ready → (start) session → (update) received → (finish)
    ready; any failure inside a session → poisoned; ``shutdown`` → uninitialized.
    """

    init_info_cls = WorkerInitInfo
    update_info_cls = UpdateInfo
    # The plan's destinations are fixed at init on the target model; a draft model is
    # another set of parameters and would need its own job.
    supports_draft_weight_update = False
    defers_processing = False

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: torch.nn.Module
                 ) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.model_config = getattr(vllm_config, "model_config", None)
        self.device = device
        self.model = model
        self._default_model = model
        self._default_model_config = self.model_config
        self._worker: BlockingWorker | None = None
        self._info: WorkerInitInfo | None = None
        self._loaded: tuple[str, ...] = ()
        self._feed: _LoadFeed | None = None
        self._session = False
        self._received = False
        self._reloading = False
        self._poison: BaseException | None = None
        self._poison_untouched: str | None = None  # why the failed round never began here
        self._updates = 0  # rounds received since init: the version the model holds
        self._lock = threading.Lock()

    # -- what vLLM reads -------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank in the job: ``rank_offset + dp_index * world_size + rank``."""
        info = self._require_init("rank")
        pc = self.parallel_config
        offset = info.rank_offset if info.rank_offset is not None else info.trainer_ranks
        return int(offset + pc.data_parallel_index * pc.world_size + pc.rank)

    @property
    def _who(self) -> str:
        """``worker rank N`` for notes, also once shut down (``rank`` then raises)."""
        return f"worker rank {self.rank}" if self._info is not None else "worker (shut down)"

    @property
    def loaded_names(self) -> tuple[str, ...]:
        """Plan names delivered through ``load_weights`` (the rest are written in place)."""
        return self._loaded

    @property
    def engine(self) -> BlockingWorker | None:
        """The blocking worker engine underneath (None before init / after shutdown)."""
        return self._worker

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self) -> None:
        self.model = self._default_model
        self.model_config = self._default_model_config

    def drain_pending(self) -> None:
        """Nothing is deferred: ``update_weights`` returns with the weights on the device."""

    def parse_init_info(self, init_dict: dict[str, Any]) -> WorkerInitInfo:
        """``WorkerInitInfo`` from the JSON dict; ``ValueError`` naming unknown or missing
        keys and values of the wrong type (vLLM's convention)."""
        from m2n_async._store._sockets import parse_address

        d = _parse(WorkerInitInfo, "init_info", init_dict)
        d["params"] = _parse_params(d["params"])
        if not d["params"]:
            raise ValueError("m2n_async init_info: params is empty: the trainer declared no "
                             "parameters (its WeightSource's metadata), so no round could "
                             "update any")
        if d.get("host") == "":
            # No meaning of its own: Gloo would bind whatever the host name resolves to.
            raise ValueError("m2n_async init_info: host (the address this worker's CPU data "
                             "plane binds) must be a host name or address, or left out for "
                             "the default, got ''")
        if not 0 < d["trainer_ranks"] < d["world_size"]:
            raise ValueError(f"m2n_async init_info: need 0 < trainer_ranks < world_size, got "
                             f"trainer_ranks={d['trainer_ranks']}, world_size="
                             f"{d['world_size']}")
        info = WorkerInitInfo(**d)
        # Everything init would refuse later, refused here with the key it comes from: vLLM
        # calls parse first, and a refusal there has changed nothing.
        offset = info.rank_offset
        if offset is not None and not info.trainer_ranks <= offset < info.world_size:
            raise ValueError(f"m2n_async init_info: rank_offset (the first worker rank of "
                             f"this deployment) must be in [trainer_ranks, world_size) = "
                             f"[{info.trainer_ranks}, {info.world_size}), got {offset}")
        if not info.token_env:
            raise ValueError("m2n_async init_info: token_env must name an environment "
                             "variable, got ''")
        try:
            parse_address(info.store_address)
        except ValueError as exc:
            raise ValueError(f"m2n_async init_info: store_address: {exc}") from None
        try:
            _engine_config(info, None)
        except PlanError as exc:
            raise ValueError(f"m2n_async init_info: {exc}") from None
        return info

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        """``UpdateInfo`` from the JSON dict (``ValueError`` as ``parse_init_info``)."""
        return UpdateInfo(**_parse(UpdateInfo, "update_info", update_dict))

    # -- lifecycle -------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: WorkerInitInfo) -> None:
        """Resolve destinations on the live model and join the job (blocks until every rank
        agreed on the plan). A second init without ``shutdown()`` raises ``RuntimeError``
        and leaves the running engine untouched."""
        with self._lock:
            if self._worker is not None or self._info is not None:
                raise RuntimeError("m2n_async: the weight-transfer engine is already "
                                   "initialized; call shutdown_weight_transfer_engine() "
                                   "before initializing again")
            if not isinstance(init_info, WorkerInitInfo):
                init_info = self.parse_init_info(init_info)  # refuses a non-object too
            token = _token(init_info.token_env)
            self._info = init_info
            try:
                self._worker = self._connect(init_info, token)
            except BaseException:
                self._info = None
                self._loaded = ()
                raise
            self._poison = None
            self._poison_untouched = None
            self._updates = 0

    def _connect(self, info: WorkerInitInfo, token: str) -> BlockingWorker:
        import torch

        pc = self.parallel_config
        tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        workers = info.world_size - info.trainer_ranks
        if not info.trainer_ranks <= self.rank < info.world_size:
            # The engine would refuse the rank too, without saying how vLLM composed it.
            offset = info.rank_offset if info.rank_offset is not None else info.trainer_ranks
            raise ValueError(
                f"m2n_async: worker rank {self.rank} (rank_offset {offset} + "
                f"data_parallel_index {pc.data_parallel_index} x {pc.world_size} + rank "
                f"{pc.rank}) is outside the job's worker ranks [{info.trainer_ranks}, "
                f"{info.world_size}): world_size must count every worker rank of every "
                f"deployment (trainer_ranks + DP x TP x PP), and rank_offset place this one "
                f"inside it")
        quantized = getattr(self.model_config, "quantization", None) is not None
        # PP splits the layers (no shard of a checkpoint tensor is a stage's slab) and
        # quantized loaders transform: both take every parameter through load_weights.
        allow_direct = not quantized and pp == 1
        if allow_direct and workers % tp:
            raise ValueError(f"m2n_async: {workers} worker ranks are not a multiple of the "
                             f"tensor-parallel size {tp}")
        mesh_dims = (workers // tp, tp) if allow_direct else (workers, 1)
        direct = resolve_destinations(self.model, info.params, tp=tp, allow_direct=allow_direct)
        device = torch.device(self.device) if self.device is not None else torch.device("cpu")
        self._loaded = tuple(p.name for p in info.params if direct[p.name] is None)
        self._feed = feed = _LoadFeed(len(self._loaded), where=f"worker rank {self.rank}")
        targets: dict[str, Any] = {}
        for p in info.params:
            d = direct[p.name]
            targets[p.name] = d if d is not None else LoadTarget(
                p.shape, p.dtype, None, feed.put, device)
        log.info("m2n_async destinations: %d of %d parameters written in place, %d through "
                 "load_weights", len(info.params) - len(self._loaded), len(info.params),
                 len(self._loaded))
        cfg = _engine_config(info, None if device.type == "cpu" else str(device))
        from m2n_async._store import JobClaimedError

        # The engine's connect bounds this wait too; checked here first for an error that
        # says which init_info setting bounded it and what to check. One connect_timeout
        # bounds the probe and the connect together: the connect gets what the probe left.
        budget = _ConnectBudget(info.connect_timeout, info.phase_timeout)
        _await_store_answer(info.store_address, budget)
        timeout = budget.left(f"connecting to the store at {info.store_address}")
        try:
            return BlockingWorker.connect(info.store_address, token=token, rank=self.rank,
                                          trainer_ranks=info.trainer_ranks,
                                          world_size=info.world_size, targets=targets,
                                          mesh_dims=mesh_dims, config=cfg,
                                          timeout=timeout)
        except JobClaimedError as exc:
            offset = info.rank_offset if info.rank_offset is not None else info.trainer_ranks
            raise JobClaimedError(
                f"m2n_async: two processes claim worker rank {self.rank} of job {info.job!r}"
                f" (rank_offset {offset} + data_parallel_index {pc.data_parallel_index} x "
                f"{pc.world_size} + rank {pc.rank}); it is held by "
                f"{exc.holder.describe() if exc.holder is not None else 'another process'}. "
                f"Several vLLM instances driven by one trainer must be the data-parallel "
                f"ranks of one deployment (distinct data_parallel_index), or each get its "
                f"own rank_offset", job=exc.job, rank=exc.rank, holder=exc.holder) from exc

    def start_weight_update(self) -> None:
        """Open a session (one round); initializes layerwise reload when some parameter goes
        through ``load_weights``. ``RuntimeError`` before init, while a session is open, or
        after a failed round (poisoned: shut down and init again)."""
        self._require_ready("start_weight_update")
        if self._session:
            raise RuntimeError("m2n_async: start_weight_update called while a weight update "
                               "is active; call finish_weight_update first")
        if self.model is not self._default_model:
            raise RuntimeError("m2n_async: the update target is not the model the plan was "
                               "built on (draft updates are not supported)")
        if self._loaded:
            hooks = _reload_hooks()
            if hooks is not None:
                hooks[0](self.model)
                self._reloading = True
        self._session = True
        self._received = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive one round into the model; returns once every rank reported it complete
        and the device is synchronized. ``RuntimeError`` (nothing received) outside a
        session or for a second round in one session; a failed round raises its
        ``TransferError`` (or ``load_weights``' error) and poisons the backend."""
        self._require_ready("update_weights")
        if not self._session:
            raise RuntimeError("m2n_async: start_weight_update must be called before "
                               "update_weights")
        try:
            info = self.parse_update_info(update_info)
            if self._received:
                raise RuntimeError("m2n_async: one round per weight update: call "
                                   "finish_weight_update before the next update_weights")
        except BaseException:
            # vLLM's worker ends its session on any error from update_weights; so does this
            # one (nothing of this call was received).
            self._end_session()
            raise
        assert self._worker is not None and self._info is not None
        timeout = info.timeout if info.timeout is not None else self._info.receive_timeout
        try:
            self._receive(self._worker, timeout)
        except TimeoutError as exc:
            if self._worker.state is not EngineState.READY:
                self._fail(exc)
                raise
            # No round started: nothing was received and the model holds its previous
            # weights. vLLM ends its session on any error, so this one ends too (its reload
            # finalized, which puts the untouched layers back); the backend stays usable.
            self._end_session()
            raise TimeoutError(f"m2n_async: {exc}; the model keeps its previous weights")\
                from exc
        except BaseException as exc:
            self._fail(exc, self._unstarted(exc))
            raise
        self._received = True
        self._updates += 1

    def _unstarted(self, exc: BaseException) -> str | None:
        """Why the round ``exc`` failed before this rank's part of it began (then nothing of
        it was written here), or None: it began, and the model may be partly updated."""
        worker = self._worker
        if worker is None:
            return None
        if isinstance(exc, PeerLostError):
            # receive raises it only for a job that has no more rounds (nothing began).
            return f"the trainer job ended ({exc})"
        if not isinstance(exc, TransferError) or exc.round is None \
                or exc.round <= worker.last_began:
            return None
        if exc.cause in ("lost", "left", "store"):
            return f"the trainer was lost ({exc})"
        return f"the round failed before this worker's part of it began ({exc})"

    def _receive(self, worker: BlockingWorker, timeout: float | None) -> SyncResult:
        import torch

        if not self._loaded:
            result = worker.receive(timeout=timeout)
        else:
            feed = self._feed
            assert feed is not None
            feed.begin()
            pending = worker.start_receive(timeout=timeout)
            try:
                with _mtp_unchecked():
                    items = feed.items(pending.done)
                    self.model.load_weights(items)  # type: ignore[operator]
                    for _ in items:  # what load_weights left unread would be lost
                        raise RuntimeError("m2n_async: model.load_weights returned before "
                                           "consuming every received tensor")
                    if feed.closed_early:
                        raise RuntimeError(
                            f"m2n_async: model.load_weights closed its iterator after "
                            f"{feed.yielded} of {feed.expected} tensors: what it left "
                            f"unread would be lost")
            except Exception as exc:
                # The unpack thread still has a load callback waiting (the last one waits for
                # load_weights to return) or to come: it raises this error's text, so the
                # round fails on every rank naming this worker, the load error and the
                # tensor load_weights was on.
                context = self._load_context(feed.taken)
                exc.add_note(f"m2n_async: {self._who}: load_weights raised"
                             f"{context}")
                feed.stop(exc, context)
                try:
                    pending.result()
                except BaseException as round_error:
                    exc.add_note(f"m2n_async: {self._who}: the round failed on "
                                 f"every rank: {round_error}")
                raise
            except BaseException:
                feed.stop()  # interrupted: a callback waiting for room fails
                pending.cancel()
                raise
            feed.loaded()
            result = pending.result()
            if feed.yielded != len(self._loaded) or feed.put_count != len(self._loaded):
                missing = sorted(set(self._loaded) - set(feed.names))
                raise RuntimeError(
                    f"m2n_async: {self._who}: load_weights got {feed.yielded} of "
                    f"{len(self._loaded)} tensors ({feed.put_count} received; never received: "
                    f"{missing[:5]}{' ...' if len(missing) > 5 else ''})")
        if torch.device(self.device or "cpu").type == "cuda":
            torch.cuda.synchronize(self.device)  # the next forward reads what landed
        return result

    def _load_context(self, name: str | None) -> str:
        """For a load error: the tensor ``load_weights`` took last (the one it was loading,
        unless it reads ahead), its declared shape and the model's parameter of that name."""
        if name is None:
            return " before it took any tensor"
        assert self._info is not None
        declared = next((p.shape for p in self._info.params if p.name == name), None)
        live = dict(self.model.named_parameters()).get(name)
        model = (f", the model's parameter of that name is {tuple(live.shape)}"
                 if live is not None else "")
        return (f"; the last tensor it had taken was {name!r} (declared {declared}{model})")

    def finish_weight_update(self) -> None:
        """Close the session: ``finalize_layerwise_reload(model, model_config)`` if the
        session opened one. ``RuntimeError`` without a session."""
        self._require_init("finish_weight_update")
        if self._poison is not None and not self._session:
            # vLLM keeps its session open when this call raised (it clears it only after a
            # return): a second finish after a failed one lets it close, so that
            # shutdown_weight_transfer_engine() is allowed again. The engine stays poisoned.
            log.warning("m2n_async: finish_weight_update after a failed update: the session "
                        "ends; %s", "the model stays poisoned until shutdown and init"
                        if self._poison_untouched is None else
                        "the model is untouched, and this connection takes no more rounds "
                        "until shutdown and init")
            return
        self._require_ready("finish_weight_update")
        if not self._session:
            raise RuntimeError("m2n_async: finish_weight_update called without a matching "
                               "start_weight_update")
        try:
            self._finalize_reload()
        except BaseException as exc:
            self._fail(exc)
            raise
        self._session = False
        self._received = False

    def shutdown(self) -> None:
        """Release the engine (from any state; idempotent). A layerwise reload still open is
        finalized first, so no layer stays on the meta device. ``init`` works again after."""
        with self._lock:
            with contextlib.suppress(Exception):
                self._finalize_reload()
            worker, self._worker = self._worker, None
            self._info = None
            self._session = self._received = False
            if self._feed is not None:  # a load callback still waiting on it returns
                self._feed.stop()
            self._feed = None
            self._loaded = ()
            self._poison = None
            self._poison_untouched = None
            self._updates = 0
            if worker is not None:
                worker.close()

    # -- guards ----------------------------------------------------------------------------

    def _end_session(self) -> None:
        self._session = self._received = False
        self._finalize_reload()

    def _finalize_reload(self) -> None:
        if self._reloading:
            self._reloading = False
            hooks = _reload_hooks()
            if hooks is not None:
                hooks[1](self.model, self.model_config)

    def _fail(self, exc: BaseException, unstarted: str | None = None) -> None:
        """A round failed: close the reload, poison. ``unstarted``: why it failed before this
        rank's part began (nothing was written: the model is untouched, but this connection
        takes no more rounds); None: the model may mix two versions."""
        # Said on the error itself: vLLM hands it to the caller (an RPC, an HTTP reply),
        # which may never see this process's log.
        if self._info is None:  # shut down (another thread) while this update ran
            exc.add_note("m2n_async: the weight transfer engine was shut down during this "
                         "update (shutdown_weight_transfer_engine); init it again for more")
            return  # nothing to poison: the next init starts clean
        if unstarted is None:
            exc.add_note(f"m2n_async: {self._who}: the model may be partly "
                         f"updated (some parameters hold this round's weights, others the "
                         f"previous ones); start_weight_update is refused until "
                         f"shutdown_weight_transfer_engine(), init_weight_transfer_engine() "
                         f"and a full update")
        else:
            exc.add_note(f"m2n_async: {self._who}: {self._untouched(unstarted)}")
        self._poison = exc
        self._poison_untouched = unstarted
        self._session = self._received = False
        try:
            self._finalize_reload()
        except Exception:
            log.exception("m2n_async: finalizing the layerwise reload after a failed round")
        if unstarted is None:
            log.error("m2n_async: weight update failed; the model's weights may mix the "
                      "previous and the new version until a round succeeds after shutdown "
                      "and init: %r", exc)
        else:
            log.error("m2n_async: weight update failed before it started: %s",
                      self._untouched(unstarted))

    def _untouched(self, why: str) -> str:
        """What a round that failed before this rank's part began left, and what to do."""
        n = self._updates
        held = (f"the weights of its update {n} since init" if n else
                "the weights it held at init (no update completed since)")
        return (f"{why} before this update started: nothing was received in this call, and "
                f"the model holds version {n} ({held}), untouched by this call. No update can "
                f"arrive on this connection: call shutdown_weight_transfer_engine(), then "
                f"init_weight_transfer_engine() against a restarted trainer (its trainer_init "
                f"sends it)")

    def _require_init(self, what: str) -> WorkerInitInfo:
        if self._info is None:
            raise RuntimeError(f"m2n_async: {what} before init_weight_transfer_engine()")
        return self._info

    def _require_ready(self, what: str) -> None:
        self._require_init(what)
        if self._poison is not None and self._poison_untouched is not None:
            raise RuntimeError(f"m2n_async: {what} refused: an earlier weight update failed "
                               f"({self._poison!r}): {self._untouched(self._poison_untouched)}"
                               ) from self._poison
        if self._poison is not None:
            raise RuntimeError(
                f"m2n_async: {what} refused: an earlier weight update failed ({self._poison!r})"
                f" and the model is poisoned (its weights may mix two versions); call "
                f"shutdown_weight_transfer_engine() and init_weight_transfer_engine() again, "
                f"then run a full update") from self._poison


# -- the trainer side ------------------------------------------------------------------------


@dataclass(kw_only=True)
class TrainerInitInfo:
    """Trainer-side init info for ``WeightTransferTrainerFactory.trainer_init`` (the factory
    dispatches on the class-level ``backend``).

    ``rank`` (this trainer's rank, ``0 <= rank < trainer_ranks``; rank 0 is the sender),
    ``trainer_ranks`` (``T``), ``world_size`` (``T + N``, every worker rank of every
    deployment the client drives). The store: ``store_address`` of a running ``m2n-async
    store``, or ``None`` for rank 0 to serve one at ``store_host:store_port`` (with
    ``T > 1`` and port 0, the address reaches the other trainers through the default
    ``torch.distributed`` group). ``token``: the store secret (default: the environment
    variable ``token_env`` — which the workers read too; never sent). ``dtype``: the wire
    dtype for floating-point parameters (the serving dtype, e.g. ``"bfloat16"``, when the
    trainer keeps fp32 masters; in-place destinations need it to equal vLLM's). The rest
    configure the engine (``EngineConfig``) and bound the RPCs (``update_timeout``).
    ``ValueError`` naming the field and its value, where it is built, for what
    ``trainer_init`` would refuse: a wrong type, ranks outside ``0 <= rank < trainer_ranks <
    world_size``, a ``worker_rank_offset`` outside ``[trainer_ranks, world_size)``, engine
    settings ``EngineConfig`` refuses.
    """

    backend: ClassVar[str] = BACKEND

    rank: int
    world_size: int
    trainer_ranks: int = 1
    store_address: str | None = None
    store_host: str = "127.0.0.1"
    store_port: int = 0
    token: str | None = field(default=None, repr=False)
    token_env: str = TOKEN_ENV
    job: str = "m2n"
    transport: str = "auto"
    dtype: str | None = None
    bucket_bytes: int | None = None
    phase_timeout: float = 60.0
    round_timeout: float = 300.0
    connect_timeout: float | None = None
    update_timeout: float = 300.0
    device: str | None = None
    host: str | None = None
    worker_host: str | None = None
    worker_rank_offset: int | None = None

    def __post_init__(self) -> None:
        # Checked where the info is built, naming the field: a port read from the
        # environment as a string would otherwise fail later as a bare comparison TypeError.
        # dtype and device also take torch objects (ParamSpec and torch.device accept both).
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        problems = _value_problems(TrainerInitInfo, values, "None",
                                   skip=frozenset({"dtype", "device"}))
        port = self.store_port
        if isinstance(port, int) and not isinstance(port, bool) and not 0 <= port <= 65535:
            problems.append(f"store_port must be in [0, 65535], got {port}")
        if not problems:
            problems += self._rank_problems()
        if self.token == "":
            # Said as what it is: falling back to token_env would blame the environment.
            problems.append("token is empty: give the store's shared secret, or leave token "
                            "None to read it from the environment variable token_env")
        if self.token_env == "":
            problems.append("token_env must name an environment variable, got ''")
        for name in ("store_host", "host", "worker_host"):
            if getattr(self, name) == "":
                # No meaning of its own: Gloo would bind whatever the host name resolves to,
                # and the store's peers could not connect to ":port".
                problems.append(f"{name} must be a host name or address, got ''")
        if self.dtype is not None:
            try:
                wire = dtype_name(self.dtype)
            except PlanError as exc:
                problems.append(f"dtype: {exc}")
            else:
                if not wire.startswith(("float", "bfloat")):
                    # It applies to floating-point parameters only, and no float source is
                    # sent as this: every round would fail at its first parameter.
                    problems.append(f"dtype (the wire dtype of floating-point parameters) "
                                    f"must be a floating-point dtype, got {wire}")
        if self.device is not None:
            problems += _device_problems(self.device)
        if not problems:
            # The engine's own checks (transport, job, bucket_bytes), here where the info
            # is built, as the workers' parse_init_info makes them: refused in trainer_init,
            # rank 0 had served a store first, and the other ranks waited for it.
            try:
                self.engine_config()
            except PlanError as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError(f"m2n_async TrainerInitInfo: {'; '.join(problems)}")
        # A trainer process is no vLLM process: vLLM never runs its general plugins there,
        # so WeightTransferTrainerFactory would not know this backend. Where vLLM's factory
        # is loaded already (it is whoever calls its trainer_init), register now; otherwise
        # the caller must call register() first (docs/vllm.md).
        if "vllm.distributed.weight_transfer" in sys.modules:
            register()

    def _rank_problems(self) -> list[str]:
        """The ranks ``TrainerEngine.connect`` would refuse (``0 <= rank < trainer_ranks <
        world_size``) and a ``worker_rank_offset`` the workers would, each naming its field:
        refused in ``trainer_init``, rank 0 may have served a store and the other ranks
        waited for it, and a worker's init only later."""
        t, w, offset = self.trainer_ranks, self.world_size, self.worker_rank_offset
        out = []
        if t < 1:
            out.append(f"trainer_ranks must be >= 1, got {t}")
        elif not 0 <= self.rank < t:
            out.append(f"rank must be in [0, trainer_ranks) = [0, {t}), got {self.rank}")
        if w <= t:
            out.append(f"world_size (trainer_ranks + every worker rank) must be > "
                       f"trainer_ranks = {t}, got {w}")
        elif offset is not None and not t <= offset < w:
            out.append(f"worker_rank_offset (the workers' first rank) must be in "
                       f"[trainer_ranks, world_size) = [{t}, {w}), got {offset}")
        return out

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    def engine_config(self) -> EngineConfig:
        """This trainer rank's ``EngineConfig`` (``PlanError`` naming a field it refuses)."""
        return EngineConfig(transport=self.transport, bucket_bytes=self.bucket_bytes,
                            phase_timeout=self.phase_timeout, round_timeout=self.round_timeout,
                            device=self.device, host=self.host, job=self.job)


def _device_problems(device: Any) -> list[str]:
    """``TrainerInitInfo.device`` that ``torch.device`` refuses (the engine would, at
    connect, after rank 0 served a store)."""
    import torch

    try:
        torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        return [f"device must be a torch device (\"cpu\", \"cuda\", \"cuda:N\") or None, "
                f"got {device!r} ({exc})"]
    return []


def _wire_problems(source: Any, specs: Sequence[ParamSpec], dtype: Any) -> list[str]:
    """The parameters whose dtype ``TrainerInitInfo.dtype`` cannot be cast from while
    packing (an fp8 or int master to bfloat16, say): each round would fail at it."""
    if dtype is None:
        return []
    from m2n_async._proto.plan import cast_problem

    out = []
    for m, spec in zip(source.metadata, specs, strict=True):
        why = cast_problem(dtype_name(m.dtype), spec.dtype)
        if why is not None:
            out.append(f"{m.name!r} ({dtype_name(m.dtype)}): {why}")
    return out


def _placement(meta_name: str, p: Any, ndim: int) -> int:
    if type(p).__name__ == "Replicate":
        return REPLICATE
    dim = getattr(p, "dim", None)
    if type(p).__name__ != "Shard" or not isinstance(dim, int):
        raise PlanError(f"parameter {meta_name!r}: placement {p!r} is neither Replicate nor "
                        f"Shard")
    if not -ndim <= dim < ndim:  # -3 of a 2-D tensor would read as REPLICATE (-1)
        raise PlanError(f"parameter {meta_name!r}: placement {p!r} shards dim {dim} of a "
                        f"{ndim}-D tensor")
    return dim + ndim if dim < 0 else dim


def specs_from_source(source: Any, trainer_ranks: int, dtype: Any = None) -> list[ParamSpec]:
    """``ParamSpec``s of a vLLM ``WeightSource``'s ``metadata``, in its order.

    ``owners`` (``None``: every trainer rank) must be a contiguous rank interval in mesh
    order; ``mesh_shape`` 1-D ``(n,)`` is ``Mesh((n, 1))``, 2-D keeps its shape;
    ``placements`` ``None`` is replicated, ``Shard(d)`` is ``d``, ``Replicate()`` is
    ``REPLICATE`` — normalized as ``specs_from_module`` does (a shard over an axis of size 1
    is a replica; two axes sharding one dim nest row-major). ``dtype``: the wire dtype for
    floating-point parameters. ``PlanError`` names the parameter for what the core cannot
    express (non-contiguous owners, two axes sharding different dims, 3-D meshes) and for
    metadata that contradicts itself (no owners, a mesh of another size than its owners,
    more placements than mesh axes, a shard of a dim the tensor does not have).
    """
    import torch

    specs = []
    for m in source.metadata:
        name = m.name
        try:
            shape = tuple(operator.index(n) for n in m.shape)  # int(4.5) would be 4
        except TypeError:
            raise PlanError(f"parameter {name!r}: shape {tuple(m.shape)} is not a tuple of "
                            f"ints") from None
        owners = tuple(range(trainer_ranks)) if m.owners is None else tuple(m.owners)
        if not owners:
            raise PlanError(f"parameter {name!r}: no owners (an empty rank interval)")
        if not 0 <= min(owners) <= max(owners) < trainer_ranks:
            raise PlanError(f"parameter {name!r}: owners {owners} are not all trainer ranks "
                            f"[0, {trainer_ranks})")
        start = owners[0]
        if owners != tuple(range(start, start + len(owners))):
            raise PlanError(f"parameter {name!r}: owners {owners} are not a contiguous rank "
                            f"interval in mesh order")
        dims = tuple(m.mesh_shape) if m.mesh_shape is not None else (len(owners),)
        if not 1 <= len(dims) <= 2:
            raise PlanError(f"parameter {name!r}: a {len(dims)}-D mesh {dims}; m2n_async "
                            f"meshes have 1 or 2 axes")
        mesh = Mesh((dims[0], 1) if len(dims) == 1 else (dims[0], dims[1]), start)
        if mesh.size != len(owners):
            raise PlanError(f"parameter {name!r}: mesh_shape {dims} holds {mesh.size} ranks, "
                            f"its owners {len(owners)} ({owners[0]}..{owners[-1]})")
        layout = Layout(mesh, None)
        if m.placements is not None:
            if len(m.placements) > len(dims):
                raise PlanError(f"parameter {name!r}: {len(m.placements)} placements "
                                f"{tuple(m.placements)} for a {len(dims)}-D mesh {dims}")
            pl = [_placement(name, p, len(shape)) for p in m.placements]
            pl += [REPLICATE] * (2 - len(pl))
            pl = [REPLICATE if d != REPLICATE and mesh.dims[a] == 1 else d
                  for a, d in enumerate(pl)]
            if pl[0] != REPLICATE and pl[1] != REPLICATE:
                if pl[0] != pl[1]:
                    raise PlanError(f"parameter {name!r}: mesh axes shard different dims "
                                    f"({m.placements}); m2n_async layouts shard along one "
                                    f"axis")
                mesh, pl = Mesh((mesh.size, 1), start), [pl[0], REPLICATE]
            if pl != [REPLICATE, REPLICATE]:
                layout = Layout(mesh, (pl[0], pl[1]))
        wire = dtype if dtype is not None and m.dtype.is_floating_point else m.dtype
        specs.append(ParamSpec(name, wire if wire is not None else torch.float32, shape,
                               layout))
    return specs


class _RPCThread:
    """One daemon thread running trainer rank 0's client calls, in order. Not a
    ``ThreadPoolExecutor``: its worker is joined at interpreter exit, so an RPC that never
    returns (given up on after ``update_timeout``) would keep the process from exiting."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]
                                       | None] = queue.SimpleQueue()
        self._closed = False
        self._last: Future[Any] | None = None  # the call submitted last (calls run in order)
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> Future[Any]:
        if self._closed:
            raise RuntimeError("m2n_async: the trainer engine's RPC thread is shut down")
        call: Future[Any] = Future()
        self._last = call
        self._calls.put((call, fn, args))
        return call

    @property
    def busy(self) -> bool:
        """A call submitted earlier has not ended: the next one waits behind it."""
        return self._last is not None and not self._last.done()

    def shutdown(self) -> None:
        """Cancel the calls not started; the thread ends after the one it runs, if any."""
        self._closed = True
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
        self._calls.put(None)

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            call, fn, args = item
            if not call.set_running_or_notify_cancel():
                continue
            try:
                call.set_result(fn(*args))
            except BaseException as exc:
                call.set_exception(exc)


# vLLM's VLLMWeightSyncClient protocol: what trainer rank 0 calls on the workers.
_CLIENT_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights",
                   "finish_weight_update")


class VLLMTrainerEngine:
    """vLLM trainer-side weight-transfer engine ``m2n_async`` (module docstring).

    Built on every trainer rank by ``WeightTransferTrainerFactory.trainer_init(init_info,
    client=client, source=source)``; ``send_weights()`` (every rank) is one round;
    ``shutdown()`` (idempotent) closes the engine and rank 0's store, and asks the workers to
    shut theirs down when the client can (``shutdown_weight_transfer_engine``).
    """

    init_info_cls = TrainerInitInfo

    def __init__(self, *, info: TrainerInitInfo, client: Any, source: Any,
                 trainer: BlockingTrainer, store: Any, executor: _RPCThread | None
                 ) -> None:
        self.init_info = info
        self.client = client
        self.source = source
        self.rank = info.rank
        self.is_sender = info.is_sender
        self._trainer: BlockingTrainer | None = trainer
        self._store = store
        self._executor = executor
        if executor is not None:
            # Dropped without shutdown(): its RPC thread would wait on its queue for the life
            # of the process. (The engine underneath reaps itself: BlockingTrainer.)
            weakref.finalize(self, executor.shutdown)
        self._failure: BaseException | None = None  # what failed the last send_weights
        self._sending = threading.Lock()  # held by the one send_weights running

    @property
    def engine(self) -> BlockingTrainer | None:
        """The blocking trainer engine underneath (None after shutdown)."""
        return self._trainer

    @classmethod
    def trainer_init(cls, init_info: TrainerInitInfo, *, client: Any, source: Any = None
                     ) -> VLLMTrainerEngine:
        """Connect this trainer rank; rank 0 also serves the store (unless given one) and
        sends the workers' init RPC while the handshake runs. Raises ``ValueError`` for a
        missing source or token, ranks out of order, or (rank 0) a client lacking vLLM's
        sync-client methods (``init_weight_transfer_engine``, ``start_weight_update``,
        ``update_weights``, ``finish_weight_update``), ``PlanError`` for metadata the core
        cannot express, the handshake's errors, or the RPC's error (which cancels this
        rank's connect)."""
        info = init_info
        try:
            if source is None:
                raise ValueError("m2n_async trainer_init needs a WeightSource (e.g. vLLM's "
                                 "ModuleSource(model)); it sends this rank's local shards")
            if not 0 <= info.rank < info.trainer_ranks < info.world_size:
                raise ValueError(f"m2n_async: need 0 <= rank < trainer_ranks < world_size, got "
                                 f"rank={info.rank}, trainer_ranks={info.trainer_ranks}, "
                                 f"world_size={info.world_size}")
            if info.is_sender:
                missing = [m for m in _CLIENT_METHODS if not callable(getattr(client, m, None))]
                if missing:
                    raise ValueError(f"m2n_async trainer_init: trainer rank 0's client must be a "
                                     f"vLLM VLLMWeightSyncClient (e.g. RayVLLMWeightSyncClient, "
                                     f"HTTPVLLMWeightSyncClient); {type(client).__name__} has no "
                                     f"{missing}")
            offset = info.worker_rank_offset
            if offset is not None and not info.trainer_ranks <= offset < info.world_size:
                raise ValueError(f"m2n_async: worker_rank_offset (the workers' first rank) must "
                                 f"be in [trainer_ranks, world_size) = [{info.trainer_ranks}, "
                                 f"{info.world_size}), got {offset}")
            token = _token(info.token_env, info.token)
            specs = specs_from_source(source, info.trainer_ranks, info.dtype)
            if not specs:  # the workers refuse an empty params list: refused before any store
                raise ValueError("m2n_async trainer_init: the WeightSource declares no parameters "
                                 "(its metadata is empty)")
            wire = _wire_problems(source, specs, info.dtype)
            if wire:  # every round would fail at the first of them, after the workers' init
                raise ValueError(f"m2n_async trainer_init: TrainerInitInfo.dtype "
                                 f"{dtype_name(info.dtype)} cannot be the wire dtype of "
                                 f"{'; '.join(wire[:3])}{' ...' if len(wire) > 3 else ''}")
            # connect_timeout bounds this rank's whole connect: the probes, the wait for rank
            # 0's listener, the engine's connect and its retries all draw on one deadline.
            budget = _ConnectBudget(info.connect_timeout, info.phase_timeout)
            if info.store_address is not None:
                # Before the workers' init RPC: they would wait on the same silent address.
                _await_store_answer(info.store_address, budget)
        except BaseException:
            # Refused before the store: the other trainer ranks may be waiting in the
            # address broadcast (_share_store) for this one, which must join it to let
            # them go (rank 0 sharing no address) rather than leave them there.
            _leave_address_broadcast(info)
            raise
        store, address = _open_store(info, token, budget)
        executor = _RPCThread("m2n-async-vllm-rpc") if info.is_sender else None
        try:
            cfg = info.engine_config()
            # Rank 0 serves a store per trainer_init on a fixed port: after shutdown() on
            # every rank, another rank's trainer_init can reach rank 0's old store before
            # rank 0 closed it, and then loses it mid-handshake. That store is gone for
            # good, so connect again (bounded) to the one rank 0 opens next.
            retry_until = budget.deadline if budget.deadline is not None else \
                time.monotonic() + info.phase_timeout
            if store is not None or info.store_address is not None or info.store_port == 0:
                retry_until = 0.0
            while True:
                pending = BlockingTrainer.start_connect(
                    address, token=token, rank=info.rank, trainer_ranks=info.trainer_ranks,
                    world_size=info.world_size, params=specs, config=cfg,
                    timeout=budget.left(f"connecting to the store at {address}"))
                rpc: Future[None] | None = None
                if executor is not None:
                    rpc = executor.submit(client.init_weight_transfer_engine,
                                          _worker_payload(info, address, specs))
                try:
                    # A worker whose init failed may never have joined the handshake, so
                    # its peers would wait out phase_timeout: cancel after _INIT_SETTLE_S,
                    # not phase_timeout. The settle lets a handshake failing at the same
                    # moment (a phase timeout every rank hits, the workers' reported first)
                    # raise its own diagnosis, the RPC's error as a note. A failed handshake
                    # is the answer: the RPC gets a short wait (for its error as a note),
                    # not another as long as the handshake's.
                    try:
                        trainer = _wait_with_rpc(pending, rpc, "init_weight_transfer_engine",
                                                 grace=info.update_timeout,
                                                 settle=_INIT_SETTLE_S,
                                                 rpc_wait=_RPC_SETTLE_S)
                    except BaseException as exc:
                        _close_connected(pending)  # the RPC failed as the connect succeeded
                        _explain_missing_workers(exc, info)
                        raise
                    break
                except StoreError as exc:
                    if isinstance(exc, AuthenticationError) or time.monotonic() > retry_until:
                        raise
                    log.info("m2n_async: trainer rank %d lost rank 0's store while "
                             "connecting (%s); connecting again", info.rank, exc)
                    time.sleep(0.1)
                    _await_listener(info.store_host, info.store_port, budget)
        except BaseException:
            if executor is not None:
                executor.shutdown()
            if store is not None:
                store.close()
            raise
        return cls(info=info, client=client, source=source, trainer=trainer, store=store,
                   executor=executor)

    def send_weights(self, weight_version: str | None = None) -> SyncResult:
        """One round on every trainer rank: rank 0 calls ``start_weight_update``, sends
        ``update_weights`` while the round runs, then ``finish_weight_update(weight_version)``
        (the version vLLM publishes). Returns this rank's ``SyncResult``. A failed round
        raises the engine's ``TransferError`` (the engine is then POISONED: ``shutdown()``
        and ``trainer_init`` again; until then ``send_weights`` raises
        ``EnginePoisonedError`` before any RPC). A failed RPC whose round also fails (a worker's
        ``load_weights`` raised) raises the round's ``TransferError``, the RPC's error in a
        note; a round still running 5 s after its RPC failed is cancelled and the RPC's
        error raised. A ``start_weight_update`` that fails on rank 0 fails the round on every
        trainer rank at once (the others' ``TransferError`` names it), not at its deadline.
        A ``weight_version`` that is not a string raises ``ValueError``, and a second call
        while one runs on this engine ``LocalProtocolError``, both before any RPC. A failure
        raises within ``update_timeout`` + 5 s of the start of the step that failed (the
        start RPC, the round and update RPC, the finish RPC): the cleanup
        ``finish_weight_update()`` is waited for only what that leaves."""
        if weight_version is not None and not isinstance(weight_version, str):
            # vLLM's finish_weight_update takes a string; refused after the round, the
            # round's weights would land with no version published.
            raise ValueError(f"m2n_async send_weights: weight_version must be a str or None, "
                             f"got {type(weight_version).__name__}")
        # The state check alone leaves a window (READY until the round starts, after the
        # start RPC): a second call in it would send a second start_weight_update, and its
        # cleanup finish would end the first call's update on the workers.
        if not self._sending.acquire(blocking=False):
            raise LocalProtocolError(f"m2n_async send_weights: trainer rank {self.rank} is "
                                     f"already sending (one send_weights at a time)")
        try:
            return self._send_weights(weight_version)
        finally:
            self._sending.release()

    def _send_weights(self, weight_version: str | None) -> SyncResult:
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError("m2n_async: send_weights after shutdown(); call trainer_init "
                               "again")
        # This engine's own state first: no RPC reaches the workers for a round that cannot
        # run here (after a failed round they refuse start_weight_update anyway).
        state = trainer.state
        if state is EngineState.POISONED:
            raise EnginePoisonedError(
                f"m2n_async send_weights: trainer rank {self.rank} is poisoned by an earlier "
                f"failure ({self._failure!r}); call shutdown() and trainer_init again"
            ) from self._failure
        if state is not EngineState.READY:
            raise LocalProtocolError(f"m2n_async send_weights: trainer rank {self.rank} is "
                                     f"{state.value.upper()}, needs READY (one send_weights "
                                     f"at a time)")
        rpc: Future[None] | None = None
        # When the step under way began (the start RPC, the first of the round and the update
        # RPC to end, the finish RPC): a failure raises within update_timeout + the grace of
        # it, the cleanup finish drawing on what is left (it must not add a second bound).
        step = [time.monotonic()]

        def step_began() -> None:
            step[0] = time.monotonic()

        try:
            if self.is_sender:
                assert self._executor is not None
                try:
                    self._rpc("start_weight_update")
                except BaseException as exc:
                    _fail_round_now(trainer, self.rank, "start_weight_update", exc)
                    raise
                rpc = self._executor.submit(self.client.update_weights, {})
            pending = trainer.start_sync_weights(_local_shards(self.source))
            result: SyncResult = _wait_with_rpc(pending, rpc, "update_weights",
                                                grace=self.init_info.update_timeout,
                                                first_ended=step_began)
            if self.is_sender:
                step_began()
                self._rpc("finish_weight_update", weight_version)
        except BaseException as exc:
            self._failure = exc
            if isinstance(exc, TransferError) and _NOTHING_SENT in str(exc):
                # Rank 0 failed the round because its start RPC failed: no worker had an
                # update session, so none received anything (the same text on every rank).
                exc.add_note("m2n_async: the workers' models are untouched (trainer rank 0's "
                             "start_weight_update failed, so no worker was updating): "
                             "shutdown() and trainer_init() on every trainer rank to recover")
            elif isinstance(exc, TransferError):
                exc.add_note("m2n_async: the workers' models may be partly updated (some "
                             "parameters hold this round's weights, others the previous "
                             "ones): shutdown() and trainer_init() on every trainer rank, "
                             "then send_weights() resyncs them all")
            if self.is_sender:
                # Workers whose part succeeded (or whose finish failed) still have vLLM's
                # update session open, and vLLM refuses shutdown_weight_transfer_engine then:
                # end those sessions, publishing no version, so that shutdown() and
                # trainer_init() recover. A worker with no session open refuses; that is
                # the one that already failed.
                # On the RPC thread, so after any RPC of this round still running there.
                self._end_sessions(exc, step[0])
            raise
        return result

    def _end_sessions(self, error: BaseException, step_began: float) -> None:
        """The cleanup ``finish_weight_update()`` after a failed round, waited for at most
        what is left of ``update_timeout`` + ``_FAILURE_GRACE_S`` since the failing step
        began, and at most ``_FAILURE_GRACE_S`` behind a call given up on (waiting longer
        would wait for that call a second time). Not waited for, it stays queued: it runs
        when that call returns, before anything sent later (``shutdown()``'s release)."""
        assert self._executor is not None
        left = step_began + self.init_info.update_timeout + _FAILURE_GRACE_S - time.monotonic()
        if self._executor.busy:
            left = min(left, _FAILURE_GRACE_S)
        try:
            self._rpc("finish_weight_update", limit=max(left, 0.0))
        except TimeoutError:
            error.add_note(f"m2n_async: the cleanup finish_weight_update() (it ends the "
                           f"workers' update sessions) had not returned within "
                           f"{max(left, 0.0):.3g} s; it stays queued behind the calls "
                           f"before it, and shutdown() waits for it")
        except Exception:
            pass  # a worker with no session open refuses: the one that already failed

    def _rpc(self, what: str, *args: Any, limit: float | None = None) -> None:
        """One client call on the RPC thread, bounded by ``update_timeout`` (or ``limit``):
        a worker that never answers (a lost reply, a wedged finalize) fails this call instead
        of hanging the trainer; calls run one at a time, in order."""
        assert self._executor is not None
        bound = "update_timeout" if limit is None else "what the failure left"
        limit = self.init_info.update_timeout if limit is None else limit
        call = self._executor.submit(getattr(self.client, what), *args)
        try:
            call.result(timeout=limit)
        except TimeoutError:
            if call.done():
                raise  # the client's own TimeoutError
            raise TimeoutError(f"m2n_async: the workers' {what} did not return within "
                               f"{limit:g} s ({bound})") from None

    def shutdown(self) -> None:
        """Close the engine and rank 0's store; rank 0 asks the workers to release theirs
        (``client.shutdown_weight_transfer_engine()`` where the client has it). Idempotent."""
        trainer, self._trainer = self._trainer, None
        if trainer is None:
            return
        try:
            trainer.close()
        finally:
            if self.is_sender:
                release = getattr(self.client, "shutdown_weight_transfer_engine", None)
                if callable(release):
                    try:
                        self._rpc("shutdown_weight_transfer_engine")  # bounded, as the rest
                    except Exception:
                        log.exception("m2n_async: the workers' "
                                      "shutdown_weight_transfer_engine failed")
            if self._executor is not None:
                self._executor.shutdown()
            if self._store is not None:
                self._store.close()


def _local_shards(source: Any) -> Iterator[tuple[str, Any]]:
    """``source.iter_local()``, detached, called only once the round runs: a source that
    raises (even before yielding, or from a plain method) fails the round on every rank
    at once, naming it, instead of leaving the other ranks to wait out its deadline."""
    for name, tensor in source.iter_local():
        yield name, tensor.detach()


def _fail_round_now(trainer: BlockingTrainer, rank: int, what: str, error: BaseException
                    ) -> None:
    """The sender's RPC failed before its round: the other trainer ranks are already in the
    round and would wait out its deadline for rank 0, then fail naming no cause. Start the
    round with a source that raises at once, so it fails on every rank now, naming this
    RPC's error (the engine is POISONED, as after any failed round). ``error`` gets a note
    saying so."""

    def refused() -> Iterator[tuple[str, Any]]:
        raise RuntimeError(f"m2n_async: trainer rank {rank}: the workers' {what} failed "
                           f"({error!r}); {_NOTHING_SENT}")
        yield  # a generator: the round starts before it raises

    try:
        pending = trainer.start_sync_weights(refused())
        try:
            pending.result(timeout=_RPC_SETTLE_S)
        except TimeoutError:
            pending.cancel()  # still running: cancelling fails it everywhere too
        except BaseException:
            pass  # the round failed, as meant
    except BaseException as exc:  # no round could start: the peers wait out its deadline
        error.add_note(f"m2n_async: failing the round on the other trainer ranks failed "
                       f"too ({exc!r}); they fail at the round deadline")
        return
    error.add_note(f"m2n_async: the round was failed on every rank (the workers' {what} "
                   f"failed before it); shutdown() and trainer_init() to recover")


def _serve_store(host: str, port: int, token: str) -> StoreThread:
    """A ``StoreServer`` on an event loop thread of its own (off every engine's loop)."""
    from m2n_async._store import StoreServer

    return StoreServer(host=host, port=port, token=token).in_thread()


def _open_store(info: TrainerInitInfo, token: str, budget: _ConnectBudget
                ) -> tuple[StoreThread | None, str]:
    if info.store_address is not None:
        return None, info.store_address
    if _shares_store(info):
        return _share_store(info, token)
    if info.rank == 0:
        store = _serve_store(info.store_host, info.store_port, token)
        return store, store.address
    _await_listener(info.store_host, info.store_port, budget)
    return None, f"{info.store_host}:{info.store_port}"


class _ConnectBudget:
    """The bound on one connect's waits (probing the store, waiting for rank 0's listener,
    the engine's connect, its retries). With ``connect_timeout`` they share one deadline,
    each getting what the earlier ones left; without it, each wait is bounded by
    ``phase_timeout`` on its own (the engine bounds each handshake phase so)."""

    def __init__(self, connect_timeout: float | None, phase_timeout: float) -> None:
        self.total = connect_timeout
        self.bound = "connect_timeout" if connect_timeout is not None else "phase_timeout"
        self.limit = connect_timeout if connect_timeout is not None else phase_timeout
        self.deadline = None if connect_timeout is None else time.monotonic() + connect_timeout

    def wait_limit(self) -> float:
        """Seconds the next bounded wait may take (> 0; ``TimeoutError`` if none are left)."""
        left = self.left("waiting for the store")
        return self.limit if left is None else left

    def left(self, what: str) -> float | None:
        """What is left of ``connect_timeout`` for the next step (None: no overall bound),
        never <= 0: ``TimeoutError`` naming ``connect_timeout`` and ``what`` if spent."""
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"m2n_async: connect_timeout ({self.limit:g} s) was spent "
                               f"before {what}: raise connect_timeout, or check that the "
                               f"store is up and reachable from here")
        return left


def _await_listener(host: str, port: int, budget: _ConnectBudget) -> None:
    """Wait (bounded) until rank 0's store accepts connections: the trainer ranks start
    together, and rank 0 may not be listening yet."""
    import socket

    limit = budget.wait_limit()
    deadline = time.monotonic() + limit
    while True:
        try:
            left = max(deadline - time.monotonic(), 0.01)
            socket.create_connection((host, port), timeout=min(1.0, left)).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"m2n_async: trainer rank 0's store at {host}:{port} "
                                   f"did not accept connections within {budget.limit:g} s "
                                   f"({budget.bound})") from None
            time.sleep(0.05)


def _shares_store(info: TrainerInitInfo) -> bool:
    """Whether ``info``'s trainer ranks learn the store's address from rank 0 through the
    default torch.distributed group (``_share_store``)."""
    return info.store_address is None and info.trainer_ranks > 1 and info.store_port == 0


def _share_store(info: TrainerInitInfo, token: str) -> tuple[StoreThread | None, str]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("m2n_async: with trainer_ranks > 1 and no store_address, give a "
                         "fixed store_port (or initialize torch.distributed so rank 0 can "
                         "share the address it picked)")
    store: StoreThread | None = None
    failed: BaseException | None = None
    if info.rank == 0:
        try:
            store = _serve_store(info.store_host, 0, token)
        except BaseException as exc:  # shared as no address: the others must not wait on
            failed = exc
    try:
        address = _broadcast_address(store.address if store is not None else "")
    except BaseException:
        if store is not None:
            store.close()
        raise
    if failed is not None:
        raise failed
    if store is None and not address:
        raise ValueError("m2n_async: trainer rank 0 shared no store address through the "
                         "default torch.distributed group: its trainer_init failed before "
                         "it served the store (its own error says why)")
    return store, address if store is None else store.address


def _leave_address_broadcast(info: TrainerInitInfo) -> None:
    """Join ``_share_store``'s broadcast sharing no address, on a rank whose trainer_init
    failed before it: best effort (the caller raises its own error)."""
    if not _shares_store(info) or not 0 <= info.rank < info.trainer_ranks:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            _broadcast_address("")


def _broadcast_address(address: str) -> str:
    """Trainer rank 0's ``address`` ("": none) to every rank of the default group."""
    import torch
    import torch.distributed as dist

    # The address as UTF-8 bytes in a tensor, not broadcast_object_list: that pickles, and
    # every other rank would unpickle what arrives (nothing on the wire is unpickled).
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    buf = torch.zeros(_ADDRESS_BYTES, dtype=torch.uint8)  # NUL-padded: no address has a NUL
    if address:
        raw = address.encode()
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    buf = buf.to(device)
    dist.broadcast(buf, src=0)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode(errors="replace")


_ADDRESS_BYTES = 512  # "host:port": a DNS name (at most 253 bytes) and a port fit


def _await_store_answer(address: str, budget: _ConnectBudget) -> None:
    """Wait (at most what ``budget`` leaves) for the store at ``address`` to accept a
    connection and send its first bytes (the store speaks first), else ``TimeoutError``
    naming the address and the setting that bounded the wait, and what to check. A refused
    or unresolvable address returns at once; the engine's connect then raises its
    ``StoreError`` naming it."""
    import socket

    from m2n_async._store._sockets import parse_address

    host, port = parse_address(address)
    bound = budget.bound
    wait_for = budget.wait_limit()
    limit = budget.limit  # the setting's value, for the error
    deadline = time.monotonic() + wait_for
    try:
        sock = socket.create_connection((host, port), timeout=wait_for)
    except TimeoutError:
        raise TimeoutError(f"m2n_async: the store at {address} did not accept a connection "
                           f"within {limit:g} s ({bound}): check store_address, and that "
                           f"trainer rank 0's store is up and reachable from here") from None
    except OSError:
        return
    with sock:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            sock.recv(1)
        except TimeoutError:
            raise TimeoutError(f"m2n_async: {address} accepted a connection but sent nothing "
                               f"within {limit:g} s ({bound}); an m2n_async store answers at "
                               f"once: check store_address (another service on that port, "
                               f"or a wedged host)") from None
        except OSError:
            return


def _explain_missing_workers(exc: BaseException, info: TrainerInitInfo) -> None:
    """A handshake that timed out waiting for worker ranks: a note on how they are
    numbered, and the usual reason some never arrive (two instances claiming one rank)."""
    if not isinstance(exc, PhaseTimeoutError):
        return
    missing = sorted(r for r in exc.ranks if r >= info.trainer_ranks)
    if not missing:
        return
    exc.add_note(
        f"m2n_async: worker rank(s) {missing} never joined. A worker's rank is rank_offset "
        f"(default trainer_ranks = {info.trainer_ranks}) + data_parallel_index x (TP x PP) + "
        f"its rank in the instance, and every rank in [{info.trainer_ranks}, "
        f"{info.world_size}) must be started exactly once: world_size counts every worker "
        f"of every vLLM instance the client drives, and several instances must be the "
        f"data-parallel ranks of one deployment (independent instances all start at "
        f"rank_offset, claim the same ranks, and the ranks above them never arrive)")


def _close_connected(pending: Any) -> None:
    """Close the engine of a connect that succeeded although its call raised (the RPC beside
    it failed): it holds this rank's claim, and the next ``trainer_init`` would wait for it."""
    if not pending.future.done() or pending.future.cancelled():
        return
    if pending.future.exception() is None:
        with contextlib.suppress(Exception):
            pending.future.result().close()


# What the round's error says on every trainer rank when rank 0's start RPC failed it.
_NOTHING_SENT = "no weights were sent to any worker"
_RPC_SETTLE_S = 5.0  # how long a failed RPC waits for the round to report the same failure
#: How long the workers' failed init RPC waits for the trainer's own handshake to end.
_INIT_SETTLE_S = 1.0
# What a failed send_weights may take beyond update_timeout from the failing step's start:
# the round failed on every rank (_RPC_SETTLE_S at most) and the cleanup finish.
_FAILURE_GRACE_S = 5.0
# How long a failed round waits for its update RPC (the workers fail with the same round):
# the sender's cleanup finish_weight_update must not run beside a worker's update_weights.
_RPC_AFTER_FAILURE_S = 30.0


def _wait_with_rpc(pending: Any, rpc: Future[None] | None, what: str, *,
                   grace: float = 300.0, settle: float = _RPC_SETTLE_S,
                   rpc_wait: float = _RPC_AFTER_FAILURE_S,
                   first_ended: Callable[[], None] | None = None) -> Any:
    """Wait for an engine call and, on the sender, for the RPC that runs beside it.

    An RPC that fails first gives the engine call ``settle`` seconds to end: a worker whose
    part of the round failed (its ``load_weights`` raised, say) fails the round on every
    rank, and that diagnosis, naming the rank, is what this rank raises, the RPC's error
    added as a note. An engine call still running after ``settle`` is cancelled (its
    cancellation semantics apply) and the RPC's error is raised. An engine call that fails
    first is what this rank raises, once the RPC ended (at most ``rpc_wait`` more seconds),
    its error, or that it had not returned, added as a note. ``first_ended()`` is called
    when the first of the two ended."""
    if rpc is None:
        return pending.result()
    try:
        done, _ = wait([pending.future, rpc], return_when=FIRST_COMPLETED)
        if first_ended is not None:
            first_ended()
        if rpc in done and rpc.exception() is None:
            wait([pending.future])  # the RPC returned first: the round bounds itself
        elif rpc in done:
            wait([pending.future], timeout=min(grace, settle))
    except BaseException:
        pending.cancel()
        raise
    rpc_error = rpc.exception() if rpc.done() else None
    if rpc_error is not None and not pending.done():
        pending.cancel()
        raise RuntimeError(f"m2n_async: the workers' {what} failed: {rpc_error!r}"
                           ) from rpc_error
    if rpc_error is not None:
        try:
            pending.result()
        except BaseException as round_error:
            round_error.add_note(f"m2n_async: the workers' {what} failed too: {rpc_error!r}")
            raise
        # This rank's part succeeded (its round committed, its connect finished); the
        # workers' side did not.
        raise RuntimeError(f"m2n_async: the workers' {what} failed: {rpc_error!r}"
                           ) from rpc_error
    try:
        result = pending.result()
    except BaseException as call_error:
        # The workers fail with the same round; let their RPC end (bounded) before raising,
        # its error added as a note.
        limit = min(grace, rpc_wait)
        try:
            rpc.result(timeout=limit)
        except Exception as rpc_error:
            if not rpc.done():
                call_error.add_note(f"m2n_async: the workers' {what} had not returned "
                                    f"{limit:g} s after this rank's part failed")
            else:
                call_error.add_note(f"m2n_async: the workers' {what} failed too: "
                                    f"{rpc_error!r}")
        raise
    try:  # this rank's part is done; the workers' side of the call gets ``grace`` more
        rpc.result(timeout=grace)
    except TimeoutError:
        raise TimeoutError(f"m2n_async: the workers' {what} did not return within {grace:g} s "
                           f"(update_timeout) after this rank's part of the call ended"
                           ) from None
    return result


# -- registration ----------------------------------------------------------------------------


def register() -> None:
    """``vllm.general_plugins`` entry point: register ``m2n_async`` with both vLLM factories.

    vLLM runs general plugins in every process of its own (API server, engine core, each
    worker), and may run them more than once in one; a name already registered is left
    alone. A trainer process runs none: call this there before ``trainer_init`` (a
    ``TrainerInitInfo`` built once ``vllm.distributed.weight_transfer`` is imported does).
    """
    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls in ((WeightTransferEngineFactory, "VLLMWorkerBackend"),
                         (WeightTransferTrainerFactory, "VLLMTrainerEngine")):
        if BACKEND not in factory._registry:
            with contextlib.suppress(ValueError):  # another thread registered it first
                factory.register_engine(BACKEND, __name__, cls)

