"""The cost model ``transport="auto"`` chooses by (``_proto.cost``): pure predictions."""

from __future__ import annotations

import pytest

from m2n_async._proto.cost import DEFAULT_LANES, cost_inputs, parse_costs, predict
from m2n_async._proto.errors import PlanError
from m2n_async._proto.handshake import choose_transport
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamSpec, ParamTransfer
from m2n_async._proto.plan import TransferPlan

R = REPLICATE
BUCKETS = {"m2n": 1 << 28, "nccl": 1 << 28, "gloo": 1 << 26}
EVERYTHING = {r: ("m2n", "nccl", "gloo") for r in range(4)}


def _experts(n: int, shape: tuple[int, ...] = (512, 256)) -> TransferPlan:
    src, dst = Layout(Mesh((1, 2)), (R, 0)), Layout(Mesh((1, 2), 2), (R, 1))
    return TransferPlan([ParamTransfer(ParamSpec(f"e{i}", "bfloat16", shape, src), dst)
                         for i in range(n)], trainer_ranks=2, world_size=4)


def test_coalescing_decides_whether_m2n_wins_on_experts() -> None:
    plan = _experts(1024)
    single = cost_inputs(DEFAULT_LANES, BUCKETS, 0)
    stacked = cost_inputs(DEFAULT_LANES, BUCKETS, 16 << 20)
    p_single = predict(plan, single)
    p_stacked = predict(plan, stacked)
    assert p_single["m2n"].calls == 1024 and p_stacked["m2n"].calls == 1
    assert p_single["nccl"].calls == p_stacked["nccl"].calls == 1
    # one M2N call per expert costs more than the packed exchange; one stacked call less
    assert p_single["m2n"].seconds > p_single["nccl"].seconds > p_stacked["m2n"].seconds
    assert choose_transport(plan, "auto", EVERYTHING, single)[0] == "nccl"
    chosen = choose_transport(plan, "auto", EVERYTHING, stacked)
    assert chosen[0] == "m2n" and chosen[2] == p_stacked["m2n"]
    # an explicit transport is predicted too, and kept
    forced = choose_transport(plan, "gloo", EVERYTHING, stacked)
    assert forced[0] == "gloo" and forced[2] == p_stacked["gloo"]


def test_prediction_terms_add_up() -> None:
    plan = _experts(3, (64, 64))
    costs = cost_inputs({"m2n": (1.0, 0.1, 1000.0)}, BUCKETS, 0)
    got = predict(plan, costs)
    assert list(got) == ["m2n"]
    busiest = max(max(plan.send_bytes(r), plan.recv_bytes(r)) for r in range(4))
    assert got["m2n"].seconds == pytest.approx(3 * 1.0 + 3 * 0.1 + busiest / 1000.0)
    assert "m2n" in got["m2n"].describe() and "3 calls" in got["m2n"].describe()


def test_lanes_without_terms_fall_back_to_preference() -> None:
    plan = _experts(4)
    only_gloo = cost_inputs({"gloo": DEFAULT_LANES["gloo"]}, BUCKETS, 0)
    # m2n and nccl have no terms: gloo is the only predicted lane, so it is chosen
    chosen = choose_transport(plan, "auto", EVERYTHING, only_gloo)
    assert chosen[0] == "gloo"


def test_bad_terms_are_plan_errors() -> None:
    assert parse_costs('{"m2n": [1e-4, 0, 3e11]}')["m2n"] == (1e-4, 0.0, 3e11)
    assert parse_costs("{}") == dict(DEFAULT_LANES)
    for text in ('{"m2n": [1, 2]}', '{"tcp": [1, 1, 1]}', "[1]", '{"m2n": [1, 1, 0]}',
                 "not json"):
        with pytest.raises(PlanError):
            parse_costs(text)
    with pytest.raises(PlanError, match="bytes_per_second"):
        cost_inputs({"m2n": (1.0, 1.0, 0.0)}, BUCKETS, 0)
    # What a peer's envelope may carry is refused locally with the same words.
    for terms, match in [((float("nan"), 0.0, 1.0), "finite"), ((-1.0, 0.0, 1.0), ">= 0"),
                         ((1.0, float("inf"), 1.0), "finite"), ((True, 0.0, 1.0), "numbers")]:
        with pytest.raises(PlanError, match=match):
            cost_inputs({"m2n": terms}, BUCKETS, 0)  # type: ignore[dict-item]
    with pytest.raises(PlanError, match="coalesce_below -1 < 0"):
        cost_inputs(DEFAULT_LANES, BUCKETS, -1)
    with pytest.raises(PlanError, match="bucket_bytes 0 < 1"):
        cost_inputs({"m2n": DEFAULT_LANES["m2n"]}, {**BUCKETS, "m2n": 0}, 0)


def test_plan_command_reports_the_predictions() -> None:
    from pathlib import Path

    from m2n_async._integrations.planfile import format_summary, load_plan_file, summarize

    example = Path(__file__).resolve().parents[2] / "examples" / "plan.toml"
    plan, bucket = load_plan_file(example)
    s = summarize(plan, bucket_bytes=bucket or 0)
    assert sorted(s.predicted) == ["gloo", "m2n", "nccl"] and s.auto in s.predicted
    calls = int(s.predicted["m2n"].split("(")[1].split()[0])
    assert calls < len(plan.params)  # layers repeat their shapes: coalesced
    text = format_summary(s)
    assert "predicted" in text and f"{s.predicted[s.auto]}   <- auto" in text


def test_auto_leaves_the_preferred_lane_only_for_a_clear_win() -> None:
    from m2n_async._proto.cost import AUTO_MARGIN

    plan = _experts(16, (4096, 4096))  # dense: the lanes predicted close together
    costs = cost_inputs(DEFAULT_LANES, BUCKETS, 16 << 20)
    got = predict(plan, costs)
    assert got["nccl"].seconds < got["m2n"].seconds < AUTO_MARGIN * got["nccl"].seconds
    chosen = choose_transport(plan, "auto", EVERYTHING, costs)
    assert chosen[0] == "m2n" and "none is predicted 1.5x faster" in chosen[1]
