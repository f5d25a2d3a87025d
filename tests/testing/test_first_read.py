"""What a user reads first: the CLI's help, the demo's round line, ``SyncResult``."""

from __future__ import annotations

import pytest

from m2n_async import SyncResult
from m2n_async.cli import main


@pytest.mark.parametrize("argv", [["--help"], ["store", "--help"], ["plan", "--help"],
                                  ["demo", "--help"]])
def test_help_is_plain_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    out = capsys.readouterr().out
    assert "``" not in out and "Theory of operation" not in out, out
    assert "usage: m2n-async" in out


def test_the_demo_says_each_worker_verified_its_tensors() -> None:
    from m2n_async._demo import DemoArgs, RoundReport, _print_round

    lines: list[str] = []

    class Bar:
        def line(self, text: str) -> None:
            lines.append(text)

    args = DemoArgs(trainers=1, workers=2, rounds=1, size_mb=1.0, transport="gloo",
                    address="", token="", job="", round_timeout=1.0, phase_timeout=1.0,
                    bucket_mb=1.0)
    reps = {r: RoundReport(r, 1, 1, 50 if r else 0, 0.5, checked=633 if r else 0)
            for r in range(3)}
    _print_round(args, reps, 100, Bar())  # type: ignore[arg-type]
    assert "per worker rank (1, 2): 633 tensors bit-exact" in lines[0], lines


def test_sync_result_summary_labels_wall_and_busy_time() -> None:
    res = SyncResult(version=3, round=3, generation=1, bytes=2_000_000, seconds=20.5,
                     phases={"wait_start": 0.1, "pack": 1.0, "transfer": 59.8, "unpack": 2.0,
                             "pipeline": 20.0, "commit": 0.4}, buckets=12,
                     lower_bound_seconds=10.0, efficiency=0.49, transport="gloo")
    text = res.summary()
    assert text.splitlines()[0].startswith("version 3 (round 3, generation 1): 2.0 MB in 12")
    assert "wall: wait_start 0.100 s, pipeline 20.000 s, commit 0.400 s" in text
    assert "busy, summed over buckets (they overlap): pack 1.000 s, transfer 59.800 s" in text
    assert "lower bound 10.000 s (49% of it)" in text
    assert len(text.splitlines()) <= 8
