"""``TrainerEngine`` and ``WorkerEngine``: connect, rounds, lifecycle, watchdog, cancellation.

Theory of operation (DESIGN §3, §6). ``connect`` = store client → claim this rank of the job
(``_store._claims``: one live holder per rank, so a second job of the same name is refused) →
join a generation (rank 0 opens it; the others join the one its live claim names) →
``ControlGroup`` → ``run_preflight`` (the handshake agrees on plan, transport and bucket
size; the transport is built and prepared in its ``runtime_ready`` phase) → the transport
creates its communicator → READY. Nothing of the data plane exists before every phase passed
on every rank.

A round, event-driven through the store under ``{job}/{generation}/round/{k}/``: trainer rank
0 writes ``start``; every rank runs its side of the bucket pipeline and reports; the version
commits only if every rank reported ok. What the round decides lives in ``_proto/round.py``
(keys, reports, the departure rule, the deadline verdict, the error text) and the I/O that
feeds it in ``_engine/_round.py`` (waiting for the start, the watchdog, reporting, gathering);
this module keeps the lifecycle around them. Every round failure reaches the caller as one
``TransferError`` whose ``rank`` is the rank that caused it and ``cause`` says how.

States are enforced: a call in the wrong state raises ``LocalProtocolError``; after any failure
(or cancellation mid-round) every call except ``close`` raises ``EnginePoisonedError`` chained
to the original failure. Recovery is a new ``connect`` (a new generation) on the same store.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import os
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import contextmanager
from typing import Any, Final, Literal, Self, TypeGuard

import anyio
import anyio.lowlevel
import anyio.to_thread

from m2n_async._data._native import NativeThread
from m2n_async._data._transport import (
    Rendezvous,
    Sink,
    SinkMap,
    Transport,
    TransportContext,
    TransportSettings,
    create_transport,
    transport_class,
)
from m2n_async._engine._config import EngineConfig, EngineState, SyncResult
from m2n_async._engine._generation import join_generation
from m2n_async._engine._pipeline import PipelineStats, run_pipeline, unwrap_group
from m2n_async._engine._preflight import PreflightInputs, PreflightOutcome, run_preflight
from m2n_async._engine._round import NOTE_CHARS, JobEnded, RoundDriver, RoundOutcome
from m2n_async._engine._sources import (  # _INLINE_PARAMS: re-exported for callers
    _INLINE_PARAMS as _INLINE_PARAMS,
)
from m2n_async._engine._sources import (
    Interrupts,
    Weights,
    _Expect,
    _source_expectations,
    _Sources,
)
from m2n_async._engine._targets import TargetCheck, check_targets, target_expectations
from m2n_async._integrations.targets import is_async_callable
from m2n_async._proto.cost import COSTS_ENV, DEFAULT_LANES, cost_inputs, parse_costs
from m2n_async._proto.errors import (
    EnginePoisonedError,
    LocalProtocolError,
    M2NError,
    PeerLostError,
    PhaseTimeoutError,
    PlanError,
    PreflightError,
    TransferError,
)
from m2n_async._proto.handshake import Phase, PreflightPlan
from m2n_async._proto.lanes import LANES, bucket_bytes
from m2n_async._proto.messages import (
    PROTO_VERSION,
    CostInputs,
    DataPlaneIdentity,
    RoundStart,
)
from m2n_async._proto.params import ParamSpec
from m2n_async._proto.plan import (
    MAX_BUCKET_PARAMS,
    TransferPlan,
    split_buckets,
)
from m2n_async._store import (
    Claim,
    ControlGroup,
    Store,
    StoreClient,
    claim_rank,
    generation_namespace,
)

__all__ = ["TrainerEngine", "WorkerEngine"]

log = logging.getLogger("m2n_async")
#: How a rank's gone note starts when its data plane failed to connect: its peers raise that
#: text (``_connect_data_plane``), not the bare loss.
_CONNECT_NOTE: Final[str] = "connected: "
#: The steps of a connect, as a ``PhaseTimeoutError`` past its timeout names them (``phase``)
#: and says them.
_CONNECT_STEPS: Final[dict[str, str]] = {
    "claim": "while claiming its rank of the job",
    "generation": "while joining the job's generation",
    "handshake": "in the handshake",
    "data plane": "while connecting the data plane",
}
#: The most ranks a job may have: past it, connect refuses at once. Each rank costs every
#: rank a liveness key and handshake entries built on the event loop, so an absurd
#: ``world_size`` (a typo, 2**70) would hold the loop past every timeout instead.
MAX_WORLD_SIZE: Final[int] = 1 << 17

Progress = Callable[[int, int], None]


class _Engine:
    """Shared machinery of both roles (not public; see the two subclasses)."""

    _role: Literal["trainer", "worker"]

    def __init__(self, *, store: Store, owns_store: bool, rank: int, trainer_ranks: int,
                 world_size: int, config: EngineConfig) -> None:
        self._store = store
        self._owns_store = owns_store
        self.rank = rank
        self.trainer_ranks = trainer_ranks
        self.world_size = world_size
        self.config = config
        self._state = EngineState.PREFLIGHT
        self._poison: BaseException | None = None
        self._group: ControlGroup | None = None
        self._native: NativeThread | None = None
        self._transport: Transport | None = None
        self._outcome: PreflightOutcome | None = None
        self._plan: TransferPlan | None = None
        self._generation = 0
        self._namespace = ""
        self._watch: tuple[str, ...] = ()
        self._rounds: RoundDriver | None = None
        self._claim: Claim | None = None  # this rank of the job, held from connect to close
        self._round = 0
        self._began = 0  # the last round this rank's part of began (its first write may follow)
        self._version = 0
        self._job_closed = False
        self._job_end = "trainer rank 0 closed the job"
        self._job_failed = False  # rank 0 closed it on an error: updates() raises, not ends
        self._closing = False  # close() has begun
        # The wait for a round's start in progress (receive, a trainer's sync_weights):
        # close() cancels it, for the wait would otherwise outlive the engine.
        self._start_wait: anyio.CancelScope | None = None
        self._busy: str | None = None  # the sync_weights/receive call in progress, if any
        # An argument refused before the handshake (a worker's malformed target, cost terms
        # that do not parse), for hello to report
        self._argument_error: Exception | None = None
        self._preflight_phase = "hello"  # the handshake's phase under way (_entered_phase)
        # What this engine's callbacks raise that is no Exception, for the call to raise
        self._interrupts = Interrupts()

    # -- public read-only facts ------------------------------------------------------------

    @property
    def state(self) -> EngineState:
        """The lifecycle state (PREFLIGHT, READY, UPDATING, POISONED, CLOSED)."""
        return self._state

    @property
    def version(self) -> int:
        """The last version committed on every rank (0 before the first round of this
        engine: the count restarts with every connect, see ``sync_weights(version=)``)."""
        return self._version

    @property
    def last_began(self) -> int:
        """The last round this rank's part of began (0 before any; the count restarts with
        every connect). A call that failed with a ``TransferError`` whose ``round`` is later
        failed before its part began: it wrote nothing (read or sent nothing) of that round
        here, and its targets hold what they held before the call."""
        return self._began

    @property
    def generation(self) -> int:
        """The store generation this engine joined."""
        return self._generation

    @property
    def plan(self) -> TransferPlan:
        """The plan every rank agreed on."""
        if self._plan is None:
            raise LocalProtocolError("the engine has no plan before connect() finished")
        return self._plan

    @property
    def transport(self) -> str:
        """The agreed transport name."""
        return self._outcome.transport if self._outcome is not None else ""

    @property
    def transport_reason(self) -> str:
        """Why that transport was chosen (what ruled out the better ones), and once connected
        how it runs (``m2n``: grouped or ordered single reshards, and why)."""
        reason = self._outcome.reason if self._outcome is not None else ""
        detail = self._transport.detail if self._transport is not None else ""
        return f"{reason}; {detail}" if reason and detail else reason or detail

    @property
    def preflight(self) -> PreflightOutcome | None:
        """The handshake's outcome (plan, digest, transport, per-phase seconds)."""
        return self._outcome

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} rank {self.rank}/{self.world_size} generation "
                f"{self._generation} {self._state.value} version {self._version}>")

    # -- connect ---------------------------------------------------------------------------

    @classmethod
    async def _open_store(cls, address: str | tuple[str, int] | None, token: str | bytes | None,
                          store: Store | None,
                          timeout: float | None,  # noqa: ASYNC109 - connect's own argument
                          config: EngineConfig) -> tuple[Store, bool, float | None]:
        """The store (and whether the engine owns it), and what is left of ``timeout``.

        The TCP connect and the store's authentication are bounded like a phase: by
        ``timeout`` when given, else ``config.phase_timeout``. A store address that accepts
        and then says nothing would otherwise hold the connect for good."""
        if (address is None) == (store is None):
            raise LocalProtocolError("connect() needs exactly one of `address` (a store "
                                     "server to connect to) or `store` (an open Store)")
        if store is not None:
            return store, False, timeout
        assert address is not None
        limit = config.phase_timeout if timeout is None else timeout
        started = anyio.current_time()
        try:
            with anyio.fail_after(limit):
                client = await StoreClient.connect(address, token=token)
        except TimeoutError:
            which = "timeout=" if timeout is not None else "EngineConfig.phase_timeout"
            raise TimeoutError(f"connect: the store at {address!r} did not complete its "
                               f"connect and authentication within {limit:g} s ({which})"
                               ) from None
        left = None if timeout is None else max(timeout - (anyio.current_time() - started),
                                                 0.0)
        return client, True, left

    def _bucket_bytes(self, transport: str) -> int:
        """The config's ``bucket_bytes``, or the transport's default when it is None: a pure
        function of the agreed transport, so every rank derives the same buckets."""
        return bucket_bytes(transport, self.config.bucket_bytes)

    def _settings(self, transport: str = "gloo") -> TransportSettings:
        c = self.config
        host = c.host
        # Gloo must bind somewhere: with a loopback TCP store, or a store that is not a TCP
        # client at all (MemoryStore: every rank is in this process), the ranks share this
        # host, so loopback works without configuration.
        if host is None and (not isinstance(self._store, StoreClient) or
                             self._store.address.startswith(("127.", "localhost", "[::1]",
                                                             "::1"))):
            host = "127.0.0.1"
        elif host is None and isinstance(self._store, StoreClient):
            # A remote store: listen on the interface that reaches it, not on whatever the
            # host name resolves to (often every interface, or a loopback alias). The data
            # plane is unauthenticated (docs/security.md): bind as narrowly as works.
            host = self._store.local_host
        # Not here: the bucket boundaries (TransportContext.buckets) and the connect bound
        # (Rendezvous.timeout, the phase timeout): one route each into the data plane.
        return TransportSettings(max_inflight=c.max_inflight,
                                 max_cta=c.max_cta, device=c.device, host=host,
                                 close_timeout=c.abort_grace,
                                 coalesce=c.coalesce, coalesce_below=c.coalesce_below)

    def _costs(self) -> CostInputs:
        """What ``auto`` predicts from: the config's (or ``M2N_ASYNC_COSTS``'s) terms over the
        defaults, each lane's bucket size and the coalescing threshold; compared in the
        handshake, so a rank configured differently is named."""
        c = self.config
        lanes = dict(DEFAULT_LANES)
        if c.costs is not None:
            lanes.update(c.costs)
        elif os.environ.get(COSTS_ENV, "").strip():
            try:
                lanes = parse_costs(os.environ[COSTS_ENV])
            except PlanError as exc:  # its text does not say where the terms came from
                raise PlanError(f"{COSTS_ENV}: {exc}") from exc
        return cost_inputs(lanes, {t: self._bucket_bytes(t) for t in lanes},
                           c.coalesce_below if c.coalesce else 0)

    def _preflight_costs(self) -> CostInputs | None:
        """``_costs()`` for the handshake. Terms it refuses (an ``M2N_ASYNC_COSTS`` of this
        process that does not parse) are a refused argument like a malformed target: raised
        here, before the group is joined, they would reach the peers as a bare loss (or a
        deadline); kept as ``_argument_error``, ``hello`` reports them to every rank."""
        try:
            return self._costs()
        except Exception as exc:
            if self._argument_error is None:  # the first refusal is the one reported
                self._argument_error = exc
            return None

    def _capabilities(self) -> list[str]:
        out = []
        for name in LANES:
            try:
                if transport_class(name).unavailable_reason(self._settings(name)) is None:
                    out.append(name)
            except M2NError as exc:
                log.debug("transport %s unavailable on rank %d: %s", name, self.rank, exc)
        return out

    def _identity(self, name: str) -> DataPlaneIdentity:
        facts = dict(transport_class(name).identity(self._settings(name)))
        libnccl = facts.pop("libnccl_version", None)
        facts.pop("max_cta", None)
        # Bucket boundaries derive from bucket_bytes: a mismatch would misalign every
        # bucket's sends and receives, so it is compared like an NCCL variable.
        facts["m2n_async.bucket_bytes"] = str(self._bucket_bytes(name))
        facts["m2n_async.bucket_params"] = str(MAX_BUCKET_PARAMS)
        # Coalescing decides which reshards are issued: every rank must stack alike.
        if name == "m2n":
            c = self.config
            facts["m2n_async.coalesce"] = f"below {c.coalesce_below}" if c.coalesce else "off"
        return DataPlaneIdentity(libnccl_version=libnccl, max_cta=self.config.max_cta,
                                 env=tuple(sorted(facts.items())))

    async def _prepare_runtime(self, agreed: PreflightPlan) -> None:
        """runtime_ready: build and prepare the transport, check local buffers."""
        assert self._native is not None
        plan = agreed.plan
        self._plan = plan
        buckets = split_buckets(plan, plan.buckets(self._bucket_bytes(agreed.transport)),
                                MAX_BUCKET_PARAMS)
        self._check_local(plan)
        ctx = TransportContext(plan, self.rank, self._generation,
                               self._settings(agreed.transport),
                               self._native, buckets, self.config.job,
                               in_place=self._in_place(plan))
        self._transport = create_transport(agreed.transport, ctx)
        await self._transport.prepare()

    def _check_local(self, plan: TransferPlan) -> None:  # overridden by the worker
        """Role-specific checks of local buffers against the agreed plan."""

    def _in_place(self, plan: TransferPlan) -> frozenset[int] | None:  # the worker's differ
        """``TransportContext.in_place``: None on a trainer."""
        return None

    def _preflight_inputs(self) -> PreflightInputs:
        raise NotImplementedError

    async def _connect(self, limit: float | None) -> None:
        c = self.config
        bound = anyio.fail_after(limit) if limit is not None else _no_deadline()
        step = "claim"  # what a connect past ``limit`` was doing (``_CONNECT_STEPS``)
        deadline: anyio.CancelScope | None = None
        try:
            with bound as deadline:
                # The job's rank first (fencing): nothing of the job is touched, no generation
                # opened or joined, while another live process holds this rank of it.
                self._claim = await claim_rank(self._store, c.job, self.rank,
                                               wait_s=c.phase_timeout)
                step = "generation"
                # Rank 0 opens a generation; the others join the one its live claim names.
                self._generation = await join_generation(self._store, c.job, self.rank,
                                                         claim=self._claim,
                                                         wait_s=c.phase_timeout)
                step = "handshake"
                ns = generation_namespace(c.job, self._generation)
                self._namespace = ns
                group = ControlGroup(self._store, self.rank, self.world_size, ns)
                self._group = group
                self._watch = tuple(group.alive_key(r) for r in range(self.world_size)
                                    if r != self.rank)
                self._rounds = RoundDriver(store=self._store, group=group, namespace=ns,
                                           generation=self._generation, rank=self.rank,
                                           world_size=self.world_size,
                                           trainer_ranks=self.trainer_ranks,
                                           abort_grace=c.abort_grace)
                self._native = NativeThread(f"{c.job}-g{self._generation}-r{self.rank}")
                self._outcome = await run_preflight(group, self._preflight_inputs(),
                                                    phase_timeout=c.phase_timeout,
                                                    on_phase=self._entered_phase)
                assert self._transport is not None
                log.info("rank %d generation %d: transport %s (%s)", self.rank,
                         self._generation, self._outcome.transport, self._outcome.reason)
                rdv = Rendezvous(self._store, f"{ns}/data/{self._outcome.transport}/",
                                 rank=self.rank, world_size=self.world_size,
                                 timeout=c.phase_timeout, watch=self._watch)
                step = "data plane"
                await self._connect_data_plane(rdv)
        except BaseException as exc:
            if (limit is not None and type(exc) is TimeoutError and deadline is not None
                    and deadline.cancel_called):
                # The caller's bound, not a phase's: anyio's bare TimeoutError says nothing,
                # so say what was under way and which ranks had not joined.
                with anyio.CancelScope(shield=True):
                    timed_out = await self._connect_timed_out(limit, step)
                timed_out.__cause__ = exc
                exc = timed_out
            refused = self._argument_error
            if refused is not None and isinstance(exc, Exception) and not isinstance(
                    exc, PreflightError):
                # The handshake failed before (or while) its hello reported the refusal: say
                # it here, or this rank's own mistake is lost behind a timeout.
                exc.add_note(f"rank {self.rank} refused its own arguments before the "
                             f"handshake, which failed before it could report that: "
                             f"{type(refused).__name__}: {refused}")
            self._state = EngineState.POISONED
            self._poison = exc
            with anyio.CancelScope(shield=True):
                await self._release(abort_reason=f"connect failed: {exc!r}")
            self._state = EngineState.CLOSED
            raise exc  # the original, or its diagnosis (whose cause is the original)
        self._state = EngineState.READY

    def _entered_phase(self, phase: str) -> None:
        self._preflight_phase = phase  # what a connect past its timeout names (below)

    async def _connect_timed_out(self, limit: float, step: str) -> PhaseTimeoutError:
        """The error of a connect past the caller's ``limit``: the step under way and, once
        this rank joined a generation, the ranks with no liveness key in it (never arrived or
        already gone). Reads the store for at most a second."""
        missing: tuple[int, ...] = ()
        group = self._group
        if group is not None:
            with anyio.move_on_after(1.0):
                try:
                    alive = await self._store.gather(group.alive_prefix, 0)
                    missing = tuple(r for r in range(self.world_size)
                                    if group.alive_key(r) not in alive)
                except M2NError:
                    pass
        who = (f"; rank(s) {list(missing)} not in generation {self._generation} (never "
               f"arrived, or already gone)"
               if missing else "")
        if step == "generation" and self.rank != 0:
            missing = (0,)  # rank 0 had not opened the generation: it is who did not arrive
        # ``phase``: the handshake's phase under way (a ``PreflightPhase`` name, as a phase's
        # own timeout says it); before the handshake, the ranks had not met: ``hello``.
        phase = {"claim": "hello", "generation": "hello", "data plane": "connected"}.get(
            step, self._preflight_phase)
        return PhaseTimeoutError(
            f"rank {self.rank}: connect did not complete within its timeout of {limit:.3g} s "
            f"(the connect's timeout, or connect_timeout), {_CONNECT_STEPS[step]}{who}",
            phase=phase, ranks=missing, generation=self._generation or None)

    async def _connect_data_plane(self, rdv: Rendezvous) -> None:
        """``transport.connect``, its failures phrased as the ``connected`` phase's.

        The rank that fails raises ``PreflightError("connected", {its rank: why})``, leaves
        ``why`` as its gone note and leaves as lost (``_release``); its peers, waiting for it
        in the rendezvous or in the barrier that ends the phase (``_confirm_connected``),
        then raise the same error at once (they read the note; a rank lost without one, its
        process killed, is ``{that rank: "was lost ..."}``).
        """
        assert self._transport is not None and self._outcome is not None
        name = self._outcome.transport
        phase = Phase.CONNECTED.value
        try:
            await self._transport.connect(rdv)
            # Every rank confirms it connected: a rank whose own connect finished before a
            # peer failed would otherwise learn of it only in round 1 (or while waiting for
            # it), and say so in other words than the ranks still connecting.
            await self._confirm_connected(rdv.timeout)
        except PeerLostError as exc:
            lost = self._lost_rank(exc)
            who = lost if lost is not None else self.rank
            # One text on every rank (as the other phases' failures): the failing rank's own,
            # from its note, else the loss; the observer's view, its rank and the group's own
            # message, goes in a note.
            why = await self._gone_note(who) if lost is not None else None
            error = PreflightError(phase, {who: why or f"was lost while the {name} data "
                                                       f"plane connected (its store session "
                                                       f"ended)"},
                                   generation=self._generation)
            error.add_note(f"seen by rank {self.rank}: {exc}")
            raise error from exc
        except TimeoutError:
            raise
        except Exception as exc:
            why = f"could not connect the {name} data plane: {type(exc).__name__}: {exc}"
            # Cut to what the note carries, so that the peers raise this very text.
            limit = NOTE_CHARS - len(_CONNECT_NOTE)
            if len(why) > limit:
                why = why[:limit - 1] + "…"
            if self._rounds is not None:
                # Before the liveness key goes (_release): a peer that sees it gone reads it.
                await self._rounds.note_leaving(f"{_CONNECT_NOTE}{why}")
            raise PreflightError(phase, {self.rank: why},
                                 generation=self._generation) from exc

    async def _gone_note(self, rank: int) -> str | None:
        """The text ``rank`` left when its data plane failed to connect, if it left one."""
        assert self._rounds is not None
        with anyio.move_on_after(self.config.abort_grace):
            text = await self._rounds.gone_note(rank)
            if text is not None and text.startswith(_CONNECT_NOTE):
                return text[len(_CONNECT_NOTE):]
        return None

    async def _confirm_connected(self, limit: float) -> None:
        """A barrier of every rank after its data plane connected (bounded)."""
        group = self._group
        assert group is not None
        try:
            with anyio.fail_after(limit):
                await group.barrier()
        except TimeoutError:
            missing: list[int] = []
            with anyio.move_on_after(1.0):
                missing = await group.missing_ranks()
            timeout = PhaseTimeoutError(
                f"preflight phase 'connected' (generation {self._generation}) timed out after "
                f"{limit:g} s: rank(s) {missing} did not confirm their data plane",
                phase=Phase.CONNECTED.value, ranks=tuple(missing),
                generation=self._generation)
            timeout.add_note(f"seen by rank {self.rank}")
            raise timeout from None

    # -- lifecycle guards ------------------------------------------------------------------

    def _require(self, *allowed: EngineState, what: str) -> None:
        if self._state is EngineState.POISONED:
            raise EnginePoisonedError(
                f"{what}: rank {self.rank} (generation {self._generation}) is poisoned by an "
                f"earlier failure ({self._poison!r}); close it and connect again"
            ) from self._poison
        if self._state not in allowed:
            raise LocalProtocolError(
                f"{what}: rank {self.rank} (generation {self._generation}) is "
                f"{self._state.value.upper()}, needs "
                f"{' or '.join(s.value.upper() for s in allowed)}")

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """READY, and no other ``sync_weights``/``receive`` of this engine running: two would
        join the same round on one transport. Marked before the first await, so a second
        call made while the first waits for its round start is refused too."""
        if self._busy is not None and self._state is EngineState.UPDATING:
            # The running call is in its round: say so, not only that the state is wrong.
            raise LocalProtocolError(f"{what}: rank {self.rank} is already in {self._busy} on "
                                     "this engine (UPDATING: its round is in progress); one "
                                     "round at a time per engine")
        self._require(EngineState.READY, what=what)
        if self._closing:  # close() began: READY until its teardown ends, but no new round
            raise LocalProtocolError(f"{what}: rank {self.rank} (generation "
                                     f"{self._generation}) is closing")
        if self._busy is not None:
            raise LocalProtocolError(f"{what}: rank {self.rank} is already in {self._busy} on "
                                     "this engine; one round at a time per engine")
        self._busy = what
        try:
            yield
        finally:
            self._busy = None

    def _poison_with(self, exc: BaseException) -> None:
        if self._state is not EngineState.CLOSED:
            self._state = EngineState.POISONED
        if self._poison is None:
            self._poison = exc

    # -- the round (the driver: _engine/_round.py; the decisions: _proto/round.py) --------

    def _lost_rank(self, exc: PeerLostError) -> int | None:
        if self._group is None:
            return exc.ranks[0] if exc.ranks else None
        return self._group.lost_rank(exc)

    def _named(self, ranks: Sequence[int]) -> str:
        """``"2 (worker), 3 (worker)"``: ranks with their roles, for messages."""
        return ", ".join(f"{r} ({'trainer' if r < self.trainer_ranks else 'worker'})"
                         for r in ranks)

    async def _wait_start(self, k: int, *, limit: float | None, missed_is_failure: bool,
                          what: str) -> RoundStart:
        """``RoundDriver.wait_start`` for round ``k``, ended by a ``close()`` of this engine
        (another task's, or another thread's through the blocking facade), which would
        otherwise leave the wait running on a released engine, or fail it as a store loss
        when the engine's own store closes: then ``LocalProtocolError``, as any call on a
        closed engine raises; nothing was written.

        Cancelled by its caller (a cancel that ``close()`` did not make): the round's keys
        are read once, shielded and bounded by ``abort_grace``
        (``RoundDriver.cancelled_waiting``). If round ``k`` had started, the cancel is posted
        as its abort record, as a cancel in the round is, and the engine is POISONED with
        the record that won; if not, nothing is written and the engine stays READY."""
        assert self._rounds is not None
        scope = anyio.CancelScope()
        self._start_wait = scope
        try:
            with scope:
                return await self._rounds.wait_start(k, limit=limit,
                                                     missed_is_failure=missed_is_failure)
        except TransferError:
            if not self._closing:
                raise
        except anyio.get_cancelled_exc_class():
            # close()'s own cancel ends in ``with scope`` above and never gets here; a close
            # that began meanwhile ends the round itself (its leave), so it is left to it.
            await self._cancelled_before_start(k)
            raise
        finally:
            self._start_wait = None
        raise LocalProtocolError(f"{what} on rank {self.rank}: the engine was closed while "
                                 f"waiting for round {k} of generation {self._generation}")

    async def _cancelled_before_start(self, k: int) -> None:
        """A call of a rank other than trainer rank 0 was cancelled by its caller before it
        joined round ``k`` (in its wait for the start, or in the checks before it): if the
        round had started, post the cancel as its abort record and poison (``_wait_start``);
        else nothing. Not for a cancel that ``close()`` made: its leave ends the round."""
        if self._closing or self._rounds is None:
            return
        # Shielded: peers that read round k's start are in it and wait for this rank; they
        # must hear of this cancel now, not at the round deadline.
        with anyio.CancelScope(shield=True):
            failure = await self._rounds.cancelled_waiting(k)
        if failure is not None:
            self._poison_with(self._rounds.core(k).error(failure))

    async def _run_round(self, start: RoundStart, work: Callable[[], Awaitable[PipelineStats]],
                         waited: float) -> SyncResult:
        """Steps 2 and 3 of the module docstring (``RoundDriver.run``), then the commit."""
        assert self._transport is not None and self._rounds is not None
        t0 = time.perf_counter()
        if self._state is not EngineState.READY or self._closing:
            # close() ran (or began) while this call waited for the start: its transport is
            # gone or going. The
            # round's record names this rank as the one that left (what its peers' poll finds).
            core = self._rounds.core(start.round)
            with anyio.CancelScope(shield=True):
                failure = await self._rounds.post(core, core.closed(self.rank))
            raise core.error(failure)
        self._began = start.round  # before any write: a later round's failure wrote nothing
        self._state = EngineState.UPDATING
        self._interrupts.take()  # none of an earlier call's is this round's
        try:
            outcome = await self._rounds.run(start, self._transport, work, self._committed,
                                             self._poison_with)
        except BaseExceptionGroup as group:
            # The driver's task group wraps what is raised after the outcome (the
            # round.commit fault point): the caller gets the exception itself, as raised.
            exc = unwrap_group(group)
            self._undecided(exc)
            raise exc from None
        except BaseException as exc:
            self._undecided(exc)
            interrupt = self._interrupts.take()
            if interrupt is not None:
                # A callback's KeyboardInterrupt/SystemExit failed the round on every rank
                # (as this rank's own error, the engine POISONED): the caller gets it back.
                raise interrupt  # noqa: B904 - chained to the round's error as its context
            raise
        return self._commit(start, outcome, waited, t0)

    def _undecided(self, exc: BaseException) -> None:
        """The driver raised with the round neither committed nor poisoned here (an error
        it does not translate, from a step that has no such error by design): this engine
        cannot know what its peers decided, so it takes no further round."""
        if self._state is EngineState.UPDATING:
            self._poison_with(exc)

    def _committed(self, start: RoundStart) -> None:
        """Every rank reported the round ok: its version is this engine's now."""
        self._round = start.round
        self._version = start.version
        if self._state is EngineState.UPDATING:  # close() during the outcome: stays CLOSED
            self._state = EngineState.READY

    def _commit(self, start: RoundStart, outcome: RoundOutcome, waited: float,
                t0: float) -> SyncResult:
        k, stats = start.round, outcome.stats
        seconds = time.perf_counter() - t0
        phases = {"wait_start": waited, **stats.busy, "pipeline": stats.wall,
                  "commit": outcome.commit_seconds}
        lower = eff = None
        bps = self.config.link_bytes_per_second
        if bps is not None and self._plan is not None:
            lower = self._plan.lower_bound_seconds(bps)
            eff = lower / seconds if seconds > 0 else None
        return SyncResult(version=self._version, round=k, generation=self._generation,
                          bytes=stats.nbytes, seconds=seconds, phases=phases,
                          buckets=stats.buckets, lower_bound_seconds=lower, efficiency=eff,
                          peak_extra_bytes=stats.peak_extra_bytes, transport=self.transport,
                          reason=self.transport_reason, cast_bytes=stats.cast_bytes,
                          predicted_seconds=(self._outcome.predicted_seconds
                                             if self._outcome is not None else None),
                          loop_stall_seconds=outcome.loop_stall_seconds)

    # -- close -----------------------------------------------------------------------------

    async def _release(self, abort_reason: str | None) -> None:
        """Tear down transport, native thread, group and (owned) store; bounded, shielded."""
        grace = self.config.abort_grace
        t = self._transport
        if t is not None:
            if abort_reason is not None:
                t.abort(abort_reason)
            with anyio.move_on_after(grace):
                await t.close()
        if self._native is not None:
            native = self._native
            joined = await anyio.to_thread.run_sync(native.close, grace,
                                                    abandon_on_cancel=True)
            if not joined:
                log.warning("rank %d: native thread still busy in %r after %g s; left behind",
                            self.rank, native.current_call, grace)
        if self._group is not None:
            with anyio.move_on_after(grace):
                try:
                        # A failing rank leaves as lost, so that peers still waiting on it
                    # (in a handshake phase, a rendezvous, the next round) hear it now.
                    await self._group.aclose(lost=abort_reason is not None)
                except M2NError:
                    pass
        if self._claim is not None:
            with anyio.move_on_after(grace):
                try:
                    await self._claim.release()
                except M2NError:
                    pass  # the store is gone: the claim went with this session
            self._claim = None
        if self._owns_store:
            with anyio.move_on_after(grace):
                await self._store.aclose()

    async def close(self, *, error: BaseException | str | None = None) -> None:
        """Release everything; callable from any state, idempotent.

        A READY trainer rank 0 first tells the workers that no more rounds will come (their
        ``updates()`` ends, ``receive()`` raises ``PeerLostError``). A round in progress on
        this engine is aborted (peers fail fast) — unless every rank had already reported
        ok: it commits all the same, and this engine leaves as after it (rank 0 then ends
        the job as when READY); on trainer rank 0, so is a round that a
        ``sync_weights`` running beside this call has just published, and one it had not
        published yet happens on no rank (that ``sync_weights`` raises ``TransferError``).
        A ``receive()`` (or a trainer's ``sync_weights``) of this engine waiting for a round
        to start raises ``LocalProtocolError`` (an ``updates()`` loop ends). This rank's
        claim on the job is released: another process may connect as this rank now.

        ``error``: why this rank leaves when it is no clean end — an exception (``async
        with engine:`` passes the one that left the block, unless it is a cancellation or a
        ``SystemExit`` with a success code: those end the job cleanly) or its text. Then
        trainer rank 0's end of the job carries it: its workers' ``receive()`` raises
        ``PeerLostError`` naming it and their ``updates()`` raises it too, instead of ending
        as if training were done. On any rank, a peer that finds this rank gone from a round
        names the error in its ``left`` failure. A ``receive()`` or ``sync_weights`` called
        once ``close()`` has begun raises ``LocalProtocolError``.

        Cancellation: the teardown is shielded and bounded by ``abort_grace`` per step; it
        completes even if the caller is cancelled.
        """
        if self._state is EngineState.CLOSED:
            return
        self._closing = True
        if self._start_wait is not None:  # a receive waiting for a round: it ends now
            self._start_wait.cancel()
        why = _error_text(error)
        with anyio.CancelScope(shield=True):
            healthy = self._state is EngineState.READY
            if why is not None and self._rounds is not None:
                # Before the liveness key goes: a peer that sees it gone reads the note.
                await self._rounds.note_leaving(why)
            started = False  # a sync_weights beside this close published its round first
            while (healthy and self._role == "trainer" and self.rank == 0
                   and self._rounds is not None):
                k = self._round + 1
                if await self._rounds.close_job(k, self._version, self.config.round_timeout,
                                                error=why):
                    break
                # Round k's start won the key: the round began on the ranks that read it, so
                # it ends as a close during a round, its record posted before the data plane
                # goes (whether or not that sync_weights is past its publish yet). Unless it
                # committed meanwhile: then the job's end goes into the next round's key.
                if self._round < k:
                    started = True
                    break
            # A worker whose job ended (POISONED: no more rounds) leaves as cleanly as a READY
            # one: its peers are done, and nothing failed.
            reason = (None if healthy or self._job_closed
                      else f"engine closed in state {self._state.value}")
            if self._state is EngineState.UPDATING or started:
                reason = "engine closed during a round"
                self._poison_with(TransferError(f"rank {self.rank}: {reason}", rank=self.rank))
                if self._rounds is not None:
                    # The round's record names this rank before its data plane goes: a peer
                    # whose transfer then fails finds the cause there, and is not blamed.
                    k = self._round + 1
                    core = self._rounds.core(k)
                    await self._rounds.post(core, core.closed(self.rank))
                    # When every rank had reported ok already, the round commits all the
                    # same: then this rank leaves as after it, cleanly (trainer rank 0 ends
                    # the job at the next round), not as lost in the next one.
                    start = await self._rounds.committed_start(k, self.config.abort_grace)
                    if start is not None:
                        reason = None
                        if self._role == "trainer" and self.rank == 0:
                            await self._rounds.close_job(k + 1, start.version,
                                                         self.config.round_timeout, error=why)
            await self._release(abort_reason=reason)
            self._state = EngineState.CLOSED

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: object) -> None:
        # An exception leaving the block is no clean end of the job: the peers are told.
        await self.close(error=None if _clean_exit(exc) else exc)


