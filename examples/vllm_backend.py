"""The ``m2n_async`` vLLM weight-transfer backend, its whole lifecycle, on CPU without vLLM.

What it shows: the calls an RL framework makes through vLLM's weight-transfer API, with
``m2n_async`` as the backend, and where each side's objects come from:

- the trainer side is ``VLLMTrainerEngine.trainer_init(TrainerInitInfo(...), client=...,
  source=...)`` — what ``WeightTransferTrainerFactory.trainer_init`` calls for
  ``backend = "m2n_async"`` — and one ``send_weights(weight_version)`` per step;
- the worker side is ``VLLMWorkerBackend(config, vllm_config, device, model)`` — what
  ``WeightTransferEngineFactory.create_engine`` builds in each vLLM GPU worker — driven in
  vLLM's order: ``init_transfer_engine(parse_init_info(d))``, then per step
  ``start_weight_update`` → ``update_weights`` → ``finish_weight_update``, ``shutdown``;
- ``Client`` stands in for vLLM's ``RayVLLMWeightSyncClient``/``HTTPVLLMWeightSyncClient``:
  each call runs on every worker at once (here: threads of this process).

The serving model is tensor-parallel (TP = 2) with a fused ``qk`` weight, so its parameters
go through ``model.load_weights`` as they would in vLLM (its parameters carry no vLLM loader
here, so nothing is written in place). After each of three steps every worker's weights are
checked bit-exact against the trainer's, cast to bf16.

Run: ``python examples/vllm_backend.py`` (progress on stderr; exits 0 and prints
``verified: ...``).
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from m2n_async.integrations.vllm import TrainerInitInfo, VLLMTrainerEngine, VLLMWorkerBackend

TP, DIM, VOCAB = 2, 16, 32
WIRE = torch.bfloat16
NAMES = {"embed.weight": (VOCAB, DIM), "q_proj.weight": (DIM, DIM),
         "k_proj.weight": (DIM, DIM), "norm.weight": (DIM,)}


# -- trainer: a WeightSource (vLLM's protocol: metadata, owned_names, iter_local) ------------

@dataclass(frozen=True)
class Meta:  # vLLM's ParamMeta: owners None = every trainer rank, replicated
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    placements: tuple[Any, ...] | None = None


class Trainer:
    """One trainer rank's fp32 masters, as a vLLM ``WeightSource``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.weights = {n: torch.randn(s, generator=g) for n, s in NAMES.items()}

    def step(self) -> None:
        for t in self.weights.values():
            t.mul_(0.9).add_(0.1)

    @cached_property
    def metadata(self) -> list[Meta]:
        return [Meta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]

    def owned_names(self, rank: int) -> list[str]:
        return list(self.weights)

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()


# -- workers: one TP rank's serving model, vLLM-style ----------------------------------------

class Served(nn.Module):
    """TP rank ``r`` of 2: embedding rows sharded, q and k fused into ``qk``, norm whole."""

    def __init__(self, r: int) -> None:
        super().__init__()
        self.r = r
        self.embed = nn.Parameter(torch.zeros(VOCAB // TP, DIM, dtype=WIRE), requires_grad=False)
        self.qk = nn.Parameter(torch.zeros(2 * DIM // TP, DIM, dtype=WIRE), requires_grad=False)
        self.norm = nn.Parameter(torch.zeros(DIM, dtype=WIRE), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's contract: checkpoint names and full tensors in, each rank keeps its part."""
        part = DIM // TP
        for name, full in weights:
            if name == "embed.weight":
                self.embed.copy_(full.chunk(TP, 0)[self.r])
            elif name in ("q_proj.weight", "k_proj.weight"):
                at = 0 if name.startswith("q") else part
                self.qk[at:at + part].copy_(full.chunk(TP, 0)[self.r])
            elif name == "norm.weight":
                self.norm.copy_(full)

    def expected(self, masters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        m = {n: t.to(WIRE) for n, t in masters.items()}
        return {"embed": m["embed.weight"].chunk(TP, 0)[self.r],
                "qk": torch.cat([m["q_proj.weight"].chunk(TP, 0)[self.r],
                                 m["k_proj.weight"].chunk(TP, 0)[self.r]]),
                "norm": m["norm.weight"]}


class Client:
    """vLLM's weight-sync client over the worker backends (a GPU worker parses ``init_info``
    and calls the engine; every call goes to every worker at once)."""

    def __init__(self, backends: list[VLLMWorkerBackend]) -> None:
        self.backends = backends

    def _all(self, fn: Any) -> None:
        with ThreadPoolExecutor(len(self.backends)) as ex:
            for f in [ex.submit(fn, b) for b in self.backends]:
                f.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all(lambda b: b.init_transfer_engine(b.parse_init_info(init_info)))

    def start_weight_update(self) -> None:
        self._all(lambda b: b.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all(lambda b: b.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all(lambda b: b.finish_weight_update())
        print(f"  vLLM would now publish weight_version {weight_version!r}", file=sys.stderr)

    def shutdown_weight_transfer_engine(self) -> None:
        self._all(lambda b: b.shutdown())


def vllm_config(r: int) -> SimpleNamespace:
    # The two pieces of VllmConfig the backend reads.
    pc = SimpleNamespace(tensor_parallel_size=TP, pipeline_parallel_size=1, data_parallel_index=0,
                         world_size=TP, rank=r)
    return SimpleNamespace(parallel_config=pc, model_config=SimpleNamespace(quantization=None))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    os.environ.setdefault("M2N_ASYNC_TOKEN", secrets.token_hex(16))  # every rank reads it

    models = [Served(r) for r in range(TP)]
    backends = [VLLMWorkerBackend(None, vllm_config(r), torch.device("cpu"), models[r])
                for r in range(TP)]
    client = Client(backends)
    trainer = Trainer()
    info = TrainerInitInfo(rank=0, trainer_ranks=1, world_size=1 + TP, dtype="bfloat16",
                           transport="gloo", round_timeout=args.timeout)
    engine = VLLMTrainerEngine.trainer_init(info, client=client, source=trainer)
    try:
        print(f"loaded through load_weights: {backends[0].loaded_names}", file=sys.stderr)
        for step in range(1, args.steps + 1):
            trainer.step()
            result = engine.send_weights(weight_version=f"step-{step}")
            for m in models:
                for name, want in m.expected(trainer.weights).items():
                    if not torch.equal(getattr(m, name), want):
                        print(f"FAILED: step {step}: TP rank {m.r}'s {name} differs",
                              file=sys.stderr)
                        return 1
            print(f"step {step}: version {result.version}, {result.bytes} bytes, "
                  f"{result.seconds * 1e3:.1f} ms", file=sys.stderr)
    finally:
        engine.shutdown()  # also shuts the workers' engines down (through the client)
        for b in backends:
            b.shutdown()  # idempotent
    print(f"verified: {args.steps} steps, {TP} TP workers bit-exact (fp32 masters, bf16 on the "
          f"wire, fused qk through load_weights)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
