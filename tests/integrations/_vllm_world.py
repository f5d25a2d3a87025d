"""A vLLM-shaped job in one process, for the backend tests (not a test module).

- ``stub_vllm()`` puts ``vllm_stub/`` (the few vLLM modules the backend imports, with vLLM's
  module paths and loader semantics) first on ``sys.path``.
- ``TinyLlama`` is one TP rank's model laid out as vLLM lays out a Llama: vocab-parallel
  embedding and LM head, fused ``qkv_proj`` and ``gate_up_proj``, row-parallel ``o_proj`` and
  ``down_proj``, norms without a loader; its ``load_weights`` maps checkpoint names onto them
  as vLLM's ``stacked_params_mapping`` does.
- ``GPUWorker`` drives a backend exactly as ``vllm/v1/worker/gpu_worker.py`` (0.33) drives
  its ``weight_transfer_engine``: the session flag, the list indexed by global worker rank,
  ``reset_weight_update_target`` on errors, refusing shutdown during an update.
- ``FanOutClient`` is the trainer's ``VLLMWeightSyncClient`` over several workers (as
  ``RayVLLMWeightSyncClient``: every worker called at once, all awaited).
- ``ShardedSource`` is a ``WeightSource`` whose metadata says FSDP2 (``Shard(0)`` over every
  trainer rank) and whose ``iter_local`` yields ``torch.chunk`` slabs of fp32 masters.
Every rank is a thread here; each engine still has its own loop thread and Gloo group.
"""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

STUB = Path(__file__).resolve().parent / "vllm_stub"
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 32, 4, 2, 8, 48
WIRE = torch.bfloat16


@contextmanager
def stub_vllm() -> Iterator[None]:
    def purge() -> None:
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]

    purge()
    sys.path.insert(0, str(STUB))
    try:
        yield
    finally:
        sys.path.remove(str(STUB))
        purge()


@contextmanager
def stubbed_backend(token: str) -> Iterator[None]:
    """``stub_vllm``, with ``token`` in the backend's token variable (every rank reads the
    store token from there); the variable is restored after."""
    import pytest

    from m2n_async.integrations import vllm as backend

    with pytest.MonkeyPatch.context() as mp, stub_vllm():
        mp.setenv(backend.TOKEN_ENV, token)
        yield


def free_port() -> int:
    """A port free on 127.0.0.1 now: trainer rank 0's store port for a job's ranks to share."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def lagging_listener(delay: float | None) -> Iterator[str]:
    """An address on 127.0.0.1 that accepts TCP connections and sends each its first byte
    only ``delay`` s later (a loaded store host: a probe takes at least ``delay``), or never
    (``None``: another service on the store's port, a wedged host; the store's client waits
    for the server's challenge)."""
    held: list[socket.socket] = []
    stop = threading.Event()
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        srv.settimeout(0.05)

        def answer(conn: socket.socket) -> None:
            if delay is not None and not stop.wait(delay):
                try:
                    conn.sendall(b"x")
                except OSError:
                    pass

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn = srv.accept()[0]
                except OSError:
                    continue
                held.append(conn)
                threading.Thread(target=answer, args=(conn,), daemon=True).start()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{srv.getsockname()[1]}"
        finally:
            stop.set()
            thread.join(5)
            for conn in held:
                conn.close()


# -- the checkpoint (trainer side): HF names and shapes ----------------------------------------

def checkpoint_shapes() -> dict[str, tuple[int, ...]]:
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": (VOCAB, HIDDEN),
        p + "input_layernorm.weight": (HIDDEN,),
        p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
        p + "post_attention_layernorm.weight": (HIDDEN,),
        p + "mlp.gate_proj.weight": (FFN, HIDDEN),
        p + "mlp.up_proj.weight": (FFN, HIDDEN),
        p + "mlp.down_proj.weight": (HIDDEN, FFN),
        "model.norm.weight": (HIDDEN,),
        "lm_head.weight": (VOCAB, HIDDEN),
    }


