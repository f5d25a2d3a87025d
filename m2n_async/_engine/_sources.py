"""The trainer's source resolution: one bucket's local shards from what ``sync_weights`` got.

Theory of operation (DESIGN §6). ``sync_weights`` accepts a Mapping name -> local shard (a
dict, ``module_shards``), a ``torch.nn.Module``, a callable ``f(names) -> Mapping`` called once
per bucket, or an iterable of ``(name, tensor)`` pairs consumed lazily. ``_Sources`` turns any
of them into the per-bucket Mapping the pipeline stages from, and checks every shard against
``_source_expectations`` (per param: wire dtype, local shape, accepted source dtypes) before
a transport reads it: a wrong shape, dtype, device or layout is refused with ``PlanError``
naming the parameter and the rank.

Where the checks run: a plain dict is checked on the event loop in chunks of
``_INLINE_PARAMS`` with a checkpoint between chunks (a thread hop costs more than the lookups,
and a thread running a Python loop holds the GIL); any other source may compute on lookup and
is resolved on a worker thread.

Before the round (``precheck``): a mapping of stored tensors (a dict or ``MappingProxyType``,
its lookups compute nothing) is checked whole — every plan parameter present, of an accepted
dtype, of this rank's local shape, on the device and contiguous — and a module or
``module_shards`` has its dtypes checked. What is wrong is refused with ``PlanError`` before
any round starts, so the engine stays READY. Every trainer checks every parameter of the
plan, not only those it sends, against its own local shapes: a mistake in what each rank's
training code builds alike (a dropped name, a wrong shard) is refused on every trainer, and
no rank starts a round its peers refused. Lazy sources (a callable, an iterable, any other
Mapping) are checked bucket by bucket at staging, where a bad shard fails the round; so does
a lookup, call or iteration of the caller's that raises, its error naming the parameters it
was asked for and the rank (as a worker's load callback that raises is named by its
parameter). A ``MappingProxyType`` is read into a dict first: a lookup of what it wraps that
raises there is refused before the round, ``PlanError`` naming the parameter.

The per-round cost for a plain dict: every shard's dtype, shape, device and contiguity are
read every round (``Tensor.data`` can be reassigned and in-place ops change shapes, so a
shard seen last round proves nothing), but by C-level ``map`` calls over chunks of
``_INLINE_PARAMS`` tensors fetched with one ``operator.itemgetter`` (``_Expectations.chunks``:
the getters and expected values are a pure function of the plan, built once per engine),
not by a Python loop per parameter, and once per round: ``precheck`` reads all of it, and
the buckets then read nothing again (``_checked``). A chunk that fails the fast pass goes
through the per-parameter check, which raises the error naming the parameter.

A chunk that passed is re-checked next round by one C call (``Recheck``): torch's
``TensorGuards``, the check dynamo runs before it reuses a compiled graph, records each
tensor's Python type, dispatch keys, dtype, device, sizes, strides and ``requires_grad`` and
compares a tuple of tensors with them, ~0.15 µs a tensor against ~0.5 µs for the fast pass's
four attribute reads. It is stricter than the contract (equal strides are contiguous ones,
an equal dtype is an accepted one), so a chunk it accepts is one the fast pass would accept;
a chunk it refuses goes through the fast pass, which passes it (and records a new guard) or
explains. Each chunk keeps the guards of the last two kinds that passed (``_GUARDS_KEPT``): a
caller alternating bf16 sources with fp32 masters would otherwise pay the fast pass and a new
guard every round (measured on the H100: the MoE precheck of 1,024 shards went from 0.6 to
1.4 ms with one guard kept). A chunk holding one tensor twice (tied weights under two names)
is one no guard accepts: it keeps the fast pass. A nested tensor never reaches a guard (its
strides raise inside torch's C++, where nothing can catch it, and the process aborts); the
checks refuse it by name. So every chunk is screened for nested tensors before its guard
(~0.06 µs a tensor), including one of the very objects the guard was recorded with:
``torch.utils.swap_tensors`` turns a tensor object into a nested one in place. The guards
hold no reference to a tensor, weak ones included: a weak reference makes
``swap_tensors`` refuse the tensor, and with it ``Module.to`` under
``torch.__future__.set_swap_module_params_on_conversion(True)``.

What ``precheck`` read of a stored mapping — each shard in plan order and its dtype (the fast
pass reads it; a guard that matched vouches for the dtypes it was recorded with) — goes to
the lane as ``CheckedSources`` for the round (``Transport.use_checked``): it takes a bucket's
shards by plan index instead of looking each up by name and reading its dtype a second time.
``torch._C._dynamo`` is private: where it is missing or its signature changed there is no
guard, and every round runs the fast pass as before.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import anyio.to_thread

from m2n_async._data._transport import CheckedSources
from m2n_async._proto.errors import LocalProtocolError, M2NError, PlanError, TransferError
from m2n_async._proto.plan import (
    CAST_DTYPES,
    TransferPlan,
    check_source_dtype,
    validate_local_buffer,
)

if TYPE_CHECKING:
    import torch

    from m2n_async._proto.plan import Bucket

__all__ = ["CallbackInterrupted", "Interrupts", "Weights", "_INLINE_PARAMS", "_Expect",
           "_Expectations", "_Sources", "_source_expectations", "Recheck",
           "device_predicates", "laid_out"]

#: How many names the plan does not carry an iterator's warning shows.
_UNPLANNED_SHOWN = 5

#: What ``sync_weights`` accepts: name -> local shard (any Mapping, e.g. ``module_shards``),
#: a ``torch.nn.Module``, a callable ``f(names) -> Mapping`` called once per bucket, or an
#: iterable of ``(name, tensor)`` pairs consumed lazily.
Weights = Any


class CallbackInterrupted(Exception):
    """A caller's callback (a ``progress``, a ``LoadTarget.load``, a lazy source) raised a
    ``BaseException`` that is no ``Exception`` — ``KeyboardInterrupt``, ``SystemExit`` —
    carried as an ``Exception`` through the round.

    Raised as it is inside a task, asyncio hands such an exception to the event loop itself,
    which stops: no abort record is posted (the peers wait out the round deadline), the
    transport is never aborted, and under the blocking facade the engine's loop thread dies
    with the engine unreleased. Carried as this, it fails the round like any error of this
    rank's own step (every rank raises at once, naming this rank), and the call then raises
    the interrupt itself (``Interrupts``)."""

    def __init__(self, where: str, interrupt: BaseException) -> None:
        super().__init__(f"{where} raised {interrupt!r}")
        self.interrupt = interrupt

    def __repr__(self) -> str:  # as the lanes quote a load callback's error
        return f"{type(self).__name__}({str(self)!r})"


def refuse_awaitable(got: Any, where: str) -> None:
    """Raise the ``TypeError`` for callback ``where`` that returned the awaitable ``got``
    (an async callback whose body has not run), closing a coroutine first so that it is not
    reported again as never awaited."""
    close = getattr(got, "close", None)
    if inspect.iscoroutine(got) and close is not None:
        close()
    raise TypeError(f"{where} returned {type(got).__name__}, an awaitable: the engine calls it "
                    f"and does not await it, so its body never ran. Use a plain function "
                    f"that does its work before it returns")


class Interrupts:
    """One engine's record of the first interrupt its callbacks raised in a round, for the
    call to raise once the round failed. Kept here, not looked for in the round error's
    cause chain: the lanes and the pipeline re-raise errors from threads and task groups,
    and the chain does not survive that."""

    def __init__(self) -> None:
        self.caught: BaseException | None = None

    def wrap(self, fn: Callable[..., Any], where: str) -> Callable[..., Any]:
        """``fn`` (a caller's callback) with a ``BaseException`` that is no ``Exception``
        recorded and raised as ``CallbackInterrupted`` (``where`` names the callback)."""

        def call(*args: Any) -> Any:
            try:
                got = fn(*args)
            except TimeoutError as exc:
                # The callback's own timeout (a metrics server that did not answer), not the
                # round's deadline: the round reports it as this rank's error (``_round``).
                exc.own_step = True  # type: ignore[attr-defined]
                raise
            except Exception:
                raise
            except BaseException as exc:
                raise self.interrupted(where, exc) from exc
            if inspect.isawaitable(got):  # an async callback: its work would never run
                refuse_awaitable(got, where)
            return got

        return call

    def interrupted(self, where: str, exc: BaseException) -> CallbackInterrupted:
        if self.caught is None:
            self.caught = exc
        return CallbackInterrupted(where, exc)

    def take(self) -> BaseException | None:
        """The interrupt recorded since the last ``take``, if any; forgets it."""
        caught, self.caught = self.caught, None
        return caught


#: A plain dict of sources is resolved on the event loop (a thread hop costs more than the
#: lookups), this many parameters at a time with a checkpoint between chunks, so that a
#: bucket of 4,096 tiny shards never holds the loop for more than ~1 ms (other mappings and
#: callables may compute on lookup and run on a thread instead).
_INLINE_PARAMS = 512


class _Sources:
    """Resolves one bucket's local shards from whatever ``sync_weights`` was given.

    Dtypes: a source may have the planned (wire) dtype or one the transports cast to it
    while packing (``_proto.plan.cast_problem``: a float-to-float cast). ``precheck`` refuses
    any other dtype before the round wherever it can be read without computing a shard, and
    for a mapping of stored tensors a missing name, a wrong shape, device or layout as well;
    the per-bucket check catches the rest at staging.
    """

    def __init__(self, weights: Weights, plan: TransferPlan, rank: int, device: str,
                 expect: list[_Expect], names: Sequence[str],
                 interrupts: Interrupts | None = None) -> None:
        import torch

        #: where a lazy source's KeyboardInterrupt/SystemExit is recorded (the engine's)
        self._interrupts = Interrupts() if interrupts is None else interrupts
        self._plan = plan
        self._names = names  # every param's name, in plan order
        self._rank = rank
        self._device = device
        self._on_device, self._all_on_device = device_predicates(device)
        #: ``precheck`` checked every shard of this round's stored mapping (name, dtype,
        #: shape, device, contiguity): the buckets read nothing again
        self._checked = False
        #: a mapping of stored tensors (lookups compute nothing): checked whole by ``precheck``
        self._stored = False
        #: what ``precheck`` checked of a stored mapping, for the lanes (``CheckedSources``)
        self.checked: CheckedSources | None = None
        self._limiter = anyio.CapacityLimiter(1)
        self._iter: Iterator[tuple[str, torch.Tensor]] | None = None
        self._pending: dict[str, torch.Tensor] = {}
        #: the plan names the iterator yielded so far: a second one is refused, not dropped
        self._yielded: set[str] = set()
        self._call: Callable[[Sequence[str]], Mapping[str, torch.Tensor]] | None = None
        self._map: Mapping[str, torch.Tensor] | None = None
        self._expect = expect
        #: name -> the dtype a lookup would give, without computing it (None: unknown)
        self._dtype_of: Callable[[str], Any] | None = None
        from m2n_async._integrations.sources import ModuleShards, module_shards

        #: a module's tensors the plan does not carry (not sent; the engine warns once)
        self.unplanned: tuple[str, ...] = ()
        #: names an iterator yielded that the plan does not carry (the first few, and how
        #: many): skipped, not sent; the engine warns once after the round
        self.iter_unplanned: list[str] = []
        self.iter_unplanned_count = 0
        if isinstance(weights, torch.nn.Module):
            # Its parameters as they are (fp32 masters stay fp32): the transports cast to
            # the wire dtype while packing, with no cast copy per bucket.
            weights = module_shards(weights, names=names)
            self.unplanned = weights.unplanned
        if type(weights) is MappingProxyType:
            # Read once, as a dict: a proxy forwards lookups to whatever it wraps, which may
            # compute on lookup, and the values checked before the round must be the values
            # sent (one C-level copy over a dict).
            try:
                weights = dict(weights)
            except Exception as exc:
                # What it wraps raised on a lookup: refused before the round, named.
                raise _proxy_refused(weights, rank, exc) from exc
        if isinstance(weights, ModuleShards):
            self._dtype_of = weights.dtype_of
        elif isinstance(weights, dict) and type(weights).__getitem__ is dict.__getitem__:
            # Stored tensors (a dict whose lookups compute nothing; a MappingProxyType was
            # read into one above): ``precheck`` checks every shard. Any other Mapping may
            # compute on lookup (a ``to_local()``, a cast) and is checked at staging.
            self._stored = True
        if isinstance(weights, Mapping):
            self._map = weights
            # A plain dict is looked up on the loop (cheap) for small buckets; any other
            # mapping may compute on lookup (to_local(), a cast), so it runs off the loop.
            self.inline = type(weights) is dict
        elif callable(weights):
            self._call = weights
            self.inline = False
        elif isinstance(weights, Iterable) and not isinstance(
                weights, str | bytes | bytearray | torch.Tensor):
            # Not a str or a bare tensor: both iterate (characters, rows), so either would
            # pass as an iterable of pairs and fail the round mid-way, POISONED, instead of
            # being refused here with nothing sent.
            self._iter = iter(weights)
            self.inline = False
        else:
            raise LocalProtocolError(
                f"sync_weights: weights must be a Mapping name -> tensor, a torch.nn.Module, "
                f"a callable(names) -> Mapping, or an iterable of (name, tensor); got "
                f"{type(weights).__name__}"
                + (" (a bare tensor: pass {name: tensor})" if isinstance(weights, torch.Tensor)
                   else ""))

    async def precheck(self) -> None:
        """Refuse, before the round, what can be found wrong without computing a shard:
        ``PlanError`` naming the parameter, the rank and what is wrong. A mapping of stored
        tensors (a dict or ``MappingProxyType``) is checked whole: every plan name present,
        its dtype the wire dtype or one cast to it while packing, its local shape, device and
        contiguity. A module or ``module_shards`` has its dtypes checked (its shards are
        computed at staging). Chunked like the per-bucket check of a dict, so that 10^5
        parameters never hold the loop for long."""
        names = self._names
        if self._stored:
            m = self._map
            assert m is not None
            if not await self._fast_ok(0, len(names)):
                # The per-parameter check raises the error naming the first bad shard.
                for a in range(0, len(names), _INLINE_PARAMS):
                    if a:
                        await anyio.lowlevel.checkpoint()
                    self._check(a, names[a:a + _INLINE_PARAMS], m)
            self._checked = True  # the buckets need not read anything again
            return
        dtype_of = self._dtype_of
        if dtype_of is None:
            return
        expect = self._expect
        for a in range(0, len(names), _INLINE_PARAMS):
            if a:
                await anyio.lowlevel.checkpoint()
            for (_, _, ok), n in zip(expect[a:a + _INLINE_PARAMS],
                                     names[a:a + _INLINE_PARAMS], strict=True):
                d = dtype_of(n)
                if d is not None and d not in ok:
                    i = a + names[a:a + _INLINE_PARAMS].index(n)
                    check_source_dtype(self._plan.params[i].spec, d, self._rank)

    async def _fast_ok(self, start: int, stop: int) -> bool:
        """True when the shards of params ``[start, stop)`` in the stored mapping are tensors
        with an accepted dtype and their shape, on this device and contiguous: the fast pass
        of the module docstring. False as soon as a chunk fails it (the per-parameter check
        then explains). Chunked with checkpoints between chunks, like that check. What
        passed is kept for the lanes (``checked``): each shard and its dtype."""
        m = self._map
        assert m is not None
        expect = self._expect
        if not isinstance(expect, _Expectations):  # a caller-built list: no tables
            return False
        on_device = self._all_on_device
        chunks = expect.chunks(self._names, start, stop)
        recheck = expect.recheck
        tensors: list[torch.Tensor] = []
        dtypes: list[torch.dtype] = []
        for a, (get, oks, shapes) in enumerate(chunks):
            if a:
                await anyio.lowlevel.checkpoint()
            key = (start, stop, a)
            try:
                ts = get(m)
                if type(ts) is not tuple:  # an itemgetter of one name returns the value
                    ts = (ts,)
                if recheck.passes(key, ts):
                    tensors += ts
                    dtypes += recheck.kind(key)  # the guard compared each dtype
                    continue
                ds = tuple(map(_DTYPE, ts))
                if not (all(map(operator.contains, oks, ds))
                        and laid_out(ts, shapes, on_device)):
                    return False
            # missing, not a tensor, or one whose shape raises (a nested tensor)
            except (KeyError, AttributeError, TypeError, RuntimeError):
                return False
            recheck.passed(key, ts, ds)
            tensors += ts
            dtypes += ds
        if start == 0 and stop == len(self._names):
            self.checked = CheckedSources(m, tensors, dtypes)
        return True

    async def __call__(self, bucket: Bucket) -> Mapping[str, torch.Tensor]:
        if self._checked:
            assert self._map is not None
            return self._map  # every shard checked by ``precheck``, this round
        names = self._names[bucket.start:bucket.stop]
        if self.inline:
            # The user's dict itself is the bucket's mapping (no copy per bucket). Checked in
            # chunks on the loop rather than on a thread: a thread running this Python loop
            # would hold the GIL and the loop would wait for it up to the 5 ms switch
            # interval.
            m = self._map
            assert m is not None
            for a in range(0, len(names), _INLINE_PARAMS):
                if a:
                    await anyio.lowlevel.checkpoint()
                self._check(bucket.start + a, names[a:a + _INLINE_PARAMS], m)
            return m
        # abandon_on_cancel: a source that hangs must not hold the round past its deadline
        # (the abandoned thread's result is dropped; the round has failed by then).
        return await anyio.to_thread.run_sync(self._resolve, bucket.start, names,
                                              limiter=self._limiter, abandon_on_cancel=True)

    def _fetch(self, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        if self._map is not None:
            return self._lookup(self._map, names)
        if self._call is not None:
            try:
                got = self._call(list(names))
            except M2NError:
                raise
            except Exception as exc:
                raise self._failed(f"called for parameters {_shown(names)}", exc) from exc
            if not isinstance(got, Mapping):
                raise LocalProtocolError(f"sync_weights: the weights callable returned "
                                         f"{type(got).__name__} for parameters "
                                         f"{_shown(names)} (rank {self._rank}), expected a "
                                         f"Mapping")
            # Looked up once, here: a lookup that raises is named like one of a Mapping's.
            return self._lookup(got, names)
        assert self._iter is not None
        want = set(names)
        while not want <= self._pending.keys():
            try:
                item = next(self._iter)
            except StopIteration:
                missing = sorted(want - self._pending.keys())
                raise PlanError(f"sync_weights: the weights iterator ended without "
                                f"parameters {missing[:10]} (rank {self._rank})") from None
            except M2NError:
                raise
            except Exception as exc:
                missing = sorted(want - self._pending.keys())
                raise self._failed(f"iterated for parameters {_shown(missing)}", exc) from exc
            try:
                name, tensor = item  # any pair: a tuple, a list
            except (TypeError, ValueError):
                raise PlanError(f"sync_weights: the weights iterator yielded a "
                                f"{type(item).__name__}, not a (name, tensor) pair (rank "
                                f"{self._rank})") from None
            try:
                self._plan.index(name)
            except (PlanError, TypeError):  # TypeError: a name that is no str
                # Not buffered (it would be held until the round ends, never sent); the
                # engine warns once, as for a module's tensors the plan does not carry.
                if len(self.iter_unplanned) < _UNPLANNED_SHOWN:
                    self.iter_unplanned.append(repr(name))
                self.iter_unplanned_count += 1
                continue
            if name in self._yielded:  # which one would be meant? neither is sent
                raise PlanError(f"sync_weights: the weights iterator yielded parameter "
                                f"{name!r} twice (rank {self._rank}); each name once")
            self._yielded.add(name)
            self._pending[name] = tensor
        return {n: self._pending.pop(n) for n in names}

    def _lookup(self, m: Mapping[str, torch.Tensor], names: Sequence[str]
                ) -> dict[str, torch.Tensor]:
        """``names`` looked up in ``m`` (a caller's Mapping, which may compute on lookup): a
        missing one is ``PlanError``, a lookup that raises is named by its parameter."""
        out = {}
        for n in names:
            try:
                out[n] = m[n]
            except KeyError:
                raise PlanError(f"sync_weights: no local shard for parameter {n!r} "
                                f"(rank {self._rank})") from None
            except M2NError:
                raise
            except Exception as exc:
                raise self._failed(f"looking up parameter {n!r}", exc) from exc
        return out

    def _failed(self, how: str, exc: Exception) -> TransferError:
        """The caller's source raised ``exc``: this rank's own step failed, naming what it
        was asked for (as a worker's load callback that raises is named by its parameter)."""
        err = TransferError(f"sync_weights: the weights source raised {exc!r} (rank "
                            f"{self._rank}, {how})", rank=self._rank)
        err.own_step = True  # type: ignore[attr-defined]  # this rank's, no peer's
        return err

    def _resolve(self, start: int, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        """Params ``start, start + 1, ...`` named ``names``: fetched and checked."""
        try:
            got = self._fetch(names)
        except Exception:
            raise
        except BaseException as exc:
            # A lookup, next() or the callable ran the caller's code on this thread: its
            # KeyboardInterrupt would reach the loop as it is (``CallbackInterrupted``).
            raise self._interrupts.interrupted("the weights source", exc) from exc
        self._check(start, names, got)
        return got

    def _check(self, start: int, names: Sequence[str], got: Mapping[str, torch.Tensor]
               ) -> None:
        """Check params ``start, start + 1, ...`` (named ``names``) in ``got``."""
        expect = self._expect
        on_device = self._on_device
        for (dtype, shape, ok), n in zip(expect[start:start + len(names)], names,
                                         strict=True):
            t: Any = got.get(n)
            # Fast path (a few attribute reads, ~0.7 us); the full check explains a mismatch.
            try:
                bad = ((t.dtype is not dtype and t.dtype not in ok) or t.shape != shape
                       or not on_device(t) or not t.is_contiguous())
            except (AttributeError, RuntimeError):  # missing, not a tensor, or nested
                bad = True
            if bad:
                if t is None:
                    raise PlanError(f"sync_weights: no local shard for parameter {n!r} "
                                    f"(rank {self._rank})")
                import torch

                if not isinstance(t, torch.Tensor):
                    raise PlanError(f"sync_weights: the local shard for parameter {n!r} "
                                    f"(rank {self._rank}) is a {type(t).__name__}, not a "
                                    f"tensor")
                i = start + names.index(n)
                validate_local_buffer(self._plan.params[i].spec, t, self._rank, "source",
                                      device=self._device, cast=True)


def _proxy_refused(proxy: Mapping[str, Any], rank: int, exc: Exception) -> PlanError:
    """``PlanError`` for a ``MappingProxyType`` whose copy raised ``exc``, naming the first
    parameter whose lookup raises (the copy itself does not say which)."""
    try:
        for n in proxy:
            try:
                proxy[n]
            except Exception as one:
                return PlanError(f"sync_weights: looking up the local shard for parameter "
                                 f"{n!r} (rank {rank}) raised {one!r}")
    except Exception:  # its iteration raises too: the copy's error is all there is
        pass
    return PlanError(f"sync_weights: reading the weights (a MappingProxyType) on rank {rank} "
                     f"raised {exc!r}")


def _shown(names: Sequence[str]) -> str:
    """Parameter names for a message: the first few of a bucket, and how many more."""
    head = ", ".join(repr(n) for n in names[:5])
    return f"[{head}]" if len(names) <= 5 else f"[{head}, and {len(names) - 5} more]"


def device_predicates(device: str) -> tuple[Callable[[torch.Tensor], bool],
                                            Callable[[tuple[torch.Tensor, ...]], bool]]:
    """Whether a tensor, and whether every one of many tensors, is on ``device`` ("cpu",
    "cuda", "cuda:N", ...): at C speed where the device allows it."""
    import torch

    # t.device builds a torch.device object (~0.6 us); the is_cpu/is_cuda flags do not.
    kind, _, index = device.partition(":")
    if device == "cpu":
        return (lambda t: bool(t.is_cpu)), (lambda ts: all(map(_IS_CPU, ts)))
    if kind == "cuda" and not index:
        return (lambda t: bool(t.is_cuda)), (lambda ts: all(map(_IS_CUDA, ts)))
    if kind == "cuda" and index.isdigit():
        want = int(index)
        get_device = torch.Tensor.get_device  # the C method: half methodcaller's cost
        # is_cuda and then the index: two C-level passes over the shards
        return ((lambda t: bool(t.is_cuda) and t.get_device() == want),
                (lambda ts: all(map(_IS_CUDA, ts)) and all(
                    map(operator.eq, map(get_device, ts), repeat(want)))))

    def one(t: torch.Tensor) -> bool:
        return bool(t.device.type == device)

    return one, (lambda ts: all(map(one, ts)))


#: Guards kept per chunk: the kinds of tensors that passed last, the latest first. Two, for
#: callers that alternate two kinds of source (bf16 rounds and fp32-master rounds); a guard
#: that does not match usually stops at its first tensor, so a miss costs little.
_GUARDS_KEPT = 2


class Recheck:
    """Per chunk of tensors that passed the fast pass, torch's ``TensorGuards`` over them
    (module docstring): ``passes`` is one C call per chunk, after the nested screen. Keyed
    by the caller (a chunk's range in the plan); holds no reference to a tensor, not even a
    weak one (module docstring)."""

    __slots__ = ("_guards", "_unguarded")

    def __init__(self) -> None:
        #: per key, the latest kinds that passed: (guard, the caller's note of the tensors
        #: it was recorded with), the latest matched first
        self._guards: dict[Any, list[tuple[Callable[..., bool], Any]]] = {}
        #: chunks no guard accepts even as they passed (the same tensor twice: tied weights)
        self._unguarded: set[Any] = set()

    def passes(self, key: Any, ts: tuple[Any, ...]) -> bool:
        """Whether ``ts`` match, tensor for tensor, a chunk of tensors recorded under
        ``key``: False when none does (the caller then runs the fast pass)."""
        kept = self._guards.get(key)
        if not kept:
            return False
        # A guard reads each tensor's strides in C++ before comparing anything, and a
        # nested tensor (of type Tensor, as the guard expects) raises there: an error no
        # Python frame can catch, so the process would abort. The fast pass refuses it by
        # name. Screened every time, even for the objects the guard was recorded with:
        # ``torch.utils.swap_tensors`` makes a tensor object nested in place.
        if any(map(_IS_NESTED, ts)):
            return False
        for i, (check, _) in enumerate(kept):
            try:
                ok = check(*ts)
            except Exception:  # another number of tensors than recorded, or an odd kind
                ok = False
            if ok:
                if i:  # the latest first: a steady kind is matched by the first call
                    kept.insert(0, kept.pop(i))
                return True
        return False

    def kind(self, key: Any) -> Any:
        """The note recorded (``passed``) with the kind ``passes`` matched last under
        ``key`` (the trainer's: the tensors' dtypes); None when nothing is recorded."""
        kept = self._guards.get(key)
        return kept[0][1] if kept else None

    def passed(self, key: Any, ts: tuple[Any, ...], note: Any = None) -> None:
        """``ts`` passed the fast pass: record them under ``key`` for the next rounds, with
        ``note`` (what the caller read of them, true of any tensors the guard accepts:
        ``kind`` returns it)."""
        make = _tensor_guards()
        if make is None or key in self._unguarded:
            return
        try:
            check = make(*ts, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
            if not check(*ts):
                # A guard refuses a tensor given twice (tied weights under two names): this
                # chunk would pay a refusal, the fast pass and a new guard every round.
                self._unguarded.add(key)
                self._guards.pop(key, None)
                return
        except Exception:  # a signature of another torch: no guard, the fast pass each round
            return
        kept = self._guards.setdefault(key, [])
        kept.insert(0, (check, note))
        del kept[_GUARDS_KEPT:]


@functools.cache  # looked up once, not per chunk and round
def _tensor_guards() -> Any:
    """torch's ``TensorGuards`` class, or None where this torch has none."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:
        return None
    return TensorGuards


def laid_out(ts: Sequence[torch.Tensor], shapes: Sequence[torch.Size],
             on_device: Callable[[tuple[torch.Tensor, ...]], bool]) -> bool:
    """Whether tensors ``ts`` have ``shapes``, are all on the device (``on_device``, from
    ``device_predicates``) and are contiguous: three C-level passes, no frame per tensor.
    The fast pass of both the trainer's source and the worker's target checks."""
    import torch

    return (all(map(operator.eq, map(_SHAPE, ts), shapes)) and on_device(tuple(ts))
            and all(map(torch.Tensor.is_contiguous, ts)))


#: Per param: (wire torch dtype, local shape, the source dtypes accepted: the wire dtype and
#: those the transports cast to it while packing).
_Expect = tuple[Any, "torch.Size", frozenset[Any]]


_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_IS_CPU = operator.attrgetter("is_cpu")
_IS_NESTED = operator.attrgetter("is_nested")
_IS_CUDA = operator.attrgetter("is_cuda")


#: One chunk of the fast check: an itemgetter of its names, the accepted dtypes and the
#: local shapes of its parameters.
_Chunk = tuple[Callable[[Mapping[str, Any]], Any], list[frozenset[Any]], list["torch.Size"]]


class _Expectations(list[_Expect]):
    """``_source_expectations``' list, plus the fast pass's chunk tables per range of params
    (the whole plan for ``precheck``, each bucket), built on first use for one names
    sequence and kept with the engine that keeps this list."""

    _names: Sequence[str] | None = None
    _chunks: dict[tuple[int, int], list[_Chunk]]
    #: the chunks that passed, for a C-level re-check next round (keyed (start, stop, chunk));
    #: set by ``chunks``, with the tables it goes with
    recheck: Recheck

    def chunks(self, names: Sequence[str], start: int, stop: int) -> list[_Chunk]:
        if self._names is not names:
            self._names, self._chunks, self.recheck = names, {}, Recheck()
        got = self._chunks.get((start, stop))
        if got is None:
            got = self._chunks[start, stop] = []
            for a in range(start, stop, _INLINE_PARAMS):
                b = min(a + _INLINE_PARAMS, stop)
                part = self[a:b]
                got.append((operator.itemgetter(*names[a:b]), [ok for _, _, ok in part],
                            [shape for _, shape, _ in part]))
        return got


def _source_expectations(plan: TransferPlan, rank: int) -> _Expectations:
    """Per param, the dtype, local shape and accepted source dtypes of this rank's shard."""
    import torch

    floats = frozenset(getattr(torch, n) for n in CAST_DTYPES)
    # Once per geometry (its shape, dtype and layouts), not per parameter: 10^5 experts
    # share a handful, and each entry costs a few microseconds.
    per_geo: dict[int, _Expect] = {}
    out = _Expectations()
    for p, gid in zip(plan.params, plan._geo_index(), strict=True):
        e = per_geo.get(gid)
        if e is None:
            wire = getattr(torch, p.spec.dtype)
            e = per_geo[gid] = (wire, torch.Size(p.spec.layout.local_shape(p.spec.shape, rank)),
                                floats if wire in floats else frozenset((wire,)))
        out.append(e)
    return out
