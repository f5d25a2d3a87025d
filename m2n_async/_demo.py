"""``m2n-async demo``: trainer and worker meshes as local processes, verified bit-exact.

Theory of operation. The parent process runs an embedded ``StoreServer`` on 127.0.0.1 with a
fresh random token and spawns ``T`` trainer and ``N`` worker processes (``spawn``: torch and
threads of the parent must not leak into children). Every process builds the same synthetic,
transformer-shaped model description (``demo_model``) and the same ``TransferPlan``: trainers
on mesh ``(1, T)`` (FSDP-style row/column shards, expert parallel on dim 0 of the 3-D expert
tensors, some replicated tensors), workers on mesh ``(1, N)`` (tensor parallel: column- and
row-parallel matrices, experts sharded along an inner dim, replicated norms), plus a block of
many tiny tensors — so the plan mixes zero-copy runs, strided reshards, replica balancing and
per-parameter overhead.

Weights are a pure function of ``(name, global element index, round)`` (``shard_content``):
``base(name, index)`` — integer hashes of the element's global row and column, so any rank
computes any box of any tensor without the global tensor — XOR a per-``(name, round)`` byte
mask. Each round
the trainers XOR their shards in place from the previous round's mask to the new one (like an
optimizer step that rewrites every byte) and call ``sync_weights``; the workers ``receive``
into zeroed targets and compare every byte with ``base ^ mask(round)`` recomputed from the
formula for their own boxes. Consecutive masks differ in every element, so a stale byte (a
piece that did not move) fails the check, and the hash makes misplaced pieces fail it too.

Between rounds the trainers wait (through the store, bounded) until every worker has verified
the previous round, so a round's time measures the transfer, not the verification.

The processes are a ``m2n_async.testing.LocalWorld`` — the toolkit a framework tests its own
integration with: the store in a thread of the parent, the ranks in spawned processes, each
talking to the parent over a pipe of its own (a child that dies mid-write garbles only its
own pipe). Ranks report as msgspec-encoded events (typed; the world carries them as bytes)
through ``ctx.event``, and the parent reads them as they come (``LocalWorld.events``): it
shows each round's progress on stderr when it is a terminal (tqdm's bar with the ``demo``
extra, plain lines without), prints per-round time and GB/s, and exits non-zero naming the
rank on any mismatch, error, dead child or deadline. A rank's error comes back as its
exception, a dead child with its exit code. Children are always reaped: on failure the
survivors get a grace period (``_FAIL_GRACE``, the world's ``fail_grace``) to report, then
are killed, their Python stacks printed first.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from m2n_async._proto.lanes import AUTO, LANES
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamSpec, ParamTransfer, dtype_itemsize
from m2n_async._proto.plan import TransferPlan

if TYPE_CHECKING:
    import torch

    from m2n_async._proto.layout import Box
    from m2n_async.testing import LocalWorld, RankContext, RankResult

__all__ = [
    "DemoParam",
    "add_demo_command",
    "demo_model",
    "demo_plan",
    "run_demo",
    "run_demo_command",
    "shard_content",
]

Placements = tuple[int, int] | None
R = REPLICATE
_MB = 1_000_000
# After the first failure, how long the other ranks get to report theirs (the engine's own
# abort path takes up to a few abort_grace steps of 5 s; 12 s once ran out on a loaded
# 2-core box) before every child is killed.
_FAIL_GRACE = 20.0


# -- the model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoParam:
    """One tensor of the synthetic model: placements on the trainer mesh ``(1, T)`` (``src``)
    and on the worker mesh ``(1, N)`` (``dst``); ``None`` means fully replicated."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    src: Placements
    dst: Placements

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_itemsize(self.dtype)


