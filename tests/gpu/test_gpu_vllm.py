"""The ``m2n_async`` vLLM backend on the GPU lanes: 2 trainer ranks (fp32 masters on CUDA,
``Shard(0)``) and 2 vLLM worker ranks (TP = 2, the Llama-shaped bf16 model of
``tests/integrations/_vllm_world.py`` on CUDA), every rank a process of its own, driven as
vLLM 0.33's GPU worker drives the backend, the workers answering trainer rank 0's RPCs
(``_vllm_ranks``). Three rounds on ``m2n`` and on ``nccl``: bit-exact, the in-place
parameters keep their storage, the fused and vocab-parallel ones arrive through
``load_weights``. The CPU suite runs the same job over Gloo with the ranks as threads
(``tests/integrations/test_vllm_backend.py``); this is the data plane vLLM users get.

A process per rank because ranks must not share a CUDA context: with the four ranks as
threads of one process on one GPU, the first m2n round hung until its deadline on the H200
(the ranks' collective kernels wait on each other inside one context). As processes they
share the one GPU as every other GPU test does (libnccl >= 2.30, several ranks per GPU).
"""

from __future__ import annotations

import pytest
from integrations._vllm_world import free_port

from m2n_async.testing import _gpu as _world

from ._vllm_ranks import IN_PLACE, TP, T
from .conftest import gpu_skip_reason

PKG = __name__.rsplit(".", 1)[0]
ROUNDS = 3


@pytest.mark.parametrize("transport", ["m2n", "nccl"])
def test_backend_rounds_bit_exact_on_gpu(transport: str) -> None:
    reason = gpu_skip_reason(transport, T + TP)
    if reason is not None:
        pytest.skip(reason)
    case = {"transport": transport, "store_port": free_port(), "rounds": ROUNDS}
    out = _world.run_world(f"{PKG}._vllm_ranks:backend_rounds", case, trainer_ranks=T,
                           world_size=T + TP, timeout=400)
    res = out["results"]
    assert sorted(res) == list(range(T + TP)), out
    errors = {r: v["error"] + "\n" + v.get("traceback", "") for r, v in res.items()
              if "error" in v}
    assert not errors, errors
    for r in range(T):
        assert res[r]["versions"] == list(range(1, ROUNDS + 1)), res[r]
        assert res[r]["transports"] == [transport] * ROUNDS, res[r]
    assert res[0]["calls"][0] == "init_weight_transfer_engine"
    assert res[0]["calls"].count("update_weights") == ROUNDS
    for r in range(T, T + TP):
        w = res[r]
        assert w["transport"] == transport, w
        assert w["rounds"] == ROUNDS, w
        assert w["mismatches"] == [], w["mismatches"]
        assert w["not_cuda"] == [], w["not_cuda"]
        assert w["in_place_kept"], "in-place parameters lost their storage"
        assert w["load_calls"] == ROUNDS, w
        assert not set(w["loaded_names"]) & IN_PLACE, w["loaded_names"]
        assert w["loaded_names"], "nothing went through load_weights"
