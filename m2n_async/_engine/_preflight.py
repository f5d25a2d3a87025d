"""The preflight driver: runs the sans-IO ``Handshake`` over a ``ControlGroup`` (DESIGN §5).

Theory of operation: a thin I/O loop in the httpcore style. Per phase it (1) runs this rank's
local step inside ``try/except`` — a failing step becomes a ``PhaseFailure`` envelope, because
the peers need the diagnosis and would otherwise wait out the deadline for it; (2) all-gathers
the encoded envelope; (3) hands the bytes to ``Handshake.receive``, which raises the same
``PreflightError`` on every rank when any rank failed or disagreed (on the failing rank,
chained to its own exception). Steps (1) and (2) run under one deadline per phase,
``phase_timeout + per_param_timeout * n_params`` (bigger plans ship more specs and placements,
and take longer to validate).

An argument the engine refused before the handshake (``PreflightInputs.argument_error``: a
worker's malformed target, a trainer's params that are no specs, cost terms of the process
that do not parse) is the ``hello`` phase's local failure: the rank still joins and reports it
there, so every rank raises it at once instead of waiting out ``hello``'s deadline for a rank
that never arrives (or seeing it lost, with no reason).

When ``source`` or ``destination`` finds plans that differ, the phase takes one more gather
before it raises: the records the chunk digests point at (``Handshake.records``), from which
every rank names the first differing parameter and field.

Failure translation at this boundary:
- a local step still running a report window (1 s, at most a quarter of the deadline)
  before the phase deadline → this rank's failure of the phase, sent like a step that raised:
  every rank raises one ``PreflightError`` naming it (a hung step never leaves its peers to
  tell a timeout from a lost rank by milliseconds);
- deadline passed → ``TimeoutError`` naming the phase and the ranks that never posted
  (``ControlGroup.missing_ranks``): frozen, or never there;
- a peer's store session ended → ``PeerLostError`` naming the phase and the rank, at once (the
  group's gathers watch every peer's liveness key; nobody waits for the deadline);
- anything else from the store propagates as ``StoreError`` with the phase in a note.

The first two texts name the rank at fault and never the rank that observed it, so every
rank raises the same one (DESIGN §5); the observer and its call of the group are a note.

Synchronous callbacks (``capabilities``, ``data_plane_identity``) run on a worker thread so that
one that blocks (an import that hangs, a wedged driver query) cannot freeze the event loop: the
deadline still fires, and the thread is abandoned. The driver creates no communicator, handle
or buffer; only the engine's ``prepare_runtime`` callback may, in ``runtime_ready``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import anyio
import msgspec

from m2n_async._engine import _faults
from m2n_async._proto.errors import PeerLostError, PhaseTimeoutError, PreflightError, StoreError
from m2n_async._proto.handshake import Event, Handshake, Phase, PreflightPlan
from m2n_async._proto.messages import (
    CostInputs,
    DataPlaneIdentity,
)
from m2n_async._proto.params import ParamSpec
from m2n_async._proto.plan import TransferPlan
from m2n_async._store import ControlGroup

__all__ = [
    "DEFAULT_PER_PARAM_TIMEOUT",
    "PreflightInputs",
    "PreflightOutcome",
    "phase_deadline",
    "run_preflight",
]

DEFAULT_PER_PARAM_TIMEOUT = 1e-4
"""Seconds added to each phase's deadline per parameter (100k params: +10 s)."""

# Bound on the follow-up store query that names the missing ranks after a timeout: the
# diagnosis must not turn one expired deadline into a second, unbounded wait.
_MISSING_QUERY_TIMEOUT = 5.0

# Seconds before the phase deadline at which a local step that has not finished counts as
# failed (at most a quarter of the deadline): time for its failure envelope to reach the
# peers, whose deadlines differ from this rank's by the milliseconds each took to see the
# previous phase end.
_REPORT_WINDOW_S = 1.0

_GATHERING = (Phase.HELLO, Phase.SOURCE, Phase.DESTINATION, Phase.DATA_PLANE,
              Phase.RUNTIME_READY)

_R = TypeVar("_R")


@dataclass(frozen=True)
class PreflightInputs:
    """What one rank brings to the handshake (see DEVELOPERS.md, "Handshake")."""

    role: Literal["trainer", "worker"]
    rank: int
    world_size: int
    trainer_ranks: int
    generation: int
    params: Sequence[ParamSpec] | None
    mesh_dims: tuple[int, int] | None
    dst_placements: Mapping[str, tuple[int, int] | None] | None
    transport: str
    capabilities: Callable[[], Sequence[str]]
    data_plane_identity: Callable[[str], DataPlaneIdentity]
    prepare_runtime: Callable[[PreflightPlan], Awaitable[None]]
    #: what ``auto`` predicts each lane's round from (``_proto.cost``); None: preference
    costs: CostInputs | None = None
    #: an argument the engine refused before the handshake (a worker's malformed target,
    #: cost terms that do not parse): ``hello``'s local step raises it, so it reaches every
    #: rank as that phase's failure
    argument_error: Exception | None = None

    @property
    def n_params(self) -> int:
        """The plan size this rank knows before the handshake (for deadline scaling)."""
        if self.params is not None:
            return len(self.params)
        return len(self.dst_placements) if self.dst_placements is not None else 0