def masters(version: int) -> dict[str, torch.Tensor]:
    """The trainer's fp32 full tensors after step ``version``."""
    out = {}
    for i, (name, shape) in enumerate(checkpoint_shapes().items()):
        g = torch.Generator().manual_seed(1000 * version + i)
        out[name] = torch.randn(shape, generator=g)
    return out


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class Replicate:
    pass


@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    placements: tuple[Any, ...] | None = None


@dataclass
class ShardedSource:
    """FSDP2-like: every parameter ``Shard(0)`` over trainer ranks ``[0, T)``."""

    rank: int
    trainers: int
    version: int = 1
    iterated: list[int] = field(default_factory=list)

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, torch.float32, s, owners=tuple(range(self.trainers)),
                          mesh_shape=(self.trainers,), placements=(Shard(0),))
                for n, s in checkpoint_shapes().items()]

    def owned_names(self, rank: int) -> list[str]:
        return [m.name for m in self.metadata]

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.iterated.append(self.version)
        for name, full in masters(self.version).items():
            yield name, torch.chunk(full, self.trainers, 0)[self.rank].contiguous()


# -- the worker model (vLLM layout) ----------------------------------------------------------

class TinyLlama(nn.Module):
    def __init__(self, tp_rank: int, tp: int) -> None:
        from vllm.model_executor.layers.linear import (  # the stub
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            VocabParallelEmbedding,
        )

        super().__init__()
        kw = {"tp_rank": tp_rank, "tp_size": tp, "dtype": WIRE}
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN, **kw)
        layer = nn.Module()
        layer.input_layernorm = _Norm()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, KV_HEADS, **kw)
        layer.self_attn.o_proj = RowParallelLinear(HEADS * HEAD_DIM, HIDDEN, **kw)
        layer.post_attention_layernorm = _Norm()
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [FFN, FFN], **kw)
        layer.mlp.down_proj = RowParallelLinear(FFN, HIDDEN, **kw)
        self.model.layers = nn.ModuleList([layer])
        self.model.norm = _Norm()
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN, **kw)
        self.fail_load = False  # tests set it to make load_weights raise
        self.fail_after_load = False  # ... or raise once it consumed every tensor
        self.load_calls = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        from vllm.model_executor.model_loader.mtp_validation import enabled
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        assert not enabled(), "vLLM's backends load partial weights with the check disabled"
        self.load_calls += 1
        stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                   ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                   ("gate_up_proj", "up_proj", 1)]
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            if self.fail_load:
                raise RuntimeError("load_weights failed (injected)")
            for fused, part, shard_id in stacked:
                if part in name:
                    fname = name.replace(part, fused)
                    p = params[fname]
                    p.weight_loader(p, w, shard_id)  # type: ignore[attr-defined]
                    loaded.add(fname)
                    break
            else:
                p = params[name]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
                loaded.add(name)
        if self.fail_after_load:  # e.g. a layer's processing after loading
            raise RuntimeError("post-load processing failed (injected)")
        return loaded


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(HIDDEN, dtype=WIRE), requires_grad=False)


def expected_locals(version: int, tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """What TP rank ``tp_rank``'s ``TinyLlama`` must hold after round ``version``."""
    full = {n: t.to(WIRE) for n, t in masters(version).items()}

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.chunk(t, tp, 0)[tp_rank]

    def cols(t: torch.Tensor) -> torch.Tensor:
        return torch.chunk(t, tp, 1)[tp_rank]

    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": rows(full["model.embed_tokens.weight"]),
        p + "input_layernorm.weight": full[p + "input_layernorm.weight"],
        p + "self_attn.qkv_proj.weight": torch.cat([rows(full[p + f"self_attn.{x}_proj.weight"])
                                                    for x in "qkv"]),
        p + "self_attn.o_proj.weight": cols(full[p + "self_attn.o_proj.weight"]),
        p + "post_attention_layernorm.weight": full[p + "post_attention_layernorm.weight"],
        p + "mlp.gate_up_proj.weight": torch.cat([rows(full[p + "mlp.gate_proj.weight"]),
                                                  rows(full[p + "mlp.up_proj.weight"])]),
        p + "mlp.down_proj.weight": cols(full[p + "mlp.down_proj.weight"]),
        "model.norm.weight": full["model.norm.weight"],
        "lm_head.weight": rows(full["lm_head.weight"]),
    }


