"""Wire types: round trips, the envelope rules, and decode errors naming the field."""

from __future__ import annotations

import typing

import msgspec
import pytest

from m2n_async import (
    REPLICATE,
    Layout,
    Mesh,
    ParamSpec,
    ParamTransfer,
    RemoteProtocolError,
    TransferPlan,
    complete_plan_digest,
    source_plan_digest,
)
from m2n_async._proto import messages
from m2n_async._proto.messages import PlanRecord, SourcePlanRecord, decode, decode_as, encode

SRC = Layout(Mesh((2, 2), 0), (REPLICATE, 0))
DST = Layout(Mesh((4, 1), 4), None)


def _plan() -> TransferPlan:
    ps = [ParamTransfer(ParamSpec("a.weight", "bfloat16", (8, 4), SRC), DST),
          ParamTransfer(ParamSpec("a.bias", "float32", (8,), SRC),
                        Layout(Mesh((2, 2), 4), (0, REPLICATE)))]
    return TransferPlan(ps, trainer_ranks=4, world_size=8)


def test_every_envelope_is_frozen_strict_and_tagged_by_class_name() -> None:
    members = typing.get_args(messages.Envelope)
    assert SourcePlanRecord in members and PlanRecord in members
    for cls in members:
        cfg = cls.__struct_config__
        assert cfg.frozen and cfg.forbid_unknown_fields, cls
        assert cfg.tag == cls.__name__ and cfg.tag_field == "type", cls


def test_plan_record_round_trip() -> None:
    plan = _plan()
    rec = decode(encode(plan.record()))
    assert isinstance(rec, PlanRecord)
    again = TransferPlan.from_record(rec)
    assert again.params == plan.params
    assert complete_plan_digest(again) == complete_plan_digest(plan)
    src = SourcePlanRecord(4, plan.source_specs())
    got = decode_as(encode(src), SourcePlanRecord)
    assert got == src


def _raw(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def _good_source() -> dict[str, object]:
    return {"type": "SourcePlanRecord", "trainer_ranks": 4,
            "params": [{"name": "a", "dtype": "bfloat16", "shape": [8, 4],
                        "layout": {"mesh": {"dims": [2, 2], "start_rank": 0},
                                   "placements": [-1, 0]}}]}


def test_good_raw_record_decodes() -> None:
    rec = decode(_raw(_good_source()))
    assert isinstance(rec, SourcePlanRecord) and rec.params[0].shape == (8, 4)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("trainer_ranks"), r"missing required field `trainer_ranks`"),
        (lambda d: d.update(extra=1), r"unknown field `extra`"),
        (lambda d: d.update(trainer_ranks="4"), r"Expected `int`, got `str` - at "
                                                 r"`\$\.trainer_ranks`"),
        (lambda d: d["params"][0].update(shape="x"), r"at `\$\.params\[0\]\.shape`"),
        (lambda d: d["params"][0]["layout"].update(placements=[0, 1]),
         r"exactly one mesh axis.*at `\$\.params\[0\]\.layout`"),
        (lambda d: d["params"][0].update(shape=[7, 4]),
         r"parameter 'a' \(source side\): dim 0 of size 7 does not divide evenly"),
        (lambda d: d["params"][0].update(dtype="float4"), r"parameter 'a': unsupported dtype"),
        (lambda d: d["params"][0]["layout"]["mesh"].update(dims=[2]), r"`\$\.params\[0\]\."
                                                                       r"layout\.mesh\.dims`"),
        (lambda d: d.update(type="Bogus"), r"Invalid value 'Bogus' - at `\$\.type`"),
        (lambda d: d.pop("type"), r"missing required field `type`"),
    ],
)
def test_decode_errors_name_the_field(mutate: typing.Callable[[dict[str, typing.Any]], object],
                                      match: str) -> None:
    d = _good_source()
    mutate(d)
    with pytest.raises(RemoteProtocolError, match=match) as ei:
        decode(_raw(d))
    assert "protocol version" in str(ei.value)
    assert isinstance(ei.value.__cause__, msgspec.ValidationError)


def test_malformed_bytes() -> None:
    data = encode(_plan().record())
    with pytest.raises(RemoteProtocolError, match=r"malformed envelope.*truncated"):
        decode(data[:-5])
    with pytest.raises(RemoteProtocolError, match="malformed"):
        decode(b"\xc1")


def test_decode_as_refuses_another_kind() -> None:
    data = encode(_plan().record())
    with pytest.raises(RemoteProtocolError, match=r"invalid SourcePlanRecord.*PlanRecord"):
        decode_as(data, SourcePlanRecord)
    assert isinstance(decode_as(data, PlanRecord), PlanRecord)


def test_golden_digests() -> None:
    # Pinned values: any change to the canonical encoding, the records or the versions must
    # show up here (and bump PLAN_SCHEMA_VERSION / PROTO_VERSION if it changes the wire).
    plan = _plan()
    assert source_plan_digest(plan.source_specs(), 4) == GOLDEN_SOURCE
    assert complete_plan_digest(plan) == GOLDEN_COMPLETE


GOLDEN_SOURCE = "8e736411b97496bd3aee20c033229ae382eb5afa3ed7771b5e683b1899ccbcc1"
GOLDEN_COMPLETE = "61beaf45bd3decbddc310766c2993b3fedd9c6415292c6bb4596db6d2043d57f"
