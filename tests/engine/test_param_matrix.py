"""Parameter edge cases through the whole engine: every dtype the package moves, scalars,
zero-size and size-1 dims, shapes the mesh does not divide, thousands of tiny parameters, one
parameter far larger than a bucket, targets that are views or of another dtype, odd names,
and the float cast while packing (NaN payloads, -0.0, subnormals, infinities).

Each case either moves bit-exactly onto every worker (compared as bytes, so NaN payloads and
-0.0 count) or is refused up front — at ``ParamSpec``, ``connect`` or ``sync_weights`` — with
an error naming the parameter, the rank where one is involved, and what is wrong. Never a
hang (every world runs under a generous deadline), a failure deep inside the lane, or a round
that commits other bytes.

Engines end to end on the Gloo lane, every rank a task of one event loop over a
``MemoryStore``: two trainers (``Mesh((2, 1))``) and two workers (``Mesh((1, 2))``, TP = 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import pytest
import torch

from m2n_async import (
    EngineConfig,
    EngineState,
    LoadTarget,
    ParamSpec,
    PlanError,
    PreflightError,
    SyncResult,
    TrainerEngine,
    WorkerEngine,
    specs_from_module,
)
from m2n_async._data._packing import DIRECT_MIN_BYTES
from m2n_async._proto.layout import Layout, Mesh
from m2n_async._proto.plan import MAX_BUCKET_PARAMS, TransferPlan
from m2n_async.testing import MemoryStore

from ._plans import (
    ParamDef,
    R,
    empty_targets,
    expected_shards,
    global_tensor,
    local_shard,
    make_plan,
    source_shards,
)

T, N = 2, 2
SRC_DIMS, DST_DIMS = (T, 1), (1, N)
DEADLINE = 60.0  # against hangs only: a world here takes well under a second to a few
CFG = EngineConfig(transport="gloo", bucket_bytes=1 << 16, max_inflight=2, phase_timeout=30,
                   round_timeout=30, abort_grace=2, host="127.0.0.1")

# Shard(0) over the trainers -> Shard(1) over the workers (strided on the trainer side:
# every piece is a column block of a row slab), and replicated on both sides (the trainers
# split each worker's pieces between them).
SHARDED = ((0, R), (R, 1))
REPLICATED = (None, None)

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]
DTYPES += [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
                                       "uint64", "complex128", "complex32")
           if hasattr(torch, n)]


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # Raw bytes (NaN payloads and -0.0 count); the copy of the same dtype moves bits and
    # gives canonical strides, which view(uint8) needs (a size-1 dim may carry any stride)
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _assert_same(got: torch.Tensor, want: torch.Tensor, what: object, *,
                 nan_bits: bool = True) -> None:
    """``got`` holds ``want``'s bytes; without ``nan_bits``, a NaN may be any NaN."""
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (
        what, got.dtype, want.dtype, got.shape, want.shape)
    if not nan_bits:
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), what
        got, want = got[~nan], want[~nan]
    assert torch.equal(_bytes(got), _bytes(want)), what


def _with_placements(plan: TransferPlan, tensors: Mapping[str, Any]) -> dict[str, Any]:
    return {n: (t if isinstance(t, LoadTarget) else (t, plan.params[plan.index(n)].dst.placements))
            for n, t in tensors.items()}


async def _connect(plan: TransferPlan, targets: Mapping[int, Mapping[str, Any]], *,
                   cfg: EngineConfig = CFG, specs: Sequence[Any] | None = None
                   ) -> tuple[list[Any], dict[int, BaseException]]:
    """Every rank connects; (engines, {}) or, when any rank raised, ([], what each raised)
    with the engines that did connect closed."""
    store = MemoryStore()
    params = list(specs) if specs is not None else [p.spec for p in plan.params]
    engines: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    async def one(r: int) -> None:
        try:
            if r < T:
                engines[r] = await TrainerEngine.connect(
                    store=store.session(), rank=r, trainer_ranks=T, world_size=T + N,
                    params=params, config=cfg)
            else:
                engines[r] = await WorkerEngine.connect(
                    store=store.session(), rank=r, trainer_ranks=T, world_size=T + N,
                    targets=targets[r], mesh_dims=DST_DIMS, config=cfg)
        except Exception as exc:
            errors[r] = exc

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for r in range(T + N):
                tg.start_soon(one, r)
    if errors:
        for e in engines.values():
            await e.close()
        return [], errors
    return [engines[r] for r in range(T + N)], errors


