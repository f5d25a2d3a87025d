"""The ``Transport`` conformance suite (``tests/dataplanes/conformance.py``) on the real GPU
runtime: the checks ``tests/dataplanes/test_conformance.py`` runs over the fake one, on the
``m2n`` and ``nccl`` lanes. One world (``_world.run_world``) per layout runs every check but
``abort`` in turn, each on transports of its own; ``abort`` gets a world of its own, since its
worker's M2N kernel waits on peers that never come until the abort, and a stream wedged that
way must not serve a later check. A test per check and layout reads its world's report."""

from __future__ import annotations

import json
from typing import Any

import pytest

from m2n_async.testing import _gpu as _world

from . import _conformance
from .conftest import gpu_skip_reason

_reason = gpu_skip_reason("nccl", 2)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_reason is not None, reason=_reason or "")]

PKG = __name__.rsplit(".", 1)[0]
C = _conformance.conformance
#: Checks that run in a world of their own (the docstring says why).
SOLO = frozenset({"abort"})
_worlds: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}


def _world_for(layout: str, check: str, transports: list[str]) -> dict[str, Any]:
    """The report of the world that runs ``check`` on ``layout``, spawned on first use."""
    checks = (check,) if check in SOLO else tuple(c for c in sorted(C.CHECKS) if c not in SOLO)
    key = (layout, checks)
    if key not in _worlds:
        t, w = C.topology(layout)
        case = {"checks": list(checks), "layout": layout, "transports": transports}
        _worlds[key] = _world.run_world(f"{PKG}._conformance:run", case, trainer_ranks=t,
                                        world_size=w, timeout=60.0 + 40.0 * len(checks))
    return _worlds[key]


@pytest.mark.parametrize("layout", sorted(C.LAYOUTS))
@pytest.mark.parametrize("check", sorted(C.CHECKS))
def test_lanes_conform(check: str, layout: str) -> None:
    _, w = C.topology(layout)
    transports = [tr for tr in ("m2n", "nccl") if gpu_skip_reason(tr, w) is None]
    if not transports:
        pytest.skip(gpu_skip_reason("nccl", w) or "")
    out = _world_for(layout, check, transports)
    res = out["results"]
    missing = [r for r in range(w) if r not in res]
    assert not missing, f"ranks {missing} never reported (hang?): {out}"
    errors = {r: v for r, v in res.items() if "error" in v}  # raised outside the checks
    assert not errors, json.dumps(errors, indent=1)[:4000]
    errors = {r: v.get(check, {"error": "not reported"}) for r, v in res.items()
              if "error" in v.get(check, {"error": ""})}
    assert not errors, json.dumps(errors, indent=1)[:4000]
    if "m2n" not in transports:
        pytest.skip(f"nccl conforms; m2n not run: {gpu_skip_reason('m2n', w)}")
