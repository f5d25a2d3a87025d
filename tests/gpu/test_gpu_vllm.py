"""The ``m2n_async`` vLLM backend on the GPU lanes: 2 trainer ranks (fp32 masters on CUDA,
``Shard(0)``) and 2 vLLM worker ranks (TP = 2, the Llama-shaped bf16 model of
``tests/integrations/_vllm_world.py`` on CUDA), every rank a thread of this process on a GPU
of its own, driven as vLLM 0.33's GPU worker drives the backend. Three rounds on ``m2n`` and on
``nccl``: bit-exact, the in-place parameters keep their storage, the fused and vocab-parallel
ones arrive through ``load_weights``. The CPU suite runs the same job over Gloo
(``tests/integrations/test_vllm_backend.py``); this is the data plane vLLM users get.

One GPU per rank: with the four ranks as threads of one process on one GPU (one CUDA
context), the first m2n round hung until its deadline on the H200 (the ranks' collective
kernels wait on each other inside the context), so on fewer than four GPUs the test skips.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from .conftest import gpu_skip_reason

T, TP = 2, 2
TOKEN = "vllm-gpu-tests"
IN_PLACE = {"model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"}


@pytest.fixture(scope="module")
def world() -> Iterator[Any]:
    """The stand-in vLLM modules and the job helpers (``_vllm_world``), with the token set."""
    import importlib

    from m2n_async.integrations import vllm as backend

    world = importlib.import_module("integrations._vllm_world")
    old = os.environ.get(backend.TOKEN_ENV)

    os.environ[backend.TOKEN_ENV] = TOKEN
    with world.stub_vllm():
        yield world
    if old is None:
        os.environ.pop(backend.TOKEN_ENV, None)
    else:
        os.environ[backend.TOKEN_ENV] = old


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _CudaSource:
    """The FSDP2-like source of the CPU tests, its local slabs on the trainer's GPU."""

    def __init__(self, inner: Any, device: torch.device) -> None:
        self.inner = inner
        self.device = device

    @property
    def metadata(self) -> Any:
        return self.inner.metadata

    def owned_names(self, rank: int) -> list[str]:
        return list(self.inner.owned_names(rank))

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.inner.iter_local():
            yield name, t.to(self.device)


@pytest.mark.parametrize("transport", ["m2n", "nccl"])
def test_backend_rounds_bit_exact_on_gpu(world: Any, transport: str) -> None:
    reason = gpu_skip_reason(transport, T + TP)
    if reason is not None:
        pytest.skip(reason)
    if torch.cuda.device_count() < T + TP:
        pytest.skip(f"needs a GPU per rank ({T + TP}); {torch.cuda.device_count()} here "
                    f"(module docstring)")
    from m2n_async.integrations import vllm as backend

    devs = [torch.device("cuda", r) for r in range(T + TP)]  # trainers first, then workers
    models = [world.TinyLlama(r, TP).to(devs[T + r]) for r in range(TP)]
    backends = [backend.VLLMWorkerBackend(object(), world.vllm_config(r, TP), devs[T + r],
                                          models[r]) for r in range(TP)]
    workers = [world.GPUWorker(b, r, world.vllm_config(r, TP)) for r, b in enumerate(backends)]
    client = world.FanOutClient(workers)
    inner = [world.ShardedSource(r, T) for r in range(T)]
    sources = [_CudaSource(s, devs[r]) for r, s in enumerate(inner)]
    port = _free_port()

    def init(r: int) -> Any:
        info = backend.TrainerInitInfo(rank=r, trainer_ranks=T, world_size=T + TP,
                                       store_port=port, job=f"vllm-gpu-{transport}",
                                       dtype="bfloat16", transport=transport,
                                       device=str(devs[r]),
                                       phase_timeout=60, round_timeout=60)
        return backend.VLLMTrainerEngine.trainer_init(info, client=client, source=sources[r])

    trainers: list[Any] = []
    try:
        with ThreadPoolExecutor(T) as ex:
            trainers = list(ex.map(init, range(T)))
        assert [b.engine.transport for b in backends if b.engine is not None] == [transport] * TP
        assert set(backends[0].loaded_names) == {
            n for n in inner[0].owned_names(0) if n not in IN_PLACE}
        ptrs = {n: p.data_ptr() for n, p in models[0].named_parameters()}
        for v in (1, 2, 3):
            for s in inner:
                s.version = v
            with ThreadPoolExecutor(T) as ex:
                results = [f.result(120) for f in
                           [ex.submit(t.send_weights, f"step-{v}") for t in trainers]]
            assert [r.version for r in results] == [v, v]
            assert {r.transport for r in results} == {transport}
            for r, m in enumerate(models):
                got = dict(m.named_parameters())
                for name, want in world.expected_locals(v, r, TP).items():
                    assert got[name].is_cuda, name
                    assert torch.equal(got[name].cpu(), want), (transport, r, name, v)
        # In place is the live storage on the device: the same tensors, written by the engine.
        assert {n: p.data_ptr() for n, p in models[0].named_parameters()} == ptrs
        assert [m.load_calls for m in models] == [3, 3]
    finally:
        for t in trainers:
            t.shutdown()
        for w in workers:
            w.shutdown()
