"""Every validation rule of the core, with the parameter name (and side, numbers) checked."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from m2n_async import (
    M2N_DTYPES,
    REPLICATE,
    Layout,
    Mesh,
    ParamSpec,
    ParamTransfer,
    PlanError,
    TransferPlan,
    check_plan_limits,
    dtype_name,
)
from m2n_async._proto.handshake import choose_transport
from m2n_async._proto.params import DTYPE_ITEMSIZE, dtype_itemsize
from m2n_async._proto.plan import (
    M2N_MAX_CALL_BYTES,
    validate_local_buffer,
    validate_source_specs,
)

T, N = 4, 4
SRC = Layout(Mesh((2, 2), 0), (REPLICATE, 0))   # 2 shards of dim 0, 2 replicas each
DST = Layout(Mesh((1, 4), T), (REPLICATE, 1))   # 4 shards of dim 1


def spec(name: str = "w", dtype: object = "bfloat16", shape: tuple[int, ...] = (8, 8),
         layout: Layout = SRC) -> ParamSpec:
    return ParamSpec(name, dtype, shape, layout)


def plan_of(*transfers: ParamTransfer, t: int = T, n: int = N) -> TransferPlan:
    return TransferPlan(transfers, trainer_ranks=t, world_size=t + n)


# -- dtypes ----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("given", "name"),
    [(torch.bfloat16, "bfloat16"), (torch.half, "float16"), (torch.float8_e4m3fn,
     "float8_e4m3fn"), ("torch.float32", "float32"), ("double", "float64"),
     ("int64", "int64"), (torch.bool, "bool")],
)
def test_dtype_name(given: object, name: str) -> None:
    assert dtype_name(given) == name


def test_every_torch_fixed_width_dtype_is_known() -> None:
    for name, size in DTYPE_ITEMSIZE.items():
        t = getattr(torch, name, None)
        if t is not None:  # older torch may lack some float8 variants
            assert t.itemsize == size, name
            assert dtype_name(t) == name
    assert M2N_DTYPES <= set(DTYPE_ITEMSIZE) and len(M2N_DTYPES) == 12
    assert dtype_itemsize("half") == 2


def test_unknown_dtype_names_param() -> None:
    with pytest.raises(PlanError, match=r"parameter 'lm_head': unsupported dtype 'torch\.quint8'"):
        spec("lm_head", torch.quint8)
    with pytest.raises(PlanError, match="unsupported dtype 'float4'"):
        dtype_name("float4")


def test_param_spec_normalizes() -> None:
    s = ParamSpec("w", torch.bfloat16, [8, 8], SRC)
    assert s == spec() and s.dtype == "bfloat16" and s.shape == (8, 8)
    assert s.nbytes == 128 and s.numel == 64 and s.itemsize == 2


@pytest.mark.parametrize(
    ("shape", "match"),
    [((8, 0), r"parameter 'w': shape must hold positive ints, got \(8, 0\)"),
     ((8, -2), "positive ints"), ((8, 2.0), "positive ints"), (8, "sequence of ints")],
)
def test_bad_shape_names_param(shape: object, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        spec(shape=shape)  # type: ignore[arg-type]


def test_empty_name() -> None:
    with pytest.raises(PlanError, match="non-empty str"):
        spec("")


def test_source_shard_dim_missing_and_uneven() -> None:
    lay = Layout(Mesh((1, 4), 0), (REPLICATE, 2))
    with pytest.raises(PlanError, match=r"parameter 'b' \(source side\): shard dim 2 does not "
                                        r"exist in a tensor of rank 1"):
        spec("b", shape=(8,), layout=lay)
    with pytest.raises(PlanError, match=r"parameter 'w' \(source side\): dim 0 of size 5 does "
                                        r"not divide evenly into 2 shards"):
        spec(shape=(5, 8))


def test_destination_shard_dim_missing_and_uneven() -> None:
    with pytest.raises(PlanError, match=r"parameter 'w' \(destination side\): dim 1 of size 6 "
                                        r"does not divide evenly into 4 shards"):
        ParamTransfer(spec(shape=(8, 6)), DST)
    with pytest.raises(PlanError, match=r"parameter 'v' \(destination side\): shard dim 1 does "
                                        r"not exist in a tensor of rank 1"):
        ParamTransfer(spec("v", shape=(8,)), DST)


# -- whole plan ------------------------------------------------------------------------------

def test_duplicate_names() -> None:
    a = ParamTransfer(spec("w"), DST)
    b = ParamTransfer(spec("x"), DST)
    with pytest.raises(PlanError, match=r"parameter 'w' appears twice in the plan \(positions "
                                        r"0 and 2\)"):
        plan_of(a, b, a)


def test_source_mesh_must_cover_trainers() -> None:
    short = Layout(Mesh((1, 2), 0), (REPLICATE, 0))
    with pytest.raises(PlanError, match=r"parameter 'w' \(source side\): mesh \(1, 2\) starting "
                                        r"at rank 0 covers ranks \[0, 2\) but the source ranks "
                                        r"are exactly \[0, 4\)"):
        plan_of(ParamTransfer(spec(layout=short), DST))
    shifted = Layout(Mesh((2, 2), 1), None)
    with pytest.raises(PlanError, match=r"'w' \(source side\).*\[1, 5\)"):
        plan_of(ParamTransfer(spec(layout=shifted), DST))


def test_destination_mesh_must_cover_workers() -> None:
    overlap = Layout(Mesh((1, 4), 2), (REPLICATE, 1))
    with pytest.raises(PlanError, match=r"parameter 'w' \(destination side\): mesh \(1, 4\) "
                                        r"starting at rank 2 covers ranks \[2, 6\) but the "
                                        r"destination ranks are exactly \[4, 8\)"):
        plan_of(ParamTransfer(spec(), overlap))
    too_big = Layout(Mesh((2, 4), 4), None)
    with pytest.raises(PlanError, match=r"'w' \(destination side\).*\[4, 12\)"):
        plan_of(ParamTransfer(spec(), too_big))


@pytest.mark.parametrize(("t", "w"), [(0, 4), (4, 4), (5, 3)])
def test_bad_topology(t: int, w: int) -> None:
    with pytest.raises(PlanError, match=rf"trainer_ranks={t}, world_size={w}"):
        TransferPlan([], trainer_ranks=t, world_size=w)


def test_plan_entries_must_be_transfers() -> None:
    with pytest.raises(PlanError, match=r"plan entry #0 must be a ParamTransfer, got ParamSpec"):
        TransferPlan([spec()], trainer_ranks=T, world_size=T + N)  # type: ignore[list-item]


def test_m2n_dtype_and_rank() -> None:
    ok = plan_of(ParamTransfer(spec(), DST))
    ok.validate("m2n")
    p = plan_of(ParamTransfer(spec("mask", torch.bool), DST))
    p.validate("gloo")
    p.validate("nccl")
    with pytest.raises(PlanError, match=r"parameter 'mask' \(source and destination\): dtype "
                                        r"bool is not supported by transport 'm2n'"):
        p.validate("m2n")
    four = Layout(Mesh((2, 2), 0), (REPLICATE, 0))
    p4 = plan_of(ParamTransfer(spec("conv", shape=(2, 4, 2, 4), layout=four), DST))
    p4.validate("nccl")
    with pytest.raises(PlanError, match=r"parameter 'conv'.*tensor rank 4 \(shape \(2, 4, 2, "
                                        r"4\)\) is outside 1\.\.3"):
        p4.validate("m2n")
    rep = Layout(Mesh((4, 1), 0), None)
    p0 = plan_of(ParamTransfer(spec("scale", shape=(), layout=rep), Layout(Mesh((4, 1), T))))
    p0.validate("gloo")
    with pytest.raises(PlanError, match=r"'scale'.*tensor rank 0"):
        p0.validate("m2n")


def test_unknown_transport() -> None:
    with pytest.raises(PlanError, match="unknown transport 'ucx'"):
        plan_of(ParamTransfer(spec(), DST)).validate("ucx")
    with pytest.raises(PlanError, match="unknown transport"):
        check_plan_limits(plan_of(ParamTransfer(spec(), DST)), "ucx")


def test_validate_source_specs() -> None:
    validate_source_specs([spec("a"), spec("b")], T, "m2n")
    with pytest.raises(PlanError, match="'a' appears twice"):
        validate_source_specs([spec("a"), spec("a")], T)
    with pytest.raises(PlanError, match=r"'a' \(source side\).*exactly \[0, 8\)"):
        validate_source_specs([spec("a")], 8)
    with pytest.raises(PlanError, match="trainer_ranks must be an int >= 1"):
        validate_source_specs([], 0)
    with pytest.raises(PlanError, match=r"source param #0 must be a ParamSpec"):
        validate_source_specs(["a"], T)  # type: ignore[list-item]


def test_fan_in_limit_names_param_and_numbers() -> None:
    # 32 source shards on dim 0, destination shards dim 1 over 2: each destination shard
    # reads all 32 source shards.
    src = Layout(Mesh((32, 1), 0), (0, REPLICATE))
    dst = Layout(Mesh((1, 2), 32), (REPLICATE, 1))
    p = TransferPlan([ParamTransfer(ParamSpec("experts.w1", "bfloat16", (64, 4), src), dst)],
                     trainer_ranks=32, world_size=34)
    assert p.fan_in(0) == 32 and p.fan_out(0) == 2
    check_plan_limits(p, "nccl")
    check_plan_limits(p, "gloo")
    with pytest.raises(PlanError, match=r"parameter 'experts\.w1': fan-in 32 source shards into "
                                        r"one destination shard exceeds the M2N limit 16"):
        check_plan_limits(p, "m2n")


def test_fan_out_limit_names_param_and_numbers() -> None:
    src = Layout(Mesh((1, 1), 0), None)
    dst = Layout(Mesh((65, 1), 1), (0, REPLICATE))
    p = TransferPlan([ParamTransfer(ParamSpec("embed", "float32", (130,), src), dst)],
                     trainer_ranks=1, world_size=66)
    assert p.fan_in(0) == 1 and p.fan_out(0) == 65
    with pytest.raises(PlanError, match=r"parameter 'embed': fan-out 65 destination shards from "
                                        r"one source shard exceeds the M2N limit 64"):
        check_plan_limits(p, "m2n")


def test_m2n_refuses_a_param_over_2_gib_per_rank_and_auto_picks_nccl() -> None:
    # A Gemma-3-27B-like embedding (262144 x 5376 bf16, 2.6 GiB) from 8 trainers to one worker
    # that holds it whole: that worker receives all of it in one reshard.
    src = Layout(Mesh((1, 8), 0), (REPLICATE, 0))
    dst = Layout(Mesh((1, 1), 8), None)
    p = TransferPlan([ParamTransfer(ParamSpec("embed", "bfloat16", (262144, 5376), src), dst)],
                     trainer_ranks=8, world_size=9)
    assert p.param_cost(0) == 262144 * 5376 * 2 > M2N_MAX_CALL_BYTES
    check_plan_limits(p, "nccl")
    with pytest.raises(PlanError, match=r"parameter 'embed': one rank sends or receives "
                                        r"2818572288 bytes of it in one reshard"):
        check_plan_limits(p, "m2n")
    everything = {r: ["m2n", "nccl", "gloo"] for r in range(9)}
    chosen = choose_transport(p, "auto", everything)
    assert isinstance(chosen, tuple) and chosen[0] == "nccl", chosen
    assert "m2n cannot carry the plan" in chosen[1]
    # Sharded over two workers, each receives 1.3 GiB: m2n carries it.
    halves = TransferPlan([ParamTransfer(ParamSpec("embed", "bfloat16", (262144, 5376), src),
                                         Layout(Mesh((1, 2), 8), (REPLICATE, 0)))],
                          trainer_ranks=8, world_size=10)
    check_plan_limits(halves, "m2n")


def test_limits_count_shards_not_replicas() -> None:
    # 16 source shards, each replicated 4x; 64 worker ranks all replicas of 1 shard... fan-in
    # 16 (ok), fan-out 1 even though 64 ranks read every source shard.
    src = Layout(Mesh((4, 16), 0), (REPLICATE, 0))
    dst = Layout(Mesh((64, 1), 64), None)
    p = TransferPlan([ParamTransfer(ParamSpec("w", "bfloat16", (32, 2), src), dst)],
                     trainer_ranks=64, world_size=128)
    assert (p.fan_in(0), p.fan_out(0)) == (16, 1)
    check_plan_limits(p, "m2n")


def test_bucket_and_bandwidth_arguments() -> None:
    p = plan_of(ParamTransfer(spec(), DST))
    with pytest.raises(PlanError, match="bucket_bytes must be an int >= 1, got 0"):
        p.buckets(0)
    with pytest.raises(PlanError, match="bytes_per_second must be > 0"):
        p.lower_bound_seconds(0.0)
    with pytest.raises(PlanError, match=r"rank 8 outside world \[0, 8\)"):
        p.send_bytes(8)
    with pytest.raises(PlanError, match="parameter 'nope' is not in the plan"):
        p.index("nope")
    with pytest.raises(IndexError, match="param index 1 out of range"):
        p.pieces(1)


# -- local buffers ---------------------------------------------------------------------------

@dataclass
class FakeTensor:
    dtype: object
    shape: tuple[int, ...]
    device: object = "cpu"
    contiguous: bool = True

    def is_contiguous(self) -> bool:
        return self.contiguous


def test_validate_local_buffer_accepts_torch_tensors() -> None:
    t = ParamTransfer(spec(), DST)
    validate_local_buffer(t, torch.empty(4, 8, dtype=torch.bfloat16), 1, "source")
    validate_local_buffer(t.spec, torch.empty(4, 8, dtype=torch.bfloat16), 3, "source",
                          device="cpu")
    validate_local_buffer(t, torch.empty(8, 2, dtype=torch.bfloat16), 5, "destination")


def test_validate_local_buffer_refuses_a_nested_tensor_by_name() -> None:
    import warnings

    with warnings.catch_warnings():  # torch.nested says it is a prototype
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.zeros(4, 8), torch.zeros(4, 8)])
    t = ParamTransfer(spec(), DST)
    for rank, side in ((1, "source"), (5, "destination")):
        with pytest.raises(PlanError, match=rf"parameter 'w' \({side} side, rank {rank}\): "
                                            r"a nested tensor"):
            validate_local_buffer(t, nested.to(torch.bfloat16), rank, side)


def test_a_tp_shard_on_a_tp_axis_of_size_one_asks_about_mesh_dims() -> None:
    # A worker that left mesh_dims at its default (4, 1) while its targets are TP shards.
    default = ParamTransfer(spec(), Layout(Mesh((4, 1), T), (REPLICATE, 1)))
    with pytest.raises(PlanError, match=r"shape \(8, 2\) != local shard shape \(8, 8\) "
                                        r"\(.*mesh \(4, 1\)\); the TP axis \(1\) has size "
                                        r"1, .*did you mean mesh_dims=\(1, 4\)\?"):
        validate_local_buffer(default, FakeTensor(torch.bfloat16, (8, 2)), T, "destination")
    # A real TP axis, or a shard along the replica axis, gets no such hint.
    for layout in (DST, Layout(Mesh((4, 1), T), (1, REPLICATE))):
        with pytest.raises(PlanError) as info:
            validate_local_buffer(ParamTransfer(spec(), layout),
                                  FakeTensor(torch.bfloat16, (3, 3)), T, "destination")
        assert "mesh_dims" not in str(info.value)


def test_validate_local_buffer_rules() -> None:
    t = ParamTransfer(spec("layers.3.w"), DST)
    with pytest.raises(PlanError, match=r"parameter 'layers\.3\.w' \(source side, rank 1\): "
                                        r"tensor dtype float32 != planned dtype bfloat16"):
        validate_local_buffer(t, torch.empty(4, 8), 1, "source")
    with pytest.raises(PlanError, match=r"'layers\.3\.w' \(destination side, rank 6\): tensor "
                                        r"shape \(8, 4\) != local shard shape \(8, 2\)"):
        validate_local_buffer(t, FakeTensor(torch.bfloat16, (8, 4)), 6, "destination")
    with pytest.raises(PlanError, match=r"'layers\.3\.w' \(source side, rank 0\): tensor is not "
                                        r"contiguous"):
        validate_local_buffer(t, torch.empty(8, 4, dtype=torch.bfloat16).t(), 0, "source")
    with pytest.raises(PlanError, match=r"'layers\.3\.w' \(source side, rank 0\): tensor is on "
                                        r"device cpu, expected cuda"):
        validate_local_buffer(t, FakeTensor("torch.bfloat16", (4, 8)), 0, "source",
                              device="cuda")
    validate_local_buffer(t, FakeTensor("torch.bfloat16", (4, 8), "cuda:3"), 0, "source",
                          device="cuda")
    with pytest.raises(PlanError, match="on device cuda:3, expected cuda:0"):
        validate_local_buffer(t, FakeTensor("torch.bfloat16", (4, 8), "cuda:3"), 0, "source",
                              device="cuda:0")
    with pytest.raises(PlanError, match=r"'layers\.3\.w' \(destination side, rank 2\): rank is "
                                        r"not in the destination mesh \[4, 8\)"):
        validate_local_buffer(t, FakeTensor("bfloat16", (8, 2)), 2, "destination")
    with pytest.raises(PlanError, match=r"'layers\.3\.w': the destination side needs the "
                                        r"ParamTransfer"):
        validate_local_buffer(t.spec, FakeTensor("bfloat16", (8, 2)), 5, "destination")
    with pytest.raises(PlanError, match="side must be 'source' or 'destination'"):
        validate_local_buffer(t, FakeTensor("bfloat16", (8, 2)), 5, "dst")


def test_shape_accepts_torch_size_and_index_ints() -> None:
    class Eight:  # any int-like with __index__ (numpy ints behave the same)
        def __index__(self) -> int:
            return 8

    s = spec(shape=torch.Size([8, 8]))  # type: ignore[arg-type]
    assert type(s.shape) is tuple and s.shape == (8, 8)
    s2 = spec(shape=(Eight(), 8))  # type: ignore[arg-type]
    assert s2.shape == (8, 8) and all(type(n) is int for n in s2.shape)
    with pytest.raises(PlanError, match="positive ints"):
        spec(shape=(True, 8))


def test_local_buffer_dtype_aliases_and_unknown_dtypes() -> None:
    t = ParamTransfer(spec(dtype="float16"), DST)
    validate_local_buffer(t, FakeTensor("torch.half", (4, 8)), 0, "source")
    with pytest.raises(PlanError, match="tensor dtype quint8 != planned dtype float16"):
        validate_local_buffer(t, FakeTensor(torch.quint8, (4, 8)), 0, "source")


@pytest.mark.parametrize("params", [None, 3])
def test_plan_params_must_be_an_iterable_of_transfers(params: object) -> None:
    with pytest.raises(PlanError, match=r"params must be an iterable of ParamTransfer, got "
                                        r"(NoneType|int)"):
        TransferPlan(params, trainer_ranks=T, world_size=T + N)  # type: ignore[arg-type]


def test_a_single_transfer_outside_a_list_is_a_plan_error() -> None:
    with pytest.raises(PlanError, match=r"params must be an iterable of ParamTransfer, got "
                                        r"ParamTransfer"):
        TransferPlan(ParamTransfer(spec(), DST), trainer_ranks=T,  # type: ignore[arg-type]
                     world_size=T + N)
