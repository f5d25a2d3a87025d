"""The pure handshake machine, driven by an in-memory all-gather harness (h11 style).

Every test runs one ``Handshake`` per rank, gathers their encoded envelopes, hands the same
bytes to every rank and checks that every rank reaches the same verdict — that is the
property the driver relies on to raise one identical ``PreflightError`` everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from m2n_async import PreflightError
from m2n_async._proto.errors import LocalProtocolError, PlanError
from m2n_async._proto.handshake import (
    ENVELOPE_OF,
    TRANSITIONS,
    Event,
    Handshake,
    Phase,
    choose_transport,
    mermaid,
    phases_doc,
)
from m2n_async._proto.lanes import nccl_environment
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.messages import (
    PROTO_VERSION,
    CostInputs,
    DataPlaneIdentity,
    DataPlaneReport,
    DestinationPlan,
    Hello,
    PhaseFailure,
    SourcePlan,
)
from m2n_async._proto.params import ParamSpec, ParamTransfer
from m2n_async._proto.plan import TransferPlan

GEN = 7
GATHERING = [Phase.HELLO, Phase.SOURCE, Phase.DESTINATION, Phase.DATA_PLANE,
             Phase.RUNTIME_READY]


def make_specs(t: int, dtype: str = "float32") -> list[ParamSpec]:
    mesh = Mesh((t, 1))
    return [ParamSpec("w", dtype, (12, 6), Layout(mesh, (0, REPLICATE))),
            ParamSpec("b", "bfloat16", (12,), Layout(mesh, None))]


def make_placements() -> dict[str, tuple[int, int] | None]:
    return {"w": (REPLICATE, 1), "b": None}


Tamper = Callable[[msgspec.Struct], bytes]


class World:
    """T trainers + N workers, each with a Handshake and default local inputs."""

    def __init__(self, t: int, n: int, *, transport: str = "auto", dtype: str = "float32",
                 caps: Mapping[int, tuple[str, ...]] | None = None,
                 costs: Mapping[int, CostInputs | None] | None = None) -> None:
        self.t, self.n, self.w = t, n, t + n
        self.machines = [
            Handshake(role="trainer" if r < t else "worker", rank=r, world_size=t + n,
                      trainer_ranks=t, generation=GEN, transport=transport)
            for r in range(t + n)]
        self.specs = make_specs(t, dtype)
        self.caps = dict(caps or {})
        self.costs = dict(costs or {})
        self.identity = {r: DataPlaneIdentity("2.30.7", None, (("NCCL_RESHARD_X", "1"),))
                         for r in range(t + n)}
        self.records_exchanged = 0
        self.tamper_records: dict[int, Tamper] = {}

    def local(self, r: int) -> msgspec.Struct:
        m = self.machines[r]
        if m.phase is Phase.HELLO:
            return m.hello()
        if m.phase is Phase.SOURCE:
            return m.source(self.specs if r < self.t else None)
        if m.phase is Phase.DESTINATION:
            caps = self.caps.get(r, ("m2n", "nccl", "gloo"))
            costs = self.costs.get(r)
            if r < self.t:
                return m.destination(caps, None, None, costs)
            return m.destination(caps, (1, self.n), make_placements(), costs)
        if m.phase is Phase.DATA_PLANE:
            return m.data_plane(self.identity[r])
        return m.runtime_ready()

    def step(self, tamper: Mapping[int, Tamper] | None = None) -> Phase | PreflightError:
        """One gathering phase on every rank; asserts every rank reached the same verdict."""
        payloads = []
        for r, m in enumerate(self.machines):
            env = self.local(r)
            payloads.append(tamper[r](env) if tamper and r in tamper else m.encode(env))
        verdicts: list[Phase | PreflightError] = []
        for m in self.machines:
            try:
                verdicts.append(m.receive(payloads))
            except PreflightError as e:
                verdicts.append(e)
        if any(m.wants_records for m in self.machines):  # plans differ: one more gather
            assert all(m.wants_records for m in self.machines)
            self.records_exchanged += 1
            records = [self.tamper_records.get(r, m.encode)(m.records())
                       for r, m in enumerate(self.machines)]
            verdicts = []
            for m in self.machines:
                with pytest.raises(PreflightError) as info:
                    m.receive_records(records)
                verdicts.append(info.value)
        first = verdicts[0]
        for v in verdicts[1:]:
            if isinstance(first, PreflightError):
                assert isinstance(v, PreflightError)
                assert (v.phase, v.failures, v.generation) == (first.phase, first.failures,
                                                               first.generation)
            else:
                assert v == first
        return first

    def run_to(self, phase: Phase) -> None:
        while self.machines[0].phase is not phase:
            result = self.step()
            assert isinstance(result, Phase), result

    def fail_at(self, phase: Phase, tamper: Mapping[int, Tamper]) -> PreflightError:
        self.run_to(phase)
        result = self.step(tamper)
        assert isinstance(result, PreflightError), f"phase {phase.value} passed: {result}"
        assert result.phase == phase.value
        assert all(m.phase is Phase.FAILED for m in self.machines)
        return result


def as_dict(env: msgspec.Struct) -> dict[str, Any]:
    d = msgspec.to_builtins(env, builtin_types=(bytes,))  # chunk digests stay bytes
    assert isinstance(d, dict)
    return d


def edit(**changes: Any) -> Tamper:
    """Re-encode an envelope with fields changed (``None`` value + ``_drop`` removes)."""
    def tamper(env: msgspec.Struct) -> bytes:
        d = as_dict(env)
        for k, v in changes.items():
            if k == "_drop":
                del d[v]
            else:
                d[k] = v
        return msgspec.msgpack.encode(d)
    return tamper


def replace(**changes: Any) -> Tamper:
    def tamper(env: msgspec.Struct) -> bytes:
        return Handshake.encode(msgspec.structs.replace(env, **changes))
    return tamper


# -- the table and the docs -----------------------------------------------------------------


def test_transitions_table_is_one_linear_chain_with_failure_exits() -> None:
    chain = [Phase.HELLO]
    while TRANSITIONS[chain[-1]]:
        chain.append(TRANSITIONS[chain[-1]][Event.AGREED])
    assert chain == [*GATHERING, Phase.CONNECTED]
    assert set(TRANSITIONS) == set(Phase)
    for phase in GATHERING:
        assert set(TRANSITIONS[phase]) == set(Event)
        assert {TRANSITIONS[phase][e] for e in Event if e is not Event.AGREED} == {Phase.FAILED}
    assert TRANSITIONS[Phase.CONNECTED] == {} and TRANSITIONS[Phase.FAILED] == {}
    assert set(ENVELOPE_OF) == set(GATHERING)


def test_committed_phase_diagram_is_current() -> None:
    doc = Path(__file__).resolve().parents[2] / "docs" / "phases.md"
    assert doc.read_text() == phases_doc(), (
        "docs/phases.md is stale: run `python -m m2n_async._proto.handshake --doc > "
        "docs/phases.md`")


def test_the_connected_row_says_what_a_failure_there_raises() -> None:
    # The engine's connect failures (tests/engine/test_engine_guards.py raises them): one
    # PreflightError of phase 'connected' naming the rank, or a TimeoutError.
    row = next(line for line in phases_doc().splitlines()
               if line.startswith(f"| `{Phase.CONNECTED.value}` |"))
    assert f"`PreflightError('{Phase.CONNECTED.value}', {{rank: why}})`" in row, row
    assert "the peers waiting for it raise that same error at once" in row, row
    assert "was lost while the … data plane connected" in row, row
    assert "`TimeoutError`" in row, row


def test_diagram_has_an_edge_for_every_transition() -> None:
    text = mermaid()
    for phase, row in TRANSITIONS.items():
        for event, target in row.items():
            line = next(x for x in text.splitlines()
                        if x.strip().startswith(f"{phase.value} --> {target.value}:"))
            assert event.value in line


# -- the happy path ---------------------------------------------------------------------------


@pytest.mark.parametrize("t,n", [(1, 1), (2, 3)])
def test_all_phases_agree(t: int, n: int) -> None:
    world = World(t, n)
    world.run_to(Phase.CONNECTED)
    plans = [m.plan for m in world.machines]
    assert all(p is not None for p in plans)
    assert len({p.digest for p in plans if p}) == 1
    first = plans[0]
    assert first is not None
    assert first.transport == "m2n" and "auto chose 'm2n'" in first.reason
    assert [x.name for x in first.plan.params] == ["w", "b"]
    assert first.plan.params[0].dst == Layout(Mesh((1, n), start_rank=t), (REPLICATE, 1))
    assert world.machines[-1].identities[0].libnccl_version == "2.30.7"


def test_only_the_first_trainer_and_worker_ship_bulk_data() -> None:
    world = World(2, 3)
    world.run_to(Phase.SOURCE)
    sources = [world.local(r) for r in range(5)]
    assert [isinstance(e, SourcePlan) and e.params is not None
            for e in sources] == [True, False, False, False, False]
    world.run_to(Phase.DESTINATION)
    dests = [world.local(r) for r in range(5)]
    assert [isinstance(e, DestinationPlan) and e.placements is not None
            for e in dests] == [False, False, True, False, False]


# -- strict decoding ---------------------------------------------------------------------------


STRICT_CASES: list[tuple[str, Callable[[], Tamper], str]] = [
    ("unknown field", lambda: edit(colour="blue"), "unknown field `colour`"),
    ("missing field", lambda: edit(_drop="trainer_ranks"), "missing required field "
                                                           "`trainer_ranks`"),
    ("wrong type", lambda: edit(world_size="5"), "Expected `int`, got `str`"),
    ("protocol version", lambda: edit(proto_version=PROTO_VERSION + 1),
     f"speaks protocol version {PROTO_VERSION + 1}"),
    ("no version at all", lambda: edit(_drop="proto_version"), "protocol version None"),
    ("stale generation", lambda: replace(generation=GEN - 1), f"stale generation {GEN - 1}"),
    ("future generation", lambda: replace(generation=GEN + 1), f"generation {GEN + 1}; this"),
    ("wrong slot", lambda: replace(rank=0), "claims rank 0 but arrived in rank"),
    ("unknown tag", lambda: edit(type="Goodbye"), "Invalid value 'Goodbye'"),
    ("not msgpack", lambda: (lambda env: b"\xc1garbage"), "not a handshake envelope"),
    ("not a map", lambda: (lambda env: msgspec.msgpack.encode([1, 2])),
     "not a handshake envelope"),
]


@pytest.mark.parametrize("case", STRICT_CASES, ids=[c[0] for c in STRICT_CASES])
@pytest.mark.parametrize("bad", [1, 4])
def test_strict_decoding_names_the_sender(case: tuple[str, Callable[[], Tamper], str],
                                          bad: int) -> None:
    _, make, needle = case
    err = World(2, 3).fail_at(Phase.HELLO, {bad: make()})
    assert list(err.failures) == [bad]
    assert needle in err.failures[bad]
    assert err.generation == GEN


@pytest.mark.parametrize("phase", GATHERING)
def test_wrong_envelope_kind_for_the_phase(phase: Phase) -> None:
    bogus = Hello(PROTO_VERSION, GEN, 2, "trainer", 5, 2, "auto")
    if phase is Phase.HELLO:
        bogus_bytes = Handshake.encode(SourcePlan(PROTO_VERSION, GEN, 2, "x", None,
                                                   None, None))
        expected = "sent SourcePlan during phase 'hello'"
    else:
        bogus_bytes = Handshake.encode(bogus)
        expected = f"sent Hello during phase {phase.value!r}"
    err = World(2, 3).fail_at(phase, {2: lambda env: bogus_bytes})
    assert list(err.failures) == [2]
    assert expected in err.failures[2]


@pytest.mark.parametrize("phase", GATHERING)
def test_strict_decoding_in_every_phase(phase: Phase) -> None:
    world = World(2, 3)
    err = world.fail_at(phase, {3: edit(extra=1)})
    assert list(err.failures) == [3] and "unknown field `extra`" in err.failures[3]
    world = World(2, 3)
    err = world.fail_at(phase, {4: replace(generation=GEN - 2)})
    assert list(err.failures) == [4] and "stale generation 5" in err.failures[4]


def test_failure_envelope_for_another_phase_is_refused() -> None:
    def other(env: msgspec.Struct) -> bytes:
        return Handshake.encode(PhaseFailure(PROTO_VERSION, GEN, 0, "hello", "x"))
    err = World(1, 1).fail_at(Phase.SOURCE, {0: other})
    assert "failure of phase 'hello' during phase 'source'" in err.failures[0]


# -- local failures and disagreement -------------------------------------------------------------


@pytest.mark.parametrize("phase", GATHERING)
@pytest.mark.parametrize("t,n,bad", [(1, 1, 0), (1, 1, 1), (2, 3, 1), (2, 3, 2), (2, 3, 4)])
def test_local_failure_is_reported_by_every_rank(phase: Phase, t: int, n: int, bad: int) -> None:
    world = World(t, n)

    def fail(env: msgspec.Struct) -> bytes:
        m = world.machines[bad]
        return m.encode(m.failure(RuntimeError(f"boom on {bad}")))
    err = world.fail_at(phase, {bad: fail})
    assert err.failures == {bad: f"local step failed: RuntimeError: boom on {bad}"}
    assert f"preflight phase {phase.value!r} failed" in str(err)


def test_long_local_errors_are_truncated() -> None:
    m = World(1, 1).machines[0]
    env = m.failure("x" * 10_000)
    assert len(env.error) < 2100 and env.error.endswith("more chars)")


def test_hello_disagreement_majority_names_the_odd_rank() -> None:
    err = World(2, 3).fail_at(Phase.HELLO, {3: replace(world_size=6)})
    assert list(err.failures) == [3]
    assert "world_size=6" in err.failures[3] and "4 rank(s)" in err.failures[3]


def test_hello_disagreement_without_majority_names_everyone() -> None:
    err = World(1, 1).fail_at(Phase.HELLO, {1: replace(trainer_ranks=2, world_size=3)})
    assert sorted(err.failures) == [0, 1]
    assert all("no majority" in m for m in err.failures.values())


def test_hello_role_must_match_rank() -> None:
    err = World(2, 3).fail_at(Phase.HELLO, {1: replace(role="worker")})
    assert list(err.failures) == [1] and "ranks [0, 2) are trainers" in err.failures[1]
    err = World(2, 3).fail_at(Phase.HELLO, {2: replace(role="driver")})
    assert list(err.failures) == [2] and "neither 'trainer' nor 'worker'" in err.failures[2]


def test_hello_requested_transport_must_agree_and_be_known() -> None:
    err = World(2, 3).fail_at(Phase.HELLO, {4: replace(transport="gloo")})
    assert list(err.failures) == [4] and "requested transport 'gloo'" in err.failures[4]
    err = World(2, 3).fail_at(Phase.HELLO, {0: replace(transport="carrier-pigeon")})
    assert list(err.failures) == [0] and "not one of" in err.failures[0]


def test_hello_impossible_topology_is_reported_by_all() -> None:
    world = World(2, 3)
    tampers = {r: replace(world_size=9) for r in range(5)}
    err = world.fail_at(Phase.HELLO, tampers)
    assert sorted(err.failures) == [0, 1, 2, 3, 4]
    assert "impossible for a group of 5 ranks" in err.failures[0]


@given(rank=st.integers(0, 4), field=st.sampled_from(["role", "world_size", "trainer_ranks",
                                                      "transport", "rank", "generation"]),
       value=st.one_of(st.integers(-3, 9), st.sampled_from(["trainer", "worker", "auto",
                                                             "nccl", "x"])))
@settings(max_examples=150, deadline=None)
def test_any_single_corrupted_hello_field_names_exactly_that_rank(rank: int, field: str,
                                                                  value: object) -> None:
    world = World(2, 3)
    honest = as_dict(world.machines[rank].hello())
    if honest[field] == value:
        return  # not a corruption
    err_or_phase = world.step({rank: edit(**{field: value})})
    assert isinstance(err_or_phase, PreflightError), (field, value)
    assert list(err_or_phase.failures) == [rank]


def test_source_digest_majority_and_tie() -> None:
    odd = "f" * 64
    # 2 trainers: a tie, both named; the worker ranks are not.
    err = World(2, 3).fail_at(Phase.SOURCE, {1: replace(digest=odd)})
    assert sorted(err.failures) == [0, 1] and "no majority" in err.failures[1]


def test_source_shipped_specs_must_match_their_digest() -> None:
    world = World(1, 1)
    other = make_specs(1)[:1]
    err = world.fail_at(Phase.SOURCE, {0: replace(params=tuple(other))})
    assert list(err.failures) == [0]
    assert "shipped source specs hash to" in err.failures[0]


def test_source_shipped_specs_are_validated() -> None:
    world = World(1, 1)
    dup = (*make_specs(1), make_specs(1)[0])
    err = world.fail_at(Phase.SOURCE, {0: replace(params=dup)})
    assert list(err.failures) == [0] and "appears twice" in err.failures[0]


def test_source_role_rules() -> None:
    err = World(2, 3).fail_at(Phase.SOURCE, {3: replace(digest="abc")})
    assert list(err.failures) == [3] and "a worker sent a source digest" in err.failures[3]
    err = World(2, 3).fail_at(Phase.SOURCE, {0: replace(params=None)})
    assert 0 in err.failures and "did not ship" in err.failures[0]
    err = World(2, 3).fail_at(Phase.SOURCE, {1: replace(params=tuple(make_specs(2)))})
    assert list(err.failures) == [1] and "only trainer rank 0" in err.failures[1]


def test_source_local_step_validates_the_trainer_mesh() -> None:
    world = World(2, 3)
    world.run_to(Phase.SOURCE)
    wrong = [ParamSpec("w", "float32", (12, 6), Layout(Mesh((3, 1)), (0, REPLICATE)))]
    with pytest.raises(PlanError, match=r"'w' \(source side\).*\[0, 2\)"):
        world.machines[0].source(wrong)


def test_destination_odd_worker_is_named() -> None:
    err = World(2, 3).fail_at(Phase.DESTINATION, {4: replace(mesh_dims=(3, 1))})
    assert list(err.failures) == [4] and "(3, 1)" in err.failures[4]


def test_destination_single_worker_mesh_must_fit() -> None:
    def wrong(env: msgspec.Struct) -> bytes:
        from m2n_async._proto.handshake import placements_digest
        pl = env.placements  # type: ignore[attr-defined]
        return Handshake.encode(msgspec.structs.replace(
            env, mesh_dims=(2, 1), placements_digest=placements_digest((2, 1), pl)))
    err = World(1, 1).fail_at(Phase.DESTINATION, {1: wrong})
    assert list(err.failures) == [1] and "hold 2 ranks, but there are 1" in err.failures[1]


def test_destination_trainer_sending_placements_or_bad_capabilities() -> None:
    err = World(2, 3).fail_at(Phase.DESTINATION, {0: replace(mesh_dims=(1, 3))})
    assert list(err.failures) == [0] and "a trainer sent destination" in err.failures[0]
    err = World(2, 3).fail_at(Phase.DESTINATION, {1: replace(capabilities=("warp",))})
    assert list(err.failures) == [1] and "capabilities ['warp']" in err.failures[1]


def test_destination_placements_must_match_their_digest() -> None:
    err = World(2, 3).fail_at(Phase.DESTINATION, {2: replace(placements=((0, REPLICATE),
                                                                         None))})
    assert list(err.failures) == [2] and "do not hash" in err.failures[2]


def test_destination_invalid_placements_name_the_workers() -> None:
    world = World(2, 3)
    world.run_to(Phase.DESTINATION)
    # dim 0 of "w" (12) splits into 3; dim 1 of "b" does not exist
    payloads = []
    for r, m in enumerate(world.machines):
        if r < 2:
            payloads.append(m.encode(m.destination(("gloo",), None, None)))
        else:
            payloads.append(m.encode(m.destination(("gloo",), (1, 3),
                                                   {"w": (REPLICATE, 0), "b": (REPLICATE, 1)})))
    for m in world.machines:
        with pytest.raises(PreflightError) as info:
            m.receive(payloads)
        assert sorted(info.value.failures) == [2, 3, 4]
        assert "'b'" in info.value.failures[2]


def test_destination_local_step_names_missing_and_extra_params() -> None:
    world = World(1, 1)
    world.run_to(Phase.DESTINATION)
    with pytest.raises(PlanError, match=r"no destination placements .*'b'.*do not send: "
                                        r"\['zz'\]"):
        world.machines[1].destination(("gloo",), (1, 1), {"w": (REPLICATE, 1), "zz": None})


def test_destination_local_step_names_mesh_dims_that_are_no_pair() -> None:
    world = World(1, 1)
    world.run_to(Phase.DESTINATION)
    with pytest.raises(PlanError, match=r"^worker rank 1: mesh_dims must be two positive ints "
                                        r"\(replicas, tp\), got 2$"):
        world.machines[1].destination(("gloo",), 2, {"w": (REPLICATE, 1), "b": None})  # type: ignore[arg-type]


@pytest.mark.parametrize("t,n", [(1, 1), (2, 3)])
def test_auto_falls_back_and_says_why(t: int, n: int) -> None:
    lacking = t + n - 1
    world = World(t, n, caps={lacking: ("nccl", "gloo")})
    world.run_to(Phase.CONNECTED)
    plan = world.machines[0].plan
    assert plan is not None and plan.transport == "nccl"
    assert f"m2n is not available on rank(s) [{lacking}]" in plan.reason


def test_auto_skips_m2n_for_a_dtype_it_cannot_carry() -> None:
    world = World(2, 3, dtype="int16")
    world.run_to(Phase.CONNECTED)
    plan = world.machines[0].plan
    assert plan is not None and plan.transport == "nccl"
    assert "'w'" in plan.reason and "int16" in plan.reason


def test_explicit_transport_names_the_ranks_that_cannot_run_it() -> None:
    world = World(2, 3, transport="m2n", caps={0: ("gloo",), 3: ("nccl", "gloo")})
    err = world.fail_at(Phase.DESTINATION, {})
    assert sorted(err.failures) == [0, 3]
    assert "cannot run the requested transport 'm2n'" in err.failures[3]


def test_explicit_transport_that_cannot_carry_the_plan_names_the_param() -> None:
    err = World(1, 1, transport="m2n", dtype="int16").fail_at(Phase.DESTINATION, {})
    assert sorted(err.failures) == [0, 1] and "'w'" in err.failures[0]


def test_auto_with_nothing_usable_names_the_incapable_rank() -> None:
    err = World(2, 3, caps={2: ()}).fail_at(Phase.DESTINATION, {})
    assert list(err.failures) == [2]
    assert "cannot run m2n; cannot run nccl; cannot run gloo" in err.failures[2]


def test_choose_transport_fan_in_limit() -> None:
    t, n = 17, 1  # 17 source shards into one destination shard: over M2N's fan-in of 16
    spec = ParamSpec("big", "float32", (34, 2), Layout(Mesh((t, 1)), (0, REPLICATE)))
    dst = Layout(Mesh((1, 1), start_rank=t), None)
    plan = TransferPlan([ParamTransfer(spec, dst)], trainer_ranks=t, world_size=t + n)
    caps = {r: ("m2n", "nccl", "gloo") for r in range(t + n)}
    chosen = choose_transport(plan, "auto", caps)
    assert isinstance(chosen, tuple) and chosen[0] == "nccl" and "fan-in 17" in chosen[1]
    refused = choose_transport(plan, "m2n", caps)
    assert isinstance(refused, dict) and sorted(refused) == list(range(t + n))


def test_data_plane_names_the_differing_variable() -> None:
    world = World(2, 3)
    world.identity[4] = DataPlaneIdentity("2.30.7", None, (("NCCL_RESHARD_X", "2"),))
    world.identity[1] = DataPlaneIdentity("2.30.7", None, (("NCCL_RESHARD_X", "1"),
                                                          ("NCCL_RESHARD_Y", "on")))
    err = world.fail_at(Phase.DATA_PLANE, {})
    assert sorted(err.failures) == [1, 4]
    assert "NCCL_RESHARD_X=2" in err.failures[4]
    assert "NCCL_RESHARD_Y=on" in err.failures[1]


def test_data_plane_identity_gives_each_variable_once() -> None:
    # Compared as a mapping, a name given twice keeps one value: (X=0, X=1) against the
    # others' X=1 would agree, and the 0 would never be named.
    with pytest.raises(PlanError, match=r"more than once \(NCCL_RESHARD_X: '0', '1'\)"):
        DataPlaneIdentity("2.30.7", None, (("NCCL_RESHARD_X", "0"), ("NCCL_RESHARD_X", "1"),
                                           ("NCCL_RESHARD_Y", "on")))
    # Names equal once the machine makes them text collide there, in the local step.
    world = World(1, 1)
    world.run_to(Phase.DATA_PLANE)
    odd = DataPlaneIdentity("2.30.7", None, ((1, "a"), ("1", "b")))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="1: 'a', 'b'"):
        world.machines[0].data_plane(odd)


def test_data_plane_names_the_rank_whose_envelope_gives_a_variable_twice() -> None:
    def twice(env: msgspec.Struct) -> bytes:
        d = as_dict(env)
        d["identity"]["env"] = [["NCCL_RESHARD_X", "0"], ["NCCL_RESHARD_X", "1"]]
        return msgspec.msgpack.encode(d)
    err = World(2, 3).fail_at(Phase.DATA_PLANE, {1: twice})
    assert list(err.failures) == [1], err.failures
    assert "invalid envelope" in err.failures[1] and "$.identity" in err.failures[1]
    assert "NCCL_RESHARD_X: '0', '1'" in err.failures[1]


def test_data_plane_versions_and_agreed_facts() -> None:
    world = World(2, 3)
    world.identity[0] = DataPlaneIdentity("2.28.9", None, (("NCCL_RESHARD_X", "1"),))
    err = world.fail_at(Phase.DATA_PLANE, {})
    assert list(err.failures) == [0] and "libnccl version '2.28.9'" in err.failures[0]
    err = World(1, 1).fail_at(Phase.DATA_PLANE, {1: replace(transport="gloo")})
    assert list(err.failures) == [1] and "'m2n' was agreed" in err.failures[1]
    err = World(1, 1).fail_at(Phase.DATA_PLANE, {0: replace(plan_digest="0" * 64)})
    assert list(err.failures) == [0] and "was agreed" in err.failures[0]


def test_data_plane_nested_identity_is_strict() -> None:
    def bad(env: msgspec.Struct) -> bytes:
        d = as_dict(env)
        d["identity"]["gpu"] = "h200"
        return msgspec.msgpack.encode(d)
    err = World(1, 1).fail_at(Phase.DATA_PLANE, {1: bad})
    assert "unknown field `gpu`" in err.failures[1] and "$.identity" in err.failures[1]


def test_runtime_ready_checks_plan_digest() -> None:
    err = World(2, 3).fail_at(Phase.RUNTIME_READY, {2: replace(plan_digest="1" * 64)})
    assert list(err.failures) == [2] and "prepared plan 111111111111" in err.failures[2]


def test_nccl_environment_filters_diagnostics() -> None:
    env = {"NCCL_RESHARD_PACK_BUFFSIZES": "4G", "NCCL_RESHARD_LOG_LEVEL": "INFO",
           "NCCL_RESHARD_SPLIT_KERNEL_TRACE": "1", "NCCL_DEBUG": "INFO",
           "NCCL_MULTI_RANK_GPU_ENABLE": "1", "PATH": "/bin"}
    assert nccl_environment(env) == (("NCCL_MULTI_RANK_GPU_ENABLE", "1"),
                                     ("NCCL_RESHARD_PACK_BUFFSIZES", "4G"))


# -- local protocol errors ----------------------------------------------------------------------


def test_local_steps_out_of_order_are_local_protocol_errors() -> None:
    world = World(1, 1)
    m = world.machines[0]
    with pytest.raises(LocalProtocolError, match="phase 'hello', not 'source'"):
        m.source(world.specs)
    with pytest.raises(LocalProtocolError, match="got 1 envelopes for world_size 2"):
        m.receive([m.encode(m.hello())])
    world.run_to(Phase.CONNECTED)
    with pytest.raises(LocalProtocolError):
        m.receive([b"", b""])
    with pytest.raises(LocalProtocolError):
        m.failure("late")


def test_abandon_moves_to_failed() -> None:
    m = World(1, 1).machines[0]
    assert m.abandon(Event.TIMED_OUT) is Phase.FAILED
    assert m.abandon(Event.PEER_LOST) is Phase.FAILED  # terminal: stays
    with pytest.raises(LocalProtocolError):
        m.abandon(Event.AGREED)


def test_data_plane_report_roundtrip_is_exact() -> None:
    world = World(1, 1)
    world.run_to(Phase.DATA_PLANE)
    env = world.local(0)
    assert isinstance(env, DataPlaneReport)
    assert msgspec.msgpack.decode(Handshake.encode(env), type=DataPlaneReport) == env


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


@given(phase=st.sampled_from(GATHERING), bad=st.integers(0, 4), data=st.data())
@settings(max_examples=200, deadline=None)
def test_fuzzed_envelope_is_named_never_crashes(phase: Phase, bad: int,
                                                data: st.DataObject) -> None:
    """Whatever one rank sends, every rank reaches one verdict; a fault names that rank."""
    world = World(2, 3)
    world.run_to(phase)
    honest = as_dict(world.local(bad))
    field_name = data.draw(st.sampled_from(sorted(honest)), label="field")
    value = data.draw(_values, label="value")
    if honest[field_name] == value:
        return
    result = world.step({bad: edit(**{field_name: value})})
    # Changing a field is either refused, naming the sender, or (e.g. a worker's harmless
    # capabilities order) accepted everywhere; World.step already checked every rank agrees.
    if isinstance(result, PreflightError):
        assert bad in result.failures, result


def test_auto_chooses_by_predicted_cost_and_names_a_rank_whose_costs_differ() -> None:
    from m2n_async._proto.cost import DEFAULT_LANES, cost_inputs

    buckets = {"m2n": 1 << 28, "nccl": 1 << 28, "gloo": 1 << 26}
    costs = cost_inputs(DEFAULT_LANES, buckets, 16 << 20)
    # a host whose M2N calls are dear: auto takes nccl, and says what it predicted
    dear = cost_inputs({**DEFAULT_LANES, "m2n": (1.0, 0.0, 1e9)}, buckets, 16 << 20)
    world = World(2, 3, costs=dict.fromkeys(range(5), dear))
    world.run_to(Phase.DATA_PLANE)
    agreed = world.machines[0].plan
    assert agreed is not None and agreed.transport == "nccl", agreed
    assert "1.5x faster than 'm2n'" in agreed.reason and "m2n 2 s (2 calls)" in agreed.reason
    assert agreed.predicted_seconds is not None and agreed.predicted_seconds < 0.01
    # the same inputs everywhere but on rank 3: rank 3 is named, in destination
    mixed = {**dict.fromkeys(range(5), costs), 3: dear}
    err = World(2, 3, costs=mixed).fail_at(Phase.DESTINATION, {})
    assert sorted(err.failures) == [3], err.failures
    assert err.failures[3].startswith(
        "its cost inputs differ (cost terms of m2n (1 s/call, 0 s/param, 1e+09 B/s) here, "
        "(8e-05 s/call, 1e-06 s/param, 2.4e+11 B/s) there; EngineConfig.costs"), err.failures[3]
    # two ranks, no majority: each is told what differs from the other
    buckets2 = {**buckets, "gloo": 1 << 20}
    small = cost_inputs(DEFAULT_LANES, buckets2, 16 << 20)
    err = World(1, 1, costs={0: costs, 1: small}).fail_at(Phase.DESTINATION, {})
    assert sorted(err.failures) == [0, 1], err.failures
    assert err.failures[1].startswith(
        f"its cost inputs differ (bucket_bytes on gloo {1 << 20} here, {1 << 26} there;")
    assert f"bucket_bytes on gloo {1 << 26} here, {1 << 20} there;" in err.failures[0]
    # without cost inputs: preference order, as before
    world = World(2, 3)
    world.run_to(Phase.DATA_PLANE)
    agreed = world.machines[0].plan
    assert agreed is not None and agreed.transport == "m2n" and agreed.predicted_seconds is None


def test_a_rank_with_another_bucket_bytes_is_told_that_setting() -> None:
    """Bucket sizes that one ``EngineConfig.bucket_bytes`` gives (one size on every lane, or
    each lane's default) are named as that setting, with who holds which value; the same
    text on every rank. Cost terms that differ beside them keep the detail."""
    from m2n_async._proto.cost import DEFAULT_LANES, cost_inputs
    from m2n_async._proto.lanes import DEFAULT_BUCKET_BYTES

    default = cost_inputs(DEFAULT_LANES, DEFAULT_BUCKET_BYTES, 16 << 20)
    small = cost_inputs(DEFAULT_LANES, dict.fromkeys(DEFAULT_LANES, 1024), 16 << 20)
    shown = ", ".join(f"{c.lane} {c.bucket_bytes}" for c in default.lanes)
    err = World(2, 3, costs={**dict.fromkeys(range(5), default), 2: small, 4: small}
                ).fail_at(Phase.DESTINATION, {})
    assert sorted(err.failures) == [2, 4], err.failures
    for r in (2, 4):
        assert err.failures[r] == (
            f"EngineConfig.bucket_bytes: 1024 on ranks [2, 4], None (each transport's "
            f"default: {shown}) on ranks [0, 1, 3] (bucket boundaries derive from it: it "
            f"must match on every rank)"), err.failures[r]
    # two ranks, no majority: each is named against the other
    err = World(1, 1, costs={0: default, 1: small}).fail_at(Phase.DESTINATION, {})
    assert err.failures[1].startswith("EngineConfig.bucket_bytes: 1024 on rank 1, None ("), err
    assert err.failures[0].startswith("EngineConfig.bucket_bytes: None ("), err
    assert err.failures[0].endswith(" on rank 0, 1024 on rank 1 (bucket boundaries derive "
                                    "from it: it must match on every rank)"), err
    # and with cost terms that differ too: the detail, the buckets as the one setting
    dear = cost_inputs({**DEFAULT_LANES, "m2n": (1.0, 0.0, 1e9)},
                       dict.fromkeys(DEFAULT_LANES, 1024), 16 << 20)
    err = World(2, 3, costs={**dict.fromkeys(range(5), default), 3: dear}
                ).fail_at(Phase.DESTINATION, {})
    assert err.failures[3].startswith(
        "its cost inputs differ (EngineConfig.bucket_bytes 1024 here, None (each "
        f"transport's default: {shown}) there; cost terms of m2n (1 s/call, 0 s/param, "
        "1e+09 B/s) here, (8e-05 s/call"), err.failures[3]
    assert "bucket_bytes on " not in err.failures[3].split("):")[0], err.failures[3]
    # lanes whose defaults are one size (a CPU job: gloo alone): that size is not claimed
    # as a setting the ranks made, since they may have left it None
    gloo = {"gloo": DEFAULT_LANES["gloo"]}
    mine = cost_inputs(gloo, {"gloo": DEFAULT_BUCKET_BYTES["gloo"]}, 16 << 20)
    set_ = cost_inputs(gloo, {"gloo": 1 << 20}, 16 << 20)
    err = World(2, 1, costs={0: mine, 1: mine, 2: set_}).fail_at(Phase.DESTINATION, {})
    assert err.failures[2] == (
        f"EngineConfig.bucket_bytes: {1 << 20} on rank 2, {DEFAULT_BUCKET_BYTES['gloo']} (the "
        f"transports' default) on ranks [0, 1] (bucket boundaries derive from it: it must "
        f"match on every rank)"), err.failures[2]


@pytest.mark.parametrize("lane", [("m2n", 8e-5, 1e-6, 0.0, 1 << 28),           # bytes/s 0
                                  ("m2n", 8e-5, 1e-6, 1e9, 0),                 # no buckets
                                  ("m2n", float("nan"), 1e-6, 1e9, 1 << 28),   # NaN
                                  ("rdma", 8e-5, 1e-6, 1e9, 1 << 28)])          # unknown
def test_cost_inputs_a_peer_sends_out_of_range_are_a_preflight_error(lane: tuple) -> None:
    # They decode (the local check that refuses them runs on the sender): every rank names
    # the senders in destination, instead of auto's prediction dividing by zero.
    from m2n_async._proto.messages import LaneCost

    bad = CostInputs((LaneCost(*lane),), 0)
    err = World(2, 3, costs=dict.fromkeys(range(5), bad)).fail_at(Phase.DESTINATION, {})
    assert sorted(err.failures) == list(range(5)), err.failures
    assert all("cost inputs are invalid" in f for f in err.failures.values()), err.failures


def many_specs(t: int, n: int = 40, **odd: Any) -> list[ParamSpec]:
    """``n`` params p0, p1, ...; ``odd`` changes one: ``at=21`` and ``name=``/``shape=``/
    ``dtype=``/``placements=`` (the source layout's)."""
    mesh = Mesh((t, 1))
    specs = [ParamSpec(f"p{i}", "float32", (12, 6), Layout(mesh, (0, REPLICATE)))
             for i in range(n)]
    if odd:
        i = odd.pop("at")
        s = specs[i]
        layout = Layout(mesh, odd.pop("placements", s.layout.placements))
        specs[i] = ParamSpec(odd.get("name", s.name), odd.get("dtype", s.dtype),
                             odd.get("shape", s.shape), layout)
    return specs


def with_trainer_specs(world: World, specs_of: Mapping[int, list[ParamSpec]]) -> World:
    """``world`` whose trainer r sends ``specs_of[r]`` (else ``world.specs``) in ``source``."""
    base_local = world.local

    def local(r: int) -> msgspec.Struct:
        m = world.machines[r]
        if m.phase is Phase.SOURCE and r in specs_of:
            return m.source(specs_of[r])
        return base_local(r)

    world.local = local  # type: ignore[method-assign]
    return world


def test_a_renamed_parameter_names_the_parameter_the_field_and_who_holds_each_name() -> None:
    world = World(3, 2)
    world.specs = many_specs(3)
    with_trainer_specs(world, {1: many_specs(3, at=21, name="p21.renamed")})
    err = world.fail_at(Phase.SOURCE, {})  # every rank raised this same error (World.step)
    assert world.records_exchanged == 1
    assert sorted(err.failures) == [1]
    msg = err.failures[1]
    assert ("the first difference is parameter #21, in its name 'p21' on rank(s) [0, 2], "
            "'p21.renamed' on rank(s) [1]") in msg, msg
    assert "2 rank(s) [0, 2] have" in msg and "no majority" not in msg


def test_a_different_shape_names_the_parameter_the_field_and_both_values() -> None:
    world = World(3, 2)
    world.specs = many_specs(3)
    with_trainer_specs(world, {2: many_specs(3, at=21, shape=(12, 12))})
    err = world.fail_at(Phase.SOURCE, {})
    assert sorted(err.failures) == [2]
    assert ("the first difference is parameter #21 'p21', in its shape (12, 6) on rank(s) "
            "[0, 1], (12, 12) on rank(s) [2]") in err.failures[2], err.failures[2]


def test_every_differing_field_of_the_first_differing_parameter_is_named() -> None:
    world = World(3, 1)
    world.specs = many_specs(3)
    odd = many_specs(3, at=3, dtype="bfloat16", placements=None)
    with_trainer_specs(world, {0: odd})  # rank 0, which also ships the specs, is the odd one
    err = world.fail_at(Phase.SOURCE, {})
    assert sorted(err.failures) == [0]
    msg = err.failures[0]
    assert ("the first difference is parameter #3 'p3', in its dtype float32 on rank(s) "
            "[1, 2], bfloat16 on rank(s) [0]; and its placements (0, REPLICATE) on rank(s) "
            "[1, 2], replicated on rank(s) [0]") in msg, msg


def test_two_trainers_without_a_majority_are_both_named_and_neither_is_blamed() -> None:
    world = World(2, 1)
    world.specs = many_specs(2)
    with_trainer_specs(world, {1: many_specs(2, at=21, shape=(12, 12))})
    err = world.fail_at(Phase.SOURCE, {})
    assert sorted(err.failures) == [0, 1]
    detail = ("the first difference is parameter #21 'p21', in its shape (12, 6) on rank(s) "
              "[0], (12, 12) on rank(s) [1] (no majority: neither is taken as right)")
    for r in (0, 1):
        assert detail in err.failures[r], err.failures[r]
        assert "no majority (rank(s) [0]:" in err.failures[r]


def test_a_missing_parameter_is_named_with_the_counts() -> None:
    world = World(2, 1)
    world.specs = many_specs(2)
    with_trainer_specs(world, {1: many_specs(2)[:39]})
    err = world.fail_at(Phase.SOURCE, {})
    assert sorted(err.failures) == [0, 1]
    msg = err.failures[1]
    assert "rank 1 has 39 parameters, rank 0 40" in msg
    assert ("the first difference is parameter #39: 'p39' on rank(s) [0], absent on rank(s) "
            "[1] (no majority") in msg, msg


def test_an_inserted_parameter_names_the_first_position_that_differs() -> None:
    world = World(3, 1)
    world.specs = many_specs(3, n=50)
    extra = ParamSpec("extra", "float32", (12, 6), Layout(Mesh((3, 1)), (0, REPLICATE)))
    with_trainer_specs(world, {2: [*world.specs[:37], extra, *world.specs[37:]]})
    err = world.fail_at(Phase.SOURCE, {})
    msg = err.failures[2]
    assert "rank 2 has 51 parameters, rank 0 50" in msg
    assert ("the first difference is parameter #37, in its name 'p37' on rank(s) [0, 1], "
            "'extra' on rank(s) [2]") in msg, msg


def test_records_that_do_not_match_their_digests_name_the_sender_only() -> None:
    # Trainer 2 differs; it is asked for its chunk and ships another one: it is named for
    # that, and its disagreement keeps the diagnosis the chunk digests alone allow.
    world = World(3, 1)
    world.specs = many_specs(3)
    with_trainer_specs(world, {2: many_specs(3, at=21, shape=(12, 12))})
    world.tamper_records[2] = lambda env: Handshake.encode(msgspec.structs.replace(
        env, specs=(tuple(world.specs[16:32]),)))
    err = world.fail_at(Phase.SOURCE, {})
    assert sorted(err.failures) == [2]
    msg = err.failures[2]
    assert "the first difference from rank 0 is within parameters #16..#31" in msg, msg
    assert "'p16'" in msg and "rank 0 has" in msg
    # a reference rank whose records are wrong is named too; the odd rank keeps the run
    world = World(3, 1)
    world.specs = many_specs(3)
    with_trainer_specs(world, {2: many_specs(3, at=21, shape=(12, 12))})
    world.tamper_records[0] = edit(chunks=[0], specs=[[]])
    err = world.fail_at(Phase.SOURCE, {})
    assert sorted(err.failures) == [0, 2]
    assert "chunks [0], but chunks [1] were asked of it" in err.failures[0], err.failures[0]
    assert "within parameters #16..#31" in err.failures[2]


def test_a_digest_that_differs_with_equal_chunks_needs_no_records() -> None:
    err = World(3, 1).fail_at(Phase.SOURCE, {1: replace(digest="f" * 64)})
    assert sorted(err.failures) == [1]
    assert "different param names, dtypes, shapes, layouts or order" in err.failures[1]


def with_worker_placements(world: World, r: int, placements: dict[str, Any],
                           mesh_dims: tuple[int, int] | None = None) -> World:
    base_local = world.local

    def local(q: int) -> msgspec.Struct:
        m = world.machines[q]
        if m.phase is Phase.DESTINATION and q == r:
            return m.destination(("gloo",), mesh_dims or (1, world.n), placements)
        return base_local(q)

    world.local = local  # type: ignore[method-assign]
    return world


def test_a_worker_asking_another_placement_names_the_parameter_and_both_placements() -> None:
    world = World(1, 3)
    with_worker_placements(world, 3, {"w": (REPLICATE, 0), "b": None})
    err = world.fail_at(Phase.DESTINATION, {})
    assert world.records_exchanged == 1
    assert sorted(err.failures) == [3]
    msg = err.failures[3]
    assert ("the first difference is parameter #0 'w', in its placements (REPLICATE, 1) on "
            "rank(s) [1, 2], (REPLICATE, 0) on rank(s) [3]") in msg, msg
    # the first worker, which ships the placements, is the odd one: the same diagnosis
    world = World(1, 3)
    with_worker_placements(world, 1, {"w": (REPLICATE, 1), "b": (REPLICATE, 0)})
    err = world.fail_at(Phase.DESTINATION, {})
    assert sorted(err.failures) == [1]
    assert ("parameter #1 'b', in its placements replicated on rank(s) [2, 3], "
            "(REPLICATE, 0) on rank(s) [1]") in err.failures[1], err.failures[1]


def test_two_workers_asking_different_placements_without_a_majority() -> None:
    world = World(1, 2)
    with_worker_placements(world, 2, {"w": (REPLICATE, 0), "b": None})
    err = world.fail_at(Phase.DESTINATION, {})
    assert sorted(err.failures) == [1, 2]
    for r in (1, 2):
        assert ("parameter #0 'w', in its placements (REPLICATE, 1) on rank(s) [1], "
                "(REPLICATE, 0) on rank(s) [2] (no majority: neither is taken as right)"
                ) in err.failures[r], err.failures[r]


def test_a_worker_on_another_mesh_is_told_the_mesh_dims_at_once() -> None:
    world = World(1, 3)
    with_worker_placements(world, 2, make_placements(), mesh_dims=(3, 1))
    err = world.fail_at(Phase.DESTINATION, {})
    assert world.records_exchanged == 0  # the placements agree: nothing more to fetch
    assert sorted(err.failures) == [2]
    assert ("worker mesh dims (1, 3) on rank(s) [1, 3], (3, 1) on rank(s) [2]"
            in err.failures[2]), err.failures[2]


def test_a_records_exchange_is_a_step_of_its_own() -> None:
    world = World(2, 1)
    world.specs = many_specs(2)
    with_trainer_specs(world, {1: many_specs(2, at=5, shape=(12, 12))})
    world.run_to(Phase.SOURCE)
    payloads = [m.encode(world.local(r)) for r, m in enumerate(world.machines)]
    m = world.machines[2]
    assert m.receive(payloads) is Phase.SOURCE and m.wants_records
    assert m.error is not None and "within parameters #0..#15" in m.error.failures[1]
    with pytest.raises(LocalProtocolError, match="records"):
        m.receive(payloads)
    with pytest.raises(LocalProtocolError, match="records"):
        m.source(None)  # the phase is over, though not yet raised
    assert m.records().chunks == ()  # the worker ships nothing
    world.machines[0].receive(payloads)
    assert world.machines[0].records().chunks == (0,)  # its version of chunk 0, as rank 1 its
    # a deadline during the exchange: FAILED, the chunk-digest diagnosis kept
    assert m.abandon(Event.TIMED_OUT) is Phase.FAILED and not m.wants_records
    assert m.error is not None and 1 in m.error.failures


# -- hello's view: a rank started with another topology ---------------------------------------


def machines_of(topologies: Mapping[int, tuple[int, int]]) -> dict[int, Handshake]:
    """One machine per rank, each started with its own (world_size, trainer_ranks)."""
    return {r: Handshake(role="trainer" if r < t else "worker", rank=r, world_size=w,
                         trainer_ranks=t, generation=GEN, transport="auto")
            for r, (w, t) in topologies.items()}


def hellos(machines: Mapping[int, Handshake]) -> dict[int, bytes]:
    return {r: m.encode(m.hello()) for r, m in machines.items()}


def test_an_agreeing_view_is_settled_only_when_complete() -> None:
    ms = machines_of({r: (4, 2) for r in range(4)})
    envs = hellos(ms)
    for r, m in ms.items():
        assert m.hello_settled(envs)
        for gone in range(4):  # never on a partial view while everyone agrees
            assert not m.hello_settled({k: v for k, v in envs.items() if k != gone}), (r, gone)


@pytest.mark.parametrize("topologies", [
    {0: (4, 2), 1: (4, 2), 2: (4, 2), 3: (5, 2)},  # a bigger world
    {0: (5, 2), 1: (4, 2), 2: (4, 2), 3: (4, 2)},  # ... on rank 0
    {0: (4, 2), 1: (4, 2), 2: (3, 2), 3: (4, 2)},  # a smaller one
    {0: (4, 2), 1: (4, 2), 2: (4, 2), 3: (4, 1)},  # other trainer_ranks
    {0: (4, 2), 1: (4, 2), 2: (4, 2), 3: (4, 2), 4: (5, 2)},  # a rank beyond the world
])
def test_a_view_that_differs_is_settled_by_the_majority_and_raises_one_text(
        topologies: dict[int, tuple[int, int]]) -> None:
    ms = machines_of(topologies)
    envs = hellos(ms)
    texts = set()
    for r, m in ms.items():
        assert m.hello_settled(envs), r
        with pytest.raises(PreflightError) as info:
            m.receive(envs)
        texts.add(str(info.value))
        assert info.value.phase == "hello"
    assert len(texts) == 1, texts
    odd = next(r for r, topo in topologies.items()
               if list(topologies.values()).count(topo) == 1)
    assert list(info.value.failures) == [odd]


def test_a_differing_view_waits_for_every_rank_of_the_majority() -> None:
    ms = machines_of({0: (4, 2), 1: (4, 2), 2: (3, 2), 3: (4, 2)})
    envs = hellos(ms)
    partial = {r: envs[r] for r in (0, 1, 2)}  # what rank 2's own count of 3 would take
    assert not ms[2].hello_settled(partial) and not ms[0].hello_settled(partial)
    assert ms[2].hello_settled(envs) and ms[0].hello_settled(envs)


def test_a_tie_settles_on_the_smaller_world() -> None:
    ms = machines_of({0: (4, 2), 1: (4, 2), 2: (5, 2), 3: (5, 2)})
    envs = hellos(ms)
    assert all(m.hello_settled(envs) for m in ms.values())  # index 4 never comes
    errors = set()
    for m in ms.values():
        with pytest.raises(PreflightError) as info:
            m.receive(envs)
        errors.add(str(info.value))
    assert len(errors) == 1 and sorted(info.value.failures) == [0, 1, 2, 3]


def test_a_view_is_only_for_hello() -> None:
    world = World(1, 1)
    world.step()
    m = world.machines[0]
    with pytest.raises(LocalProtocolError, match="phase 'source'"):
        m.receive({0: m.encode(m.source(world.specs)), 1: b""})


def test_a_rank_with_coalescing_off_is_told_that_setting() -> None:
    # EngineConfig(coalesce=False) goes on the wire as coalesce_below 0: the refusal names
    # the setting the user made, not that encoding.
    from m2n_async._proto.cost import DEFAULT_LANES, cost_inputs
    from m2n_async._proto.lanes import DEFAULT_BUCKET_BYTES

    on = cost_inputs(DEFAULT_LANES, DEFAULT_BUCKET_BYTES, 16 << 20)
    off = cost_inputs(DEFAULT_LANES, DEFAULT_BUCKET_BYTES, 0)
    err = World(2, 3, costs={**dict.fromkeys(range(5), on), 4: off}
                ).fail_at(Phase.DESTINATION, {})
    assert sorted(err.failures) == [4], err.failures
    assert err.failures[4].startswith(
        "its cost inputs differ (EngineConfig.coalesce / coalesce_below coalesce=False here, "
        f"coalesce=True, coalesce_below={16 << 20} there;"), err.failures[4]