class _no_deadline:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


# -- the trainer -----------------------------------------------------------------------------


class TrainerEngine(_Engine):
    """The trainer side: ``sync_weights`` pushes this rank's shards to the workers."""

    _role = "trainer"

    def __init__(self, *, params: Sequence[ParamSpec], **kw: Any) -> None:
        super().__init__(**kw)
        try:
            self._params = _param_specs(params)
        except LocalProtocolError as exc:
            # Not raised here: the peers are already in the handshake, and would wait out its
            # first phase for this rank. Its hello reports it instead, to every rank.
            self._params = ()
            self._argument_error = exc
        self._expect: list[_Expect] = []
        self._names: list[str] = []
        self._warned_unplanned = False
        #: the round whose refusal note (``RoundDriver.note_refusal``) this engine left
        self._refused_round: int | None = None

    @classmethod
    async def connect(cls, address: str | tuple[str, int] | None = None, *,
                      token: str | bytes | None = None, rank: int, trainer_ranks: int,
                      world_size: int, params: Sequence[ParamSpec],
                      config: EngineConfig | None = None, store: Store | None = None,
                      timeout: float | None = None,  # noqa: ASYNC109 - DESIGN §3 API
                      ) -> TrainerEngine:
        """Join the job as trainer ``rank`` (``0 <= rank < trainer_ranks``) and agree on the
        plan with every rank; return a READY engine.

        ``params``: the ordered source specs (identical on every trainer). ``address`` and
        ``token`` reach a ``StoreServer``; or pass an open ``store`` (kept open on close).
        ``timeout`` bounds the whole connect (each handshake phase is bounded by
        ``config.phase_timeout`` regardless): past it, ``PhaseTimeoutError`` says the step
        under way, its ``phase`` the handshake's, its ``ranks`` those not (or no longer) in
        the generation (rank 0 while waiting for it); the store's TCP
        connect and authentication
        are bounded by ``timeout``, else ``config.phase_timeout``, and a store ``address``
        that accepts and then says nothing fails with a ``TimeoutError`` naming it. Raises
        ``PreflightError`` (the same on every rank), ``PeerLostError``, ``TimeoutError``,
        ``StoreError`` — among them
        ``JobClaimedError`` when another live process holds this rank of ``config.job`` on
        the store (another job with the same name, or a process of an earlier run still
        connected) and did not release it within ``config.phase_timeout``; it names the
        holder (host, pid, since when, generation), and nothing of that job was touched.

        ``params`` that is no sequence of ``ParamSpec`` (a ``torch.nn.Module`` passed as it
        is, say: ``specs_from_module(model)`` makes the specs) is not raised before
        connecting: the peers are already in the handshake and would wait out
        ``config.phase_timeout`` for this rank. It joins and fails the ``hello`` phase
        instead, so every rank raises the same ``PreflightError`` naming this rank and the
        entry (on this rank chained to the ``LocalProtocolError``), as a worker's malformed
        target does (``WorkerEngine.connect``). A ``rank`` outside ``[0, trainer_ranks)``, a
        ``world_size`` past 131,072 ranks, or not exactly one of ``address`` and ``store``,
        raises ``LocalProtocolError`` at once: such a rank cannot join.

        Cancellation: everything created so far is released (shielded); peers of this
        generation then fail their handshake (they see this rank lost). Connect again for a
        new generation.
        """
        if not 0 <= rank < trainer_ranks < world_size <= MAX_WORLD_SIZE:
            raise LocalProtocolError(f"TrainerEngine.connect: need 0 <= rank < trainer_ranks < "
                                     f"world_size <= {MAX_WORLD_SIZE}, got rank={rank}, "
                                     f"trainer_ranks={trainer_ranks}, world_size={world_size}")
        cfg = config or EngineConfig()
        st, owns, timeout = await cls._open_store(address, token, store, timeout, cfg)
        engine = cls(params=params, store=st, owns_store=owns, rank=rank,
                     trainer_ranks=trainer_ranks, world_size=world_size, config=cfg)
        await engine._connect(timeout)
        return engine

    def _check_local(self, plan: TransferPlan) -> None:
        self._expect = _source_expectations(plan, self.rank)
        self._names = [p.spec.name for p in plan.params]

    def _preflight_inputs(self) -> PreflightInputs:
        costs = self._preflight_costs()  # first: it may set the argument_error passed below
        return PreflightInputs(
            role="trainer", rank=self.rank, world_size=self.world_size,
            trainer_ranks=self.trainer_ranks, generation=self._generation,
            params=self._params, mesh_dims=None, dst_placements=None,
            transport=self.config.transport, capabilities=self._capabilities,
            data_plane_identity=self._identity, prepare_runtime=self._prepare_runtime,
            costs=costs, argument_error=self._argument_error)

    async def sync_weights(self, weights: Weights, *, version: int | None = None,
                           timeout: float | None = None,  # noqa: ASYNC109 - DESIGN §3 API
                           progress: Progress | None = None) -> SyncResult:
        """Run one round: move this rank's shards to every worker; collective over trainers.

        ``weights``: name -> local shard (a dict, ``module_shards(...)`` or any Mapping), a
        ``torch.nn.Module``, a callable ``f(names) -> Mapping`` called once per bucket, or an
        iterable of ``(name, tensor)`` pairs — lazy sources are materialized bucket by bucket.
        A module's tensors, or an iterable's names, that the plan does not carry are skipped
        (not sent, not held) with one warning per engine naming them; an iterable that
        yields a plan name twice fails the round naming it. Each shard is checked
        against the plan (present, dtype, local shape, contiguity, device): a dict (or
        ``MappingProxyType``) of tensors whole, before the round; a module and
        ``module_shards(...)`` for their dtypes before the round and the rest when each
        bucket is staged; any other source when its bucket is staged. Keep the
        tensors unchanged until this returns.

        Dtypes: a shard may have its parameter's planned (wire) dtype, or another float
        dtype among float64 / float32 / bfloat16 / float16 when the wire dtype is one of them
        (fp32 master weights, bf16 on the wire). Such a shard is cast while it is packed, in
        the copy that packs, on every transport; the workers get exactly
        ``shard.to(wire_dtype)`` (round to nearest even; but for the NaN bits of a float64
        shard on a bfloat16 wire, which torch's CPU cast encodes by position: a NaN stays a
        NaN) and ``SyncResult.cast_bytes`` says how many bytes were cast. Any other
        conversion (int <-> float, to or from fp8, bool, integer widths) raises
        ``PlanError`` naming the parameter, the rank and both dtypes.

        Refused before the round, with ``PlanError`` naming the parameter, the rank and what
        is wrong: for a dict (or ``MappingProxyType``) of tensors, a missing parameter, a
        dtype refused above, a shard of another local shape, on another device or not
        contiguous; for a module and ``module_shards(...)``, a missing parameter or a dtype
        refused above. Nothing was sent and the engine stays READY. Every trainer checks
        every parameter of the plan against its own local shapes, the ones it does not send
        included, so weights built alike on every trainer are refused on every trainer and
        no round starts. A rank other than 0 refused alone leaves its peers in the round
        rank 0 began: call again with fixed weights to join it, or close the engine so they
        fail at once; if it does neither, the round's deadline fails it on every rank naming
        this rank with its refusal (``cause="deadline"``). Rank 0 refused alone starts no
        round: the other trainers waiting for it fail at the deadline naming rank 0 and
        its refusal. A lazy source (a callable, an iterable, any other Mapping, which may
        compute on lookup), and a module's shapes, are checked when the bucket is staged:
        the round then fails on every rank with a ``TransferError`` naming the parameter, as
        any other bad shard, and the engine is POISONED.
        ``version`` (rank 0): the version to commit (default: current + 1; must increase).
        The default counts this engine's rounds: a new ``connect`` (a reconnect after a
        failure, a restarted rank) starts again at version 1. A framework that reconnects
        and tags rollouts by version passes its own increasing number, e.g.
        ``sync_weights(model, version=step)``, so versions keep increasing across
        reconnects.
        ``timeout`` (rank 0): the round deadline for every rank (default
        ``config.round_timeout``). ``progress(bytes_done, bytes_total)`` after each bucket,
        on the event loop: a plain function (an ``async def`` raises ``LocalProtocolError``
        at once, as in ``receive``).
        A ``KeyboardInterrupt`` or ``SystemExit`` raised by ``progress`` or by a lazy source
        fails the round as its error would (``TransferError`` on every rank, naming this
        rank, ``cause="error"``; the engine POISONED), and this call then raises that
        exception (its context the round's ``TransferError``).

        Returns the ``SyncResult`` once every rank reported success. Raises the same
        ``TransferError`` on every rank when the round failed, after which the engine is
        POISONED: ``exc.rank`` is the rank that caused it, ``exc.cause`` how (see
        ``TransferError``; docs/concepts.md, "When a round fails"). A trainer other than rank
        0 waits for rank 0 to start the round at most the round deadline, then fails the round
        for every rank naming rank 0 (``cause="deadline"``). ``PeerLostError`` (ranks
        ``(0,)``) on a trainer other than rank 0 when rank 0 closed the job or opened a newer
        generation. A ``close()`` of rank 0's engine from another task while this call has
        not yet published its round closes the job first: the round happens on no rank, this
        call raises ``TransferError`` (``rank=0``, ``cause="left"``) and the other ranks see
        the job end; once the round is published, ``close()`` fails it on every rank
        (``cause="left"``, naming rank 0).

        Raises ``LocalProtocolError`` (nothing happened, the engine stays READY) for a
        ``version`` that is not an int above the committed one (a bool is no int here) or is
        above 2**64 - 1, a ``timeout`` that is not a finite number of seconds > 0 (0, a
        negative number, NaN, ``math.inf``, a bool, anything that is no real number: the
        round deadline cannot be unbounded, as ``EngineConfig.round_timeout`` cannot), a
        ``progress`` that is neither None nor callable, ``weights`` of none of the kinds
        above, or a second ``sync_weights`` while one runs on this engine; ``PlanError``
        (likewise) for a shard refused before the round (above).

        Cancellation: on rank 0, if cancelled before it publishes the round, nothing
        happened and the engine stays READY. Rank 0's publish itself is shielded (bounded by
        the round deadline, at least ``abort_grace``): a cancel that lands during it takes
        effect just after, once the round has started. A trainer other than 0 cancelled
        while it checks its sources or waits for rank 0's start looks once, shielded and
        bounded by ``abort_grace``, whether the start is there: if it is (rank 0 published the round
        before the look), the cancel is one in the round, as below; if not, nothing was
        posted, the engine stays READY and the round is not refused: rank 0 may publish it
        the next moment, and the other ranks then wait in it for this rank — a later call
        of this one joins it, a ``close()`` of this engine fails it at once
        (``cause="left"``), and otherwise its deadline fails it on every rank naming this
        rank (``cause="deadline"``), as after a refusal (above). A look the store does not
        answer within that bound leaves the engine POISONED (``cause="store"``): whether
        its peers are in the round cannot be told. Once the round started and until this
        rank's part of it is done, this rank posts the round's abort record by
        compare-and-set (peers fail fast with a ``TransferError`` naming this rank,
        ``cause="cancelled"``, unless a record of another failure landed first), aborts its
        transport (shielded, bounded), and the engine is POISONED with the record that won;
        the version does not advance anywhere. Connect again for a new generation. Once its
        part is done, the
        outcome is gathered and committed shielded (bounded by the round deadline), so the
        round ends here as on every other rank; the cancel takes effect after. To bound a
        round, pass ``timeout=`` on rank 0 (or set ``EngineConfig.round_timeout``) rather
        than wrapping this call in ``asyncio.wait_for`` / ``anyio.fail_after``: a timeout that
        cancels it mid-round leaves this engine POISONED and raises a bare ``TimeoutError``, while
        the engine's deadline fails the round on every rank with a ``TransferError`` naming the late
        rank (``cause="deadline"``).
        """
        with self._exclusive("sync_weights"):
            return await self._sync_weights(weights, version, timeout, progress)

    async def _checked_sources(self, weights: Weights, plan: TransferPlan, device: str,
                               version: int | None) -> _Sources:
        """The round's sources, checked before the round (``sync_weights``: what is refused
        with nothing sent)."""
        rank = self.rank
        sources = _Sources(weights, plan, rank, device, self._expect, self._names,
                           self._interrupts)
        if sources.unplanned and not self._warned_unplanned:
            self._warned_unplanned = True  # once per engine: the module is the same each round
            shown = ", ".join(repr(n) for n in sources.unplanned[:5])
            more = (f" and {len(sources.unplanned) - 5} more" if len(sources.unplanned) > 5
                    else "")
            log.warning("sync_weights on rank %d: the module has %d tensor(s) the plan does "
                        "not carry, not sent: %s%s (the plan is what connect agreed; connect "
                        "again with specs_from_module of this module to carry them)",
                        rank, len(sources.unplanned), shown, more)
        v = self._version + 1 if version is None else version
        if rank == 0 and v <= self._version:  # the cheap argument check first
            raise LocalProtocolError(f"sync_weights: version {v} does not advance the "
                                     f"committed version {self._version}")
        await sources.precheck()
        return sources

    async def _rounds_note_refusal(self, exc: BaseException) -> None:
        """Leave why this call refused its arguments for the round it would have joined."""
        if self._rounds is not None and self._state is EngineState.READY:
            self._refused_round = self._round + 1  # a later call joining it takes it back
            await self._rounds.note_refusal(self._round + 1, f"{type(exc).__name__}: {exc}")

    async def _sync_weights(self, weights: Weights, version: int | None,
                            timeout: float | None,  # noqa: ASYNC109 - the API's argument
                            progress: Progress | None) -> SyncResult:
        assert self._plan is not None and self._transport is not None
        plan, transport, rank = self._plan, self._transport, self.rank
        # The device the transport resolved ("cuda" -> "cuda:N"): shards are checked against
        # the very device the transport copies on, index included.
        resolved = getattr(transport, "device", None)
        device = str(resolved) if resolved is not None else (
            transport.ctx.settings.device or "cpu")
        # Before the round: a weights object of the wrong kind, a module lacking plan names,
        # a dtype that is not a float cast of the wire dtype, or a dict's missing, misshapen,
        # misplaced or non-contiguous shard is refused with nothing sent, the engine still
        # READY.
        t0 = time.perf_counter()
        try:
            if version is not None and (type(version) is not int):
                raise LocalProtocolError(f"sync_weights: version must be an int, got "
                                         f"{version!r} ({type(version).__name__})")
            if version is not None and version > _MAX_VERSION:
                # The round's start carries it as an unsigned 64-bit int: refused here, not
                # as an encoding error of the publish.
                raise LocalProtocolError(f"sync_weights: version must be at most 2**64 - 1, "
                                         f"got {version!r}")
            timeout = _round_deadline(timeout)
            _check_progress(progress, "sync_weights")
            sources = await self._checked_sources(weights, plan, device, version)
        except (PlanError, LocalProtocolError) as exc:
            # Refused before joining (its arguments or its weights): the peers stay in the
            # round (this rank may call again, fixed). The note lets their deadline verdict
            # name this refusal instead of a frozen rank.
            with anyio.CancelScope(shield=True):
                await self._rounds_note_refusal(exc)
            raise
        except anyio.get_cancelled_exc_class():
            if self.rank != 0:  # rank 0 published nothing yet: no round can have started
                await self._cancelled_before_start(self._round + 1)
            raise
        if progress is not None:  # it runs in a task of the loop: see CallbackInterrupted
            progress = self._interrupts.wrap(progress, "the progress callback")
        k = self._round + 1
        rounds = self._rounds
        assert rounds is not None
        if self._refused_round == k:
            # This call joins the round an earlier one refused: the note no longer says why
            # this rank may be missing there. Emptied, not deleted: a rank waiting for the
            # start counts the keys under the round's prefix, and that count must not drop.
            try:
                await rounds.note_refusal(k, "")
            except anyio.get_cancelled_exc_class():
                if self.rank != 0:  # as a cancel of the checks before it (a round started?)
                    await self._cancelled_before_start(k)
                raise
            self._refused_round = None
        v = self._version + 1 if version is None else version
        if self.rank == 0:
            rt = self.config.round_timeout if timeout is None else float(timeout)
            start = RoundStart(PROTO_VERSION, self._generation, k, v, rt, False)
            # A caller cancelled already: nothing published, nothing happened.
            await anyio.lowlevel.checkpoint_if_cancelled()
            try:
                if self._state is not EngineState.READY:
                    # close() ran while the sources were checked: round k's start key holds
                    # its closing start (the store it used may be closed by now).
                    core = rounds.core(k)
                    raise core.error(core.closed_before_start())
                # Shielded: a request cut off mid-flight may still have been applied, and a
                # round that started must be aborted, not forgotten. A cancel that lands here
                # is delivered in _run_round, which aborts the round everywhere.
                with anyio.CancelScope(shield=True):
                    await rounds.publish_start(start)
            except TransferError as exc:
                self._poison_with(exc)
                raise
        else:
            try:
                # Bounded: the round cannot happen without this rank, so a rank 0 that does
                # not start it fails the round for everyone (recorded, naming rank 0).
                start = await self._wait_start(k, limit=self.config.round_timeout,
                                               missed_is_failure=True, what="sync_weights")
            except TransferError as exc:
                self._poison_with(exc)
                raise
            except JobEnded as ended:
                self._job_closed = True  # nothing failed: close() leaves cleanly, as a worker
                err = PeerLostError(f"generation {self._generation}: {ended.why}; no more "
                                    f"rounds", ranks=(0,))
                self._poison_with(err)
                raise err from None
        async def work() -> PipelineStats:
            # What the checks before the round read (each shard, its dtype) serves the lane:
            # it need not look every shard up again. Dropped with the pipeline, so the
            # shards are not kept alive past the round.
            transport.use_checked(sources.checked)
            try:
                # Buckets and depth from the transport's context: the lane sized its arenas
                # for these very buckets and that many in flight.
                stats = await run_pipeline(transport, transport.ctx.buckets,
                                           max_inflight=transport.ctx.settings.max_inflight,
                                           sources=sources, progress=progress,
                                           total_bytes=plan.send_bytes(rank))
            finally:
                transport.use_checked(None)
            _check_bytes(stats, plan.send_bytes(rank), "sent", rank)
            return stats

        try:
            return await self._run_round(start, work, time.perf_counter() - t0)
        finally:
            if sources.iter_unplanned_count and not self._warned_unplanned:
                self._warned_unplanned = True  # once per engine, as for a module's
                n = sources.iter_unplanned_count
                more = (f" and {n - len(sources.iter_unplanned)} more"
                        if n > len(sources.iter_unplanned) else "")
                log.warning("sync_weights on rank %d: the weights iterator yielded %d "
                            "name(s) the plan does not carry, skipped, not sent: %s%s (the "
                            "plan is what connect agreed)", rank, n,
                            ", ".join(sources.iter_unplanned), more)