def vllm_config(tp_rank: int, tp: int, dp_index: int = 0) -> SimpleNamespace:
    pc = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                         data_parallel_size=1, data_parallel_index=dp_index, world_size=tp,
                         rank=tp_rank)
    return SimpleNamespace(parallel_config=pc, model_config=SimpleNamespace(quantization=None,
                                                                            dtype=WIRE))


# -- vLLM's GPU worker, as it drives weight_transfer_engine ----------------------------------

class GPUWorker:
    """The weight-transfer part of ``vllm.v1.worker.gpu_worker.Worker`` (0.33), verbatim in
    behaviour."""

    def __init__(self, engine: Any, rank: int, vllm_config: Any) -> None:
        self.weight_transfer_engine = engine
        self.rank = rank  # rank within its data-parallel replica
        self.vllm_config = vllm_config
        self._weight_update_active = False

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        typed = self.weight_transfer_engine.parse_init_info(init_info)
        self.weight_transfer_engine.init_transfer_engine(typed)

    def shutdown_weight_transfer_engine(self) -> None:
        if self._weight_update_active:
            raise RuntimeError("Cannot release a trainer connection during a weight update")
        self.weight_transfer_engine.shutdown()

    def start_weight_update(self) -> None:
        if self._weight_update_active:
            raise RuntimeError("start_weight_update called while a weight update is already "
                               "active. Call finish_weight_update first.")
        try:
            self.weight_transfer_engine.start_weight_update()
        except BaseException:
            self.weight_transfer_engine.reset_weight_update_target()
            raise
        self._weight_update_active = True

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        if not self._weight_update_active:
            raise RuntimeError("start_weight_update must be called before update_weights.")
        try:
            if isinstance(update_info, list):
                pc = self.vllm_config.parallel_config
                update_info = update_info[pc.data_parallel_index * pc.world_size + self.rank]
            self.weight_transfer_engine.update_weights(update_info)
        except BaseException:
            self._weight_update_active = False
            self.weight_transfer_engine.reset_weight_update_target()
            raise

    def finish_weight_update(self) -> None:
        if not self._weight_update_active:
            raise RuntimeError("finish_weight_update called without a matching "
                               "start_weight_update.")
        self.weight_transfer_engine.finish_weight_update()
        self.weight_transfer_engine.reset_weight_update_target()
        self._weight_update_active = False

    def shutdown(self) -> None:
        self.weight_transfer_engine.shutdown()


class SyncClient:
    """The calls of vLLM's ``VLLMWeightSyncClient`` the backend makes, each sent to every
    worker by ``_all(method, *args)`` (which a client defines: in this process, over a pipe,
    through a store); ``calls`` records them, ``versions`` what ``finish`` published."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.versions: list[str | None] = []

    def _all(self, method: str, *args: Any) -> None:
        raise NotImplementedError

    def _call(self, method: str, *args: Any) -> None:
        self.calls.append(method)
        self._all(method, *args)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._call("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update")
        self.versions.append(weight_version)  # vLLM publishes it after finish


class FanOutClient(SyncClient):
    """``VLLMWeightSyncClient`` over several ``GPUWorker``s: each call runs on every worker at
    once and returns when all did (the first error is raised), as Ray's client does."""

    def __init__(self, workers: list[GPUWorker]) -> None:
        super().__init__()
        self.workers = workers

    def _all(self, method: str, *args: Any) -> None:
        with ThreadPoolExecutor(len(self.workers)) as ex:
            futs = [ex.submit(getattr(w, method), *args) for w in self.workers]
            for f in futs:
                f.result()