@dataclass(frozen=True)
class PreflightOutcome:
    """What every rank agreed on; identical on every rank except ``rank``/``role``/``seconds``."""

    role: str
    rank: int
    generation: int
    plan: TransferPlan
    digest: str  # complete-plan digest
    transport: str
    reason: str  # why this transport (names what ruled out the better ones)
    seconds: Mapping[str, float] = field(default_factory=dict)  # phase name -> wall time here
    predicted_seconds: float | None = None  # the transport's predicted round (_proto.cost)

    @property
    def preflight_plan(self) -> PreflightPlan:
        """The agreement as ``prepare_runtime`` saw it."""
        return PreflightPlan(self.plan, self.digest, self.transport, self.reason,
                             self.predicted_seconds)


def _report_window(deadline: float) -> float:
    return min(_REPORT_WINDOW_S, deadline / 4)


def phase_deadline(phase_timeout: float, n_params: int,
                   per_param_timeout: float = DEFAULT_PER_PARAM_TIMEOUT) -> float:
    """Seconds one phase may take on a rank that knows ``n_params`` parameters."""
    return phase_timeout + per_param_timeout * max(n_params, 0)


async def run_preflight(group: ControlGroup, inputs: PreflightInputs, *, phase_timeout: float,
                        per_param_timeout: float = DEFAULT_PER_PARAM_TIMEOUT,
                        on_phase: Callable[[str], None] | None = None
                        ) -> PreflightOutcome:
    """Run every preflight phase with the other ranks of ``group``; return the agreement.

    Raises ``PreflightError(phase, {rank: message})`` — the same on every rank — when a rank's
    local step failed or overran (it must finish a report window before the phase deadline),
    an envelope was invalid, or ranks disagreed; ``TimeoutError`` naming the phase and the
    ranks that did not arrive when a phase overran its deadline;
    ``PeerLostError`` naming the phase and rank when a peer's store session ended; a
    ``StoreError`` from the store itself. ``ValueError`` for inputs that do not match
    ``group`` (a local programming error; raised before anything is sent).

    The group is joined (its liveness key written) first; it must be fresh, and after any
    failure it is out of step with its peers: a retry needs a new generation.

    Cancellation: propagates at once. This rank's envelopes up to the current phase may be
    visible to the peers, which then time out (or see this rank lost when its session ends).
    No communicator, handle or buffer was created by the driver; only ``prepare_runtime`` may
    have prepared local resources (it owns their cleanup). The group must not be reused.

    ``on_phase(name)``: called as each phase begins.
    """
    _check_inputs(group, inputs, phase_timeout, per_param_timeout)
    machine = Handshake(role=inputs.role, rank=inputs.rank, world_size=inputs.world_size,
                        trainer_ranks=inputs.trainer_ranks, generation=inputs.generation,
                        transport=inputs.transport)
    deadline = phase_deadline(phase_timeout, inputs.n_params, per_param_timeout)
    seconds: dict[str, float] = {}
    for phase in _GATHERING:
        if on_phase is not None:  # the caller says which phase a timeout of its own hit
            on_phase(phase.value)
        started = anyio.current_time()
        await _run_phase(group, machine, inputs, phase, deadline)
        seconds[phase.value] = anyio.current_time() - started
    assert machine.phase is Phase.CONNECTED and machine.plan is not None
    agreed = machine.plan
    return PreflightOutcome(role=inputs.role, rank=inputs.rank, generation=inputs.generation,
                            plan=agreed.plan, digest=agreed.digest, transport=agreed.transport,
                            reason=agreed.reason, seconds=seconds,
                            predicted_seconds=agreed.predicted_seconds)


# -- machinery ------------------------------------------------------------------------------


def _check_inputs(group: ControlGroup, inputs: PreflightInputs, phase_timeout: float,
                  per_param_timeout: float) -> None:
    if not phase_timeout > 0:
        raise ValueError(f"phase_timeout must be > 0 seconds, got {phase_timeout!r}")
    if not per_param_timeout >= 0:
        raise ValueError(f"per_param_timeout must be >= 0 seconds, got {per_param_timeout!r}")
    if (group.rank, group.world_size) != (inputs.rank, inputs.world_size):
        raise ValueError(f"preflight inputs are for rank {inputs.rank} of {inputs.world_size} "
                         f"but the control group is rank {group.rank} of {group.world_size}")