def _clean_exit(exc: BaseException | None) -> bool:
    """Whether leaving a ``with`` block on ``exc`` is a clean end of the job: none, a
    cancellation (a time box around the training loop, a task group's shutdown), or
    ``SystemExit`` with a success code. Anything else — ``KeyboardInterrupt`` included — is
    an error the peers are told of."""
    if exc is None or isinstance(exc, GeneratorExit):
        return True
    if isinstance(exc, SystemExit):
        return exc.code in (0, None)
    try:
        return isinstance(exc, anyio.get_cancelled_exc_class())
    except RuntimeError:  # no event loop (the blocking facade's thread): asyncio's class
        import asyncio

        return isinstance(exc, asyncio.CancelledError)


def _error_text(error: BaseException | str | None) -> str | None:
    """``close(error=...)`` as the text the peers get: ``"Type: message"``."""
    if error is None or isinstance(error, str):
        return error
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _param_specs(params: Sequence[ParamSpec]) -> tuple[ParamSpec, ...]:
    """``TrainerEngine.connect``'s ``params`` as a tuple; ``LocalProtocolError`` when it is
    no sequence of ``ParamSpec`` (a module passed as it is, say), naming the first entry that
    is not one."""
    hint = "e.g. specs_from_module(model) or [ParamSpec(name, dtype, shape, layout)]"
    if isinstance(params, str | bytes | Mapping) or not isinstance(params, Iterable):
        raise LocalProtocolError(f"params must be a sequence of ParamSpec, got "
                                 f"{type(params).__name__}; {hint}")
    specs = tuple(params)
    for i, spec in enumerate(specs):
        if not isinstance(spec, ParamSpec):
            raise LocalProtocolError(f"params[{i}] must be a ParamSpec, got "
                                     f"{type(spec).__name__}; {hint}")
    return specs


