"""``EngineConfig.bucket_bytes=None`` resolves to the agreed transport's default."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from m2n_async import EngineConfig, TrainerEngine
from m2n_async._proto.errors import PlanError
from m2n_async._proto.lanes import DEFAULT_BUCKET_BYTES, LANES


def _resolve(cfg: EngineConfig, transport: str) -> int:
    # The resolution reads nothing but the config: call it without building an engine.
    return TrainerEngine._bucket_bytes(SimpleNamespace(config=cfg), transport)  # type: ignore[arg-type]


def test_default_bucket_bytes_follow_the_transport() -> None:
    cfg = EngineConfig()
    assert cfg.bucket_bytes is None
    assert _resolve(cfg, "gloo") == 64 << 20
    assert _resolve(cfg, "nccl") == _resolve(cfg, "m2n") == 256 << 20
    assert all(_resolve(cfg, t) == DEFAULT_BUCKET_BYTES[t] for t in LANES)


def test_explicit_bucket_bytes_win_everywhere() -> None:
    cfg = EngineConfig(bucket_bytes=1 << 20)
    assert {_resolve(cfg, t) for t in ("gloo", "nccl", "m2n")} == {1 << 20}


@pytest.mark.parametrize("bad", [0, -1, 1.5, "64MiB", True, 2**63, 2**64])
def test_bad_bucket_bytes_are_refused(bad: object) -> None:
    # From 2**63 on, the handshake could not pack it: refused here, not at connect.
    with pytest.raises(PlanError, match=r"bucket_bytes must be None or an int in \[1, 2\*\*63\)"):
        EngineConfig(bucket_bytes=bad)  # type: ignore[arg-type]
