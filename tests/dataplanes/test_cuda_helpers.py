"""``_data/_cuda``: actionable import errors, the libnccl gate, identity, completion signals."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import anyio
import pytest
import torch

from m2n_async._data import _cuda
from m2n_async._data._transport import TransportSettings, transport_class
from m2n_async._proto.errors import LocalProtocolError
from m2n_async._proto.lanes import GPU_LANES, LANES

SETTINGS = TransportSettings(max_inflight=2)


def test_missing_nccl4py_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nccl.core", None)  # import raises ImportError
    _cuda.reset_import_cache()
    try:
        with pytest.raises(LocalProtocolError, match=r"pip install 'm2n_async\[gpu\]'"):
            _cuda.nccl_core()
        assert _cuda.libnccl_version() == (None, None)
    finally:
        _cuda.reset_import_cache()


def test_old_libnccl_is_named_before_importing_m2n(fake_world):
    fake_world.libnccl = "2.28.9"
    with pytest.raises(LocalProtocolError) as info:
        _cuda.m2n_module()
    msg = str(info.value)
    assert "2.28.9" in msg and "2.30.5" in msg and "nvidia-nccl-cu13==2.30.7" in msg
    assert "/fake/libnccl.so.2" in msg


def test_new_libnccl_imports_m2n(fake_world):
    assert _cuda.m2n_module() is sys.modules["nccl.m2n"]
    assert _cuda.libnccl_version() == ("2.30.7", "/fake/libnccl.so.2")


def test_cpu_host_cannot_run_gpu_transports(fake_world):
    if _cuda._torch().cuda.is_available():  # pragma: no cover - GPU hosts
        pytest.skip("this host has CUDA")
    for name in GPU_LANES:
        reason = _cuda.gpu_unavailable_reason(name, SETTINGS)
        assert reason is not None and "CUDA is not available" in reason
    reason = _cuda.gpu_unavailable_reason("nccl", TransportSettings(max_inflight=1, device="cpu"))
    assert reason is not None and "not a CUDA device" in reason


def test_only_gloo_is_usable_without_cuda(fake_world):
    # What the engine's capabilities ask each lane; auto then never picks a GPU lane.
    if _cuda._torch().cuda.is_available():  # pragma: no cover - GPU hosts
        pytest.skip("this host has CUDA")
    reasons = {name: transport_class(name).unavailable_reason(SETTINGS) for name in LANES}
    assert reasons["gloo"] is None
    assert all("CUDA is not available" in (reasons[name] or "") for name in GPU_LANES)


def test_identity_matches_the_handshake_filter(fake_world, monkeypatch):
    monkeypatch.setenv("NCCL_RESHARD_NUM_CTAS", "8")
    monkeypatch.setenv("NCCL_RESHARD_LOG_LEVEL", "DEBUG")  # diagnostic: may differ
    monkeypatch.setenv(_cuda.GROUPING_ENV, "off")
    d = transport_class("m2n").identity(TransportSettings(max_inflight=1, max_cta=4))
    assert d["libnccl_version"] == "2.30.7" and d["max_cta"] == "4"
    assert d["NCCL_RESHARD_NUM_CTAS"] == "8" and d[_cuda.GROUPING_ENV] == "off"
    assert "NCCL_RESHARD_LOG_LEVEL" not in d
    nccl = transport_class("nccl").identity(TransportSettings(max_inflight=1))
    assert nccl["NCCL_RESHARD_NUM_CTAS"] == "8" and _cuda.GROUPING_ENV not in nccl
    gloo = transport_class("gloo").identity(TransportSettings(max_inflight=1))
    assert "libnccl_version" not in gloo


def test_grouping_mode_rejects_typos(monkeypatch):
    monkeypatch.setenv(_cuda.GROUPING_ENV, "yes")
    with pytest.raises(LocalProtocolError, match="'auto', 'on' or 'off'"):
        _cuda.grouping_mode()


class _SlowEvent:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.released = threading.Event()

    def synchronize(self) -> None:
        self.released.wait(self.seconds)

    def query(self) -> bool:
        return self.released.is_set()


def test_watcher_fires_in_order_and_skips_aborted():
    w = _cuda._Watcher("t")
    order: list[int] = []
    sigs = [_cuda.Signal() for _ in range(3)]
    for k, s in enumerate(sigs):
        s.add_done_callback(lambda _s, k=k: order.append(k))
    aborted = _cuda.Signal()
    aborted.fire(RuntimeError("aborted"))
    forever = _SlowEvent(3600)
    w.watch(forever, aborted)          # already done: the watcher must not wait on it
    for s in sigs:
        w.watch(_SlowEvent(0.01), s)
    deadline = time.monotonic() + 5
    while not all(s.done() for s in sigs) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == [0, 1, 2]
    assert all(s.error is None for s in sigs)
    w.close(1.0)


@pytest.mark.asyncio
async def test_signal_wakes_the_loop_from_another_thread():
    from m2n_async._data._native import wait_threadsafe

    s = _cuda.Signal()
    threading.Timer(0.05, s.fire).start()
    with anyio.fail_after(5):
        await wait_threadsafe(s.add_done_callback)
    assert s.done() and s.error is None
    assert s.fire() is False  # first caller wins


def test_the_triton_copy_declines_pieces_whose_offsets_pass_int32(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel computes row * stride + column in int32: 8 column blocks (2048 x 1024 bytes,
    # rows 2 MiB apart) of a 4 GiB byte view faulted on an H200 (illegal address). Such pieces
    # must go to the fallback copy; the same blocks of a 1 GiB view still launch. A stand-in
    # kernel records launches (no GPU here).
    import types

    from m2n_async._data import _kernels

    launched: list[Any] = []

    class Kernel:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *a, **kw: launched.append(grid)

    tl = types.SimpleNamespace(int8="i8", int16="i16", int32="i32", int64="i64",
                               float32="f32", bfloat16="bf16", float16="f16", float64="f64")
    triton = types.SimpleNamespace(cdiv=lambda a, b: -(-a // b))
    monkeypatch.setitem(_kernels._state, "kernel", (Kernel(), triton, tl))
    monkeypatch.setattr(_kernels, "pointer_table",
                        lambda ts, dev: _kernels.PointerTable(None, 16))

    def piece(row_stride: int) -> Any:
        strides = (row_stride, 1)
        return types.SimpleNamespace(dtype=torch.uint8, dim=lambda: 2, shape=(2048, 1024),
                                     stride=lambda d=None: strides if d is None else strides[d],
                                     is_cuda=True)

    dsts = [piece(1024) for _ in range(8)]
    assert _kernels._launch(dsts, [piece(1 << 21) for _ in range(8)], "cuda") is False
    assert launched == []
    assert _kernels._launch(dsts, [piece(1 << 19) for _ in range(8)], "cuda") is True
    assert len(launched) == 1


def test_address_align_is_the_widest_common_power_of_two() -> None:
    # What the Triton copy may assume of every piece's address (``PointerTable.align``):
    # a wrong answer would let it read misaligned memory.
    from m2n_async._data._kernels import address_align

    assert address_align([0x1000, 0x2010]) == 16
    assert address_align([0x1000, 0x2008]) == 8
    assert address_align([0x1002]) == 2
    assert address_align([0x1001, 0x1000]) == 1
    assert address_align([]) == 16


@pytest.mark.asyncio
@pytest.mark.parametrize("failing", [False, True])
async def test_a_warm_up_that_cannot_list_its_forms_is_logged_not_raised(monkeypatch, caplog,
                                                                         failing):
    # The lanes' connect-time compile of their copies (``_warm_copies``) only spares the
    # first round: when listing the forms fails, connect goes on (a warning), and the forms
    # listed are handed to ``warm_forms`` on a thread. Doubles: a CUDA stream flag and the
    # kernel module's availability and warm-up (no GPU here).
    from types import SimpleNamespace

    from m2n_async._data import _kernels

    warmed: list[tuple[Any, list[Any]]] = []
    monkeypatch.setattr(_kernels, "available", lambda: True)
    monkeypatch.setattr(_kernels, "warm_forms", lambda dev, forms: warmed.append(
        (dev, forms)) or len(forms))
    t: Any = SimpleNamespace(streams=SimpleNamespace(cuda=True), device="cuda:3", name="nccl",
                             ctx=SimpleNamespace(rank=5))
    form = _kernels.Form(torch.bfloat16, torch.bfloat16, (4,), (1,), (1,), 16)

    def forms() -> list[Any]:
        if failing:
            raise RuntimeError("meta tensors refused a view")
        return [form]

    with caplog.at_level("WARNING", logger="m2n_async"):
        await _cuda.GpuTransportBase._warm_copies(t, forms)
    if failing:
        assert warmed == []
        assert "rank 5 could not list" in caplog.text and "refused a view" in caplog.text
    else:
        assert warmed == [("cuda:3", [form])] and not caplog.text
    t.streams.cuda = False  # a CPU device: nothing is listed or warmed
    await _cuda.GpuTransportBase._warm_copies(t, lambda: pytest.fail("listed on a CPU"))
    assert len(warmed) == (0 if failing else 1)