def _check_bytes(stats: PipelineStats, want: int, verb: str, rank: int) -> None:
    if stats.nbytes != want:
        raise TransferError(f"rank {rank} {verb} {stats.nbytes} bytes but the plan says "
                            f"{want}", rank=rank)


# -- the worker ------------------------------------------------------------------------------


class WorkerEngine(_Engine):
    """The worker side: ``receive``/``updates`` write new weights into the targets."""

    _role = "worker"

    def __init__(self, *, targets: Mapping[str, Any], mesh_dims: tuple[int, int],
                 **kw: Any) -> None:
        super().__init__(**kw)
        self._mesh_dims = mesh_dims
        self._target_check: TargetCheck | None = None  # built for the first round
        #: per param, its target's dtype and local shape (``target_expectations``; connect)
        self._target_expect: list[tuple[Any, Any] | None] | None = None
        # Each target read once, here: its record says where the shard goes, its placements
        # and what the plan checks; the lanes get this very mapping every bucket.
        try:
            self._sinks = _sink_map(targets, self._interrupts)
        except Exception as exc:
            # Not raised here: the peers are already in the handshake, and would wait out its
            # first phase for this rank. Its hello reports it instead, to every rank.
            self._sinks = SinkMap()
            self._argument_error = exc

    @classmethod
    async def connect(cls, address: str | tuple[str, int] | None = None, *,
                      token: str | bytes | None = None, rank: int, trainer_ranks: int,
                      world_size: int, targets: Mapping[str, Any],
                      mesh_dims: tuple[int, int] | None = None,
                      config: EngineConfig | None = None, store: Store | None = None,
                      timeout: float | None = None,  # noqa: ASYNC109 - DESIGN §3 API
                      ) -> WorkerEngine:
        """Join the job as worker ``rank`` (``trainer_ranks <= rank < world_size``).

        ``targets``: per plan parameter name, ``(tensor, placements)`` — this worker's local
        shard, written in place by every round — or a ``LoadTarget`` (its ``load(name,
        tensor)`` gets the shard instead). Placements are on the worker mesh ``mesh_dims``
        (default ``(world_size - trainer_ranks, 1)``): ``(REPLICATE, d)`` shards dim ``d``
        along the second (TP) axis, ``None`` replicates. Every name of the plan needs a
        target and vice versa (checked in the handshake). A tensor target holds the wire
        bytes as they are, so it must have the parameter's planned (wire) dtype — the worker
        side never casts; a ``LoadTarget`` whose ``load`` copies into a tensor of another
        dtype does —, this rank's local shard shape, be contiguous, on the engine's
        device and share no memory with another parameter's target: one that is not fails
        the ``runtime_ready`` phase on every rank, one ``PreflightError`` naming this rank,
        the parameter and what is wrong. Raises as
        ``TrainerEngine.connect``.

        Malformed ``targets`` (not a mapping, or a value that is neither ``(tensor,
        placements)`` nor a ``LoadTarget``, such as a bare tensor) are not raised before
        connecting: the peers are already in the handshake and would wait out
        ``config.phase_timeout`` for this rank. It joins and fails the ``hello`` phase
        instead, so every rank raises the same ``PreflightError`` once every rank arrived,
        with ``failures == {rank: "local step failed: LocalProtocolError: target for
        parameter 'w' must be (tensor, placements) or a LoadTarget, got Tensor; e.g. ..."}``;
        on this rank its ``__cause__`` is that ``LocalProtocolError``. Placements or
        ``mesh_dims`` that are not two ints fail the ``destination`` phase the same way
        (``PlanError`` text). Should the handshake fail before ``hello`` could report the
        refusal (trainer rank 0 never opened the generation: ``TimeoutError``), this rank's
        error carries it as a note. A ``rank`` outside ``[trainer_ranks, world_size)``, or
        not exactly one of ``address`` and ``store``, raises ``LocalProtocolError`` at once:
        such a rank cannot join.

        Cancellation: as ``TrainerEngine.connect``.
        """
        if not 0 <= trainer_ranks <= rank < world_size <= MAX_WORLD_SIZE:
            raise LocalProtocolError(f"WorkerEngine.connect: need trainer_ranks <= rank < "
                                     f"world_size <= {MAX_WORLD_SIZE}, got rank={rank}, "
                                     f"trainer_ranks={trainer_ranks}, world_size={world_size}")
        cfg = config or EngineConfig()
        dims = mesh_dims if mesh_dims is not None else (world_size - trainer_ranks, 1)
        if isinstance(dims, Iterable):  # anything else: the destination phase names it
            dims = tuple(dims)  # type: ignore[assignment]
        st, owns, timeout = await cls._open_store(address, token, store, timeout, cfg)
        engine = cls(targets=targets, mesh_dims=dims, store=st,
                     owns_store=owns, rank=rank, trainer_ranks=trainer_ranks,
                     world_size=world_size, config=cfg)
        await engine._connect(timeout)
        return engine

    def _preflight_inputs(self) -> PreflightInputs:
        costs = self._preflight_costs()  # first: it may set the argument_error passed below
        return PreflightInputs(
            role="worker", rank=self.rank, world_size=self.world_size,
            trainer_ranks=self.trainer_ranks, generation=self._generation, params=None,
            mesh_dims=self._mesh_dims,
            dst_placements={name: s.placements for name, s in self._sinks.items()},
            transport=self.config.transport, capabilities=self._capabilities,
            data_plane_identity=self._identity, prepare_runtime=self._prepare_runtime,
            costs=costs, argument_error=self._argument_error)

    def _in_place(self, plan: TransferPlan) -> frozenset[int] | None:
        # Targets given as tensors take their messages in place; load callbacks need staging.
        # Lets Gloo size its receive arenas for what is really staged, not the whole bucket.
        return frozenset(i for i, p in enumerate(plan.params)
                         if (s := self._sinks.get(p.spec.name)) is not None and s.in_place)

    def _check_local(self, plan: TransferPlan) -> None:
        device = self.config.device or "cpu"
        sinks = self._sinks
        self._target_expect = target_expectations(plan, self.rank)
        check_targets(plan, [sinks[p.spec.name].declared for p in plan.params], self.rank,
                      device, self._target_expect)
        self._target_check = None  # its tables need the transport's device: first round

    async def receive(self, *, timeout: float | None = None,  # noqa: ASYNC109 - DESIGN §3
                      progress: Progress | None = None) -> SyncResult:
        """Wait for the next round and write every destination shard into its target.

        ``timeout`` bounds the wait for the round to *start* (``TimeoutError``; the engine
        stays READY); the round itself is bounded by trainer rank 0's round deadline. It is
        a number of seconds > 0; ``None`` or ``math.inf`` waits without bound. One that
        bounds no wait — 0, a negative number, NaN, a bool, anything that is no real number —
        raises ``LocalProtocolError`` at once (nothing happened, the engine stays READY): a
        zero bound would time out even when the round has already started, so poll with a
        short timeout instead.
        ``progress(bytes_done, bytes_total)`` after each bucket (one that is neither None nor
        a plain callable — an ``async def`` is never awaited — raises ``LocalProtocolError``
        at once, as such a timeout; a
        ``KeyboardInterrupt`` or ``SystemExit`` raised by it or by a load callback: as in
        ``sync_weights``). Returns the ``SyncResult`` once every rank reported success; the
        version advances only then. Raises the same ``TransferError`` as every other rank
        when the round failed — also when it failed while this rank waited for it to start
        (a peer died, a trainer gave up on rank 0): engine POISONED, targets may hold a
        partial update; ``exc.rank`` is the rank that caused it. Raises ``PeerLostError``
        (ranks ``(0,)``) when there will be no more rounds in this generation: trainer rank
        0 closed the job (its text names the error it closed on, if it did: see ``close``),
        or already opened a newer generation (a reconnect). The engine is then POISONED,
        though nothing failed: it can receive no more and is usable only for ``close``
        (connect again to follow a new generation); a later ``receive`` raises the same
        ``PeerLostError``. A second ``receive`` while one runs on this engine raises
        ``LocalProtocolError`` (the running one is unaffected); so does this one when a ``close()``
        of this engine ends its wait for the round.

        Cancellation: while checking its targets or waiting for the round to start, this
        rank looks once, shielded and bounded by ``abort_grace``, whether trainer rank 0's
        start is there. If not,
        nothing happened: the engine stays READY, and the next ``receive`` takes that round
        (if the trainers start it and no ``receive`` comes, its deadline fails it on every
        rank naming this worker, ``cause="deadline"``; a ``close()`` fails it at once,
        ``cause="left"``). If it is (the round started before the look), the cancel is one
        in the round, as below; a look the store does not answer within that bound leaves
        the engine POISONED (``cause="store"``). During the round, until its part is done,
        this rank posts the round's abort record by compare-and-set (peers fail fast with a
        ``TransferError`` naming this rank, ``cause="cancelled"``, unless a record of another
        failure landed first), aborts its transport, and is POISONED with the record that
        won; targets may be partially written and the version does not advance. Once its
        part is done, the round's outcome is gathered and committed shielded (bounded), as on
        every other rank; the cancel takes effect after. ``receive(timeout=)`` running out is
        no cancel: it raises ``TimeoutError`` and the engine stays READY.
        """
        limit = _wait_bound(timeout)
        _check_progress(progress, "receive")
        if self._job_closed and self._state is EngineState.POISONED:
            if self._closing:  # as for any engine once close() began (its docstring)
                raise LocalProtocolError(f"receive: rank {self.rank} (generation "
                                         f"{self._generation}) is closing")
            # The job ended: told again as it was told first (and updates() ends again).
            raise PeerLostError(f"generation {self._generation}: {self._job_end}; no more "
                                f"rounds", ranks=(0,))
        with self._exclusive("receive"):
            return await self._receive(limit, progress)

    async def _receive(self, limit: float | None, progress: Progress | None) -> SyncResult:
        k = self._round + 1
        t0 = time.perf_counter()
        assert self._rounds is not None
        assert self._plan is not None and self._transport is not None
        plan, transport, rank = self._plan, self._transport, self.rank
        if self._target_check is None:
            # The device the transport resolved ("cuda" -> "cuda:N"), as for the sources.
            resolved = getattr(transport, "device", None)
            self._target_check = TargetCheck(plan, self._sinks, rank, str(resolved)
                                             if resolved is not None else
                                             (transport.ctx.settings.device or "cpu"),
                                             hand=transport.use_checked_targets,
                                             expect=self._target_expect)
        # While the trainers check their sources and start the round: off its path
        # (``_targets``); the round checks again what failed, or all if it starts late.
        try:
            await self._target_check.precheck(transport.ctx.buckets)
        except anyio.get_cancelled_exc_class():
            await self._cancelled_before_start(k)  # as a cancel of the wait that follows
            raise
        try:
            start = await self._wait_start(k, limit=limit, missed_is_failure=False,
                                           what="receive")
        except TimeoutError:
            if limit is None:  # not this call's bound that ran out: raised as it came
                raise
            raise TimeoutError(f"receive on rank {self.rank}: no round {k} started within "
                               f"{limit:g} s (generation {self._generation})") from None
        except TransferError as exc:
            self._poison_with(exc)
            raise
        except JobEnded as ended:
            # No more rounds in this generation: the engine can only be closed (POISONED, as
            # a trainer that sees the job end), though nothing failed.
            self._job_closed = True
            self._job_failed = ended.error is not None
            self._job_end = ended.why
            err = PeerLostError(f"generation {self._generation}: {ended.why}; no more "
                                f"rounds", ranks=(0,))
            self._poison_with(err)
            raise err from None
        self._target_check.started()
        if progress is not None:  # it runs in a task of the loop: see CallbackInterrupted
            progress = self._interrupts.wrap(progress, "the progress callback")

        async def work() -> PipelineStats:
            stats = await run_pipeline(transport, transport.ctx.buckets,
                                       max_inflight=transport.ctx.settings.max_inflight,
                                       sinks=self._sinks, check_sinks=self._target_check,
                                       progress=progress,
                                       total_bytes=plan.recv_bytes(rank))
            _check_bytes(stats, plan.recv_bytes(rank), "received", rank)
            return stats

        return await self._run_round(start, work, time.perf_counter() - t0)

    async def updates(self) -> AsyncIterator[SyncResult]:
        """``async for result in worker.updates():`` — one ``SyncResult`` per round, until
        trainer rank 0 closes the job or opens a newer generation (the iteration then ends
        and the engine is POISONED: it can receive no more, and a later ``updates()`` ends at
        once; close this engine and connect again to follow the new one), or this engine is
        closed (it ends too). Errors as ``receive``: rank 0 closing the job on an error
        raises its ``PeerLostError``. Bound the wait for a round with
        ``receive(timeout=...)`` instead.

        Keep the loop body short — swap a pointer, copy into the live model, hand the result
        to another task: this worker takes part in a round only while the loop awaits the
        next one. While the body runs, the trainers' next ``sync_weights`` waits for this
        worker, and a body longer than the round deadline (``round_timeout``) fails that
        round on every rank with a ``TransferError`` naming this worker
        (``cause="deadline"``).

        Cancellation: as ``receive``.
        """
        while True:
            try:
                yield await self.receive()
            except PeerLostError:
                if self._job_closed and not self._job_failed:
                    return
                raise
            except LocalProtocolError:
                if self._closing:  # this engine was closed while it waited: the end
                    return
                raise


