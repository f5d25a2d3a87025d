"""The ``Transport`` conformance suite (``tests/dataplanes/conformance.py``) on the real GPU
runtime: the checks ``tests/dataplanes/test_conformance.py`` runs over the fake one, on the
``m2n`` and ``nccl`` lanes, each world spawned by ``_world.run_world``."""

from __future__ import annotations

import json

import pytest

from m2n_async.testing import _gpu as _world

from . import _conformance
from .conftest import gpu_skip_reason

_reason = gpu_skip_reason("nccl", 2)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_reason is not None, reason=_reason or "")]

PKG = __name__.rsplit(".", 1)[0]
C = _conformance.conformance


@pytest.mark.parametrize("layout", sorted(C.LAYOUTS))
@pytest.mark.parametrize("check", sorted(C.CHECKS))
def test_lanes_conform(check: str, layout: str) -> None:
    t, w = C.topology(layout)
    transports = [tr for tr in ("m2n", "nccl") if gpu_skip_reason(tr, w) is None]
    if not transports:
        pytest.skip(gpu_skip_reason("nccl", w) or "")
    case = {"check": check, "layout": layout, "transports": transports}
    out = _world.run_world(f"{PKG}._conformance:run", case, trainer_ranks=t, world_size=w,
                           timeout=180.0)
    res = out["results"]
    missing = [r for r in range(w) if r not in res]
    assert not missing, f"ranks {missing} never reported (hang?): {out}"
    errors = {r: v for r, v in res.items() if "error" in v}
    assert not errors, json.dumps(errors, indent=1)[:4000]
    if "m2n" not in transports:
        pytest.skip(f"nccl conforms; m2n not run: {gpu_skip_reason('m2n', w)}")
