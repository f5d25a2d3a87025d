"""Host copies of many small tensors, side by side: where ``_hostcopy``'s address tables beat
torch's multi-tensor copies, and so where ``MAX_BYTES`` and ``MIN_SEGMENTS`` lie.

One process, one torch thread, CPU. For each word width (8, 4, 2, 1 bytes: the widest that
divides a segment's size and addresses) and segment size, ``--segments`` separate tensors
(fewer for the larger sizes: 16 MiB in all) are

- scattered from one packed buffer: ``torch._foreach_copy_`` (what the Gloo lane did) against
  ``HostScatter.run``;
- gathered into one packed buffer: ``torch.cat(out=)`` against ``HostGather.run``.

Each figure is the best of ``--reps`` runs, in microseconds per segment; ``ratio`` is the
torch figure over the table's (above 1: the table wins). Then the group size: the same
64 B segments in groups of 1 .. 64 per table (a table runs one ``index_copy_`` or
``index_select`` per group), against ``_foreach_copy_`` of the same pairs.

Usage: ``.venv/bin/python bench/cpu_host_copy.py [--segments 4000] [--reps 5]``
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import torch

import m2n_async._data._hostcopy as hc
from m2n_async._data._hostcopy import MAX_BYTES, MIN_SEGMENTS, HostGather, HostScatter

_DTYPE = {8: torch.float64, 4: torch.float32, 2: torch.bfloat16, 1: torch.uint8}


def best(fn: Callable[[], object], reps: int) -> float:
    out = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def sizes_case(word: int, length: int, count: int, reps: int) -> tuple[float, ...]:
    """(foreach, scatter table, cat, gather table) seconds per segment."""
    dtype = _DTYPE[word]
    srcs = [torch.randn(length).to(dtype) if word > 1 else
            torch.randint(0, 256, (length,), dtype=torch.uint8) for _ in range(count)]
    dsts = [torch.zeros_like(s) for s in srcs]
    n = length * word
    buf = torch.cat([s.view(torch.uint8) for s in srcs])
    offsets = [k * n for k in range(count)]
    dst_bytes = [d.view(torch.uint8) for d in dsts]
    parts = list(buf.split(n))
    saved = hc.MAX_BYTES
    hc.MAX_BYTES = 1 << 40  # measure past the limit too
    try:
        scatter, rest = HostScatter.build(buf, offsets, dst_bytes)
        out = torch.empty_like(buf)
        gather = HostGather.build(out, offsets, [n] * count, [s.data_ptr() for s in srcs])
    finally:
        hc.MAX_BYTES = saved
    assert scatter is not None and not rest, (word, length)
    assert gather is not None and not gather.rest
    t_foreach = best(lambda: torch._foreach_copy_(dst_bytes, parts), reps)
    t_scatter = best(lambda: scatter.run(buf), reps)
    assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    typed = out.view(dtype)
    t_cat = best(lambda: torch.cat(srcs, out=typed), reps)
    out.zero_()
    t_gather = best(lambda: gather.run(out), reps)
    assert torch.equal(out, buf)
    return tuple(t / count for t in (t_foreach, t_scatter, t_cat, t_gather))


def group_case(group: int, count: int, reps: int) -> tuple[float, float]:
    """(foreach, scatter tables) seconds per 64 B segment, the tables ``group`` each."""
    srcs = [torch.randn(16) for _ in range(count)]
    dsts = [torch.zeros(16).view(torch.uint8) for _ in range(count)]
    buf = torch.cat([s.view(torch.uint8) for s in srcs])
    parts = list(buf.split(64))
    saved = hc.MIN_SEGMENTS
    hc.MIN_SEGMENTS = 1  # measure below the threshold too
    try:
        tables = []
        for a in range(0, count, group):
            t, rest = HostScatter.build(buf, list(range(a * 64, min(a + group, count) * 64, 64)),
                                        dsts[a:a + group])
            assert t is not None and not rest
            tables.append(t)
    finally:
        hc.MIN_SEGMENTS = saved

    def run_all() -> None:
        for t in tables:
            t.run(buf)
    return (best(lambda: torch._foreach_copy_(dsts, parts), reps) / count,
            best(run_all, reps) / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"cpu_host_copy: {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, 1 thread; MAX_BYTES {MAX_BYTES}, MIN_SEGMENTS {MIN_SEGMENTS}")
    print("us per segment; ratio = torch / table (> 1: the table wins)")
    print(f"{'word':>4} {'words':>6} {'bytes':>7} | {'foreach':>8} {'scatter':>8} {'ratio':>6} "
          f"| {'cat':>8} {'gather':>8} {'ratio':>6}")
    for word in (8, 4, 2, 1):
        for nbytes in (8, 64, 512, 2048, 4096, 8192, 16384):
            if nbytes < word:
                continue
            length = nbytes // word
            count = max(200, min(args.segments, (16 << 20) // nbytes))
            f, s, c, g = sizes_case(word, length, count, args.reps)
            print(f"{word:>4} {length:>6} {length * word:>7} | {f * 1e6:8.3f} {s * 1e6:8.3f} "
                  f"{f / s:6.2f} | {c * 1e6:8.3f} {g * 1e6:8.3f} {c / g:6.2f}")
    print("\ngroup size (64 B segments, one table per group): us per segment")
    print(f"{'group':>6} | {'foreach':>8} {'tables':>8} {'ratio':>6}")
    for group in (1, 2, 4, 8, 16, 64):
        f, s = group_case(group, args.segments, args.reps)
        print(f"{group:>6} | {f * 1e6:8.3f} {s * 1e6:8.3f} {f / s:6.2f}")


if __name__ == "__main__":
    main()
