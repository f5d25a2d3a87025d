"""Multi-tensor copies on CUDA: many same-shape pieces in one Triton launch.

Theory of operation. Packing a stack of 1024 experts, scattering it into 1024 targets, and
packing 1024 strided column blocks for a peer are each "copy n pieces of one geometry". The
obvious tool, ``torch._foreach_copy_``, costs ~0.5 ms for 1024 contiguous 128 KiB pieces
on an H200 and falls back to one launch per piece for strided ones (8.3 ms for 1024 column
blocks of (256, 256) shards), while one kernel that reads every piece through a table of
base pointers moves the same bytes in 0.07 ms (``bench/gpu_strided_copy.py``; BENCHMARKS
"GPU sync", strided pieces). So where Triton is installed (an optional, GPU-only
dependency), ``copy_many`` launches one such kernel per group of pieces that share shape,
row strides and dtypes; everything else — CPU tensors, no Triton, mixed shapes, more than
two dims, a dtype pair the kernel does not convert exactly — returns False and the caller
runs ``torch._foreach_copy_`` as before.

Exactness. Equal dtypes are copied as same-width integers (bits, never a float round trip).
A float cast (fp32 / bf16 / fp16 / fp64 to another of them) must give the bytes of
``Tensor.to``: the first use of each dtype pair in a process runs the kernel and torch on
ties, subnormals, infinities, NaNs and -0 and turns the pair off if a single bit differs.

Access width. Contiguous pieces (stack members, separate parameters, targets) are copied
as one run of elements each ("flat"); only strided pieces split every offset into row and
column, an integer division per element. Addresses read from a table have no alignment the
compiler can see, so every access would be one element wide; ``pointer_table`` records the
alignment common to all its addresses (``PointerTable.align``) and the kernel is told it,
which lets 16-byte aligned pieces move in 16-byte accesses (``bench/gpu_copy_kernel.py``
times each form side by side).

The pointer tables live on the device (one int64 per piece); callers that copy the same
pieces every round (a stack's member views, a worker's fixed targets) build them once with
``pointer_table`` and pass them in. A table and the pieces must stay referenced until the
copy ran on the stream (the transports keep them with the staging).
"""

from __future__ import annotations

import array
import operator
import threading
import time
from collections.abc import Sequence
from functools import reduce
from typing import Any, NamedTuple

__all__ = ["MIN_PIECES", "WARM_BUDGET_S", "WARM_MAX_BYTES", "Form", "PointerTable", "address_align",
           "available", "compiled_variants", "contiguous_strides", "copy_many", "pointer_table",
           "uniform_pieces", "warm_forms", "warm_up"]

#: Fewer pieces than this: ``_foreach_copy_`` costs about the same, skip the launch.
MIN_PIECES = 8
#: ``warm_forms`` skips a form whose scratch piece would be larger than this.
WARM_MAX_BYTES = 64 << 20
#: ``warm_forms`` starts no form after this many seconds (a compile takes ~40 ms on the
#: H200 host): what it leaves compiles in a round, and connect stays bounded.
WARM_BUDGET_S = 10.0
_BLOCK = 1024
_WARPS = 4

_lock = threading.Lock()
_state: dict[str, Any] = {}        # "kernel": the jitted kernel, or None if unavailable
_pairs: dict[tuple[Any, Any], bool] = {}   # (src dtype, dst dtype) -> exact cast


def _kernel() -> Any:
    with _lock:
        if "kernel" in _state:
            return _state["kernel"]
        try:
            import triton
            import triton.language as tl

            # Triton reads the parameters' annotations (tl.constexpr): no others here.
            @triton.jit  # type: ignore[untyped-decorator]
            def copy(src_ptrs, dst_ptrs, n, rows, cols, sstride, dstride,  # type: ignore[no-untyped-def]
                     BLOCK: tl.constexpr, SRC: tl.constexpr, DST: tl.constexpr,
                     FLAT: tl.constexpr, ALIGN: tl.constexpr):
                p = tl.program_id(0)
                offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
                mask = offs < n
                src = tl.load(src_ptrs + p).to(tl.pointer_type(SRC))
                dst = tl.load(dst_ptrs + p).to(tl.pointer_type(DST))
                if ALIGN > 1:
                    # addresses read from a table have no known alignment: without the
                    # caller's word on it every access is one element wide
                    src = tl.multiple_of(src, ALIGN)
                    dst = tl.multiple_of(dst, ALIGN)
                if FLAT:  # contiguous pieces: no per-element division into row and column
                    x = tl.load(src + offs, mask=mask)
                    tl.store(dst + offs, x.to(DST), mask=mask)
                else:
                    r = offs // cols
                    c = offs % cols
                    x = tl.load(src + r * sstride + c, mask=mask)
                    tl.store(dst + r * dstride + c, x.to(DST), mask=mask)

            _state["kernel"] = (copy, triton, tl)
        except Exception:  # Triton absent or broken: the caller's fallback is exact anyway
            _state["kernel"] = None
        return _state["kernel"]