def _wait_bound(timeout: object) -> float | None:
    """``receive(timeout=)`` as the bound of the wait for a round's start: None for no bound
    (``None`` or ``math.inf``); ``LocalProtocolError`` for a value that bounds no wait."""
    if timeout is None:
        return None
    if not _positive_seconds(timeout):
        raise LocalProtocolError(f"receive: timeout must be a number of seconds > 0 (None or "
                                 f"math.inf: no bound), got {timeout!r}; to poll for a round, "
                                 f"pass a short timeout such as 0.05")
    return None if math.isinf(_seconds(timeout)) else float(timeout)


def _positive_seconds(timeout: object) -> TypeGuard[numbers.Real]:
    """Whether ``timeout`` is a number of seconds > 0 (infinity included)."""
    # Real, not (int, float): a NumPy scalar or a Fraction is a number of seconds too. Not
    # bool, though it is an int: True would be one second where the caller meant a flag.
    return (isinstance(timeout, numbers.Real) and not isinstance(timeout, bool)
            and not math.isnan(_seconds(timeout)) and timeout > 0)  # type: ignore[operator]


def _seconds(timeout: numbers.Real) -> float:
    """``timeout`` as a float; infinity for an int too large for one (10**400 seconds), which
    ``math.isnan`` and ``float`` would refuse with ``OverflowError``."""
    try:
        return float(timeout)
    except OverflowError:
        return math.inf


