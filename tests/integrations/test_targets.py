"""targets_from_module / LoadTarget: worker destinations from a module and a TP plan."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from m2n_async import PlanError
from m2n_async._integrations.sources import specs_from_module
from m2n_async._integrations.targets import LoadTarget, WorkerTargets, targets_from_module
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamTransfer
from m2n_async._proto.plan import TransferPlan, validate_local_buffer

TP = 4


class Block(nn.Module):
    """A transformer-ish block; ``tp`` > 1 builds the worker's local shards by hand."""

    def __init__(self, tp: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(32 // tp, 16)       # vocab-parallel (rowwise)
        self.q = nn.Linear(16, 32 // tp)              # colwise: weight [out/tp, in]
        self.o = nn.Linear(32 // tp, 16)              # rowwise: weight [out, in/tp]
        self.norm = nn.LayerNorm(16)                  # replicated
        self.lm_head = nn.Linear(16, 8 // tp, bias=False)


PLAN = {"embed": "rowwise", "q": "colwise", "o": RowwiseParallel(), "lm_head": 0,
        "norm": SequenceParallel()}


def test_tp_plan_styles_map_to_worker_placements() -> None:
    targets = targets_from_module(Block(TP), PLAN)
    assert isinstance(targets, dict) and isinstance(targets, WorkerTargets)
    assert targets.placements() == {
        "embed.weight": (REPLICATE, 0),
        "q.weight": (REPLICATE, 0), "q.bias": (REPLICATE, 0),
        "o.weight": (REPLICATE, 1), "o.bias": None,       # bias added after the all-reduce
        "norm.weight": None, "norm.bias": None,
        "lm_head.weight": (REPLICATE, 0),
    }
    block = Block(TP)
    t = targets_from_module(block, PLAN)
    assert t["q.weight"][0].data_ptr() == block.q.weight.data_ptr()  # written in place


def test_embedding_colwise_and_explicit_dims_and_globs() -> None:
    t = targets_from_module(Block(), {"embed": ColwiseParallel(), "*.weight": -1, "q": 0})
    p = t.placements()
    assert p["embed.weight"] == (REPLICATE, 1)
    assert p["q.weight"] == (REPLICATE, 1)  # the first matching entry wins ("*.weight")
    assert p["q.bias"] == (REPLICATE, 0)
    assert p["norm.bias"] is None


def test_unknown_style_and_bad_dim_are_refused() -> None:
    with pytest.raises(PlanError, match=r"TP plan entry for 'q': unknown style 'diagonal'"):
        targets_from_module(Block(), {"q": "diagonal"})
    with pytest.raises(PlanError, match=r"'q.weight': TP plan 'q' shards dim 2 of a tensor"):
        targets_from_module(Block(), {"q": 2})


def test_worker_targets_match_a_trainer_plan() -> None:
    """Trainer specs of the global model + worker targets of its TP shards = a valid plan."""
    T = 2
    specs = specs_from_module(Block(), mesh=Mesh((T, 1)))
    worker_mesh = Mesh((1, TP), T)
    workers = [targets_from_module(Block(TP), PLAN) for _ in range(TP)]
    transfers = [ParamTransfer(s, Layout(worker_mesh, workers[0].placements()[s.name]))
                 for s in specs]
    plan = TransferPlan(transfers, trainer_ranks=T, world_size=T + TP)
    for i, targets in enumerate(workers):
        for tr in plan.params:
            tensor = targets[tr.name][0]
            validate_local_buffer(tr, tensor, T + i, "destination")


def test_load_targets_declare_shape_and_call_back() -> None:
    fused = torch.zeros(16, 8)
    got: list[tuple[str, torch.Tensor]] = []
    loaders = {
        "q.weight": LoadTarget((8, 16), torch.bfloat16, (REPLICATE, 0),
                               lambda n, t: got.append((n, t.clone()))),
        # half of a dim-1 fused weight: a non-contiguous view, written through copy_
        "extra.weight": LoadTarget.into(fused[:, 4:], (REPLICATE, 1)),
    }
    targets = targets_from_module(Block(TP), PLAN, loaders=loaders)
    assert set(targets.loaded_names) == {"q.weight", "extra.weight"}
    assert targets.placements()["extra.weight"] == (REPLICATE, 1)
    extra = targets["extra.weight"]
    assert isinstance(extra, LoadTarget) and extra.shape == (16, 4) and extra.is_contiguous()
    extra.load("extra.weight", torch.ones(16, 4))
    assert fused[:, 4:].eq(1).all() and fused[:, :4].eq(0).all()
    # a LoadTarget validates against the plan like a tensor does
    spec = specs_from_module(Block(), mesh=Mesh((1, 1)))[1]
    assert spec.name == "q.weight"
    tr = ParamTransfer(spec, Layout(Mesh((1, TP), 1), (REPLICATE, 0)))
    validate_local_buffer(tr, LoadTarget((8, 16), torch.float32, (REPLICATE, 0), print), 2,
                          "destination")
    with pytest.raises(PlanError, match=r"shape \(4, 16\) != local shard shape \(8, 16\)"):
        validate_local_buffer(tr, LoadTarget((4, 16), "float32", (REPLICATE, 0), print), 2,
                              "destination")
    with pytest.raises(PlanError, match="must be a LoadTarget"):
        targets_from_module(Block(), loaders={"x": (torch.zeros(1), None)})  # type: ignore[dict-item]
    with pytest.raises(PlanError, match="must be callable"):
        LoadTarget((1,), "float32", None, None)  # type: ignore[arg-type]


def test_dtensor_worker_params_give_their_own_placements(fake_world) -> None:
    with fake_world(1, 4):
        mesh = init_device_mesh("cpu", (4,))
        block = Block()
        parallelize_module(block, mesh, {"q": ColwiseParallel(), "o": RowwiseParallel()})
        t = targets_from_module(block)
        assert t.placements()["q.weight"] == (REPLICATE, 0)
        assert t.placements()["o.weight"] == (REPLICATE, 1)
        assert t.placements()["o.bias"] is None
        assert tuple(t["q.weight"][0].shape) == (8, 16)  # the local shard, not the DTensor
        assert type(t["q.weight"][0]) is torch.Tensor


def test_dtensor_worker_params_on_a_2d_mesh(fake_world) -> None:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    with fake_world(3, 4):
        mesh = init_device_mesh("cpu", (2, 2))
        m = nn.Module()
        m.register_parameter("a", nn.Parameter(distribute_tensor(
            torch.zeros(4, 4), mesh, [Replicate(), Shard(1)]), requires_grad=False))
        assert targets_from_module(m).placements() == {"a": (REPLICATE, 1)}
        m.register_parameter("b", nn.Parameter(distribute_tensor(
            torch.zeros(4, 4), mesh, [Shard(0), Shard(0)]), requires_grad=False))
        with pytest.raises(PlanError, match=r"parameter 'b': .*shard one dim across both axes"):
            targets_from_module(m)


def test_fused_targets_write_in_place_or_load() -> None:
    from m2n_async._integrations.targets import fused_targets

    qkv = torch.zeros(12, 4)
    parts = fused_targets(qkv, {"q": 8, "k": 2, "v": 2}, dim=0, placements=(REPLICATE, 0))
    q, k = parts["q"], parts["k"]
    assert isinstance(q, tuple) and isinstance(k, tuple)  # rows of a contiguous tensor: views
    q[0].fill_(1.0)
    k[0].fill_(2.0)
    assert qkv[:8].eq(1).all() and qkv[8:10].eq(2).all() and qkv[10:].eq(0).all()
    gate_up = torch.zeros(4, 6)
    cols = fused_targets(gate_up, {"gate": 3, "up": 3}, dim=-1, placements=(REPLICATE, 1))
    up = cols["up"]
    assert isinstance(up, LoadTarget) and up.shape == (4, 3)  # columns: not contiguous
    up.load("up", torch.ones(4, 3))
    assert gate_up[:, 3:].eq(1).all() and gate_up[:, :3].eq(0).all()
    with pytest.raises(PlanError, match=r"add up to 11 along dim 0 but the fused tensor has 12"):
        fused_targets(qkv, {"q": 8, "k": 2, "v": 1}, dim=0, placements=None)


def test_rename_keys_targets_but_patterns_match_module_names() -> None:
    block = Block(TP)
    block.register_buffer("scale", torch.ones(3))
    t = targets_from_module(block, PLAN, buffers=True,
                            rename=lambda n: None if n.startswith("norm") else "model." + n)
    assert "model.q.weight" in t and "norm.weight" not in t and "model.norm.bias" not in t
    assert t.placements()["model.q.weight"] == (REPLICATE, 0)   # matched as "q"
    assert t.placements()["model.o.weight"] == (REPLICATE, 1)
    assert t.placements()["model.scale"] is None
    assert t["model.scale"][0].data_ptr() == block.scale.data_ptr()


def test_non_contiguous_worker_parameters_are_copied_into() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3)).to(memory_format=torch.channels_last)
    targets = targets_from_module(model)
    target = targets["0.weight"]
    assert isinstance(target, LoadTarget) and "0.weight" in targets.loaded_names
    received = torch.arange(8 * 3 * 3 * 3, dtype=torch.float32).reshape(8, 3, 3, 3)
    target.load("0.weight", received)
    assert torch.equal(model[0].weight.detach(), received)  # the model itself changed
    assert isinstance(targets["0.bias"], tuple)  # contiguous: still written in place


class _Attn(nn.Module):
    def __init__(self, tp: int = 1) -> None:
        super().__init__()
        self.q = nn.Linear(16, 32 // tp)
        self.o = nn.Linear(32 // tp, 16)


class _Layer(nn.Module):
    def __init__(self, tp: int = 1) -> None:
        super().__init__()
        self.attn = _Attn(tp)
        self.norm = nn.LayerNorm(16)


class _Blocks(nn.Module):
    def __init__(self, tp: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(tp) for _ in range(2)])


def test_an_entry_for_a_block_does_not_shadow_its_childrens() -> None:
    # As parallelize_module reads the plan ('*' within one dotted segment): q Shard(0),
    # o Shard(1); the block's own entry (activations only) says nothing about its weights.
    plan = {"layers.*": PrepareModuleInput(), "layers.*.attn.q": ColwiseParallel(),
            "layers.*.attn.o": RowwiseParallel()}
    p = targets_from_module(_Blocks(4), plan).placements()
    assert p["layers.0.attn.q.weight"] == (REPLICATE, 0)
    assert p["layers.1.attn.o.weight"] == (REPLICATE, 1)
    assert p["layers.0.norm.weight"] is None
    # '*' across dots still works where nothing matches segment by segment
    p = targets_from_module(_Blocks(4), {"*.q": "colwise", "*.o": "rowwise"}).placements()
    assert (p["layers.1.attn.q.weight"], p["layers.1.attn.o.weight"]) == ((REPLICATE, 0),
                                                                          (REPLICATE, 1))


def test_a_plan_entry_that_matches_nothing_is_refused() -> None:
    # a typo, or HF's base_model_tp_plan without the "model." prefix: everything would be
    # replicated, and the mismatch only seen at connect without a word about the plan
    with pytest.raises(PlanError, match=r"\['layers\.\*\.attn\.q_proj'\] match no module"):
        targets_from_module(_Blocks(4), {"layers.*.attn.q_proj": "colwise",
                                         "layers.*.attn.o": "rowwise"})


def test_subclasses_of_torchs_styles_are_understood_and_a_bool_is_no_dim() -> None:
    class Float8ColwiseParallel(ColwiseParallel):  # torchao's, as torchtitan uses it
        pass

    p = targets_from_module(_Blocks(4), {"layers.*.attn.q": Float8ColwiseParallel()})
    assert p.placements()["layers.0.attn.q.weight"] == (REPLICATE, 0)
    with pytest.raises(PlanError, match="True is not a style or a tensor dim"):
        targets_from_module(_Blocks(4), {"layers.*.attn.q.weight": True})


def test_a_fused_part_of_a_parameter_loads_on_another_thread() -> None:
    # the lanes call loads on a worker thread, where grad mode is on: the view of a
    # Parameter must not be an autograd op ("a view of a leaf Variable that requires grad")
    import threading

    from m2n_async._integrations.targets import fused_targets

    w = nn.Parameter(torch.zeros(4, 6))
    up = fused_targets(w, {"gate": 3, "up": 3}, dim=1, placements=(REPLICATE, 1))["up"]
    assert isinstance(up, LoadTarget)
    errors: list[BaseException] = []

    def unpack() -> None:
        try:
            up.load("up", torch.ones(4, 3))
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=unpack)
    thread.start()
    thread.join()
    assert not errors, errors
    assert bool(w.detach()[:, 3:].eq(1).all()) and bool(w.detach()[:, :3].eq(0).all())