def available() -> bool:
    """True when the Triton kernel can be used in this process (CUDA tensors only)."""
    return _kernel() is not None


def compiled_variants() -> int | None:
    """How many variants of the kernel this process holds compiled (None without Triton):
    what a test or bench compares before and after rounds to see a compile in a round."""
    got = _kernel()
    if got is None:
        return None
    fn = got[0]
    caches = getattr(fn, "device_caches", None)
    if caches is not None:  # Triton 3.x: device -> (kernel cache, ...)
        return sum(len(v[0]) for v in caches.values())
    return sum(len(v) for v in getattr(fn, "cache", {}).values())


def _tl_type(tl: Any, dtype: Any, bits: bool) -> Any:
    import torch

    if bits:  # same dtype on both sides: copy the bits as integers of its width
        return {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}.get(dtype.itemsize)
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
            torch.float16: tl.float16, torch.float64: tl.float64}.get(dtype)


def _geometry(t: Any) -> tuple[int, int, int] | None:
    """(rows, cols, row stride) of a piece the kernel can address, else None."""
    if t.dim() == 0:
        return 1, 1, 1
    if t.dim() == 1:
        return (1, t.shape[0], t.shape[0]) if t.stride(0) == 1 or t.shape[0] == 1 else None
    if t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] == 1):
        return t.shape[0], t.shape[1], t.stride(0)
    return None


def uniform_pieces(tensors: Sequence[Any]) -> bool:
    """Do all ``tensors`` share the first one's dtype, CUDA device, shape and strides, in a
    geometry the kernel addresses? (What ``copy_many(..., uniform=True)`` assumes; a caller
    that copies the same pieces every round checks it once.)"""
    t0 = tensors[0]
    if not getattr(t0, "is_cuda", False) or _geometry(t0) is None:
        return False
    key = (t0.dtype, t0.device, t0.shape, t0.stride())
    return all((t.dtype, t.device, t.shape, t.stride()) == key for t in tensors)


class PointerTable(NamedTuple):
    """The pieces' base addresses on the device, and the largest power of two (up to 16
    bytes) that divides every one of them: the widest access the kernel may assume."""

    table: Any
    align: int


def address_align(ptrs: Sequence[int]) -> int:
    """The largest power of two up to 16 that divides every address in ``ptrs``."""
    x = reduce(operator.or_, ptrs, 16)  # 16 caps the answer
    return x & -x


def pointer_table(tensors: Sequence[Any], device: Any,
                  ptrs: Sequence[int] | None = None) -> PointerTable:
    """The pieces' base addresses as a device int64 tensor (for ``copy_many``); ``ptrs``:
    those addresses, when the caller has read them already."""
    import torch

    if ptrs is None:
        ptrs = list(map(torch.Tensor.data_ptr, tensors))  # the C method: no frame per piece
    # through an array: half torch.tensor(list)'s cost for 1024 addresses (the tensor keeps
    # the array alive)
    host = torch.frombuffer(array.array("q", ptrs), dtype=torch.int64)
    if torch.device(device).type == "cuda":
        # Pinned: an upload from pageable memory may synchronize with the current stream
        # (CUDA's API sync behavior), blocking this thread — the event loop — until the
        # stream's earlier work is done: the producer's kernels a pack waits for, the
        # transfer an unpack waits for (which never ends if a peer died). From pinned
        # memory it is queued; torch's host allocator keeps the block until it ran.
        host = host.pin_memory()
    return PointerTable(host.to(device, non_blocking=True), address_align(ptrs))


def _exact(src_dtype: Any, dst_dtype: Any, device: Any) -> bool:
    """Does the kernel cast ``src_dtype`` -> ``dst_dtype`` exactly as ``Tensor.to``?"""
    import torch

    key = (src_dtype, dst_dtype)
    got = _pairs.get(key)
    if got is not None:
        return got
    specials = [0.0, -0.0, 1.0, -1.0, 1.00390625, 1.01171875, 3.0e38, -3.0e38, 6.0e-8,
                1.0e-40, -1.0e-40, 1.0e-45, 65504.0, 65520.0, 1.0e-5, 3.14159265]
    special = torch.tensor(specials, dtype=torch.float64)
    special = torch.cat([special, torch.tensor([float("inf"), float("-inf"), float("nan")],
                                               dtype=torch.float64)])
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int32, generator=gen)
    values = torch.cat([special.to(src_dtype),
                        raw.view(torch.float32).to(src_dtype)]).to(device)
    values = values.reshape(1, -1)
    want = values.to(dst_dtype)
    out = torch.empty_like(want)
    ok = False
    # On a stream of its own, synchronized alone: a device-wide sync here would wait for
    # every kernel in flight, an M2N reshard towards a dead peer among them.
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            launched = _launch([out], [values], device, check=False)
        if launched:
            side.synchronize()
            ok = bool(torch.equal(out.view(torch.uint8), want.view(torch.uint8)))
    except Exception:
        ok = False
    _pairs[key] = ok
    return ok


