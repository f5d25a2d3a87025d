"""Contract with the real vLLM 0.33.0 (``tox -e vllm-contract``; skipped without vLLM).

What only the real vLLM can check: the ``vllm.general_plugins`` entry point is found and run
by vLLM's own ``load_general_plugins()``; its ``WeightTransferEngineFactory.create_engine``
builds our worker engine from ``WeightTransferConfig(backend="m2n_async")``; its
``WeightTransferTrainerFactory.trainer_init`` dispatches our ``TrainerInitInfo`` and our
trainer reads vLLM's ``ModuleSource`` over an FSDP2 module (real DTensor ``ParamMeta``); the
worker's ``load_weights`` path runs under vLLM's own ``collective_rpc``-style calls. (vLLM's
layer and layerwise-reload modules need its engine closure — xgrammar, apache-tvm-ffi — which
this env leaves out, so the backend finds no known-safe loader and no reload hooks here and
loads everything through ``load_weights``; the in-place rule and the hooks are covered by
tests/integrations/test_vllm_backend.py against modules with vLLM's paths.) The job: 1 FSDP2
trainer rank (its own one-rank Gloo world) and 2 vLLM worker engines (TP = 2),
driven as vLLM's GPU worker drives them, 3 rounds bit-exact, plus shutdown and init again.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("vllm.distributed.weight_transfer", reason="the vllm-contract tox env "
                    "installs vLLM 0.33.0 (no deps)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from _vllm_world import FanOutClient, GPUWorker, vllm_config

T, TP = 1, 2
VOCAB, DIM = 16, 8
WIRE = torch.bfloat16


def _fused_loader(param: torch.Tensor, loaded_weight: torch.Tensor, part: int) -> None:
    param.data.narrow(0, part * DIM, DIM).copy_(loaded_weight)


class Policy(nn.Module):
    """The trainer's model (fp32 masters): checkpoint names, unfused q/k/v."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.norm = nn.LayerNorm(DIM, bias=False)


class Served(nn.Module):
    """A worker's model, vLLM-style: a fused ``qk`` (filled by a loader taking a shard id),
    an embedding and a norm without loaders, all through ``load_weights``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.zeros(VOCAB, DIM, dtype=WIRE),
                                         requires_grad=False)
        self.qk = nn.Module()
        self.qk.weight = nn.Parameter(torch.zeros(2 * DIM, DIM, dtype=WIRE),
                                      requires_grad=False)
        self.qk.weight.weight_loader = _fused_loader  # type: ignore[attr-defined]
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.zeros(DIM, dtype=WIRE), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        done = set()
        for name, w in weights:
            params = dict(self.named_parameters())  # layerwise reload swaps them
            if name in ("q_proj.weight", "k_proj.weight"):
                p = params["qk.weight"]
                p.weight_loader(p, w, 0 if name.startswith("q") else 1)  # type: ignore[attr-defined]
                done.add("qk.weight")
            else:
                p = params[name]
                p.data.copy_(w)
                done.add(name)
        return done


def _expected(model: nn.Module) -> dict[str, torch.Tensor]:
    full = {n: p.full_tensor().detach().to(WIRE) for n, p in model.named_parameters()}
    return {"embed.weight": full["embed.weight"], "norm.weight": full["norm.weight"],
            "qk.weight": torch.cat([full["q_proj.weight"], full["k_proj.weight"]])}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    import torch.distributed as dist

    path = tmp_path_factory.mktemp("trainer") / "rendezvous"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    os.environ["M2N_ASYNC_TOKEN"] = "vllm-contract"
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_lifecycle_through_vllms_own_factories(world: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import (
        ModuleSource,
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.plugins import load_general_plugins

    from m2n_async.integrations.vllm import TrainerInitInfo, VLLMWorkerBackend

    load_general_plugins()  # runs our entry point (and vLLM's own plugins)
    assert "m2n_async" in WeightTransferEngineFactory._registry
    assert "m2n_async" in WeightTransferTrainerFactory._registry
    from m2n_async.integrations.vllm import register

    register()  # idempotent: vLLM may run plugins again in one process

    cfg = WeightTransferConfig(backend="m2n_async")
    models = [Served() for _ in range(TP)]
    engines = [WeightTransferEngineFactory.create_engine(cfg, vllm_config(r, TP),
                                                         torch.device("cpu"), models[r])
               for r in range(TP)]
    assert all(isinstance(e, VLLMWorkerBackend) for e in engines)
    workers = [GPUWorker(e, r, vllm_config(r, TP)) for r, e in enumerate(engines)]
    client = FanOutClient(workers)

    torch.manual_seed(0)
    policy = Policy()
    fully_shard(policy, mesh=init_device_mesh("cpu", (T,)))
    source = ModuleSource(policy)
    assert source.metadata[0].owners == (0,)  # a DTensor's ParamMeta

    def trainer_init() -> Any:
        info = TrainerInitInfo(rank=0, trainer_ranks=T, world_size=T + TP, dtype="bfloat16",
                               transport="gloo", job="vllm-contract", phase_timeout=30,
                               round_timeout=30)
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)

    trainer = trainer_init()
    try:
        assert set(engines[0].loaded_names) == {"embed.weight", "q_proj.weight",
                                                "k_proj.weight", "norm.weight"}
        for v in (1, 2, 3):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(1.0)  # a "step": new weights every round
            result = trainer.send_weights(f"v{v}")
            assert result.version == v
            want = _expected(policy)
            for m in models:
                got = dict(m.named_parameters())
                for name, t in want.items():
                    assert torch.equal(got[name], t), (v, name)
        # Shutdown and init again: a new generation, and it still moves the weights.
        trainer.shutdown()
        trainer.shutdown()
        trainer = trainer_init()
        with torch.no_grad():
            for p in policy.parameters():
                p.mul_(0.5)
        assert trainer.send_weights().version == 1
        for m in models:
            got = dict(m.named_parameters())
            for name, t in _expected(policy).items():
                assert torch.equal(got[name], t), name
    finally:
        trainer.shutdown()
        with ThreadPoolExecutor(TP) as ex:
            list(ex.map(lambda w: w.shutdown(), workers))
