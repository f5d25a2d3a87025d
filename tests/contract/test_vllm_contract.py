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
tests/integrations/test_vllm_backend.py against modules with vLLM's paths.) The job: 2 FSDP2
trainer ranks (spawned processes in a two-rank Gloo world, so the metadata is a real DTensor's
over two owners) and 2 vLLM worker engines (TP = 2) in this process, driven as vLLM's GPU
worker drives them, answering trainer rank 0's RPCs over a pipe (the trainer's
``VLLMWeightSyncClient``): 3 rounds bit-exact, then shutdown and init again.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("vllm.distributed.weight_transfer", reason="the vllm-contract tox env "
                    "installs vLLM 0.33.0 (no deps)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integrations"))
from _vllm_world import FanOutClient, GPUWorker, SyncClient, free_port, vllm_config

T, TP = 2, 2
TOKEN = "vllm-contract"
ROUNDS = 3
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


def _steps(policy: nn.Module, step: int) -> None:
    """The trainer's "optimizer step" before round ``step`` (1..ROUNDS; ROUNDS + 1 is the
    round after init again): elementwise, so sharded and whole masters stay identical."""
    with torch.no_grad():
        for p in policy.parameters():
            if step <= ROUNDS:
                p.add_(1.0)
            else:
                p.mul_(0.5)


class PipeClient(SyncClient):
    """Trainer rank 0's ``VLLMWeightSyncClient``: each call goes over ``conn`` (JSON) to the
    test process, which runs it on every worker at once (``FanOutClient``) and answers when
    all did; a worker's error comes back as a ``RuntimeError``."""

    def __init__(self, conn: Any) -> None:
        super().__init__()
        self.conn = conn
        self.lock = threading.Lock()  # the backend's RPC thread and its caller both call

    def _all(self, method: str, *args: Any) -> None:
        with self.lock:
            self.conn.send_bytes(json.dumps({"method": method, "args": list(args)}).encode())
            answer = json.loads(self.conn.recv_bytes())
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")