async def _local_envelope(machine: Handshake, inputs: PreflightInputs, phase: Phase
                          ) -> msgspec.Struct:
    if phase is Phase.HELLO:
        if inputs.argument_error is not None:
            raise inputs.argument_error  # the peers are waiting for this rank: tell them why
        return machine.hello()
    if phase is Phase.SOURCE:
        return machine.source(inputs.params if inputs.role == "trainer" else None)
    if phase is Phase.DESTINATION:
        caps = await _off_loop(inputs.capabilities)
        return machine.destination(caps, inputs.mesh_dims, inputs.dst_placements,
                                   inputs.costs)
    if phase is Phase.DATA_PLANE:
        assert machine.plan is not None
        identity = await _off_loop(functools.partial(inputs.data_plane_identity,
                                                     machine.plan.transport))
        return machine.data_plane(identity)
    assert phase is Phase.RUNTIME_READY and machine.plan is not None
    await inputs.prepare_runtime(machine.plan)
    return machine.runtime_ready()


async def _off_loop(fn: Callable[[], _R]) -> _R:
    # A limiter of its own: the shared default one (40 threads) may be busy with other
    # work, and a preflight step must not queue behind it.
    return await anyio.to_thread.run_sync(fn, abandon_on_cancel=True,
                                          limiter=anyio.CapacityLimiter(1))


async def _run_phase(group: ControlGroup, machine: Handshake, inputs: PreflightInputs,
                     phase: Phase, deadline: float) -> None:
    local: list[Exception] = []  # this rank's own failure of the phase, if any
    start = anyio.current_time()
    end = start + deadline  # one deadline for the phase, records included
    # A local step that overruns is this rank's own failure, reported like any other. It
    # stops a report window before the phase deadline, so its envelope reaches the peers
    # before their deadlines pass (theirs fall within milliseconds of this one). Left to run
    # until the phase deadline, the rank would give up first and leave as lost, and a peer
    # whose deadline passed a few ms later would raise PeerLostError where the others raised
    # TimeoutError.
    window = _report_window(deadline)

    async def produce() -> bytes:
        if phase is Phase.HELLO:
            await group.join()  # liveness first: peers must see this rank die from now on
        with anyio.CancelScope(deadline=end - window):
            try:
                if _faults.armed:  # tests only (m2n_async.testing); one global read otherwise
                    await _faults.hit("handshake.phase", rank=group.rank, phase=phase.value)
                return machine.encode(await _local_envelope(machine, inputs, phase))
            except Exception as exc:  # the diagnosis goes to every rank, not raised here
                local.append(exc)
                return machine.encode(machine.failure(exc))
        # Only the step's own deadline gets here (the scope swallowed its cancellation).
        overran = TimeoutError(f"did not finish within {deadline - window:.3g} s (the "
                               f"phase deadline of {deadline:.3g} s less "
                               f"{window:.3g} s to report it): hung or too slow")
        local.append(overran)
        return machine.encode(machine.failure(overran))

    # hello agrees the group itself: its view is settled by what the envelopes say, not by
    # this rank's world_size, which may be the wrong one (``Handshake.hello_settled``).
    settled = machine.hello_settled if phase is Phase.HELLO else None
    payloads = await _gather(group, phase.value, inputs.generation, deadline, produce, machine,
                             settled)
    try:
        machine.receive(payloads)  # PreflightError: the same on every rank
    except PreflightError as error:
        if not local:
            raise
        # Same text as the peers'; the failing rank also keeps its own traceback.
        raise error from local[0]
    if machine.wants_records:  # plans differ: every rank names where, from one more gather
        left = max(end - anyio.current_time(), 1e-3)
        await _exchange_records(group, machine, phase, inputs.generation, left)


async def _exchange_records(group: ControlGroup, machine: Handshake, phase: Phase,
                            generation: int, deadline: float) -> None:
    """All-gather the records the chunk digests point at and raise the phase's error.

    Raises the ``PreflightError`` of ``receive_records`` (the first differing parameter and
    field); if the gather itself times out or loses a peer, the one ``receive`` found from
    the chunk digests (the run of parameters), with what went wrong in a note.
    """
    async def produce() -> bytes:
        try:
            return machine.encode(machine.records())
        except Exception as exc:  # the peers still get an envelope from this rank
            return machine.encode(machine.failure(exc))

    try:
        payloads = await _gather(group, phase.value, generation, deadline, produce, machine)
    except (TimeoutError, PeerLostError) as exc:
        error = machine.error
        assert error is not None
        error.add_note(f"the plan records that name the first differing parameter could not "
                       f"be exchanged: {exc}")
        raise error from exc
    assert isinstance(payloads, list)  # an ordinary gather: no ``settled``
    machine.receive_records(payloads)


