"""Multi-tensor copies on the host: one packed buffer scattered into many small CPU tensors,
or many small CPU tensors gathered into one buffer, with a few torch calls, through a table
of addresses.

Theory of operation. A worker that receives 100,000 tiny parameters scatters each packed
message into as many targets. ``torch._foreach_copy_`` has no fused CPU kernel: it runs one
``copy_`` per pair, a TensorIterator each, ~0.55-0.7 us per pair whatever its size (CPU dev
box, ``bench/cpu_host_copy.py``). ``HostScatter`` does what the Triton kernel of ``_kernels``
does on CUDA, reading the destinations' addresses from a table:

- A segment is moved in words of ``w`` bytes (8, 4, 2 or 1: the widest that divides its
  size, its destination's address and its source's address).
- The destinations of one group (segments of one word size and one length ``L``) are
  addressed through one raw view spanning them: a tensor over the bytes from their lowest
  address to their highest end, seen as overlapping rows of ``L`` words (``as_strided`` with
  strides (1, 1): row r is the ``L`` words starting at word r). Nothing outside the rows
  the table names is ever read or written.
- One ``index_copy_`` with the segments' row numbers then writes the whole group: ~0.01 us
  per 64 B segment, ~0.08 us with the version bump below, against ~0.51-0.57 us for
  ``_foreach_copy_``. Sources that lie back to back
  in the buffer are read as one (n, L) view; others are gathered first by one
  ``index_select`` over the buffer's own overlapping rows.

``HostGather`` is the mirror, for a trainer packing many small shards: the sources are read
through one raw view over their span with one ``index_select`` per group, straight into the
buffer where the group lies back to back there (~0.004 us per 64 B segment against ~0.17 us
for ``torch.cat``). Sources of another float dtype than the buffer's (fp32 master weights,
bf16 on the wire) are gathered in their own words and cast by one ``copy_`` per group,
``Tensor.to``'s rounding. A gather table holds addresses only, no source: its caller must
hold the sources, at exactly those addresses, while it runs.

An indexed copy moves a row element by element where ``copy_`` uses memcpy, and a group
costs two or three torch calls, so a long segment or a small group is faster through torch's
own copies: a group is taken when its segments have at most ``MAX_BYTES`` each and it has at
least ``MIN_SEGMENTS`` of them (``bench/cpu_host_copy.py`` prints both sides at each size,
word width and group size). The rest is the caller's, copied as before.

Safety. The raw views own nothing: a ``HostScatter`` keeps referenced every destination it
writes and the buffer it reads, so their storage lives as long as it does (a target whose
``.data`` is replaced keeps its old storage alive through the table, exactly as a cached
view would; the caller builds a new table when a target's address changes, and one table
serves only the buffer it was built for). Only contiguous, one-dimensional uint8 CPU
destinations are taken, with the sizes they have when the table is built.

Version counters. A write through an address is invisible to autograd, so every scatter
bumps its destinations' version counters (``torch.autograd.graph.increment_version``, torch's
hook for writes it cannot see), as the ``copy_`` it replaces would.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.graph import increment_version

__all__ = ["MAX_BYTES", "MIN_SEGMENTS", "HostGather", "HostScatter", "raw_words"]

#: The longest segment a table copies; longer ones go through ``copy_`` (memcpy), which is
#: faster from 16 KiB on (``bench/cpu_host_copy.py``; BENCHMARKS "Host copies").
MAX_BYTES = 8192
#: The fewest segments of one word size and length a table takes as a group: below it, a
#: group's two or three torch calls cost about what ``_foreach_copy_`` does per segment.
MIN_SEGMENTS = 16

_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

#: A gather group: (source rows, their row numbers, destination, destination row numbers or
#: None, (source dtype, buffer dtype) when it casts or None)
_Group = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor | None",
               "tuple[torch.dtype, torch.dtype] | None"]


def _bump_versions(tensors: Sequence[torch.Tensor]) -> None:
    """Advance the version counters of ``tensors`` (written through their addresses)."""
    try:
        increment_version(tensors)  # a list, where this torch takes one
    except TypeError:  # older torch: one tensor per call
        for t in tensors:
            increment_version(t)


#: One ctypes array type for every raw view, its length the most any view may claim:
#: ``frombuffer(count=)`` gives each view its own size. (ctypes keeps every array type it
#: ever made, one per length, so a type per span would grow without bound over rebuilds.)
_ADDRESSABLE = ctypes.c_byte * (sys.maxsize // 2)


def raw_words(lo: int, nbytes: int, word: int) -> torch.Tensor:
    """A 1-D tensor of ``nbytes // word`` words of ``word`` bytes over the memory at address
    ``lo``: it owns nothing and keeps nothing alive (the caller keeps the owners referenced
    and touches only what lies inside them). Nothing is read or mapped to make it."""
    return torch.frombuffer(_ADDRESSABLE.from_address(lo), dtype=_WORD[word],
                            count=nbytes // word)


def _word(*values: int) -> int:
    """The widest word (8, 4, 2 or 1 bytes) that divides every value."""
    x = 8
    for v in values:
        x |= v
    return x & -x


def _rows(words: torch.Tensor, length: int) -> torch.Tensor:
    """``words`` seen as its overlapping rows of ``length`` words: row r starts at word r."""
    return words.as_strided((words.numel() - length + 1, length), (1, 1))


def _flat_bytes(buf: torch.Tensor) -> bool:
    """Is ``buf`` what a table packs into or scatters from: contiguous 1-D uint8 on the CPU?"""
    return bool(buf.is_cpu and buf.dtype == torch.uint8 and buf.dim() == 1
                and buf.is_contiguous())


def _span_rows(ptrs: Sequence[int], word: int, length: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The regions of ``length`` words of ``word`` bytes at addresses ``ptrs`` (each a
    multiple of ``word``): (the overlapping rows of one raw view over their span, each
    region's row number in it)."""
    lo = min(ptrs)
    hi = max(ptrs) + word * length
    rows = torch.tensor([(p - lo) // word for p in ptrs], dtype=torch.int64)
    return _rows(raw_words(lo, hi - lo, word), length), rows


def _buffer_rows(base: int, offsets: Sequence[int], word: int, length: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The buffer side of a group: its regions at ``offsets`` from address ``base`` (each
    ``base + offset`` a multiple of ``word``). Back to back, they are one (n, L) view and no
    row numbers; otherwise the buffer's overlapping rows from the group's first byte and
    each region's row number."""
    n = word * length
    first = offsets[0]
    if all(off == first + j * n for j, off in enumerate(offsets)):
        return raw_words(base + first, len(offsets) * n, word).view(len(offsets), length), None
    return _span_rows([base + off for off in offsets], word, length)


class HostScatter:
    """Scatters one packed CPU buffer into many small destinations, a few torch calls for
    all of them (module docstring). Built once per (buffer, destinations) by ``build``;
    ``run(buf)`` copies every segment it took, every round."""

    __slots__ = ("_buf", "_dsts", "_groups", "_ptr")

    def __init__(self, buf: torch.Tensor, dsts: list[torch.Tensor],
                 groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                    torch.Tensor | None]]) -> None:
        self._buf = buf          # what the source views point into: kept alive
        self._ptr = buf.data_ptr()
        self._dsts = dsts        # every destination written: kept alive, versions bumped
        #: per group: (destination rows, their row numbers, the source as (n, L) rows or
        #: the buffer's overlapping rows, the source row numbers or None when back to back)
        self._groups = groups

    @classmethod
    def build(cls, buf: torch.Tensor, offsets: Sequence[int], dsts: Sequence[torch.Tensor]
              ) -> tuple[HostScatter | None, list[int]]:
        """The table that copies ``buf[offsets[k]:offsets[k] + dsts[k].numel()]`` into
        ``dsts[k]`` for the pairs it can take, and the indices k of those it leaves to the
        caller (in order). ``buf``: a contiguous 1-D uint8 CPU tensor. None when it takes no
        pair (then every index is left)."""
        if not _flat_bytes(buf):
            return None, list(range(len(dsts)))
        base = buf.data_ptr()
        size = buf.numel()
        by_shape: dict[tuple[int, int], list[int]] = {}
        rest: list[int] = []
        ptrs: list[int] = []
        for k, (d, off) in enumerate(zip(dsts, offsets, strict=True)):
            n = d.numel()
            p = d.data_ptr() if d.is_cpu else 0
            ptrs.append(p)
            if not (p and d.dtype == torch.uint8 and d.dim() == 1 and d.is_contiguous()
                    and 0 < n and 0 <= off and off + n <= size):
                rest.append(k)
                continue
            w = _word(n, p, base + off)
            if n > MAX_BYTES:
                rest.append(k)
                continue
            by_shape.setdefault((w, n // w), []).append(k)
        groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        taken: list[torch.Tensor] = []
        for (w, length), ks in by_shape.items():
            if len(ks) < MIN_SEGMENTS:
                rest.extend(ks)
                continue
            dst_rows, rows = _span_rows([ptrs[k] for k in ks], w, length)
            src, src_rows = _buffer_rows(base, [offsets[k] for k in ks], w, length)
            groups.append((dst_rows, rows, src, src_rows))
            taken.extend(dsts[k] for k in ks)
        if not groups:
            return None, list(range(len(dsts)))
        rest.sort()
        return cls(buf, taken, groups), rest

    @property
    def segments(self) -> int:
        """How many segments the table copies."""
        return len(self._dsts)

    @property
    def groups(self) -> int:
        """How many groups (one ``index_copy_`` each) it copies them in."""
        return len(self._groups)

    def run(self, buf: torch.Tensor) -> None:
        """Copy every segment the table took from ``buf`` (the buffer it was built for)."""
        if buf.data_ptr() != self._ptr:
            raise RuntimeError("HostScatter.run: a buffer other than the one it was built for")
        for dst_rows, rows, src, src_rows in self._groups:
            if src_rows is not None:
                src = torch.index_select(src, 0, src_rows)
            dst_rows.index_copy_(0, rows, src)
        _bump_versions(self._dsts)

    def __repr__(self) -> str:
        return f"HostScatter({self.segments} segments in {self.groups} groups)"


class HostGather:
    """Packs many small contiguous CPU sources into one buffer, a few torch calls for all of
    them: the mirror of ``HostScatter`` (module docstring), casting on the way where the
    sources' dtype is not the buffer's (fp32 master weights into bf16: the gathered rows
    go through one ``copy_`` per group, ``Tensor.to``'s rounding). Built for one set of
    source addresses; ``run`` serves only sources at exactly those addresses, which the
    caller checks every round. A source is read only while the caller holds it: the table
    keeps no source alive, only its address."""

    __slots__ = ("_buf", "_groups", "_ptr", "rest")

    def __init__(self, buf: torch.Tensor,
                 groups: list[_Group], rest: list[int]) -> None:
        self._buf = buf  # what the destination views point into: kept alive
        self._ptr = buf.data_ptr()
        #: per group: (the source rows: a raw view over the sources' span, seen as
        #: overlapping rows; their row numbers; the destination: (n, L) of the buffer when
        #: the group lies back to back there, else the buffer's overlapping rows; the
        #: destination row numbers or None; when the group casts, the sources' dtype and
        #: the buffer's)
        self._groups = groups
        #: the indices of the sources left to the caller, in order
        self.rest = rest

    @classmethod
    def build(cls, buf: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int],
              ptrs: Sequence[int], cast: tuple[torch.dtype, Sequence[torch.dtype]] | None = None
              ) -> HostGather | None:
        """The table that copies source k (a contiguous CPU source at address ``ptrs[k]``,
        which the caller has checked) to ``buf[offsets[k]:offsets[k] + sizes[k]]``, for the
        sources it takes (``rest``: the others). Without ``cast`` the bytes are copied as
        they are; with ``cast = (source dtype, per source the buffer's dtype)`` each source
        holds ``sizes[k]`` bytes' worth of elements of the source dtype and is cast into
        its place (which must be aligned to the buffer dtype). None when it takes none.
        ``buf``: a contiguous 1-D uint8 CPU tensor."""
        if not _flat_bytes(buf):
            return None
        base = buf.data_ptr()
        size = buf.numel()
        by_shape: dict[tuple[Any, int], list[int]] = {}
        rest: list[int] = []
        src_size = cast[0].itemsize if cast is not None else 1
        for k, (off, n, p) in enumerate(zip(offsets, sizes, ptrs, strict=True)):
            if not (p and 0 < n and 0 <= off and off + n <= size):
                rest.append(k)
                continue
            if cast is None:
                w: Any = _word(n, p, base + off)
                key = (w, n // w)
                read = n
            else:
                w = cast[1][k]  # the buffer's dtype here: its words are the elements
                key = (w, n // w.itemsize)
                read = key[1] * src_size
                if (p % src_size or (base + off) % w.itemsize or n % w.itemsize
                        or w.itemsize not in _WORD):
                    rest.append(k)
                    continue
            if read > MAX_BYTES:
                rest.append(k)
                continue
            by_shape.setdefault(key, []).append(k)
        groups: list[_Group] = []
        for (w, length), ks in by_shape.items():
            if len(ks) < MIN_SEGMENTS:
                rest.extend(ks)
                continue
            dtypes: tuple[torch.dtype, torch.dtype] | None = None
            if cast is None:
                src_w, dst_w = w, w
            else:
                src_w, dst_w, dtypes = src_size, w.itemsize, (cast[0], w)
            src_rows, rows = _span_rows([ptrs[k] for k in ks], src_w, length)
            dst, at = _buffer_rows(base, [offsets[k] for k in ks], dst_w, length)
            if at is None and dtypes is not None:
                dst = dst.view(w)  # typed: the copy casts into it
            groups.append((src_rows, rows, dst, at, dtypes))
        if not groups:
            return None
        rest.sort()
        return cls(buf, groups, rest)

    def run(self, buf: torch.Tensor) -> None:
        """Copy every source the table took into ``buf`` (the buffer it was built for). The
        caller holds those sources, at the addresses the table was built for."""
        if buf.data_ptr() != self._ptr:
            raise RuntimeError("HostGather.run: a buffer other than the one it was built for")
        for src_rows, rows, dst, at, dtypes in self._groups:
            if dtypes is None:
                if at is None:
                    torch.index_select(src_rows, 0, rows, out=dst)
                else:
                    dst.index_copy_(0, at, torch.index_select(src_rows, 0, rows))
                continue
            got = torch.index_select(src_rows, 0, rows).view(dtypes[0])
            if at is None:
                dst.copy_(got)  # cast into the typed rows: Tensor.to's rounding
            else:  # cast, then placed as words of the buffer dtype's width
                dst.index_copy_(0, at, got.to(dtypes[1]).view(dst.dtype))