def warm_up(device: Any, wire_dtypes: Sequence[Any]) -> None:
    """Compile the kernel for ``wire_dtypes`` and self-test the usual casts into them (from
    fp32 and bf16), off the event loop and before any round: Triton compiles on first
    launch (then caches on disk), which would otherwise stall the first round's packing."""
    import torch

    if _kernel() is None:
        return
    try:
        with torch.cuda.device(device):
            _warm(device, wire_dtypes)
    except Exception:  # a kernel that fails here is not used at all (the fallback is exact)
        with _lock:
            _state["kernel"] = None


def _warm(device: Any, wire_dtypes: Sequence[Any]) -> None:
    import torch

    for wire in dict.fromkeys(wire_dtypes):
        # both forms, 16-byte aligned pieces (what stacks, targets and staging are): the
        # flat one for contiguous pieces, the row/column one for column blocks
        x = torch.zeros(MIN_PIECES, 2, 16, dtype=wire, device=device)
        y = x.clone()
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(side):
            _launch(list(x.unbind(0)), list(y.unbind(0)), device)
            _launch([p[:, :8] for p in x.unbind(0)], [p[:, :8] for p in y.unbind(0)], device)
        side.synchronize()
        if wire in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for src in (torch.float32, torch.bfloat16):
                if src != wire:
                    _exact(src, wire, device)


class Form(NamedTuple):
    """One kind of copy ``copy_many`` will be asked for: the pieces' dtypes, their shape,
    each side's strides, and the alignment in bytes (a power of two up to 16) that every
    address on both sides shares.

    Triton compiles one variant of the kernel per dtype pair, flat or row/column form,
    alignment, and pattern of which integer arguments (elements, rows, columns, row
    strides) are 1 or multiples of 16. A variant first needed in a round is compiled in
    that round, on the event loop (0.1-1 s each). Pieces of one form need the same
    variant, so a lane that knows its forms at connect has ``warm_forms`` compile them
    then."""

    src: Any
    dst: Any
    shape: tuple[int, ...]
    src_stride: tuple[int, ...]
    dst_stride: tuple[int, ...]
    align: int


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``, in elements."""
    out = []
    acc = 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return tuple(reversed(out))


def _elements(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements from a piece's first to its last one, inclusive (0 for an empty piece)."""
    if any(d == 0 for d in shape):
        return 0
    return 1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))


def warm_forms(device: Any, forms: Sequence[Form], budget_s: float = WARM_BUDGET_S) -> int:
    """Compile the kernel variants ``forms`` need: one launch of each over scratch memory
    (one piece per side, at the form's alignment), on a stream of its own, starting none
    after ``budget_s`` seconds. Run it off the event loop (the lanes call it at connect, on
    a thread). Returns the forms launched.

    A form the kernel does not take (``copy_many`` would fall back for it too), a cast
    that is not exact, or a scratch piece over ``WARM_MAX_BYTES`` is skipped. An error
    stops the warming and is swallowed: the round's own launch decides, and falls back."""
    import torch

    if not forms or _kernel() is None:
        return 0
    done = 0
    stop = time.monotonic() + budget_s
    try:
        with torch.cuda.device(device):
            # every scratch buffer is allocated and freed on this stream: the allocator
            # reuses a block for the next form only after this stream's earlier launch
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            for f in dict.fromkeys(forms):
                if time.monotonic() > stop:
                    break
                if f.src != f.dst and not _exact(f.src, f.dst, device):
                    continue
                src_n = _elements(f.shape, f.src_stride) * f.src.itemsize
                dst_n = _elements(f.shape, f.dst_stride) * f.dst.itemsize
                size = max(src_n, dst_n)
                if (not size or size > WARM_MAX_BYTES or f.align % f.src.itemsize
                        or f.align % f.dst.itemsize):
                    continue
                off = f.align % 16  # 0 for 16: the allocation's own (512-byte) alignment
                with torch.cuda.stream(side):
                    # one buffer under both sides: the bytes are scratch, only the compiled
                    # variant matters (the same one the round's pieces key)
                    buf = torch.empty(off + size, dtype=torch.uint8, device=device)
                    src = buf[off:off + src_n].view(f.src).as_strided(f.shape, f.src_stride)
                    dst = buf[off:off + dst_n].view(f.dst).as_strided(f.shape, f.dst_stride)
                    if _launch([dst], [src], device, check=False):
                        done += 1
                    del buf, src, dst
            side.synchronize()
    except Exception:
        pass
    return done