async def _gather(group: ControlGroup, phase: str, generation: int, deadline: float,
                  produce: Callable[[], Awaitable[bytes]], machine: Handshake | None,
                  settled: Callable[[Mapping[int, bytes]], bool] | None = None
                  ) -> list[bytes] | dict[int, bytes]:
    """``produce()`` then all-gather it, under ``deadline``; failures translated and named.
    With ``settled``, the gather's view by key index once that says it is complete
    (``ControlGroup.all_gather_open``).

    A lost peer or a missing one is one text on every rank that sees it (the promise of one
    diagnosis): the text names the phase, the generation and the rank at fault, never the
    rank that observed it; which rank that was, and in which call of its group, is a note.
    """
    where = f"preflight phase {phase!r} (generation {generation})"
    local_done = False

    def abandon(event: Event) -> None:
        if machine is not None:
            machine.abandon(event)

    try:
        with anyio.fail_after(deadline):
            payload = await produce()
            local_done = True
            if settled is not None:
                return await group.all_gather_open(payload, settled)
            return await group.all_gather_bytes(payload)
    except TimeoutError:
        abandon(Event.TIMED_OUT)
        text, blamed = await _timeout_message(group, phase, where, deadline, local_done,
                                              machine if settled is not None else None)
        timeout = PhaseTimeoutError(text, phase=phase, ranks=blamed, generation=generation)
        if local_done:
            timeout.add_note(f"seen by rank {group.rank}, waiting in call {group.calls - 1} "
                             f"of group {group.namespace!r}")
        raise timeout from None
    except PeerLostError as exc:
        abandon(Event.PEER_LOST)
        lost = PeerLostError(f"{where}: {_lost_text(exc.ranks)}", ranks=exc.ranks,
                             key=exc.key)
        lost.add_note(f"seen by rank {group.rank}: {exc}")  # its call and group
        raise lost from exc
    except StoreError as exc:
        abandon(Event.STORE_ERROR)
        exc.add_note(f"during {where} on rank {group.rank}")
        raise
    except BaseException:
        abandon(Event.CANCELLED)
        raise


def _lost_text(ranks: Sequence[int]) -> str:
    # No role beside the rank: roles come from this rank's trainer_ranks, which hello has not
    # yet checked against the peers', and the text must not depend on who observes it.
    who = f"rank(s) {list(ranks)} were" if len(ranks) > 1 else (
        f"rank {ranks[0]} was" if ranks else "a peer was")
    return (f"{who} lost before posting an envelope (its store session ended: the process "
            f"died or was disconnected, or it gave up after a failure of its own)")


async def _timeout_message(group: ControlGroup, phase: str, where: str, deadline: float,
                           local_done: bool, hello: Handshake | None = None
                           ) -> tuple[str, tuple[int, ...]]:
    """The timeout's text and the ranks it blames. With ``hello`` (the open gather of the
    ``hello`` phase), the missing ranks are those the gathered view waits for, which need
    not be this rank's world (``Handshake.hello_missing``), and a disagreement on the
    topology is said: so a rank started with the right world, among peers started with a
    bigger one, names the rank they wait for and why, as they do."""
    if not local_done:
        return (f"{where} timed out after {deadline:.3g} s: rank {group.rank}'s own local "
                f"step did not finish"), (group.rank,)
    missing: list[int] | None = None
    disagreement: str | None = None
    with anyio.move_on_after(_MISSING_QUERY_TIMEOUT):
        if hello is not None:
            missing, disagreement = hello.hello_missing(await group.arrived())
        else:
            missing = await group.missing_ranks()
    if missing is None:
        who = "the store did not say which ranks are missing"
    elif missing and phase == Phase.HELLO.value:
        # Never here in this generation: the usual causes, the last two of which look alike
        # from here (its own connect times out waiting for a generation of its job).
        who = (f"rank(s) {missing} did not arrive (not started, crashed, or connected to "
               f"another store address or EngineConfig.job?)")
    elif missing:
        # It posted the earlier phases, so it is this job's and its store session is alive.
        who = f"rank(s) {missing} did not arrive (frozen, or its event loop blocked?)"
    else:
        who = (f"every rank had arrived at rank {group.rank}'s last call (rank {group.rank} "
               f"is the late one)")
        missing = [group.rank]
    if disagreement is not None:
        who = f"{who}; {disagreement}"
    return f"{where} timed out after {deadline:.3g} s: {who}", tuple(missing or ())