async def _round(engines: Sequence[Any], weights: Mapping[int, Any]) -> dict[int, SyncResult]:
    results: dict[int, SyncResult] = {}

    async def one(r: int) -> None:
        if r < T:
            results[r] = await engines[r].sync_weights(weights[r])
        else:
            results[r] = await engines[r].receive()

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            for r in range(T + N):
                tg.start_soon(one, r)
    return results


async def _one_round(plan: TransferPlan, *, targets: Mapping[int, Mapping[str, Any]]
                     | None = None, weights: Mapping[int, Any] | None = None,
                     cfg: EngineConfig = CFG) -> tuple[dict[int, SyncResult],
                                                       dict[int, dict[str, Any]]]:
    """Connect, one round, close: (every rank's result, the workers' targets)."""
    tensors = dict(targets) if targets is not None else {
        r: empty_targets(plan, r) for r in range(T, T + N)}
    engines, errors = await _connect(plan, {r: _with_placements(plan, tensors[r])
                                            for r in tensors}, cfg=cfg)
    assert not errors, {r: f"{type(e).__name__}: {e}" for r, e in errors.items()}
    try:
        results = await _round(engines, weights if weights is not None else
                               {r: source_shards(plan, r, 1) for r in range(T)})
    finally:
        for e in engines:
            await e.close()
    assert all(res.version == 1 for res in results.values()), results
    return results, tensors


def _assert_delivered(plan: TransferPlan, tensors: Mapping[int, Mapping[str, Any]]) -> None:
    for r in range(T, T + N):
        want = expected_shards(plan, r, 1)
        for name, got in tensors[r].items():
            _assert_same(got, want[name], (r, name))


def _one_refusal(errors: Mapping[int, BaseException], phase: str) -> PreflightError:
    """Every rank raised one PreflightError of ``phase`` (the same text); that error."""
    assert sorted(errors) == list(range(T + N)), errors
    assert all(isinstance(e, PreflightError) for e in errors.values()), errors
    assert len({str(e) for e in errors.values()}) == 1, errors
    err = errors[0]
    assert isinstance(err, PreflightError) and err.phase == phase, err
    return err


# -- every dtype, bit-exact ---------------------------------------------------------------