def copy_many(dsts: Sequence[Any], srcs: Sequence[Any], *,
              src_table: PointerTable | None = None, dst_table: PointerTable | None = None,
              uniform: bool = False) -> bool:
    """``dsts[i].copy_(srcs[i])`` for every i in one launch on the current stream, cast to
    the destinations' dtype; False (nothing done) when the pieces do not qualify — then
    the caller copies them some other way. ``*_table``: ``pointer_table`` of that side, if
    the caller keeps one. ``uniform``: the caller guarantees that every piece of a side has
    the first one's dtype, device, shape and strides (a stack's views, a group keyed by
    them), so only the first pair is checked: checking 1024 pairs costs ~2.8 ms of host
    time, 20x the launch."""
    n = len(dsts)
    if n < MIN_PIECES or n != len(srcs) or _kernel() is None:
        return False
    d0, s0 = dsts[0], srcs[0]
    if not (getattr(d0, "is_cuda", False) and getattr(s0, "is_cuda", False)):
        return False
    if d0.dtype != s0.dtype and not _exact(s0.dtype, d0.dtype, d0.device):
        return False
    return _launch(dsts, srcs, d0.device, check=not uniform, src_table=src_table,
                   dst_table=dst_table)


def _launch(dsts: Sequence[Any], srcs: Sequence[Any], device: Any, *, check: bool = True,
            src_table: PointerTable | None = None, dst_table: PointerTable | None = None,
            flat: bool | None = None, align: int | None = None, block: int = _BLOCK,
            warps: int = _WARPS) -> bool:
    """Launch the kernel over the pieces (True), or False when they do not qualify.
    ``flat``, ``align``, ``block`` and ``warps`` override what is derived from the pieces:
    for ``bench/gpu_copy_kernel.py``'s side-by-side variants only (a wrong ``align``
    reads misaligned memory)."""
    got = _kernel()
    if got is None:
        return False
    kernel, triton, tl = got
    d0, s0 = dsts[0], srcs[0]
    bits = d0.dtype == s0.dtype
    src_ty, dst_ty = _tl_type(tl, s0.dtype, bits), _tl_type(tl, d0.dtype, bits)
    gs, gd = _geometry(s0), _geometry(d0)
    if src_ty is None or dst_ty is None or gs is None or gd is None or gs[:2] != gd[:2]:
        return False
    if check:  # one geometry and one dtype pair for every piece
        for s, d in zip(srcs, dsts, strict=True):
            if (s.dtype != s0.dtype or d.dtype != d0.dtype or not s.is_cuda or not d.is_cuda
                    or _geometry(s) != gs or _geometry(d) != gd):
                return False
    rows, cols = gs[0], gs[1]
    n = rows * cols
    blocks = triton.cdiv(n, block)
    if blocks > 65535:  # the grid's second dim; pieces this large gain nothing here anyway
        return False
    # the kernel's offsets (r * stride + c) are int32: a piece spanning 2**31 elements or
    # more (a column block of a > 2 GiB byte view) would address out of bounds
    if max((g[0] - 1) * g[2] + g[1] for g in (gs, gd)) >= 2**31:
        return False
    st = src_table if src_table is not None else pointer_table(srcs, device)
    dt = dst_table if dst_table is not None else pointer_table(dsts, device)
    if flat is None:  # rows back to back on both sides: one run of n elements per piece
        flat = rows == 1 or (gs[2] == cols and gd[2] == cols)
    if align is None:
        align = min(st.align, dt.align)
    if _state.get("narrow"):
        align = 1
    grid = (len(dsts), blocks)
    try:
        kernel[grid](st.table, dt.table, n, rows, cols, gs[2], gd[2], BLOCK=block,
                     SRC=src_ty, DST=dst_ty, FLAT=flat, ALIGN=align, num_warps=warps)
    except Exception:
        if align == 1:
            raise
        # A Triton that cannot compile the alignment hint fails here, at compile time,
        # before anything is enqueued: the narrow form is the same copy.
        _state["narrow"] = True
        kernel[grid](st.table, dt.table, n, rows, cols, gs[2], gd[2], BLOCK=block,
                     SRC=src_ty, DST=dst_ty, FLAT=flat, ALIGN=1, num_warps=warps)
    return True
