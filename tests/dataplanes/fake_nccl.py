"""FAKE ``nccl.core`` / ``nccl.m2n`` for CPU tests of the GPU data planes (not NVIDIA code).

Every rank of a test world runs in one process (one thread per rank's native thread), so the
fake can check what real NCCL cannot: that every rank issues the *same* M2N calls in the same
order with identical metadata (real M2N would hang on a mismatch; the fake raises), that a
send meets a receive of the same size, and that aborted communicators are never used again.

Semantics kept from the real libraries (DEVELOPERS "GPU notes"): ``nccl.core.group()`` defers
point-to-point calls to the group end; ``nccl.m2n.group()`` records reshards and submits them
at exit — or, with ``world.fail_groups`` (a GIN-less host), raises ``NcclReshardError`` at the
end of any group of two or more entries on every rank, leaving the communicator usable.
Buffers are CPU torch tensors; streams are ignored (``stream`` must be an int, like the raw
pointers the transports pass).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import queue
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

TIMEOUT = 20.0


class FakeNcclError(RuntimeError):
    pass


class NcclReshardError(FakeNcclError):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"NCCL Reshard error code {status}: {detail}")
        self.status = status
        self.detail = detail


@dataclass
class _Slot:
    meta: tuple[Any, ...] | None = None
    srcs: dict[int, torch.Tensor] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)


class FakeWorld:
    """Shared state of one fake job: p2p channels and M2N collective slots per communicator."""

    def __init__(self, *, fail_groups: bool = False, fail_group_ranks: set[int] | None = None,
                 libnccl: str = "2.30.7") -> None:
        self.fail_groups = fail_groups
        self.fail_group_ranks = fail_group_ranks  # None: every rank (when fail_groups)
        self.libnccl = libnccl
        self.timeout = TIMEOUT  # how long a fake collective waits for its peers
        self.lock = threading.Lock()
        self.channels: dict[tuple[bytes, int, int], queue.Queue[torch.Tensor]] = {}
        self.slots: dict[tuple[bytes, int], _Slot] = {}
        self.aborted: set[bytes] = set()
        self.reshard_calls: dict[int, int] = {}   # rank -> number of native reshards
        self.group_sizes: list[int] = []
        self.sends: dict[int, int] = {}          # rank -> bytes sent
        self.comms: list[Comm] = []

    def channel(self, uid: bytes, src: int, dst: int) -> queue.Queue[torch.Tensor]:
        with self.lock:
            return self.channels.setdefault((uid, src, dst), queue.Queue())

    def slot(self, uid: bytes, seq: int) -> _Slot:
        with self.lock:
            return self.slots.setdefault((uid, seq), _Slot())


WORLD: FakeWorld | None = None
_tls = threading.local()


def _world() -> FakeWorld:
    assert WORLD is not None, "fake nccl used without a FakeWorld installed"
    return WORLD


# -- nccl.core ------------------------------------------------------------------------------


class _LibInfo:
    def __init__(self, version: str) -> None:
        self.version = version
        self.path = "/fake/libnccl.so.2"


class _Version:
    def __init__(self, version: str) -> None:
        self.libnccl = _LibInfo(version)


def get_version() -> _Version:
    return _Version(_world().libnccl)


class UniqueId:
    def __init__(self, b: bytes) -> None:
        self.as_bytes = bytes(b)

    @staticmethod
    def from_bytes(b: bytes) -> UniqueId:
        return UniqueId(b)


def get_unique_id() -> UniqueId:
    return UniqueId(os.urandom(128))


class Comm:
    def __init__(self, nranks: int, rank: int, uid: bytes) -> None:
        self.nranks, self.rank, self.uid = nranks, rank, uid
        self.valid = True
        self.m2n_seq = 0
        _world().comms.append(self)

    @classmethod
    def init(cls, nranks: int, rank: int, unique_id: UniqueId, config: Any = None) -> Comm:
        return cls(nranks, rank, unique_id.as_bytes)

    def _check(self) -> None:
        if not self.valid:
            raise FakeNcclError(f"communicator of rank {self.rank} was aborted")

    def send(self, buf: torch.Tensor, peer: int, *, stream: int | None = None) -> None:
        self._check()
        assert isinstance(stream, int), "transports pass raw stream pointers"
        assert buf.is_contiguous()
        op = ("send", self, buf, peer)
        ops = getattr(_tls, "p2p_group", None)
        if ops is not None:
            ops.append(op)
        else:
            _run_p2p([op])

    def recv(self, buf: torch.Tensor, peer: int, *, stream: int | None = None) -> None:
        self._check()
        assert isinstance(stream, int)
        assert buf.is_contiguous()
        op = ("recv", self, buf, peer)
        ops = getattr(_tls, "p2p_group", None)
        if ops is not None:
            ops.append(op)
        else:
            _run_p2p([op])

    def abort(self) -> None:
        _world().aborted.add(self.uid)
        self.valid = False

    def destroy(self) -> None:
        self.valid = False


Communicator = Comm


def _run_p2p(ops: list[tuple[str, Comm, torch.Tensor, int]]) -> None:
    w = _world()
    for kind, comm, buf, peer in ops:  # sends never block: post them all first
        if kind == "send":
            w.channel(comm.uid, comm.rank, peer).put(buf.clone())
            w.sends[comm.rank] = w.sends.get(comm.rank, 0) + buf.numel() * buf.element_size()
    for kind, comm, buf, peer in ops:
        if kind != "recv":
            continue
        ch = w.channel(comm.uid, peer, comm.rank)
        waited = 0.0
        while True:
            try:
                data = ch.get(timeout=0.05)
                break
            except queue.Empty:
                comm._check()
                waited += 0.05
                if waited > w.timeout:
                    raise FakeNcclError(f"rank {comm.rank}: recv from {peer} timed out") from None
        if data.numel() != buf.numel() or data.dtype != buf.dtype:
            raise FakeNcclError(f"rank {comm.rank}: recv of {buf.numel()} x {buf.dtype} from "
                                f"{peer} met a send of {data.numel()} x {data.dtype}")
        buf.copy_(data)


@contextlib.contextmanager
def core_group() -> Iterator[None]:
    outer = getattr(_tls, "p2p_group", None)
    if outer is not None:
        yield
        return
    _tls.p2p_group = []
    try:
        yield
        ops = _tls.p2p_group
    finally:
        _tls.p2p_group = None
    _run_p2p(ops)


# -- nccl.m2n -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class Shard:
    dim: int


class Mesh:
    def __init__(self, dims: tuple[int, ...], start_rank: int = 0) -> None:
        self.dims = tuple(int(d) for d in dims)
        self.start_rank = int(start_rank)

    @property
    def size(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n

    def key(self) -> tuple[Any, ...]:
        return (self.dims, self.start_rank)


@dataclass(frozen=True)
class Config:
    max_cta: int | None = None


class DistTensor:
    """A buffer is a contiguous tensor, or a raw pointer (an int, with ``local_shape`` and
    ``dtype`` given), as the real ``DistTensor`` takes; None: the side this rank takes no
    part in. A raw pointer is read when the reshard runs, as the real one is on the GPU."""

    def __init__(self, buffer: Any, local_shape: tuple[int, ...], dtype: Any, *, mesh: Mesh,
                 placements: tuple[Any, ...]) -> None:
        if isinstance(buffer, int):
            assert buffer > 0, f"raw pointer {buffer}"
        elif buffer is not None:
            assert buffer.is_contiguous(), "M2N buffers must be contiguous"
            assert tuple(buffer.shape) == tuple(local_shape), (buffer.shape, local_shape)
            assert buffer.dtype == dtype, (buffer.dtype, dtype)
        self.buffer = buffer
        self.local_shape = tuple(local_shape)
        self.dtype = dtype
        self.mesh = mesh
        self.placements = tuple(placements)

    def key(self) -> tuple[Any, ...]:
        return (self.local_shape, str(self.dtype), self.mesh.key(), self.placements)

    def tensor(self) -> torch.Tensor:
        """The buffer as a CPU tensor of ``local_shape`` (a raw pointer: the memory there)."""
        if not isinstance(self.buffer, int):
            return self.buffer
        nbytes = self.dtype.itemsize * math.prod(self.local_shape)
        raw = (ctypes.c_char * nbytes).from_address(self.buffer)
        return torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype).view(self.local_shape)


def _box(global_shape: tuple[int, ...], d: DistTensor, rank: int) -> tuple[slice, ...]:
    idx = rank - d.mesh.start_rank
    dims = d.mesh.dims
    coords = (idx // dims[1], idx % dims[1]) if len(dims) == 2 else (idx,)
    sl = [slice(0, n) for n in global_shape]
    for axis, p in enumerate(d.placements):
        if isinstance(p, Shard):
            step = d.local_shape[p.dim]
            sl[p.dim] = slice(coords[axis] * step, (coords[axis] + 1) * step)
    return tuple(sl)


def _global_shape(d: DistTensor) -> tuple[int, ...]:
    shape = list(d.local_shape)
    for axis, p in enumerate(d.placements):
        if isinstance(p, Shard):
            shape[p.dim] *= d.mesh.dims[axis]
    return tuple(shape)


def _reshard_now(comm: Comm, src: DistTensor, dst: DistTensor) -> None:
    comm._check()
    w = _world()
    seq = comm.m2n_seq
    comm.m2n_seq += 1
    w.reshard_calls[comm.rank] = w.reshard_calls.get(comm.rank, 0) + 1
    meta = (src.key(), dst.key())
    slot = w.slot(comm.uid, seq)
    in_src = src.mesh.start_rank <= comm.rank < src.mesh.start_rank + src.mesh.size
    in_dst = dst.mesh.start_rank <= comm.rank < dst.mesh.start_rank + dst.mesh.size
    if in_src != (src.buffer is not None) or in_dst != (dst.buffer is not None):
        raise FakeNcclError(f"rank {comm.rank}: reshard #{seq}: buffer presence does not "
                            f"match mesh membership (src {in_src}, dst {in_dst})")
    with slot.cond:
        if slot.meta is None:
            slot.meta = meta
        elif slot.meta != meta:
            raise FakeNcclError(f"rank {comm.rank}: reshard #{seq} metadata {meta} differs "
                                f"from another rank's {slot.meta} (real M2N would hang)")
        if in_src:
            slot.srcs[comm.rank] = src.tensor().clone()
            slot.cond.notify_all()
        if in_dst:
            gshape = _global_shape(src)
            ok = False
            waited = 0.0
            while not ok and waited < w.timeout:  # wake up now and then to notice an abort
                ok = slot.cond.wait_for(lambda: len(slot.srcs) == src.mesh.size, timeout=0.05)
                comm._check()
                waited += 0.05
            comm._check()
            if not ok:
                raise FakeNcclError(f"rank {comm.rank}: reshard #{seq} timed out")
            full = torch.empty(gshape, dtype=src.dtype)
            for r, buf in slot.srcs.items():
                full[_box(gshape, src, r)] = buf
            dst.tensor().copy_(full[_box(gshape, dst, comm.rank)])


class Handle:
    def __init__(self) -> None:
        self.destroyed = False

    @classmethod
    def create(cls, config: Config | None = None) -> Handle:
        return cls()

    def reshard(self, comm: Comm, src: DistTensor, dst: DistTensor, *,
                stream: int | None = None) -> None:
        assert not self.destroyed
        assert isinstance(stream, int)
        entries = getattr(_tls, "m2n_group", None)
        if entries is not None:
            entries.append((comm, src, dst))
        else:
            _reshard_now(comm, src, dst)

    def destroy(self) -> None:
        self.destroyed = True


def group_start() -> None:
    if getattr(_tls, "m2n_group", None) is None:
        _tls.m2n_group = []
        _tls.m2n_depth = 0
    _tls.m2n_depth += 1


def group_abort() -> None:
    _tls.m2n_group = None
    _tls.m2n_depth = 0


def group_end() -> None:
    _tls.m2n_depth -= 1
    if _tls.m2n_depth > 0:
        return
    entries, _tls.m2n_group = _tls.m2n_group, None
    w = _world()
    rank = entries[0][0].rank if entries else -1
    if len(entries) >= 2 and w.fail_groups and (
            w.fail_group_ranks is None or rank in w.fail_group_ranks):
        raise NcclReshardError(4, f"ncclM2nGroupEnd: entry {len(entries) - 1} of "
                                  f"{len(entries)} failed: fake GIN-less host")
    w.group_sizes.append(len(entries))
    for comm, src, dst in entries:
        _reshard_now(comm, src, dst)


@contextlib.contextmanager
def m2n_group() -> Iterator[None]:
    group_start()
    try:
        yield
    except BaseException:
        group_abort()
        raise
    group_end()


# -- installation ---------------------------------------------------------------------------


def install(world: FakeWorld) -> dict[str, types.ModuleType | None]:
    """Put fake ``nccl``, ``nccl.core`` and ``nccl.m2n`` into ``sys.modules``; returns the
    previous entries for ``uninstall``."""
    global WORLD
    WORLD = world
    saved = {name: sys.modules.get(name) for name in ("nccl", "nccl.core", "nccl.m2n")}
    pkg = types.ModuleType("nccl")
    pkg.__path__ = []  # a package
    core = types.ModuleType("nccl.core")
    core.__dict__.update(get_version=get_version, get_unique_id=get_unique_id,
                         UniqueId=UniqueId, Communicator=Communicator, group=core_group)
    m2n = types.ModuleType("nccl.m2n")
    m2n.__dict__.update(Mesh=Mesh, DistTensor=DistTensor, Replicate=Replicate, Shard=Shard,
                        Config=Config, Handle=Handle, group=m2n_group,
                        group_start=group_start, group_end=group_end,
                        group_abort=group_abort, NcclReshardError=NcclReshardError)
    pkg.core = core  # type: ignore[attr-defined]
    pkg.m2n = m2n  # type: ignore[attr-defined]
    sys.modules.update({"nccl": pkg, "nccl.core": core, "nccl.m2n": m2n})
    return saved


def uninstall(saved: dict[str, types.ModuleType | None]) -> None:
    global WORLD
    WORLD = None
    for name, mod in saved.items():
        if mod is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = mod
