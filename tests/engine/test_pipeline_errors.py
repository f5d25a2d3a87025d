"""The pipeline's errors keep their chain: the leaf a task group wrapped reaches the caller
with its own ``__cause__`` (a native library's error behind a ``TransferError``, say), so the
root of a failed round stays in the traceback."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from m2n_async._engine._pipeline import run_pipeline
from m2n_async._proto.errors import TransferError


class _FailingTransport:
    """A stand-in transport whose stage or completion fails with a chained error."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.ctx = SimpleNamespace(rank=0)
        self._round = 1

    def _fail(self) -> None:
        try:
            raise OSError("native: peer 3 unreachable")
        except OSError as root:
            raise TransferError("m2n: reshard of param 'w' failed", rank=0, round=1) from root

    async def stage(self, bucket: Any, **_: Any) -> Any:
        if self.where == "stage":
            self._fail()
        return SimpleNamespace(seconds={}, cast_bytes=0, nbytes=0, nbytes_moved=0)

    def transfer(self, staging: Any) -> Any:
        outer = self

        class Completion:
            async def wait(self) -> None:
                outer._fail()

        return Completion()

    def release(self, staging: Any) -> None:
        pass


@pytest.mark.parametrize("where", ["stage", "completion"])
def test_the_leaf_error_keeps_its_cause(where: str) -> None:
    async def main() -> None:
        await run_pipeline(_FailingTransport(where),  # type: ignore[arg-type]
                           [SimpleNamespace(index=0)], max_inflight=1,
                           sources=lambda b: _sources())

    async def _sources() -> dict[str, Any]:
        return {}

    with pytest.raises(TransferError) as info:
        anyio.run(main)
    assert isinstance(info.value.__cause__, OSError)
    assert "peer 3 unreachable" in str(info.value.__cause__)
    assert info.value.__suppress_context__  # the task group itself stays out of the report
