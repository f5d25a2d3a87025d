"""Strided pieces on the GPU: how to pack many small strided boxes into one contiguous buffer.

Theory of operation. The ``nccl`` lane packs, per peer, the box of every parameter's local
shard that the peer needs. A row-sharded trainer feeding column-sharded workers sends column
blocks: strided views (``shard[:, a:b]``). ``torch._foreach_copy_`` is one launch for
contiguous tensors but falls back to one copy per tensor for strided ones, so 1024 experts
cost 1024 launches either way. This bench times, in one process on one GPU, the options for
``n`` pieces of one geometry (the case coalescing groups by), each from its own tensor:

* ``per_tensor``   -- ``dst[i].copy_(src[i][:, a:b])`` per piece (what a naive lane does);
* ``foreach``      -- one ``torch._foreach_copy_`` over the strided views (the lanes today);
* ``triton``       -- one Triton launch that reads every piece through a table of base
                      pointers (same shape and row stride: "batched by geometry"), when
                      Triton is installed (an optional, GPU-only dependency);
* ``contiguous``   -- one ``_foreach_copy_`` of the same bytes from contiguous tensors (the
                      floor: what the copies would cost with no striding at all);

with and without an fp32 -> bf16 cast. Every option's output is checked equal to
``per_tensor``'s. Prints one table; ``--json`` appends the figures to a file.

    python bench/gpu_strided_copy.py --pieces 1024 --rows 256 --cols 256 --take 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def _time(fn: Any, iters: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _triton_copy() -> Any:
    """A Triton kernel: piece p's rows x cols box at ``src_ptrs[p]`` (row stride ``sstride``
    elements) into ``dst[p]`` (contiguous rows x cols), cast to ``dst``'s dtype."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(src_ptrs, dst, rows, cols, sstride, BLOCK: tl.constexpr,
               SRC: tl.constexpr):
        p = tl.program_id(0)
        blk = tl.program_id(1)
        base = tl.load(src_ptrs + p).to(tl.pointer_type(SRC))
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        n = rows * cols
        mask = offs < n
        r = offs // cols
        c = offs % cols
        x = tl.load(base + r * sstride + c, mask=mask)
        tl.store(dst + p * n + offs, x.to(dst.dtype.element_ty), mask=mask)

    return kernel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pieces", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=256)
    ap.add_argument("--take", type=int, default=128, help="columns of each piece")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    dev = torch.device("cuda")
    results: dict[str, Any] = {"pieces": args.pieces, "rows": args.rows, "cols": args.cols,
                               "take": args.take}
    rows: list[tuple[str, str, float, float]] = []
    try:
        kernel = _triton_copy()
    except Exception as exc:  # optional dependency
        kernel = None
        results["triton_error"] = f"{type(exc).__name__}: {exc}"
    for src_dtype in (torch.bfloat16, torch.float32):
        srcs = [torch.randn(args.rows, args.cols, device=dev).to(src_dtype)
                for _ in range(args.pieces)]
        views = [s[:, :args.take] for s in srcs]
        flat = [v.contiguous() for v in views]
        out = torch.empty(args.pieces, args.rows, args.take, dtype=torch.bfloat16, device=dev)
        dsts = list(out.unbind(0))
        want = torch.stack([v.to(torch.bfloat16) for v in views])
        nbytes = out.numel() * out.element_size()
        tag = "fp32->bf16" if src_dtype == torch.float32 else "bf16"

        def per_tensor(dsts: Any = dsts, views: Any = views) -> None:
            for d, v in zip(dsts, views, strict=True):
                d.copy_(v)

        def foreach(dsts: Any = dsts, views: Any = views) -> None:
            torch._foreach_copy_(dsts, views)

        def contiguous(dsts: Any = dsts, flat: Any = flat) -> None:
            torch._foreach_copy_(dsts, flat)

        options = {"per_tensor": per_tensor, "foreach": foreach, "contiguous": contiguous}
        if kernel is not None:
            import triton

            ptrs = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=dev)
            block = 1024
            grid = (args.pieces, triton.cdiv(args.rows * args.take, block))
            src_tl = {torch.bfloat16: "bf16", torch.float32: "fp32"}[src_dtype]
            import triton.language as tl

            src_ty = {"bf16": tl.bfloat16, "fp32": tl.float32}[src_tl]

            def triton_copy(out: Any = out, ptrs: Any = ptrs, grid: Any = grid,
                            src_ty: Any = src_ty, stride: int = views[0].stride(0),
                            block: int = block) -> None:
                kernel[grid](ptrs, out, args.rows, args.take, stride, BLOCK=block, SRC=src_ty)

            options["triton"] = triton_copy
        for name, fn in options.items():
            out.zero_()
            try:
                t = _time(fn, args.iters)
            except Exception as exc:
                results[f"{name}_{tag}_error"] = f"{type(exc).__name__}: {exc}"
                continue
            ok = bool(torch.equal(out, want))
            results[f"{name}_{tag}"] = {"seconds": t, "gbps": nbytes / t / 1e9, "exact": ok}
            rows.append((name, tag, t, nbytes / t / 1e9))
    print(f"{args.pieces} pieces of ({args.rows}, {args.cols})[:, :{args.take}] -> bf16")
    print(f"{'option':<12} {'source':<11} {'ms':>9} {'GB/s':>9} exact")
    for name, tag, t, gbps in rows:
        exact = results[f"{name}_{tag}"]["exact"]
        print(f"{name:<12} {tag:<11} {t * 1e3:9.3f} {gbps:9.1f} {exact}")
    if "triton_error" in results:
        print("triton unavailable:", results["triton_error"])
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
