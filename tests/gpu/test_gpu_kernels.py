"""The Triton multi-tensor copy (``m2n_async._data._kernels``) on a real GPU: bit-exact against
``Tensor.copy_`` for contiguous and strided pieces, equal dtypes (bits) and float casts
(ties, subnormals, infinities, NaN payloads, -0), and its refusals (mixed shapes, 3-d)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device (GPU tests run on the H200 host)")]


def _kernels():
    from m2n_async._data import _kernels

    if not _kernels.available():
        pytest.skip("Triton is not installed here (the kernel is optional)")
    return _kernels


def _random(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    raw = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    x = raw.view(torch.float32).reshape(shape)  # every bit pattern: NaNs, subnormals, inf
    return x.to(dtype).cuda()


@pytest.mark.parametrize("src_dtype,dst_dtype", [
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16), (torch.int8, torch.int8), (torch.int64, torch.int64)])
@pytest.mark.parametrize("strided", [False, True])
def test_copy_many_matches_copy(src_dtype, dst_dtype, strided):
    k = _kernels()
    if src_dtype in (torch.int8, torch.int64):
        srcs = [torch.randint(-100, 100, (64, 48), dtype=src_dtype).cuda() for _ in range(16)]
    else:
        srcs = [_random((64, 48), src_dtype, i) for i in range(16)]
    if strided:
        srcs = [s[:, 8:40] for s in srcs]
    out = torch.empty(16, *srcs[0].shape, dtype=dst_dtype, device="cuda")
    parts = list(out.unbind(0))
    want = torch.stack([s.to(dst_dtype) for s in srcs])
    assert k.uniform_pieces(parts) and k.uniform_pieces(srcs)
    did = k.copy_many(parts, srcs, uniform=strided)  # the caller's promise, or checked here
    if not did:  # a dtype pair failing the exactness self-test is refused, not run
        assert src_dtype != dst_dtype, "equal dtypes are bit copies: always taken"
        return
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_scatter_into_separate_targets_and_refusals():
    k = _kernels()
    stack = _random((12, 32, 16), torch.bfloat16, 7)
    targets = [torch.empty(32, 16, dtype=torch.bfloat16, device="cuda") for _ in range(12)]
    assert k.copy_many(targets, list(stack.unbind(0)))
    torch.cuda.synchronize()
    for t, s in zip(targets, stack.unbind(0), strict=True):
        assert torch.equal(t.view(torch.int16), s.view(torch.int16))
    mixed = [*targets[:-1], torch.empty(16, 32, dtype=torch.bfloat16, device="cuda")]
    assert not k.copy_many(mixed, list(stack.unbind(0)))
    three = [torch.empty(2, 4, 4, device="cuda") for _ in range(12)]
    assert not k.copy_many(three, [t.clone() for t in three])
    assert not k.copy_many(targets[:4], list(stack.unbind(0))[:4])  # too few to pay
    assert not k.uniform_pieces(mixed) and not k.uniform_pieces(three)
