"""Child process of test_gloo_world: one rank of a real 2-process Gloo world running FSDP2.

Kept in its own module so ``spawn`` children import it without importing pytest fixtures.
"""

from __future__ import annotations

import traceback


def run(rank: int, world_size: int, init_file: str, result_file: str) -> None:
    try:
        _run(rank, world_size, init_file)
    except BaseException:
        with open(result_file, "w") as f:
            f.write(traceback.format_exc())
        raise
    with open(result_file, "w") as f:
        f.write("ok")


def _run(rank: int, world_size: int, init_file: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from m2n_async import module_shards, specs_from_module

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 4))
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loss = model(torch.randn(5, 6)).square().mean()
        loss.backward()
        opt.step()
        specs = specs_from_module(model, dtype=torch.bfloat16)
        shards = module_shards(model, [s.name for s in specs], dtype=torch.bfloat16)
        params = dict(model.named_parameters())
        for spec in specs:
            full = params[spec.name].full_tensor().to(torch.bfloat16)  # collective: same order
            box = spec.layout.box(spec.shape, rank)
            want = full[tuple(slice(lo, hi) for lo, hi in box)]
            got = shards[spec.name]
            assert got.dtype == torch.bfloat16, (spec.name, got.dtype)
            assert torch.equal(got, want), (spec.name, rank, got, want)
            assert spec.layout.mesh.dims == (world_size, 1)
    finally:
        dist.destroy_process_group()
