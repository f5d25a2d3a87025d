"""module_shards against a real 2-process Gloo world: after an FSDP2 optimizer step, each
rank's lazy shards are exactly its box of the updated global tensors."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from . import _gloo_fsdp


@pytest.mark.slow
def test_fsdp2_shards_after_a_step_are_the_boxes_of_the_specs(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    world = 2
    results = [tmp_path / f"rank{r}.txt" for r in range(world)]
    procs = [ctx.Process(target=_gloo_fsdp.run,
                         args=(r, world, str(tmp_path / "init"), str(results[r])))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not alive, f"ranks still running after 120 s: pids {alive}"
    for r, f in enumerate(results):
        text = f.read_text() if f.exists() else "(no result written)"
        assert text == "ok", f"rank {r}:\n{text}"
