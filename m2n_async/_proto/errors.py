"""The exception hierarchy (DESIGN §8).

Theory of operation: every failure the package reports is an ``M2NError``; foreign
exceptions (msgspec, NCCL, M2N, torch.distributed, OS errors) are translated at the layer
boundary that first sees them, so callers catch one family. Timeouts stay the builtin
``TimeoutError`` because that is what anyio's ``fail_after`` raises and what callers expect.

Messages name what they are about (parameter, phase, generation, rank) because in a job of
hundreds of ranks an error that does not say *where* is useless.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "AuthenticationError",
    "EnginePoisonedError",
    "LocalProtocolError",
    "M2NError",
    "PeerLostError",
    "PhaseTimeoutError",
    "PlanError",
    "PreflightError",
    "ProtocolError",
    "RemoteProtocolError",
    "StoreError",
    "TransferError",
]


def _state(exc: BaseException) -> dict[str, object]:
    # Every attribute, ``__notes__`` included: a rank process's error crosses to the test
    # process by pickle, and the notes say which rank observed it (the text does not).
    return dict(vars(exc))


class M2NError(Exception):
    """Base of every error m2n_async raises; timeouts are ``TimeoutError`` s, the builtin or,
    for a handshake phase, ``PhaseTimeoutError`` (both an ``M2NError`` and a
    ``TimeoutError``)."""


class ProtocolError(M2NError):
    """A protocol rule was broken."""


class LocalProtocolError(ProtocolError):
    """This process broke the protocol (e.g. called ``receive`` on an engine that is UPDATING)."""


class RemoteProtocolError(ProtocolError):
    """A peer sent something we cannot accept (bad frame, wrong field, wrong version)."""


class PlanError(M2NError, ValueError):
    """A parameter, layout or plan is invalid; the message names the parameter and numbers."""


class PreflightError(M2NError):
    """A handshake phase failed on one or more ranks; raised identically on every rank.

    ``failures`` maps each failing or disagreeing rank to its diagnosis.
    """

    def __init__(self, phase: str, failures: Mapping[int, str], *, generation: int | None = None):
        self.phase = phase
        self.failures = dict(sorted(failures.items()))
        self.generation = generation
        gen = f" (generation {generation})" if generation is not None else ""
        lines = "; ".join(f"rank {r}: {m}" for r, m in self.failures.items())
        super().__init__(f"preflight phase {phase!r} failed{gen} on rank(s) "
                         f"{sorted(self.failures)}: {lines}")

    def __reduce__(self) -> tuple[object, ...]:  # keep picklable for multiprocessing tests
        # The generation through __init__ too: it is part of the text, which must be the one
        # the rank raised.
        return (_rebuild_preflight, (type(self), self.phase, self.failures, self.generation),
                _state(self))


def _rebuild_preflight(cls: type[PreflightError], phase: str, failures: Mapping[int, str],
                       generation: int | None) -> PreflightError:
    return cls(phase, failures, generation=generation)


class PhaseTimeoutError(M2NError, TimeoutError):
    """A handshake phase did not complete within its deadline: a ``TimeoutError`` that says
    which phase and which ranks did not arrive (``ranks``; this rank itself when its own
    step did not finish, empty when the store could not say)."""

    def __init__(self, message: str, *, phase: str, ranks: tuple[int, ...] = (),
                 generation: int | None = None):
        self.phase = phase
        self.ranks = ranks
        self.generation = generation
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_phase_timeout, (type(self), self.args[0], self.phase),
                _state(self))


def _rebuild_phase_timeout(cls: type[PhaseTimeoutError], message: str, phase: str
                           ) -> PhaseTimeoutError:
    return cls(message, phase=phase)


class StoreError(M2NError):
    """The control-plane store failed or refused a request."""


class AuthenticationError(StoreError):
    """The store refused our token (or we refused the server's proof)."""


class PeerLostError(M2NError):
    """A peer's session ended (process died, connection dropped) while we depended on it."""

    def __init__(self, message: str, *, ranks: tuple[int, ...] = (), key: str | None = None):
        self.ranks = ranks
        self.key = key
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0],), _state(self))


class TransferError(M2NError):
    """A round failed; raised identically on every rank (``docs/concepts.md``, "When a round
    fails").

    ``rank`` is the rank that caused the failure — the one whose step failed, that was
    cancelled, died, left, or did not report by the round deadline (frozen or hung) — and
    ``None`` when no rank did (``cause == "store"``: the control-plane store was lost).
    ``cause`` says which (one of ``"error"``, ``"cancelled"``, ``"lost"``, ``"left"``,
    ``"deadline"``, ``"store"``, ``"superseded"``, ``"protocol"``); ``round`` and
    ``generation`` say where. The data planes raise it too, locally, with ``cause`` None; the
    engine translates those before they reach a caller.
    """

    def __init__(self, message: str, *, rank: int | None = None, round: int | None = None,
                 cause: str | None = None, generation: int | None = None):
        self.rank = rank
        self.round = round
        self.cause = cause
        self.generation = generation
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.args[0],), _state(self))


class EnginePoisonedError(M2NError):
    """The engine failed earlier and can only be closed; ``__cause__`` is the original error."""
