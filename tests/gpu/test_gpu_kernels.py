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


@pytest.mark.parametrize("offset", [0, 1, 3, 8])  # elements: 0 and 8 are 16-byte aligned
@pytest.mark.parametrize("numel", [4096, 4095, 17])  # whole vectors, a ragged end, tiny
def test_flat_pieces_at_any_alignment(offset, numel):
    # Contiguous pieces take the flat form; its wide accesses are allowed only when every
    # address is 16-byte aligned. Pieces cut out of one buffer at odd element offsets must
    # still copy exactly (narrow accesses), in both directions of a cast.
    k = _kernels()
    base = _random((16 * (numel + 16) + offset,), torch.float32, 3)
    step = numel + (16 if offset else 0)  # offset 0: back to back, so aligned iff numel is
    srcs = [base[offset + i * step: offset + i * step + numel] for i in range(16)]
    out = torch.empty(16 * step + 16, dtype=torch.bfloat16, device="cuda")
    dsts = [out[offset + i * step: offset + i * step + numel] for i in range(16)]
    table_s, table_d = k.pointer_table(srcs, "cuda"), k.pointer_table(dsts, "cuda")
    assert table_s.align == k.address_align([s.data_ptr() for s in srcs])
    if offset % 4:
        assert table_s.align < 16 and table_d.align < 16
    assert k.copy_many(dsts, srcs, src_table=table_s, dst_table=table_d, uniform=True) or (
        not k._exact(torch.float32, torch.bfloat16, "cuda"))
    torch.cuda.synchronize()
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d.view(torch.int16), s.to(torch.bfloat16).view(torch.int16))
    back = [torch.empty(numel, dtype=torch.float32, device="cuda") for _ in range(16)]
    assert k.copy_many(back, dsts, uniform=True) or not k._exact(
        torch.bfloat16, torch.float32, "cuda")
    torch.cuda.synchronize()
    for b, d in zip(back, dsts, strict=True):
        assert torch.equal(b.view(torch.int32), d.to(torch.float32).view(torch.int32))


def test_flat_and_general_forms_agree():
    # The same contiguous pieces through the row/column form and the flat form.
    k = _kernels()
    srcs = [_random((64, 48), torch.bfloat16, 40 + i) for i in range(16)]
    outs = []
    for flat in (False, True):
        dsts = [torch.empty(64, 48, dtype=torch.bfloat16, device="cuda") for _ in range(16)]
        assert k._launch(dsts, srcs, torch.device("cuda"), check=True, flat=flat)
        outs.append(dsts)
    torch.cuda.synchronize()
    for a, b, s in zip(*outs, srcs, strict=True):
        assert torch.equal(a.view(torch.int16), s.view(torch.int16))
        assert torch.equal(b.view(torch.int16), s.view(torch.int16))



def test_a_pointer_table_is_queued_behind_a_busy_stream_not_waited_for():
    # pointer_table runs on the event loop's thread, on a stream that may still have work
    # queued (the producer's kernels a pack waits for; the transfer an unpack waits for,
    # which never ends if a peer died): it must return while that work is still queued.
    from m2n_async._data import _kernels as k  # the table needs no Triton

    pieces = [torch.empty(16, device="cuda") for _ in range(64)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clock cycles queued on the stream
        table = k.pointer_table(pieces, torch.device("cuda"))
        busy = not side.query()
    side.synchronize()
    assert busy, "pointer_table waited for the stream's earlier work"
    assert table.table.cpu().tolist() == [t.data_ptr() for t in pieces]


@pytest.mark.parametrize("shape,offset,src_dtype", [
    ((33, 48), 0, torch.bfloat16),     # rows not a multiple of 16: its own variant
    ((64, 64), 0, torch.float32),      # a cast into bf16
    ((7,), 2, torch.bfloat16),         # 14-byte pieces from a 4-byte offset: 2-aligned
    ((5, 3), 1, torch.bfloat16)])      # 2-byte aligned
def test_warm_forms_compiles_what_the_copy_then_launches(shape, offset, src_dtype):
    # A form warmed (scratch launch, on a stream of its own) is the variant the real
    # copy of pieces of that form needs: the copy compiles nothing more, and is exact.
    k = _kernels()
    n = torch.Size(shape).numel()
    step = n + 8  # elements between pieces: keeps each piece at the offset's alignment
    base = _random((16 * step + offset,), src_dtype, 11)
    srcs = [base[offset + i * step: offset + i * step + n].view(shape) for i in range(16)]
    out = torch.empty(16 * step + offset, dtype=torch.bfloat16, device="cuda")
    dsts = [out[offset + i * step: offset + i * step + n].view(shape) for i in range(16)]
    align = min(k.address_align([s.data_ptr() for s in srcs]),
                k.address_align([d.data_ptr() for d in dsts]))
    stride = k.contiguous_strides(shape)
    form = k.Form(src_dtype, torch.bfloat16, tuple(shape), stride, stride, align)
    if src_dtype != torch.bfloat16 and not k._exact(src_dtype, torch.bfloat16, "cuda"):
        pytest.skip("this Triton's cast is not exact: the pair is not used")
    assert k.warm_forms(torch.device("cuda"), [form, form]) == 1
    before = k.compiled_variants()
    assert before, "compiled_variants cannot count this Triton's compiled kernels"
    assert k.warm_forms(torch.device("cuda"), [form]) == 1  # a cache hit: nothing new
    assert k.compiled_variants() == before
    assert k.copy_many(dsts, srcs, uniform=True)
    torch.cuda.synchronize()
    assert k.compiled_variants() == before, "the copy compiled a variant the warm-up missed"
    for d, s in zip(dsts, srcs, strict=True):
        assert torch.equal(d.view(torch.int16), s.to(torch.bfloat16).view(torch.int16))


def test_warm_forms_skips_what_the_kernel_does_not_take_and_keeps_its_budget():
    k = _kernels()
    three = k.Form(torch.bfloat16, torch.bfloat16, (2, 4, 4), (16, 4, 1), (16, 4, 1), 16)
    huge = k.Form(torch.bfloat16, torch.bfloat16, (k.WARM_MAX_BYTES,), (1,), (1,), 16)
    assert k.warm_forms(torch.device("cuda"), [three, huge]) == 0
    assert k.warm_forms(torch.device("cuda"), []) == 0
    one = k.Form(torch.bfloat16, torch.bfloat16, (16, 16), (16, 1), (16, 1), 16)
    assert k.warm_forms(torch.device("cuda"), [one], budget_s=-1.0) == 0  # spent: none
