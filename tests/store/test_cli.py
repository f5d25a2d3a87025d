"""``m2n-async store``: runs standalone, prints its address, serves, stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import anyio
import pytest

from m2n_async import StoreClient
from m2n_async.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.asyncio
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
async def test_store_command_serves_and_stops(tmp_path: Path, loop: str) -> None:
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop (extra 'fast') is not installed")
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")  # trailing newline as editors write it
    cmd = [sys.executable, "-m", "m2n_async.cli", "store", "--host", "127.0.0.1",
           "--port", "0", "--token-file", str(token_file), "--loop", loop]
    async with await anyio.open_process(cmd, env={**os.environ}) as proc:
        assert proc.stdout is not None
        with anyio.fail_after(60):
            line = b""
            async for chunk in proc.stdout:
                line += chunk
                if b"\n" in line:
                    break
        address = line.split(b"\n")[0].decode()
        assert address.startswith("127.0.0.1:")
        with anyio.fail_after(10):
            async with await StoreClient.connect(address, token="s3cret") as c:
                await c.set("k", b"v")
                assert await c.get("k") == b"v"
        proc.send_signal(signal.SIGTERM)
        with anyio.fail_after(30):
            assert await proc.wait() == 0
        assert proc.stderr is not None
        assert f"({loop} event loop".encode() in await proc.stderr.receive()


def test_store_command_rejects_missing_or_empty_token_file(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    assert main(["store", "--token-file", str(tmp_path / "absent")]) == 2
    assert "absent" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert main(["store", "--token-file", str(empty)]) == 2
    assert "is empty" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--max-output-bytes", "--max-partial-bytes"])
def test_store_command_passes_its_budgets_to_the_server(tmp_path: Path, flag: str,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret")
    # too small for one frame: the server refuses it, so the flag reached the server
    assert main(["store", "--token-file", str(token), flag, "100"]) == 2
    assert f"{flag} 100: must be >=" in capsys.readouterr().err
