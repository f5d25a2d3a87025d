"""The multi-tensor copy kernel (``m2n_async._data._kernels``) variant by variant, side by side.

Theory of operation. The m2n lane packs a stack of experts with one launch of the Triton
copy (trainer: 1024 separate fp32 shards into one bf16 stack) and scatters a received stack
into 1024 separate targets (worker: bf16 bits). The kernel reads every piece's address from
a table, so it cannot know their alignment, and its general form splits each element's
offset into row and column with an integer division. This bench times, in one process on
one GPU, for each of those copies:

* ``foreach``       -- ``torch._foreach_copy_`` over the same pieces (the fallback);
* ``general``       -- the kernel's row/column form with one-element accesses (how every
                       piece was copied before the flat form existed);
* ``flat``          -- contiguous pieces as one run of elements each, still one element wide;
* ``flat_aligned``  -- the flat form told that every address is 16-byte aligned (what
                       ``copy_many`` picks for such pieces), also with larger blocks;
* ``one_tensor``    -- one ``copy_`` of the same bytes between two single tensors (the HBM
                       floor: no table, no pieces);

each the median of ``--iters`` timings of ``--reps`` back-to-back launches (device time by
CUDA events, divided by ``--reps``; host time of one launch call beside it). Every variant's
output is checked bit-equal to ``Tensor.copy_``'s. Prints one table; ``--json`` appends the
figures to a file.

    python3 bench/gpu_copy_kernel.py                      # the MoE model's pack and scatter
    python3 bench/gpu_copy_kernel.py --pieces 807 --rows 768 --cols 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def _time(fn: Callable[[], Any], iters: int, reps: int) -> tuple[float, float]:
    """(device seconds per launch, host seconds per launch call), medians over ``iters``."""
    import torch

    fn()
    torch.cuda.synchronize()
    dev, host = [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host.append((time.perf_counter() - t0) / reps)
        end.record()
        end.synchronize()
        dev.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(dev), statistics.median(host)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pieces", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=256, help="rows of a trainer's shard")
    ap.add_argument("--cols", type=int, default=256, help="columns of a trainer's shard")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from m2n_async._data import _kernels

    if not _kernels.available():
        print("Triton is not installed here: nothing to compare")
        return 1
    dev = torch.device("cuda")
    n, r, c = args.pieces, args.rows, args.cols
    g = torch.Generator(device=dev).manual_seed(0)
    cases: dict[str, tuple[list[Any], list[Any], Any, Any]] = {}
    # trainer: separate fp32 shards -> one bf16 stack (its member views)
    srcs = [torch.randn(r, c, device=dev, generator=g) for _ in range(n)]
    stack = torch.empty(n, r, c, dtype=torch.bfloat16, device=dev)
    cases["pack fp32->bf16"] = (list(stack.unbind(0)), srcs, stack.view(-1),
                                torch.randn(n * r * c, device=dev, generator=g))
    # worker: a received bf16 stack (its half of the columns) -> separate targets
    got = torch.randn(n, 2 * r, c // 2, device=dev, generator=g).to(torch.bfloat16)
    targets = [torch.empty(2 * r, c // 2, dtype=torch.bfloat16, device=dev) for _ in range(n)]
    cases["scatter bf16"] = (targets, list(got.unbind(0)),
                             torch.empty(n * r * c, dtype=torch.bfloat16, device=dev),
                             got.reshape(-1))
    # the nccl lane: column blocks of each shard (strided) -> a packed buffer
    cols = [s[:, : c // 2] for s in srcs]
    packed = torch.empty(n, r, c // 2, dtype=torch.bfloat16, device=dev)
    cases["strided fp32->bf16"] = (list(packed.unbind(0)), cols, None, None)

    results: dict[str, Any] = {"pieces": n, "rows": r, "cols": c}
    lines = []
    for case, (dsts, pieces, floor_dst, floor_src) in cases.items():
        want = [p.to(dsts[0].dtype) for p in pieces]
        st = _kernels.pointer_table(pieces, dev)
        dt = _kernels.pointer_table(dsts, dev)
        variants: dict[str, Callable[[], Any]] = {
            "foreach": lambda d=dsts, s=pieces: torch._foreach_copy_(d, s),
            "general": lambda d=dsts, s=pieces, a=st, b=dt: _kernels._launch(
                d, s, dev, check=False, src_table=a, dst_table=b, flat=False, align=1),
        }
        flat_ok = all(x.is_contiguous() for x in (*dsts[:1], *pieces[:1]))
        if flat_ok:
            variants["flat"] = lambda d=dsts, s=pieces, a=st, b=dt: _kernels._launch(
                d, s, dev, check=False, src_table=a, dst_table=b, flat=True, align=1)
        for block, warps in ((1024, 4), (2048, 4), (4096, 8), (8192, 8)):
            variants[f"{'flat' if flat_ok else 'general'}_aligned b{block} w{warps}"] = (
                lambda d=dsts, s=pieces, a=st, b=dt, bl=block, w=warps: _kernels._launch(
                    d, s, dev, check=False, src_table=a, dst_table=b, block=bl, warps=w))
        variants["copy_many (shipped)"] = lambda d=dsts, s=pieces, a=st, b=dt: (
            _kernels.copy_many(d, s, src_table=a, dst_table=b, uniform=True))
        if floor_dst is not None:
            variants["one_tensor"] = lambda d=floor_dst, s=floor_src: d.copy_(s)
        base = None
        for name, fn in variants.items():
            for d in dsts:
                d.zero_()
            try:
                t_dev, t_host = _time(fn, args.iters, args.reps)
            except Exception as exc:  # a variant that does not compile is reported, not fatal
                results[f"{case}: {name}"] = {"error": f"{type(exc).__name__}: {exc}"}
                lines.append(f"{case:<20} {name:<26} error: {type(exc).__name__}: {exc}")
                continue
            torch.cuda.synchronize()
            exact = name == "one_tensor" or all(
                torch.equal(d.view(torch.uint8), w.view(torch.uint8))
                for d, w in zip(dsts, want, strict=True))
            if name == "general":
                base = t_dev
            ratio = base / t_dev if base else float("nan")
            results[f"{case}: {name}"] = {"device_s": t_dev, "host_s": t_host, "exact": exact,
                                          "general_over_this": ratio}
            lines.append(f"{case:<20} {name:<26} {t_dev * 1e3:9.3f} {t_host * 1e6:9.1f} "
                         f"{ratio:8.2f}  {exact}")
    print(f"{n} pieces; trainer shard ({r}, {c}); device ms per launch, host us per call")
    print(f"{'copy':<20} {'variant':<26} {'dev_ms':>9} {'host_us':>9} {'x_gen':>8}  exact")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