#: The largest ``sync_weights(version=)``: the round's start carries it as a uint64.
_MAX_VERSION: Final[int] = 2**64 - 1


def _round_deadline(timeout: object) -> float | None:
    """``sync_weights(timeout=)`` as the round deadline: None for the config's
    ``round_timeout``; ``LocalProtocolError`` for a value that is no finite number of seconds
    > 0 (0, a negative number, NaN, infinity, a bool, anything that is no real number), as
    ``receive(timeout=)`` refuses a bound that bounds no wait. Infinity too: the deadline is
    what ends a round a rank froze in on every rank, like ``EngineConfig.round_timeout``."""
    if timeout is None:
        return None
    if not _positive_seconds(timeout) or math.isinf(_seconds(timeout)):
        raise LocalProtocolError(f"sync_weights: timeout must be a finite number of seconds "
                                 f"> 0 (the round deadline of every rank; None: "
                                 f"EngineConfig.round_timeout), got {timeout!r}")
    return float(timeout)


def _check_progress(progress: object, what: str) -> None:
    """``LocalProtocolError`` for a ``progress`` that is neither None nor callable: called
    after the first bucket, it would fail the round on every rank instead."""
    if progress is not None and not callable(progress):
        raise LocalProtocolError(f"{what}: progress must be a callable(bytes_done, "
                                 f"bytes_total) or None, got {type(progress).__name__}")
    if is_async_callable(progress):  # called on the loop between buckets, never awaited
        raise LocalProtocolError(f"{what}: progress must be a plain function, got an async "
                                 f"one ({progress!r}): the engine calls it after each bucket "
                                 f"without awaiting it, so its body would never run")