def demo_model(size_mb: float, trainers: int, workers: int, *, small_per_layer: int = 96
               ) -> list[DemoParam]:
    """A transformer-shaped parameter list of about ``size_mb`` MB (10^6 bytes).

    Per layer: a replicated norm, a row-sharded fused QKV (column-parallel on workers), an
    output projection resharded row → column, a column-sharded gate/up (→ rows), a down
    projection (columns → columns), a replicated router, two expert tensors of shape
    ``(E, ., .)`` expert-parallel on dim 0 on the trainers and tensor-parallel on dim 1 or 2 on
    the workers, and ``small_per_layer`` tiny tensors alternating replicated → sharded and
    sharded → replicated. Plus a vocab-sharded embedding, a replicated-source LM head and a
    final norm. Every sharded dim divides by ``T`` and ``N``; the hidden size and the layer
    count are chosen so that the total lands near ``size_mb`` (at least one layer, hidden at
    least ``16 x lcm(T, N)``, so very small sizes round up).
    """
    if trainers < 1 or workers < 1:
        raise ValueError(f"need at least one trainer and one worker, got {trainers}+{workers}")
    if not size_mb > 0:
        raise ValueError(f"size_mb must be > 0, got {size_mb}")
    u = math.lcm(trainers, workers)
    experts = trainers * max(1, math.ceil(8 / trainers))
    step = 16 * u  # hidden multiple: d/2 (expert width) and d still divide by T and N
    # Bytes per hidden^2: 20 (dense, bf16) + 3 * experts (expert tensors, bf16) per layer;
    # 64 for the embedding + head (vocab = 16 * hidden, bf16). Aim for ~6 layers.
    per_layer = 20 + 3 * experts
    target = size_mb * _MB
    d = max(step, int(math.sqrt(target / (6 * per_layer + 64))) // step * step)
    layers = max(1, round((target - 64 * d * d) / (per_layer * d * d)))
    vocab, ffn, expert_ffn = 16 * d, 2 * d, d // 2
    small = 4 * u
    out: list[DemoParam] = [DemoParam("embed.weight", (vocab, d), "bfloat16", (R, 0), (R, 0))]
    for i in range(layers):
        p = f"layers.{i}"
        out += [
            DemoParam(f"{p}.input_norm.weight", (d,), "float32", None, None),
            DemoParam(f"{p}.attn.qkv.weight", (3 * d, d), "bfloat16", (R, 0), (R, 0)),
            DemoParam(f"{p}.attn.o.weight", (d, d), "bfloat16", (R, 0), (R, 1)),
            DemoParam(f"{p}.mlp_norm.weight", (d,), "float32", None, None),
            DemoParam(f"{p}.mlp.gate_up.weight", (2 * ffn, d), "bfloat16", (R, 1), (R, 0)),
            DemoParam(f"{p}.mlp.down.weight", (d, ffn), "bfloat16", (R, 1), (R, 1)),
            DemoParam(f"{p}.router.weight", (experts, d), "float32", None, None),
            DemoParam(f"{p}.experts.gate_up", (experts, 2 * expert_ffn, d), "bfloat16",
                      (R, 0), (R, 1)),
            DemoParam(f"{p}.experts.down", (experts, d, expert_ffn), "bfloat16",
                      (R, 0), (R, 2)),
        ]
        for j in range(small_per_layer):
            src, dst = ((None, (R, 0)) if j % 2 == 0 else ((R, 0), None))
            dtype = ("float16", "float32", "int8")[j % 3]
            out.append(DemoParam(f"{p}.small.{j}", (small,), dtype, src, dst))
    out += [
        DemoParam("final_norm.weight", (d,), "float32", None, None),
        DemoParam("lm_head.weight", (vocab, d), "bfloat16", None, (R, 0)),
    ]
    return out


def demo_plan(params: Sequence[DemoParam], trainers: int, workers: int) -> TransferPlan:
    """The plan of ``params`` from trainer mesh ``(1, T)`` at rank 0 to worker mesh ``(1, N)``."""
    smesh, dmesh = Mesh((1, trainers), 0), Mesh((1, workers), trainers)
    return TransferPlan(
        [ParamTransfer(ParamSpec(p.name, p.dtype, p.shape, Layout(smesh, p.src)),
                       Layout(dmesh, p.dst)) for p in params],
        trainer_ranks=trainers, world_size=trainers + workers)


# -- the weights: a pure function of (name, global index, round) -----------------------------


def _name_seed(name: str) -> int:
    """FNV-1a of the name, 40 bits (so the hash arithmetic below never overflows int64)."""
    h = 1469598103934665603
    for ch in name.encode():
        h = ((h ^ ch) * 1099511628211) % (1 << 64)
    return h >> 24


def _global_index(shape: tuple[int, ...], box: Box) -> torch.Tensor:
    """int64 global flat (row-major) index of every element of ``box``, shaped like the box."""
    import torch

    stride = 1
    idx: torch.Tensor | None = None
    for dim in reversed(range(len(shape))):
        lo, hi = box[dim]
        view = [1] * len(shape)
        view[dim] = hi - lo
        part = (torch.arange(lo, hi, dtype=torch.int64) * stride).view(view)
        idx = part if idx is None else part + idx
        stride *= shape[dim]
    assert idx is not None
    return idx


_WORD: dict[int, Any] = {}


def _words() -> None:
    import torch

    _WORD.update({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})


def _hash_bytes(idx: torch.Tensor, seed: int, k: int) -> torch.Tensor:
    """``k`` pseudo-random bytes per int64 index (shape ``idx.shape + (k,)``, uint8).

    An integer hash whose every intermediate stays below 2^63 (indices < 2^28, seed < 2^40),
    so it is exact and identical on every machine.
    """
    import torch

    x = idx * 0x9E3779B1 + seed
    x = x ^ (x >> 29)
    x = (x & 0xFFFFFFFF) * 0x2C1B3C6D
    x = x ^ (x >> 31)
    return torch.stack([((x >> (8 * j)) & 0xFF).to(torch.uint8) for j in range(k)], dim=-1)


def base_content(name: str, shape: tuple[int, ...], dtype: str, box: Box) -> torch.Tensor:
    """The round-independent bytes of ``box`` of parameter ``name`` (a fresh tensor).

    Element ``(row, col)`` — ``row`` the global flat index over all dims but the last, ``col``
    the last-dim index — is ``H(row) XOR C(col)``, each a hash seeded by the name. Hashing
    rows and columns separately costs one broadcast XOR per byte instead of a hash per
    element (the demo recomputes hundreds of MB per process), and still gives every element
    of a tensor a different-looking value: a piece landing in the wrong row, column or tensor
    fails the check.
    """
    import torch

    k = dtype_itemsize(dtype)
    if not _WORD:
        _words()
    seed = _name_seed(name)
    rows = (_global_index(shape[:-1], box[:-1]) if len(shape) > 1
            else torch.zeros((), dtype=torch.int64))
    cols = torch.arange(box[-1][0], box[-1][1], dtype=torch.int64)
    # XOR in a k-byte integer view: one vectorized op per element (a uint8 broadcast over a
    # trailing dim of k runs ~7x slower).
    word = _WORD[k]
    h_rows = _hash_bytes(rows, seed, k).view(word)                       # (*lead, 1)
    h_cols = _hash_bytes(cols + (1 << 27), seed ^ 0x5BD1E995, k).view(word).view(-1)
    raw = torch.bitwise_xor(h_rows, h_cols)                              # (*lead, cols)
    return raw.view(getattr(torch, dtype)).reshape([hi - lo for lo, hi in box])


def round_mask(name: str, dtype: str, round_: int) -> torch.Tensor:
    """``itemsize`` bytes XORed into every element of ``name`` in round ``round_`` (0: none).

    Byte 0 is ``1 + (37 * round + seed) % 255``: it differs between consecutive rounds (37 is
    not a multiple of 255), so every element changes every round.
    """
    import torch

    k = dtype_itemsize(dtype)
    if round_ == 0:
        return torch.zeros(k, dtype=torch.uint8)
    seed = _name_seed(name)
    first = 1 + (37 * round_ + seed) % 255
    rest = [((seed >> (3 * j)) + 101 * round_) & 0xFF for j in range(1, k)]
    return torch.tensor([first, *rest], dtype=torch.uint8)


def _bytes_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as a ``(numel, itemsize)`` uint8 view."""
    import torch

    return t.view(-1).view(torch.uint8).view(t.numel(), t.element_size())


def shard_content(p: DemoParam, box: Box, round_: int) -> torch.Tensor:
    """The exact bytes of ``box`` of ``p`` in round ``round_`` (what every rank recomputes)."""
    t = base_content(p.name, p.shape, p.dtype, box)
    if round_:
        _bytes_2d(t).bitwise_xor_(round_mask(p.name, p.dtype, round_))
    return t


# -- events: ranks -> parent (msgspec, through the world's ctx.event) ------------------------


class Ready(msgspec.Struct, tag=True, frozen=True):
    rank: int
    generation: int
    transport: str
    reason: str
    local_bytes: int
    #: wall clock (``time.time()``: one clock for every process of the host) when this rank
    #: called ``connect``, its process started and its shards built, and when it returned
    connecting_at: float
    connected_at: float


class Progress(msgspec.Struct, tag=True, frozen=True):
    rank: int
    round: int
    done: int
    total: int


class RoundReport(msgspec.Struct, tag=True, frozen=True):
    rank: int
    round: int
    version: int
    bytes: int
    seconds: float
    mismatched: tuple[str, ...] = ()  # workers: parameters whose bytes differ
    checked: int = 0                  # workers: tensors compared


Event = Ready | Progress | RoundReport
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Event)


@dataclass(frozen=True)
class DemoArgs:
    """Everything a rank needs (plain values: they cross the spawn boundary)."""

    trainers: int
    workers: int
    rounds: int
    size_mb: float
    transport: str
    address: str
    token: str
    job: str
    round_timeout: float
    phase_timeout: float
    bucket_mb: float

    @property
    def world(self) -> int:
        return self.trainers + self.workers


#: This rank's pipe to the parent (set in ``_demo_rank``; only the ``torn`` fault writes it
#: directly).
_pipe_fd: int | None = None


async def _demo_rank(ctx: RankContext, *, args: DemoArgs) -> None:
    """One rank, as the world runs it in its process (torch imported, one intra-op thread:
    2 cores shared by T + N processes). An exception is this rank's failure: the world
    carries it to the parent."""
    global _pipe_fd
    if ctx._events is not None:  # the world's own pipe, for the torn fault only
        _pipe_fd = ctx._events.fileno()

    def send(ev: Event) -> None:
        # A synchronous write on the caller's thread (the world's pipes have no feeder
        # thread that an abrupt exit, the 'exit' fault or a crash, could cut short).
        ctx.event("demo", _encoder.encode(ev))

    await _rank_main(args, ctx.rank, send)


async def _rank_main(args: DemoArgs, rank: int, send: Callable[[Event], None]) -> None:
    from m2n_async._engine._config import EngineConfig
    from m2n_async._store import StoreClient

    params = demo_model(args.size_mb, args.trainers, args.workers)
    plan = demo_plan(params, args.trainers, args.workers)
    config = EngineConfig(transport=args.transport, bucket_bytes=int(args.bucket_mb * (1 << 20)),
                          phase_timeout=args.phase_timeout, round_timeout=args.round_timeout,
                          job=args.job)
    store = await StoreClient.connect(args.address, token=args.token)
    verified = [f"{args.job}-demo/verified/{{}}/{w}" for w in range(args.trainers, args.world)]
    try:
        if rank < args.trainers:
            await _trainer(args, rank, params, plan, config, store, verified, send)
        else:
            await _worker(args, rank, params, plan, config, store, verified, send)
    finally:
        with anyio.CancelScope(shield=True), anyio.move_on_after(5):
            await store.aclose()


def _fault(rank: int, round_: int) -> str | None:
    """The fault ``M2N_DEMO_FAULT=kind:rank:round`` injects here, if any.

    A test hook, so that the demo's own checks are shown to fail: ``exit`` ends the process
    abruptly (``os._exit``) as round ``round`` begins on that rank; ``torn`` does the same
    after writing half an event to its pipe (a child killed mid-report); ``hang`` blocks
    there without ever reporting (the parent must dump its stacks and kill it); ``corrupt``
    (a worker) flips one received byte before verifying; ``exit_verify`` (a worker) ends the
    process after receiving, before it reports the round verified.
    """
    spec = os.environ.get("M2N_DEMO_FAULT", "")
    if not spec:
        return None
    try:
        kind, r, k = spec.split(":")
        hit = (int(r), int(k)) == (rank, round_)
    except ValueError:
        raise ValueError(f"M2N_DEMO_FAULT must be 'KIND:RANK:ROUND', got {spec!r}"
                         ) from None
    if hit and kind == "torn" and _pipe_fd is not None:
        # A length header promising 1000 bytes (the world's frames: 8 bytes of length, then
        # the message), then 3 of them: the parent must read EOF on this pipe, count the
        # rank as dead, and still hear every other rank.
        os.write(_pipe_fd, (1000).to_bytes(8, "big") + b"abc")
    if hit and kind in ("exit", "torn"):
        os._exit(9)
    if hit and kind == "hang":  # blocks the rank's event loop itself: a true hang
        time.sleep(3600)
    return kind if hit else None


def _progress(send: Callable[[Event], None], rank: int, round_: int
              ) -> Callable[[int, int], None]:
    return lambda done, total: send(Progress(rank, round_, done, total))


async def _trainer(args: DemoArgs, rank: int, params: Sequence[DemoParam], plan: TransferPlan,
                   config: Any, store: Any, verified: list[str],
                   send: Callable[[Event], None]) -> None:
    from m2n_async._engine._engine import TrainerEngine
    from m2n_async._store import ControlGroup, generation_namespace

    # This rank's shards at round 0; each round rewrites them in place (mask r-1 -> r).
    shards = {p.name: shard_content(p, t.spec.layout.box(p.shape, rank), 0)
              for p, t in zip(params, plan.params, strict=True)}
    t_connect = time.time()
    engine = await TrainerEngine.connect(store=store, rank=rank, trainer_ranks=args.trainers,
                                         world_size=args.world, params=plan.source_specs(),
                                         config=config, timeout=args.phase_timeout * 6)
    try:
        send(Ready(rank, engine.generation, engine.transport, engine.transport_reason,
                   plan.send_bytes(rank), t_connect, time.time()))
        # The engine's liveness keys of the workers: a worker that dies while verifying
        # fails this wait at once instead of after the deadline.
        group = ControlGroup(store, rank, args.world,
                             generation_namespace(args.job, engine.generation))
        alive = [group.alive_key(w) for w in range(args.trainers, args.world)]
        for r in range(1, args.rounds + 1):
            if r > 1:  # every worker verified round r-1: round r times the transfer only
                with anyio.fail_after(args.round_timeout):
                    await store.wait([k.format(r - 1) for k in verified], watch=alive)
            _fault(rank, r)
            for p in params:
                _bytes_2d(shards[p.name]).bitwise_xor_(
                    round_mask(p.name, p.dtype, r - 1) ^ round_mask(p.name, p.dtype, r))
            res = await engine.sync_weights(shards, version=r if rank == 0 else None,
                                            progress=_progress(send, rank, r))
            send(RoundReport(rank, r, res.version, res.bytes, res.seconds))
    finally:
        await engine.close()


async def _worker(args: DemoArgs, rank: int, params: Sequence[DemoParam], plan: TransferPlan,
                  config: Any, store: Any, verified: list[str],
                  send: Callable[[Event], None]) -> None:
    import torch

    from m2n_async._engine._engine import WorkerEngine

    boxes = [t.dst.box(p.shape, rank) for p, t in zip(params, plan.params, strict=True)]
    # Zeroed targets: bytes that never arrive cannot pass the check by accident.
    targets = {p.name: torch.zeros([hi - lo for lo, hi in box], dtype=getattr(torch, p.dtype))
               for p, box in zip(params, boxes, strict=True)}
    # The round-independent part of the expected bytes, recomputed from the formula.
    base = {p.name: _bytes_2d(base_content(p.name, p.shape, p.dtype, box))
            for p, box in zip(params, boxes, strict=True)}
    scratch = torch.empty(max(t.numel() * t.element_size() for t in targets.values()),
                          dtype=torch.uint8)
    t_connect = time.time()
    engine = await WorkerEngine.connect(
        store=store, rank=rank, trainer_ranks=args.trainers, world_size=args.world,
        mesh_dims=(1, args.workers), config=config, timeout=args.phase_timeout * 6,
        targets={p.name: (targets[p.name], t.dst.placements)
                 for p, t in zip(params, plan.params, strict=True)})
    try:
        send(Ready(rank, engine.generation, engine.transport, engine.transport_reason,
                   plan.recv_bytes(rank), t_connect, time.time()))
        for r in range(1, args.rounds + 1):
            fault = _fault(rank, r)
            res = await engine.receive(timeout=args.round_timeout,
                                       progress=_progress(send, rank, r))
            if fault == "corrupt":
                _bytes_2d(targets[params[-1].name])[-1, 0] ^= 1
            bad = mismatches(params, targets, base, r, scratch)
            if fault == "exit_verify":
                os._exit(9)
            send(RoundReport(rank, r, res.version, res.bytes, res.seconds, tuple(bad),
                             len(params)))
            await store.set(verified[rank - args.trainers].format(r), b"1")
    finally:
        await engine.close()


def mismatches(params: Sequence[DemoParam], targets: dict[str, torch.Tensor],
               base: dict[str, torch.Tensor], round_: int, scratch: torch.Tensor) -> list[str]:
    """Names whose target bytes differ from ``base ^ mask(round_)`` (``base``: the
    ``_bytes_2d`` of ``base_content`` for the same boxes; ``scratch``: uint8, large enough
    for the largest target)."""
    import torch

    bad = []
    for p in params:
        want = base[p.name]
        exp = scratch[:want.numel()].view(want.shape)
        torch.bitwise_xor(want, round_mask(p.name, p.dtype, round_), out=exp)
        if not torch.equal(_bytes_2d(targets[p.name]), exp):
            bad.append(p.name)
    return bad


# -- the parent ------------------------------------------------------------------------------


class _Display:
    """Where a person watches: result lines on ``out`` (stdout), each round's progress on
    ``err`` (stderr). This base shows no progress — ``err`` is not a terminal (a log, a
    pipe, a test), where redrawn bars would be noise; ``_display`` picks the kind."""

    def __init__(self, out: Any) -> None:
        self.out = out

    def progress(self, round_: int, rounds: int, done: int, total: int) -> None:
        """``done`` of the ``total`` bytes the workers receive in round ``round_``."""

    def end_progress(self) -> None:
        """Before a line: the progress of the round so far leaves the screen."""

    def line(self, text: str) -> None:
        self.end_progress()
        self.out.write(text + "\n")
        self.out.flush()


class _TqdmDisplay(_Display):
    """One tqdm bar per round on ``err`` (bytes, MB by 10^6 like every figure here), removed
    when the round's line is printed."""

    def __init__(self, tqdm: Any, err: Any, out: Any) -> None:
        super().__init__(out)
        self._tqdm, self._err = tqdm, err
        self._bar: Any = None
        self._round = 0

    def progress(self, round_: int, rounds: int, done: int, total: int) -> None:
        if self._bar is None or self._round != round_:
            self.end_progress()
            self._round = round_
            self._bar = self._tqdm(total=total, desc=f"round {round_}/{rounds}", unit="B",
                                   unit_scale=True, file=self._err, leave=False,
                                   dynamic_ncols=True)
        self._bar.update(done - self._bar.n)

    def end_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class _LineDisplay(_Display):
    """Without tqdm: a plain line on ``err`` at most every ``every`` seconds of a round
    (a round shorter than that prints none; its result line follows anyway)."""

    def __init__(self, err: Any, out: Any, every: float = 2.0) -> None:
        super().__init__(out)
        self._err, self.every = err, every
        self._round = 0
        self._last = 0.0

    def progress(self, round_: int, rounds: int, done: int, total: int) -> None:
        now = time.monotonic()
        if round_ != self._round:
            self._round, self._last = round_, now
        if now - self._last < self.every or done >= total:
            return
        self._last = now
        self._err.write(f"round {round_}/{rounds}: {done / _MB:.1f} of {total / _MB:.1f} MB "
                        f"received ({done / total:.0%})\n")
        self._err.flush()


def _display(err: Any, out: Any) -> _Display:
    """tqdm's bar when ``err`` is a terminal and tqdm is installed (``pip install
    m2n_async[demo]``; ``tox -e demo`` has it), plain lines on a terminal without it, no
    progress elsewhere."""
    if not getattr(err, "isatty", lambda: False)():
        return _Display(out)
    try:
        # Untyped, and absent where the extra is not installed (the types env): either is fine.
        from tqdm import tqdm  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        return _LineDisplay(err, out)
    return _TqdmDisplay(tqdm, err, out)


class DemoFailed(Exception):
    """The demo failed: the message names the rank(s) and what went wrong."""


def run_demo(*, trainers: int = 2, workers: int = 2, rounds: int = 3, size_mb: float = 350.0,
             transport: str = "gloo", timeout: float | None = None, round_timeout: float = 120.0,
             bucket_mb: float = 64.0, out: Any = None, err: Any = None) -> int:
    """Run the demo (see the module docstring); return 0 when every round verified.

    ``out`` receives the summary lines, ``err`` the progress and errors (default stdout /
    stderr). ``timeout`` bounds the whole run (default: three handshake phases plus
    ``round_timeout`` per round); every child is reaped before this returns.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    refused = _refusal(trainers, workers, rounds, size_mb, bucket_mb, round_timeout)
    if refused is not None:
        print(f"m2n-async demo: {refused}", file=err)
        return 2
    if timeout is None:
        timeout = 3 * min(60.0, round_timeout) + rounds * round_timeout
    try:
        failure = _parent(trainers, workers, rounds, size_mb, transport, timeout,
                          round_timeout, bucket_mb, out, err)
    except KeyboardInterrupt:
        print("m2n-async demo: interrupted (children killed)", file=err)
        return 130
    if failure is not None:
        out.flush()
        print(f"m2n-async demo FAILED: {failure}", file=err)
        return 1
    return 0


# Bounds of the arguments, each far past a real run and within float arithmetic (past them
# the demo failed with an OverflowError, before or after its processes started).
_MAX_RANKS = 4096  # processes per side, every one on this host
_MAX_ROUNDS = 10**9
_MAX_SIZE_MB = 1e12  # an exabyte: far past any host's memory, which is checked below
_MAX_ROUND_TIMEOUT = 1e9  # seconds; a rank's deadline at 1e300 s overflowed the platform's time_t


def _refusal(trainers: int, workers: int, rounds: int, size_mb: float, bucket_mb: float,
             round_timeout: float) -> str | None:
    """Why these arguments cannot run, naming the flag and its value; None when they can.
    Checked before any process starts: each would otherwise fail on its own, seconds later,
    or (a model past the host's memory) not at all before memory runs out."""
    for flag, count, most in (("--trainers", trainers, _MAX_RANKS),
                              ("--workers", workers, _MAX_RANKS),
                              ("--rounds", rounds, _MAX_ROUNDS)):
        if not 1 <= count <= most:
            return f"{flag} must be >= 1 and at most {most}, got {count}"
    if not 0 < size_mb <= _MAX_SIZE_MB:  # false for nan as well
        return f"--size-mb must be a number of MB > 0 and at most {_MAX_SIZE_MB:g}, got {size_mb:g}"
    bucket = bucket_mb * (1 << 20)
    if not (math.isfinite(bucket) and 1 <= int(bucket) < 2**63):  # EngineConfig.bucket_bytes
        return (f"--bucket-mb must be at least one byte (2**-20 MiB) and below 2**63 bytes, "
                f"got {bucket_mb:g}")
    if not 0 < round_timeout <= _MAX_ROUND_TIMEOUT:
        return (f"--round-timeout must be a number of seconds > 0 and at most "
                f"{_MAX_ROUND_TIMEOUT:g}, got {round_timeout:g}")
    params = demo_model(size_mb, trainers, workers)  # shapes only: nothing is allocated
    # A lower bound of what the ranks hold together: each its own shards, a replicated tensor
    # whole on every rank of its side (the verification's recomputation comes on top).
    held = sum(p.nbytes * ((trainers if p.src is None else 1) + (workers if p.dst is None else 1))
               for p in params)
    memory = _host_memory()
    if memory is None or held <= memory:
        return None
    model = sum(p.nbytes for p in params)
    why = ""
    if model > 2 * size_mb * _MB:  # rounded up far past the request: say why it cannot shrink
        step = 16 * math.lcm(trainers, workers)
        why = (f" (its hidden size is a multiple of 16 x lcm({trainers}, {workers}) = {step}, "
               f"so no --size-mb makes it smaller; fewer ranks or counts sharing factors do)")
    return (f"--trainers {trainers}, --workers {workers} and --size-mb {size_mb:g} make a "
            f"model of {model / _MB:.0f} MB whose shards the processes hold as "
            f"{held / 1e9:.1f} GB together, more than this host's {memory / 1e9:.1f} GB of "
            f"memory{why}")


def _host_memory() -> int | None:
    """This host's physical memory in bytes; None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # a name unknown here, or no sysconf
        return None


def _parent(trainers: int, workers: int, rounds: int, size_mb: float, transport: str,
            limit_s: float, round_timeout: float, bucket_mb: float, out: Any, err: Any
            ) -> str | None:
    """Run the job; return None on success, else the failure (named ranks)."""
    from m2n_async.testing import LocalWorld

    params = demo_model(size_mb, trainers, workers)
    plan = demo_plan(params, trainers, workers)
    total = sum(plan.recv_bytes(r) for r in range(trainers, trainers + workers))
    shapes = sum(1 for p in params if ".small." not in p.name)
    print(f"m2n-async demo: {trainers} trainer + {workers} worker processes, {transport} "
          f"transport, {rounds} round{'s' if rounds > 1 else ''}", file=out)
    print(f"model: {len(params)} tensors ({shapes} large + {len(params) - shapes} small), "
          f"{sum(p.nbytes for p in params) / _MB:.1f} MB; {total / _MB:.1f} MB received by "
          f"the workers per round", file=out)
    print(f"starting {trainers + workers} processes (each imports torch and computes its "
          f"shards) ...", file=out)
    out.flush()
    spawned_at = time.time()  # the ranks' Ready events are on this clock
    # Leaving the block ends every rank process: one still in the job is killed.
    with LocalWorld(trainers, workers, job_prefix="demo") as world:
        args = DemoArgs(trainers, workers, rounds, size_mb, transport, world.address,
                        world.token, f"demo-{secrets.token_hex(4)}", round_timeout,
                        phase_timeout=min(60.0, round_timeout), bucket_mb=bucket_mb)
        try:
            _monitor(world, args, total, limit_s, _display(err, out), spawned_at)
        except DemoFailed as exc:
            return str(exc)
    return None


def _show_stacks(results: Sequence[RankResult]) -> None:
    """The Python stacks of the ranks the world killed still running (taken just before the
    kill, every thread): a hung rank then shows where it hung."""
    stuck = [r for r in results if r.status in ("killed", "frozen") and r.stacks]
    if not stuck:
        return
    names = ", ".join(f"m2n-demo-rank{r.rank}" for r in stuck)
    print(f"m2n-async demo: {names} still running at the end; their Python stacks follow, "
          "then they are killed", file=sys.stderr, flush=True)
    for r in stuck:
        sys.stderr.write(r.stacks)
    sys.stderr.flush()


def _error_text(exc: BaseException | None) -> str:
    tail = f"{type(exc).__name__}: {exc}"
    return tail if isinstance(exc, Exception) else f"{tail} (interrupted)"


def _monitor(world: LocalWorld, args: DemoArgs, total: int, limit_s: float, bar: _Display,
             spawned_at: float) -> None:
    from m2n_async.testing import WorldHangError

    started = time.monotonic()
    deadline = started + limit_s
    ready: dict[int, Ready] = {}
    failures: dict[int, str] = {}
    reports: dict[int, dict[int, RoundReport]] = {}
    progress: dict[int, dict[int, int]] = {}
    current = 1
    run = world.start(_demo_rank, kwargs={"args": args}, job=args.job)
    try:
        # Until every rank ended, _FAIL_GRACE after the first failure, or the deadline.
        for msg in world.events(run, timeout=limit_s, fail_grace=_FAIL_GRACE):
            if msg.name != "demo":
                continue
            ev = _decoder.decode(msg.payload)
            if isinstance(ev, Ready):
                ready[ev.rank] = ev
                if len(ready) == args.world:
                    bar.line(_connected_line(ready, spawned_at))
            elif isinstance(ev, Progress) and ev.rank >= args.trainers and ev.round == current:
                progress.setdefault(ev.round, {})[ev.rank] = ev.done
                done = sum(progress[ev.round].values())
                bar.progress(ev.round, args.rounds, done, total)
            elif isinstance(ev, RoundReport):
                reports.setdefault(ev.round, {})[ev.rank] = ev
                if ev.mismatched:
                    failures[ev.rank] = (f"round {ev.round}: {len(ev.mismatched)} of "
                                         f"{ev.checked} tensors differ from the "
                                         f"recomputation, e.g. {list(ev.mismatched[:5])}")
                    world.mark_failed()  # the grace runs from here, as from an error
                while len(reports.get(current, {})) == args.world:
                    _print_round(args, reports[current], total, bar)
                    current += 1
    except DemoFailed:
        # The round's count disagrees with the plan: 5 s for the ranks to end, then stacks.
        world.mark_failed()
        try:
            _show_stacks(world.collect(run, timeout=max(0.0, deadline - time.monotonic()),
                                       fail_grace=5.0))
        except WorldHangError as exc:
            _show_stacks(exc.results)
        raise
    hung = False
    results: Sequence[RankResult]
    try:
        results = world.collect(run, timeout=max(0.0, deadline - time.monotonic()),
                                fail_grace=_FAIL_GRACE)
    except WorldHangError as exc:  # the deadline: reported with what the others said
        results, hung = exc.results, True
    _show_stacks(results)
    for r in results:
        if r.status == "error":
            failures[r.rank] = _error_text(r.error)
            if os.environ.get("M2N_DEMO_TRACEBACK"):
                print(f"rank {r.rank}:\n{r.traceback}", file=sys.stderr, flush=True)
        elif r.status == "dead":
            failures.setdefault(r.rank, f"process exited with code {r.exitcode} without "
                                        f"reporting an error (killed or crashed)")
        elif r.status != "ok":
            # Still running when the grace or the deadline ran out: killed, say so (a
            # trainer's round error names the rank it waited for).
            failures.setdefault(r.rank, (
                f"still running when the demo's deadline of {limit_s:.0f} s passed (killed)"
                if hung else f"no report within {_FAIL_GRACE:.0f} s of the first failure "
                             f"(killed)"))
    if failures:
        # Every rank of a failed round raises the same error: say it once, naming them all.
        by_message: dict[str, list[int]] = {}
        for rank, m in sorted(failures.items()):
            by_message.setdefault(m, []).append(rank)
        lines = [f"{_ranks(rs, args.trainers)}: {m}" for m, rs in by_message.items()]
        raise DemoFailed("\n  " + "\n  ".join(lines))
    if current <= args.rounds:
        raise DemoFailed(f"only {current - 1} of {args.rounds} rounds were reported")
    bar.line(f"OK: {args.rounds} round{'s' if args.rounds > 1 else ''}, "
             f"{_per_worker(args)}: every tensor bit-exact every round "
             f"({time.monotonic() - started:.1f} s in all)")


def _per_worker(args: DemoArgs) -> str:
    """``"per worker rank (2, 3)"``: each worker checks its own shards, so every count the
    demo prints is one worker's, not a sum."""
    ranks = ", ".join(map(str, range(args.trainers, args.world)))
    return f"worker rank {ranks}" if args.workers == 1 else f"per worker rank ({ranks})"


def _connected_line(ready: dict[int, Ready], spawned_at: float) -> str:
    """Process start and the handshake apart (the first dominates on a small host): the
    processes are up once the last one called ``connect`` (spawned, torch imported, its
    shards built); the handshake runs from then until the last ``connect`` returned (a rank
    that called earlier waited in it for the others to start, which is not the handshake's
    time)."""
    up = max(r.connecting_at for r in ready.values())
    done = max(r.connected_at for r in ready.values())
    t = ready[0]
    return (f"connected: processes up in {max(up - spawned_at, 0.0):.1f} s (spawn, import "
            f"torch, build shards), handshake {max(done - up, 0.0):.1f} s; generation "
            f"{t.generation}, transport {t.transport} ({t.reason})")


def _ranks(ranks: Sequence[int], trainers: int) -> str:
    roles = {"trainer" if r < trainers else "worker" for r in ranks}
    if len(ranks) == 1:
        return f"rank {ranks[0]} ({roles.pop()})"
    role = f"{roles.pop()}s" if len(roles) == 1 else "trainers and workers"
    return f"ranks {', '.join(map(str, ranks))} ({role})"


def _print_round(args: DemoArgs, reps: dict[int, RoundReport], total: int,
                 bar: _Display) -> None:
    k = next(iter(reps.values())).round
    workers = [reps[r] for r in range(args.trainers, args.world)]
    got = sum(w.bytes for w in workers)
    if got != total:
        raise DemoFailed(f"round {k}: workers received {got} bytes, the plan says {total}")
    seconds = max(r.seconds for r in reps.values())
    versions = {r.version for r in reps.values()}
    counts = [w.checked - len(w.mismatched) for w in workers]
    # Each worker checks its own shard of every tensor: one count per worker rank, never a
    # sum that reads like one tensor list split in parts.
    verified = (f"{_per_worker(args)}: {counts[0]} tensors bit-exact" if len(set(counts)) == 1
                else "tensors bit-exact per worker rank: " + ", ".join(
                    f"rank {w.rank} {c}" for w, c in zip(workers, counts, strict=True)))
    bar.line(f"round {k}/{args.rounds}: version {min(versions)}, {got / _MB:7.1f} MB in "
             f"{seconds:6.2f} s = {got / seconds / 1e9:5.2f} GB/s; {verified}")


# -- the command -----------------------------------------------------------------------------


def add_demo_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``demo`` on the ``m2n-async`` subparsers."""
    p = sub.add_parser(
        "demo", help="sync weights between local trainer and worker processes, bit-exact",
        description="Spawn trainer and worker processes on this machine (CPU, Gloo by "
                    "default), build a synthetic transformer-shaped model with mixed layouts, "
                    "run several rounds with changing weights and verify every worker's "
                    "tensors bit-exact. Exit status: 0 verified, 1 mismatch or failure, 2 bad "
                    "option, 130 interrupted.")
    p.add_argument("--trainers", type=int, default=2,
                   help=f"trainer processes (default 2, at most {_MAX_RANKS})")
    p.add_argument("--workers", type=int, default=2,
                   help=f"worker processes (default 2, at most {_MAX_RANKS})")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--size-mb", type=float, default=350.0,
                   help="model size in MB (10^6 bytes; default 350); refused when the "
                        "processes would hold more than this host's memory")
    p.add_argument("--transport", choices=(*LANES, AUTO), default="gloo",
                   help="data plane (default gloo; auto picks the best available)")
    p.add_argument("--bucket-mb", type=float, default=64.0,
                   help="bucket size in MiB (default 64)")
    p.add_argument("--round-timeout", type=float, default=120.0,
                   help="seconds a round may take before it is aborted (default 120, at "
                        f"most {_MAX_ROUND_TIMEOUT:g})")


def run_demo_command(args: argparse.Namespace) -> int:
    """Run ``m2n-async demo``; returns the exit status."""
    return run_demo(trainers=args.trainers, workers=args.workers, rounds=args.rounds,
                    size_mb=args.size_mb, transport=args.transport, bucket_mb=args.bucket_mb,
                    round_timeout=args.round_timeout)
