"""``_hostcopy``: one packed CPU buffer into many small targets (``HostScatter``), and many
small sources into one buffer (``HostGather``), through tables of addresses. Bit-exact for
every word width, every alignment of the buffer and every layout of the segments in it; what
a table leaves to the caller is exactly what it must not take; a scatter keeps what it writes
alive and bumps version counters; a table refuses a buffer it was not built for."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from m2n_async._data._hostcopy import MAX_BYTES, MIN_SEGMENTS, HostGather, HostScatter


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _case(sizes: list[int], *, interleave: bool = False, seed: int = 0
          ) -> tuple[torch.Tensor, list[int], list[torch.Tensor], list[torch.Tensor]]:
    """A packed buffer of random bytes, each segment's offset, fresh zeroed targets (flat
    byte views of tensors of several dtypes) and the bytes each must receive."""
    gen = torch.Generator().manual_seed(seed)
    order = list(range(len(sizes)))
    if interleave:  # segments of one size not back to back in the buffer
        random.Random(seed).shuffle(order)
    offsets = [0] * len(sizes)
    off = 0
    for k in order:
        offsets[k] = off
        off += sizes[k]
    buf = torch.randint(0, 256, (off,), dtype=torch.uint8, generator=gen)
    dtypes = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16}
    targets = []
    for n in sizes:
        dt = next((d for w, d in dtypes.items() if n % w == 0), torch.uint8)
        targets.append(_flat(torch.zeros(n // dt.itemsize, dtype=dt)))
    want = [buf[o:o + n].clone() for o, n in zip(offsets, sizes, strict=True)]
    return buf, offsets, targets, want


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 6, 8, 24, 64, 1000, 4096])
def test_every_word_width_bit_exact(size: int, interleave: bool) -> None:
    sizes = [size] * 40 + [size + 1] * 20  # two groups (or one and a rest)
    buf, offsets, targets, want = _case(sizes, interleave=interleave, seed=size)
    table, rest = HostScatter.build(buf, offsets, targets)
    if size <= 64 or not interleave:  # long segments at odd offsets: 1-byte words, too long
        assert table is not None
    if table is None:
        assert rest == list(range(len(sizes)))
        return
    for k in rest:  # the caller's share, copied as the lane does
        targets[k].copy_(buf[offsets[k]:offsets[k] + sizes[k]])
    table.run(buf)
    for k, (t, w) in enumerate(zip(targets, want, strict=True)):
        assert torch.equal(t, w), k
    # a second round with new bytes: the same table
    buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8))
    table.run(buf)
    for k in range(len(sizes)):
        if k not in rest:
            assert torch.equal(targets[k], buf[offsets[k]:offsets[k] + sizes[k]]), k


def test_mixed_sizes_and_what_it_leaves() -> None:
    long_ = MAX_BYTES + 8
    sizes = [64] * MIN_SEGMENTS + [48] * (MIN_SEGMENTS - 1) + [long_] * MIN_SEGMENTS + [16] * 20
    buf, offsets, targets, want = _case(sizes, interleave=True, seed=7)
    targets[-1] = torch.zeros(16, 2, dtype=torch.uint8)[:, 0]  # strided
    targets[-2] = torch.zeros(4, dtype=torch.float32)          # not a byte view
    table, rest = HostScatter.build(buf, offsets, targets)
    assert table is not None
    n64, n48 = MIN_SEGMENTS, MIN_SEGMENTS - 1
    left = set(rest)
    assert not left & set(range(n64))                          # a full group: taken
    assert set(range(n64, n64 + n48)) <= left                  # too few of one length
    assert set(range(n64 + n48, n64 + n48 + MIN_SEGMENTS)) <= left  # too long
    assert {len(sizes) - 1, len(sizes) - 2} <= left            # strided / not uint8
    assert rest == sorted(rest)
    assert table.segments == len(sizes) - len(rest)
    table.run(buf)
    for k in range(len(sizes)):
        if k not in left:
            assert torch.equal(targets[k], want[k]), k


def test_takes_nothing_from_a_buffer_it_cannot_read() -> None:
    buf, offsets, targets, _ = _case([8] * 32)
    for bad in (buf.view(torch.int64), buf[::2], buf.view(2, -1)):
        assert HostScatter.build(bad, offsets[:len(offsets) // 2], targets[:16]) == (
            None, list(range(16)))
    # a segment running past the buffer's end is left, never read
    table, rest = HostScatter.build(buf[:200], offsets, targets)
    assert table is not None and rest == [k for k in range(32) if offsets[k] + 8 > 200]
    assert rest


def test_only_the_bytes_of_each_target_are_written() -> None:
    # targets as views into one zeroed storage with guards between them: the raw view spans
    # the guards, which must stay zero
    storage = torch.zeros(64 * 24, dtype=torch.uint8)
    targets = [storage[k * 24 + 8:k * 24 + 16] for k in range(64)]
    buf = torch.full((8 * 64,), 0xAB, dtype=torch.uint8)
    table, rest = HostScatter.build(buf, [8 * k for k in range(64)], targets)
    assert table is not None and rest == []
    table.run(buf)
    written = torch.zeros_like(storage, dtype=torch.bool)
    for k in range(64):
        written[k * 24 + 8:k * 24 + 16] = True
    assert bool((storage[written] == 0xAB).all()) and bool((storage[~written] == 0).all())


def test_keeps_its_targets_alive_and_bumps_their_versions() -> None:
    params = [torch.zeros(4) for _ in range(MIN_SEGMENTS)]
    targets = [_flat(p) for p in params]
    buf = torch.arange(16 * MIN_SEGMENTS, dtype=torch.uint8)
    table, _ = HostScatter.build(buf, [16 * k for k in range(MIN_SEGMENTS)], targets)
    assert table is not None
    before = [p._version for p in params]
    table.run(buf)
    assert [p._version for p in params] == [v + 1 for v in before]
    old = [p.data for p in params]
    for p in params:  # new storage behind the tensors; the old is only the table's now
        p.data = torch.ones(4)
    del old, targets
    gc.collect()
    table.run(buf)  # writes into the old storages, which it kept alive: no crash
    assert all(torch.equal(p, torch.ones(4)) for p in params)  # the new ones untouched


def test_refuses_a_buffer_it_was_not_built_for() -> None:
    buf, offsets, targets, _ = _case([8] * 32)
    table, _ = HostScatter.build(buf, offsets, targets)
    assert table is not None
    with pytest.raises(RuntimeError, match="other than the one it was built for"):
        table.run(buf.clone())


def _packed(sizes: list[int], shift: int, seed: int
            ) -> tuple[torch.Tensor, list[int], list[torch.Tensor]]:
    """A zeroed buffer starting ``shift`` bytes into its storage, each segment's offset in
    it (back to back), and a source tensor of random bytes per segment, several dtypes."""
    gen = torch.Generator().manual_seed(seed)
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += n
    buf = torch.zeros(off + shift, dtype=torch.uint8)[shift:]
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    dtypes = {8: torch.int64, 4: torch.float32, 2: torch.float16}
    srcs = [s.view(next((d for w, d in dtypes.items() if s.numel() % w == 0), torch.uint8))
            for s in srcs]
    return buf, offsets, srcs


# one-element parameters of five dtypes in turn (as a plan of tiny params packs them), and
# one size throughout; buffers at every alignment
@pytest.mark.parametrize("shift", [0, 1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("sizes", [[4, 2, 8, 1, 1] * 40, [24] * 40, [16, 6, 64] * 30])
def test_scatter_and_gather_at_every_buffer_alignment(sizes: list[int], shift: int) -> None:
    buf, offsets, srcs = _packed(sizes, shift, seed=len(sizes) + shift)
    want = torch.cat([_flat(s) for s in srcs])
    gather = HostGather.build(buf, offsets, sizes, [s.data_ptr() for s in srcs])
    assert gather is not None
    gather.run(buf)
    for k in gather.rest:
        buf[offsets[k]:offsets[k] + sizes[k]].copy_(_flat(srcs[k]))
    assert torch.equal(buf, want)
    targets = [torch.zeros_like(s) for s in srcs]
    scatter, rest = HostScatter.build(buf, offsets, [_flat(t) for t in targets])
    assert scatter is not None and rest == gather.rest
    scatter.run(buf)
    for k in rest:
        _flat(targets[k]).copy_(buf[offsets[k]:offsets[k] + sizes[k]])
    assert all(torch.equal(_flat(t), _flat(s)) for t, s in zip(targets, srcs, strict=True))


def test_gather_leaves_what_it_must_not_take() -> None:
    long_ = MAX_BYTES + 8
    sizes = [32] * MIN_SEGMENTS + [long_] * MIN_SEGMENTS + [12] * (MIN_SEGMENTS - 1) + [8]
    buf, offsets, srcs = _packed(sizes, 0, seed=3)
    ptrs = [s.data_ptr() for s in srcs]
    ptrs[-1] = 0  # no address: left
    gather = HostGather.build(buf, offsets, sizes, ptrs)
    assert gather is not None
    assert gather.rest == list(range(MIN_SEGMENTS, len(sizes)))
    gather.run(buf)
    assert torch.equal(buf[:32 * MIN_SEGMENTS],
                       torch.cat([_flat(s) for s in srcs[:MIN_SEGMENTS]]))
    assert not bool(buf[32 * MIN_SEGMENTS:].any())  # nothing else written
    with pytest.raises(RuntimeError, match="other than the one it was built for"):
        gather.run(buf.clone())
    assert HostGather.build(buf[:64].view(torch.int64), [0], [8], [ptrs[0]]) is None
    assert HostGather.build(buf, offsets[-4:], sizes[-4:], ptrs[-4:]) is None


def test_targets_far_apart_in_memory() -> None:
    # views into a large (separately mapped) tensor beside small heap tensors: the raw view
    # spans terabytes of address space, of which only the rows named are touched
    big = torch.zeros(64 << 20, dtype=torch.uint8)
    dsts = [big[(k * 1000003 * 64) % (60 << 20):][:64] for k in range(20)]
    dsts += [torch.zeros(64, dtype=torch.uint8) for _ in range(20)]
    buf = torch.randint(0, 256, (64 * 40,), dtype=torch.uint8)
    offsets = [64 * k for k in range(40)]
    scatter, rest = HostScatter.build(buf, offsets, dsts)
    assert scatter is not None and rest == []
    scatter.run(buf)
    assert all(torch.equal(d, buf[64 * k:64 * k + 64]) for k, d in enumerate(dsts))
    out = torch.zeros_like(buf)
    gather = HostGather.build(out, offsets, [64] * 40, [d.data_ptr() for d in dsts])
    assert gather is not None and gather.rest == []
    gather.run(out)
    assert torch.equal(out, buf)
    assert int(big.count_nonzero()) <= 20 * 64  # nothing written beside the 20 views


@pytest.mark.parametrize(("src", "wire"), [(torch.float32, torch.bfloat16),
                                           (torch.float64, torch.float16),
                                           (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("interleave", [False, True])
def test_gather_casts_as_tensor_to(src: torch.dtype, wire: torch.dtype,
                                   interleave: bool) -> None:
    # masters of ``src`` into a buffer of ``wire``: every value (ties, subnormals, inf, NaN)
    # as ``Tensor.to`` gives it; with ``interleave`` the groups are not back to back
    gen = torch.Generator().manual_seed(5)
    specials = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, 1e-40, -3e-39, float("inf"),
                             float("-inf"), float("nan"), -0.0, 65519.0, 1e6])
    masters = []
    for k in range(48):
        n = (8, 3)[k % 2] if interleave else 8
        t = torch.randn(n, generator=gen, dtype=torch.float64) * 10
        t[:min(n, 10)] = specials.roll(k)[:min(n, 10)].double()
        masters.append(t.to(src))
    sizes = [m.numel() * wire.itemsize for m in masters]
    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += n
    buf = torch.zeros(off, dtype=torch.uint8)
    gather = HostGather.build(buf, offsets, sizes, [m.data_ptr() for m in masters],
                              (src, [wire] * len(masters)))
    assert gather is not None and gather.rest == []
    gather.run(buf)
    want = torch.cat([_flat(m.to(wire)) for m in masters])
    assert torch.equal(buf, want)
    # misaligned for the source dtype: left to the caller
    odd = torch.zeros(8 * src.itemsize + 1, dtype=torch.uint8)[1:].view(torch.uint8)
    assert HostGather.build(buf[:16 * 8 * wire.itemsize], [k * 8 * wire.itemsize
                                                          for k in range(16)],
                            [8 * wire.itemsize] * 16, [odd.data_ptr()] * 16,
                            (src, [wire] * 16)) is None


def test_raw_views_of_any_length_make_no_new_ctypes_types() -> None:
    # ctypes keeps every array type it made, one per length: tables rebuilt over new spans
    # round after round must not add one each
    import ctypes

    from m2n_async._data._hostcopy import raw_words

    meta = type(ctypes.c_byte * 1)  # the metaclass of every ctypes array type

    def array_types() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is meta)

    x = torch.arange(512, dtype=torch.int64)
    assert torch.equal(raw_words(x.data_ptr(), 4096, 8), x)
    before = array_types()
    for n in range(8, 4096, 8):
        assert raw_words(x.data_ptr() + 8, n, 8).numel() == n // 8
    assert array_types() == before