def _sink_map(targets: Mapping[str, Any], interrupts: Interrupts) -> SinkMap:
    """``WorkerEngine.connect``'s ``targets`` as records, one per name (``_sink_of``);
    ``LocalProtocolError`` when it is no mapping, or naming the parameter whose target is
    malformed."""
    if not isinstance(targets, Mapping):
        raise LocalProtocolError(f"targets must be a mapping of parameter name -> (tensor, "
                                 f"placements) or LoadTarget, got {type(targets).__name__}; "
                                 f"e.g. targets_from_module(model, tp_plan)")
    out = SinkMap()
    for name, target in targets.items():
        sink = _sink_of(name, target)
        if not sink.in_place:
            # The lanes catch a callback's Exception, not its KeyboardInterrupt: see
            # CallbackInterrupted.
            sink = dataclasses.replace(sink, target=interrupts.wrap(
                sink.load, f"the load callback for parameter {name!r}"))
        out[name] = sink
    return out


def _sink_of(name: str, target: Any) -> Sink:
    """The record of one worker target: where its shard goes (the tensor, written in place,
    or a ``LoadTarget``'s callback), its placements, and what the plan checks (the tensor, or
    the ``LoadTarget``'s declared shape, dtype and device)."""
    import torch

    if type(target) is tuple and len(target) == 2:
        # ``(tensor, placements)``, the usual form, first and with no more than it needs:
        # 10^5 targets through the general path below were ~0.4 s of connect
        t, placements = target
        if isinstance(t, torch.Tensor) and (placements is None or type(placements) is tuple):
            return Sink(t, True, placements, t)
    from m2n_async._integrations.targets import LoadTarget

    if isinstance(target, LoadTarget):
        return Sink(target.load, in_place=False, placements=target.placements,
                    declared=target)
    if isinstance(target, tuple) and len(target) == 2:
        tensor, placements = target
        # Anything not iterable (an int, say) goes on as it is: the destination phase names
        # the parameter and the value, on every rank.
        if isinstance(placements, Iterable):
            placements = tuple(placements)
        return Sink.of(tensor, placements=placements)
    raise LocalProtocolError(f"target for parameter {name!r} must be (tensor, placements) or a "
                             f"LoadTarget, got {type(target).__name__}; e.g. (t, None) for a "
                             f"replicated tensor, (t, (REPLICATE, d)) for a shard of dim d "
                             f"along the TP axis")