def _trainer(rank: int, rendezvous: str, port: int, conn: Any, out: Any) -> None:
    """A spawned FSDP2 trainer rank: vLLM's ``ModuleSource`` over ``fully_shard(Policy())``
    on a two-rank Gloo mesh, through vLLM's ``WeightTransferTrainerFactory``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from m2n_async.integrations.vllm import TrainerInitInfo

    torch.set_num_threads(1)
    os.environ["M2N_ASYNC_TOKEN"] = TOKEN
    report: dict[str, Any] = {"rank": rank, "versions": []}
    try:
        load_general_plugins()
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                                world_size=T)
        torch.manual_seed(0)
        policy = Policy()
        fully_shard(policy, mesh=init_device_mesh("cpu", (T,)))
        source = ModuleSource(policy)
        report["owners"] = [list(m.owners) for m in source.metadata]
        client = PipeClient(conn) if rank == 0 else None

        def trainer_init() -> Any:
            info = TrainerInitInfo(rank=rank, trainer_ranks=T, world_size=T + TP,
                                   store_port=port, dtype="bfloat16", transport="gloo",
                                   job="vllm-contract", phase_timeout=60, round_timeout=60)
            return WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                             source=source)

        trainer = trainer_init()
        for step in range(1, ROUNDS + 1):
            _steps(policy, step)
            report["versions"].append(trainer.send_weights(f"v{step}").version)
        # Shutdown and init again: a new generation, and it still moves the weights.
        trainer.shutdown()
        trainer.shutdown()
        trainer = trainer_init()
        _steps(policy, ROUNDS + 1)
        report["versions"].append(trainer.send_weights().version)
        trainer.shutdown()
        dist.destroy_process_group()
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
    out.put(report)


def test_lifecycle_through_vllms_own_factories(tmp_path: Path) -> None:
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )
    from vllm.plugins import load_general_plugins

    from m2n_async.integrations.vllm import VLLMWorkerBackend, register

    load_general_plugins()  # runs our entry point (and vLLM's own plugins)
    assert "m2n_async" in WeightTransferEngineFactory._registry
    assert "m2n_async" in WeightTransferTrainerFactory._registry
    register()  # idempotent: vLLM may run plugins again in one process

    os.environ["M2N_ASYNC_TOKEN"] = TOKEN
    cfg = WeightTransferConfig(backend="m2n_async")
    models = [Served() for _ in range(TP)]
    engines = [WeightTransferEngineFactory.create_engine(cfg, vllm_config(r, TP),
                                                         torch.device("cpu"), models[r])
               for r in range(TP)]
    assert all(isinstance(e, VLLMWorkerBackend) for e in engines)
    workers = [GPUWorker(e, r, vllm_config(r, TP)) for r, e in enumerate(engines)]
    client = FanOutClient(workers)

    torch.manual_seed(0)
    whole = Policy()  # the same masters unsharded: what every round must deliver
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_trainer, args=(r, str(tmp_path / "rendezvous"), port,
                                                theirs if r == 0 else None, out),
                         daemon=True) for r in range(T)]
    for p in procs:
        p.start()
    checked: list[int] = []
    loaded: set[str] = set()
    reports: list[dict[str, Any]] = []

    def next_call(limit: float) -> dict[str, Any] | None:
        """Rank 0's next RPC; None once a trainer reported an error (or after ``limit``)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if ours.poll(0.2):
                return json.loads(ours.recv_bytes())  # type: ignore[no-any-return]
            while not out.empty():
                reports.append(out.get())
            if any("error" in r for r in reports):
                return None
        return None

    try:
        step = 0
        while len(checked) <= ROUNDS:  # serve rank 0's RPCs up to the round after init again
            call = next_call(120)
            if call is None:
                raise AssertionError(f"trainers: {reports}, exit codes "
                                     f"{[p.exitcode for p in procs]}")
            method, args = call["method"], call["args"]
            if method == "start_weight_update":
                step += 1
                _steps(whole, step)
            try:
                getattr(client, method)(*args)
                answer: dict[str, Any] = {}
            except Exception as exc:
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            if method == "finish_weight_update" and not answer:
                want = _expected_whole(whole)
                for r, m in enumerate(models):
                    got = dict(m.named_parameters())
                    for name, t in want.items():
                        assert torch.equal(got[name], t), (step, r, name)
                checked.append(step)
                loaded = set(engines[0].loaded_names)  # while the engine is up
            ours.send_bytes(json.dumps(answer).encode())
        call = next_call(60)  # rank 0's last shutdown releases the workers' engines
        assert call is not None and call["method"] == "shutdown_weight_transfer_engine", \
            (call, reports)
        client.shutdown_weight_transfer_engine()
        ours.send_bytes(b"{}")
        while len(reports) < T:
            reports.append(out.get(timeout=60))
        reports.sort(key=lambda r: r["rank"])
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        with ThreadPoolExecutor(TP) as ex:
            list(ex.map(lambda w: w.shutdown(), workers))
    assert [r.get("error") for r in reports] == [None] * T, reports
    assert [r["versions"] for r in reports] == [[1, 2, 3, 1]] * T, reports
    assert all(o == list(range(T)) for o in reports[0]["owners"]), reports[0]["owners"]
    assert checked == list(range(1, ROUNDS + 2))
    assert loaded == {"embed.weight", "q_proj.weight", "k_proj.weight", "norm.weight"}


def _expected_whole(model: nn.Module) -> dict[str, torch.Tensor]:
    full = {n: p.detach().to(WIRE) for n, p in model.named_parameters()}
    return {"embed.weight": full["embed.weight"], "norm.weight": full["norm.weight"],
            "qk.weight": torch.cat([full["q_proj.weight"], full["k_proj.weight"]])}


_PLAIN_TRAINER = """
import os
os.environ["M2N_ASYNC_TOKEN"] = "x"
from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
from m2n_async.integrations.vllm import TrainerInitInfo

class Client:
    def init_weight_transfer_engine(self, init_info): pass
    def start_weight_update(self): pass
    def update_weights(self, update_info): pass
    def finish_weight_update(self, weight_version=None): pass

info = TrainerInitInfo(rank=0, trainer_ranks=1, world_size=2)
try:
    WeightTransferTrainerFactory.trainer_init(info, client=Client())
except ValueError as exc:
    print("RAISED", exc)
"""


def test_a_plain_trainer_process_reaches_the_backend_without_plugins(tmp_path: Path) -> None:
    # A fresh interpreter that never runs vLLM's general plugins (as a trainer process):
    # the documented snippet's trainer_init is dispatched to m2n_async, whose own check
    # answers (no WeightSource), not vLLM's "Invalid weight transfer backend".
    import subprocess

    import m2n_async

    here = str(Path(m2n_async.__file__).resolve().parents[1])  # m2n_async as imported here
    path = os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _PLAIN_TRAINER], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "VLLM_PLUGINS": "", "PYTHONPATH": path})
    assert "RAISED" in done.stdout and "needs a WeightSource" in done.stdout, (
        done.stdout, done.stderr[-2000:])