def _dtype_defs(dtype: torch.dtype, tag: str) -> list[ParamDef]:
    w = torch.empty((), dtype=dtype).element_size()
    return [
        (f"{tag}.sharded", (6, 10), dtype, *SHARDED),
        (f"{tag}.replicated", (3, 5), dtype, *REPLICATED),
        (f"{tag}.scalar", (), dtype, *REPLICATED),
        (f"{tag}.size1", (1, 8), dtype, None, (R, 1)),
        # pieces of DIRECT_MIN_BYTES: messages of their own, packed on the trainer (strided
        # there) and landing in place on the worker
        (f"{tag}.direct", (2048, DIRECT_MIN_BYTES // 512 // w), dtype, *SHARDED),
    ]


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", DTYPES, ids=_short)
async def test_every_dtype_moves_bit_exact_sharded_and_replicated(dtype: torch.dtype) -> None:
    plan = make_plan(_dtype_defs(dtype, _short(dtype)), SRC_DIMS, DST_DIMS)
    _, tensors = await _one_round(plan)
    _assert_delivered(plan, tensors)


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
async def test_all_dtypes_interleaved_in_one_bucket_move_bit_exact() -> None:
    # Items of 1, 2, 4, 8 and 16 bytes side by side in one packed message: most segments
    # start at offsets that are no multiple of their item size.
    defs: list[ParamDef] = []
    for k, dtype in enumerate(DTYPES):
        defs += [(f"m{k}.sharded", (2, 2 * (k + 1)), dtype, *SHARDED),
                 (f"m{k}.odd", (3,), dtype, *REPLICATED),
                 (f"m{k}.scalar", (), dtype, *REPLICATED)]
    plan = make_plan(defs, SRC_DIMS, DST_DIMS)
    assert len(plan.buckets(CFG.bucket_bytes or 0)) == 1
    _, tensors = await _one_round(plan)
    _assert_delivered(plan, tensors)


# -- shapes -------------------------------------------------------------------------------


def test_a_sharded_scalar_is_refused_naming_the_parameter() -> None:
    with pytest.raises(PlanError, match=r"parameter 'step' \(source side\): shard dim 0 does "
                                        r"not exist in a tensor of rank 0"):
        ParamSpec("step", torch.float32, (), Layout(Mesh(SRC_DIMS), (0, R)))


@pytest.mark.parametrize("shape", [(0, 8), (8, 0), (0,)], ids=str)
def test_a_zero_size_dim_is_refused_naming_the_parameter(shape: tuple[int, ...]) -> None:
    with pytest.raises(PlanError, match=rf"parameter 'empty': shape must hold positive ints, "
                                        rf"got {shape}".replace("(", r"\(").replace(")", r"\)")):
        ParamSpec("empty", torch.float32, shape, Layout(Mesh(SRC_DIMS), None))
    m = torch.nn.Module()
    m.ok = torch.nn.Parameter(torch.zeros(2))
    m.empty = torch.nn.Parameter(torch.zeros(shape))
    with pytest.raises(PlanError, match=r"parameter 'empty': shape must hold positive ints"):
        specs_from_module(m)


@pytest.mark.parametrize(("shape", "placements", "side", "dim", "size"), [
    ((7, 4), (0, R), "source", 0, 7),
    ((1, 4), (0, R), "source", 0, 1),
    ((3, 7, 2), (0, R), "source", 0, 3),
], ids=["7-rows", "1-row", "3-d"])
def test_a_dim_the_trainer_mesh_does_not_divide_is_refused(
        shape: tuple[int, ...], placements: tuple[int, int], side: str, dim: int,
        size: int) -> None:
    # Layouts are equal slabs (docs/concepts.md): an uneven shard is refused, never guessed.
    with pytest.raises(PlanError, match=rf"parameter 'w' \({side} side\): dim {dim} of size "
                                        rf"{size} does not divide evenly into 2 shards"):
        ParamSpec("w", torch.float32, shape, Layout(Mesh(SRC_DIMS), placements))


@pytest.mark.asyncio
async def test_a_dim_the_worker_mesh_does_not_divide_fails_connect_on_every_rank() -> None:
    # The trainers declare 8 x 7 (rows over 2 trainers: fine); the workers ask for the 7
    # columns over TP = 2. Found in the destination phase, naming both workers.
    specs = [ParamSpec("w", torch.float32, (8, 7), Layout(Mesh(SRC_DIMS), (0, R)))]
    plan = make_plan([("w", (8, 8), torch.float32, *SHARDED)], SRC_DIMS, DST_DIMS)
    targets = {r: {"w": (torch.zeros(8, 3), (R, 1))} for r in range(T, T + N)}
    _, errors = await _connect(plan, targets, specs=specs)
    err = _one_refusal(errors, "destination")
    assert sorted(err.failures) == [2, 3], err
    for r in (2, 3):
        assert ("parameter 'w' (destination side): dim 1 of size 7 does not divide evenly "
                "into 2 shards") in err.failures[r], err


@pytest.mark.asyncio
async def test_size_1_dims_move_bit_exact_whatever_their_strides() -> None:
    # A size-1 dim may carry any stride and the tensor is still contiguous (a transposed
    # (1, n) is (n, 1) with strides (1, n)): sources and targets like that are accepted by
    # the checks, so the lanes must move them like any other.
    plan = make_plan([
        ("col", (8, 1), torch.float32, (0, R), (R, 0)),       # whole shards, in place
        ("col_rep", (8, 1), torch.float32, None, (R, 0)),      # contiguous pieces
        ("cube", (2, 4, 1), torch.bfloat16, None, (R, 1)),     # strided pieces
        ("one", (1,), torch.int64, None, None),
        ("row", (1, 8), torch.float16, (R, 1), (R, 1)),        # plain strides, for contrast
    ], SRC_DIMS, DST_DIMS)

    def odd(t: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor equal to ``t`` whose size-1 dims have strides other than the
        canonical ones."""
        if t.shape == (1,):
            out = torch.empty(5, dtype=t.dtype)[::5]
        elif t.dim() == 2 and t.shape[1] == 1:
            out = torch.empty(1, t.shape[0], dtype=t.dtype).t()
        elif t.dim() == 3 and t.shape[2] == 1:
            out = torch.empty(t.shape[0], 1, t.shape[1], dtype=t.dtype).transpose(1, 2)
        else:
            return t
        assert out.is_contiguous() and out.stride() != t.contiguous().stride(), out.stride()
        return out.copy_(t)

    weights = {r: {n: odd(t) for n, t in source_shards(plan, r, 1).items()} for r in range(T)}
    targets = {r: {n: odd(t) for n, t in empty_targets(plan, r).items()}
               for r in range(T, T + N)}
    _, tensors = await _one_round(plan, targets=targets, weights=weights)
    _assert_delivered(plan, tensors)


@pytest.mark.asyncio
async def test_a_target_of_a_zero_size_or_other_shape_fails_connect_naming_it() -> None:
    plan = make_plan([("w", (8, 8), torch.float32, *SHARDED),
                      ("s", (), torch.float32, *REPLICATED)], SRC_DIMS, DST_DIMS)
    targets = {r: {"w": (torch.zeros(0, 4), (R, 1)), "s": (torch.zeros(1), None)}
               for r in range(T, T + N)}
    _, errors = await _connect(plan, targets)
    err = _one_refusal(errors, "runtime_ready")
    assert sorted(err.failures) == [2, 3], err
    for r in (2, 3):
        assert (f"parameter 'w' (destination side, rank {r}): tensor shape (0, 4) != local "
                f"shard shape (8, 4)") in err.failures[r], err


# -- many tiny parameters, one large one --------------------------------------------------


@pytest.mark.asyncio
async def test_five_thousand_one_element_params_move_bit_exact_in_bounded_time() -> None:
    kinds = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8]
    plan = make_plan([(f"tiny.{i}", (1,), kinds[i % len(kinds)], *REPLICATED)
                      for i in range(5000)], SRC_DIMS, DST_DIMS)
    cfg = EngineConfig(transport="gloo", max_inflight=2, phase_timeout=30, round_timeout=30,
                       abort_grace=2, host="127.0.0.1")  # the lane's own bucket size
    with anyio.fail_after(DEADLINE / 2):  # against a hang or a quadratic path: ~3 s here
        results, tensors = await _one_round(plan, cfg=cfg)
    _assert_delivered(plan, tensors)
    # one bucket by bytes, cut at MAX_BUCKET_PARAMS parameters: the pipeline overlaps them
    assert all(res.buckets == -(-5000 // MAX_BUCKET_PARAMS) for res in results.values())


@pytest.mark.asyncio
async def test_a_64_mib_param_over_a_1_mib_bucket_gets_a_bucket_of_its_own() -> None:
    # EngineConfig: "a single parameter larger than bucket_bytes gets a bucket of its own".
    plan = make_plan([("before", (4, 6), torch.float32, *SHARDED),
                      ("big", (4096, 4096), torch.float32, *SHARDED),
                      ("after", (6,), torch.bfloat16, *REPLICATED)], SRC_DIMS, DST_DIMS)
    cfg = EngineConfig(transport="gloo", bucket_bytes=1 << 20, max_inflight=2,
                       phase_timeout=30, round_timeout=30, abort_grace=2, host="127.0.0.1")
    results, tensors = await _one_round(plan, cfg=cfg)
    _assert_delivered(plan, tensors)
    assert all(res.buckets == 3 for res in results.values()), results
    # each trainer sends its whole 32 MiB row slab of it
    assert all(results[r].bytes > 32 << 20 for r in range(T)), results


# -- targets: views, other dtypes ---------------------------------------------------------


@pytest.mark.asyncio
async def test_a_transposed_view_target_fails_connect_naming_it() -> None:
    plan = make_plan([("w", (8, 6), torch.float32, *SHARDED)], SRC_DIMS, DST_DIMS)
    targets = {r: {"w": (torch.zeros(3, 8).t(), (R, 1))} for r in range(T, T + N)}
    _, errors = await _connect(plan, targets)
    err = _one_refusal(errors, "runtime_ready")
    assert sorted(err.failures) == [2, 3], err
    for r in (2, 3):
        assert (f"parameter 'w' (destination side, rank {r}): tensor is not contiguous"
                in err.failures[r]), err


@pytest.mark.asyncio
async def test_a_transposed_view_source_is_refused_before_the_round() -> None:
    # Refused on every trainer (rank 0 included: no round starts), nothing sent; the same
    # engines then complete a round with contiguous shards.
    plan = make_plan([("w", (8, 6), torch.float32, *SHARDED)], SRC_DIMS, DST_DIMS)
    tensors = {r: empty_targets(plan, r) for r in range(T, T + N)}
    engines, errors = await _connect(plan, {r: _with_placements(plan, tensors[r])
                                            for r in tensors})
    assert not errors, errors
    try:
        for r in range(T):
            view = source_shards(plan, r, 1)["w"].t().contiguous().t()  # (4, 6), strided
            with pytest.raises(PlanError, match=rf"parameter 'w' \(source side, rank {r}\): "
                                                r"tensor is not contiguous"):
                await engines[r].sync_weights({"w": view})
            assert engines[r].state is EngineState.READY
        await _round(engines, {r: source_shards(plan, r, 1) for r in range(T)})
    finally:
        for e in engines:
            await e.close()
    _assert_delivered(plan, tensors)


@pytest.mark.asyncio
async def test_a_target_of_another_dtype_than_the_wire_fails_connect_naming_it() -> None:
    # The worker side never casts: a tensor target holds wire bytes, so its dtype must be
    # the plan's (a LoadTarget casts, below).
    plan = make_plan([("w", (8, 6), torch.bfloat16, *SHARDED)], SRC_DIMS, DST_DIMS)
    targets = {r: {"w": (torch.zeros(8, 3), (R, 1))} for r in range(T, T + N)}
    _, errors = await _connect(plan, targets)
    err = _one_refusal(errors, "runtime_ready")
    assert sorted(err.failures) == [2, 3], err
    for r in (2, 3):
        assert (f"parameter 'w' (destination side, rank {r}): tensor dtype float32 != "
                f"planned dtype bfloat16") in err.failures[r], err


@pytest.mark.asyncio
async def test_a_load_target_casting_into_another_dtype_gets_the_wire_values() -> None:
    plan = make_plan([("w", (8, 6), torch.bfloat16, *SHARDED),
                      ("s", (), torch.bfloat16, *REPLICATED)], SRC_DIMS, DST_DIMS)
    fp32 = {r: {"w": torch.zeros(8, 3), "s": torch.zeros(())} for r in range(T, T + N)}

    def load_into(r: int) -> Any:
        def load(name: str, t: torch.Tensor) -> None:
            fp32[r][name].copy_(t)
        return load

    targets = {r: {p.spec.name: LoadTarget(p.dst.local_shape(p.spec.shape, r), p.spec.dtype,
                                           p.dst.placements, load_into(r))
                   for p in plan.params} for r in range(T, T + N)}
    await _one_round(plan, targets=targets)
    for r in range(T, T + N):
        for name, want in expected_shards(plan, r, 1).items():
            _assert_same(fp32[r][name], want.to(torch.float32), (r, name))


# -- names --------------------------------------------------------------------------------

NAMES = ["layers/0/attn/q.weight", "module.ü∑.偏置.😀", "n" * 1000, "with space\tand\nnewline",
         "nul\x00inside", "../../{job}/1/round", "*", "x" * 1000 + "/" + "y" * 1000]


@pytest.mark.asyncio
async def test_unicode_slashes_and_long_names_move_bit_exact() -> None:
    defs: list[ParamDef] = []
    for k, name in enumerate(NAMES):
        defs += [(name, (2, 4), torch.float32, *SHARDED),
                 (name + f".{k}", (3,), torch.int8, *REPLICATED)]
    plan = make_plan(defs, SRC_DIMS, DST_DIMS)
    _, tensors = await _one_round(plan)
    _assert_delivered(plan, tensors)


def test_a_name_that_is_no_utf_8_text_is_refused_naming_it() -> None:
    # Names travel as UTF-8 (digests, the handshake): a lone surrogate cannot, and must be
    # refused where the name is given, not in a phase that cannot say which one.
    with pytest.raises(PlanError, match=r"parameter 'w\\ud800': the name is not valid "
                                        r"UTF-8 text"):
        ParamSpec("w\ud800", torch.float32, (4,), Layout(Mesh(SRC_DIMS), None))


# -- the cast while packing ---------------------------------------------------------------

# fp32 bit patterns: NaN payloads (quiet, signalling, negative, the extremes), signed zeros,
# subnormals (the smallest, the largest, halfway cases in bf16), infinities, the largest
# finite (rounds to inf in bf16 and fp16), exact ties (round half to even, both ways).
F32_SPECIALS = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FC00001, 0x7FBFFFFF, 0xFF812345,
                0x7FFFFFFF, 0xFFFFFFFF, 0x80000000, 0x00000000, 0x00000001, 0x807FFFFF,
                0x00400000, 0x00008000, 0x00018000, 0x007F8000, 0x7F800000, 0xFF800000,
                0x7F7FFFFF, 0xFF7FFFFF, 0x3F808000, 0x3F818000, 0xBF808000, 0x477FF000,
                0x477FE000, 0x33800000, 0x33000000]
# fp64 bit patterns of the same kinds, plus a value that rounds differently through fp32
F64_SPECIALS = [0x7FF8000000000000, 0xFFF8000000000001, 0x7FF0000000000001,
                0x7FF7FFFFFFFFFFFF, 0x8000000000000000, 0x0000000000000001,
                0x000FFFFFFFFFFFFF, 0x7FF0000000000000, 0xFFF0000000000000,
                0x7FEFFFFFFFFFFFFF, 0x3FF0100000000001, 0x3FF0100000000000,
                0x36A0000000000000, 0x47EFFFFFE0000000]


def _master(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A full master tensor: random values with the special patterns spread through it, so
    every piece of every layout holds some, at every alignment."""
    g = torch.Generator().manual_seed(sum(name.encode()) * 7919)
    n = torch.Size(shape).numel()
    t = (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
    if dtype == torch.float32:
        specials = torch.tensor(F32_SPECIALS, dtype=torch.int64).to(torch.int32)
    else:
        specials = torch.tensor([b - (1 << 64) if b >= 1 << 63 else b for b in F64_SPECIALS],
                                dtype=torch.int64)
    bits = t.view(specials.dtype)
    step = 3  # every third element, cycling through the specials
    idx = torch.arange(0, n, step)
    bits[idx] = specials[torch.arange(len(idx)) % len(specials)]
    return t.reshape(shape)


CAST_DEFS: list[tuple[str, tuple[int, ...], tuple[int, int] | None, tuple[int, int] | None]] = [
    ("pad", (3,), None, None),                 # a uint8 param: what follows is unaligned
    ("strided", (16, 24), *SHARDED),           # column blocks of row slabs
    ("rows", (10, 6), None, (R, 0)),           # contiguous row ranges
    ("whole", (8, 12), (0, R), (R, 0)),        # whole shards
    ("odd", (5, 7), *REPLICATED),
    ("scalar", (), *REPLICATED),
    ("pad2", (2,), None, None),                # the next scalar lands at an odd offset
    ("scalar2", (), *REPLICATED),
    ("scalar3", (), *REPLICATED),
    ("big", (1024, 1024), None, (R, 0)),       # 1 MiB+ pieces: messages of their own
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("master", "wire"), [
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
    (torch.float64, torch.bfloat16), (torch.float64, torch.float32),
], ids=["fp32-bf16", "fp32-fp16", "fp64-bf16", "fp64-fp32"])
async def test_the_cast_while_packing_gives_exactly_shard_to_wire(master: torch.dtype,
                                                                  wire: torch.dtype) -> None:
    defs: list[ParamDef] = [(n, s, torch.uint8 if n.startswith("pad") else wire, sp, dp)
                            for n, s, sp, dp in CAST_DEFS]
    plan = make_plan(defs, SRC_DIMS, DST_DIMS)
    fulls = {p.spec.name: (global_tensor(p.spec.name, p.spec.shape, torch.uint8)
                           if p.spec.name.startswith("pad") else
                           _master(p.spec.name, p.spec.shape, master)) for p in plan.params}
    shards = {r: {p.spec.name: local_shard(fulls[p.spec.name], p.spec.layout, r)
                  for p in plan.params} for r in range(T)}
    # What the workers must hold: each trainer's shard.to(wire), put back where it lies
    wire_fulls = {}
    for p in plan.params:
        dtype = getattr(torch, p.spec.dtype)
        full = torch.empty(p.spec.shape, dtype=dtype)
        for r in range(T):
            box = p.spec.layout.box(p.spec.shape, r)
            full[tuple(slice(a, b) for a, b in box)] = shards[r][p.spec.name].to(dtype)
        wire_fulls[p.spec.name] = full
    results, tensors = await _one_round(plan, weights=shards)
    # torch's own fp64 -> bf16 cast on the CPU encodes a NaN by where it lies in the tensor
    # (0xffff inside a vector of the kernel, 0x7fc0 in a tail), so no copy of a part of the
    # shard can promise shard.to's NaN bits there; every other value, and NaN-ness, it can
    nan_bits = (master, wire) != (torch.float64, torch.bfloat16)
    for r in range(T, T + N):
        for p in plan.params:
            _assert_same(tensors[r][p.spec.name],
                         local_shard(wire_fulls[p.spec.name], p.dst, r), (r, p.spec.name),
                         nan_bits=nan_bits)
    assert all(results[r].cast_bytes > 0 for r in range(T)), results
    # the specials really reached the workers: NaNs, infinities, zeros among them
    got = torch.cat([tensors[r]["strided"].reshape(-1) for r in range(T, T + N)])
    assert got.isnan().any() and got.isinf().any() and (got == 0).any()
