"""The demo (``m2n-async demo``) and the CPU sync bench at tiny sizes.

The content function and the verifier are checked in-process (they are what makes the demo's
"bit-exact" claim mean something: a wrong, stale or misplaced byte must fail it); the demo
runs end to end as processes once through the CLI and once per injected fault (a rank dying
mid-job, a corrupted byte), which must exit non-zero naming the rank — with every child
reaped. The bench runs once at its smallest size and must print its figures.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from m2n_async._demo import (
    DemoParam,
    Ready,
    _bytes_2d,
    _connected_line,
    _Display,
    _display,
    _LineDisplay,
    base_content,
    demo_model,
    demo_plan,
    mismatches,
    run_demo,
    shard_content,
)
from m2n_async._proto.layout import REPLICATE as R

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--size-mb", "2", "--rounds", "2", "--round-timeout", "60"]


def _full_box(shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((0, n) for n in shape)


@pytest.mark.parametrize("shape,box,dtype", [
    ((6, 8, 10), ((2, 4), (0, 8), (5, 10)), "bfloat16"),
    ((12,), ((4, 8),), "float32"),
    ((6, 8), ((3, 6), (2, 4)), "int8"),
    ((4, 6), ((0, 2), (3, 6)), "float64"),
    ((4, 6, 2), ((1, 3), (0, 6), (0, 2)), "float16"),
])
def test_content_of_a_box_is_the_box_of_the_global_tensor(
        shape: tuple[int, ...], box: tuple[tuple[int, int], ...], dtype: str) -> None:
    p = DemoParam("layers.0.w", shape, dtype, None, None)
    for round_ in (0, 1, 7):
        full = shard_content(p, _full_box(shape), round_)
        part = shard_content(p, box, round_)
        sl = tuple(slice(lo, hi) for lo, hi in box)
        assert part.dtype == getattr(torch, dtype) and tuple(part.shape) == tuple(
            hi - lo for lo, hi in box)
        assert torch.equal(_bytes_2d(full[sl].contiguous()), _bytes_2d(part))


def test_content_changes_every_element_every_round_and_differs_between_names() -> None:
    shape = (16, 32)
    prev = _bytes_2d(shard_content(DemoParam("a", shape, "bfloat16", None, None),
                                   _full_box(shape), 0))
    for round_ in range(1, 6):
        cur = _bytes_2d(shard_content(DemoParam("a", shape, "bfloat16", None, None),
                                      _full_box(shape), round_))
        assert (cur != prev).any(dim=1).all(), f"round {round_} left an element unchanged"
        prev = cur
    a = base_content("a", shape, "bfloat16", _full_box(shape))
    b = base_content("b", shape, "bfloat16", _full_box(shape))
    assert not torch.equal(a.view(torch.int16), b.view(torch.int16))
    # Nearly every element distinct: a misplaced piece cannot match by accident.
    assert torch.unique(a.view(torch.int16)).numel() > 0.9 * a.numel()


def _targets_and_base(params: list[DemoParam], round_: int
                      ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    targets = {p.name: shard_content(p, _full_box(p.shape), round_) for p in params}
    base = {p.name: _bytes_2d(base_content(p.name, p.shape, p.dtype, _full_box(p.shape)))
            for p in params}
    scratch = torch.empty(max(p.nbytes for p in params), dtype=torch.uint8)
    return targets, base, scratch


def test_verifier_flags_a_flipped_byte_a_stale_tensor_and_a_swapped_row() -> None:
    params = [DemoParam("x", (8, 4), "float32", None, None),
              DemoParam("y", (5,), "bfloat16", None, None),
              DemoParam("z", (3, 4, 2), "int8", None, None)]
    targets, base, scratch = _targets_and_base(params, 3)
    assert mismatches(params, targets, base, 3, scratch) == []
    assert mismatches(params, targets, base, 2, scratch) == ["x", "y", "z"]  # stale round
    _bytes_2d(targets["y"])[2, 1] ^= 0x10
    assert mismatches(params, targets, base, 3, scratch) == ["y"]
    targets, base, scratch = _targets_and_base(params, 3)
    targets["x"][[1, 2]] = targets["x"][[2, 1]].clone()  # two rows swapped
    assert mismatches(params, targets, base, 3, scratch) == ["x"]


@pytest.mark.parametrize("trainers,workers", [(2, 2), (3, 2), (1, 3), (4, 1)])
def test_model_has_every_layout_kind_and_a_valid_plan(trainers: int, workers: int) -> None:
    params = demo_model(3, trainers, workers)
    plan = demo_plan(params, trainers, workers)  # validates every shape against both meshes
    assert plan.world_size == trainers + workers
    kinds = {(p.src, p.dst, len(p.shape)) for p in params}
    assert ((R, 0), (R, 1), 2) in kinds            # row -> column
    assert ((R, 1), (R, 0), 2) in kinds            # column -> row
    assert (None, None, 1) in kinds                # replicated -> replicated
    assert (None, (R, 0), 2) in kinds              # replicated -> sharded
    assert ((R, 0), (R, 1), 3) in kinds and ((R, 0), (R, 2), 3) in kinds  # experts EP -> TP
    assert sum(".small." in p.name for p in params) >= 96   # many small tensors


def test_default_model_size_is_several_hundred_mb() -> None:
    total = sum(p.nbytes for p in demo_model(350, 2, 2))
    assert 300e6 <= total <= 400e6
    small = sum(p.nbytes for p in demo_model(10, 2, 2))
    assert 5e6 <= small <= 20e6


def _no_children_left(before: set[int]) -> None:
    # Only the demo's own children count: other test modules keep process pools alive for the
    # whole session (e.g. tests/engine), and those are not the demo's to reap.
    import multiprocessing

    left = [p for p in multiprocessing.active_children() if p.pid not in before]
    assert left == []


def _children() -> set[int]:
    import multiprocessing

    return {p.pid for p in multiprocessing.active_children() if p.pid is not None}


def test_demo_cli_end_to_end() -> None:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "m2n_async.cli", "demo", "--trainers", "1",
                           "--workers", "2", *TINY], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "round 1/2: version 1" in out and "round 2/2: version 2" in out, out
    assert "GB/s" in out and "OK: 2 rounds" in out, out
    # What is verified, per worker rank (not a sum over the workers), and process start
    # apart from the handshake.
    n = len(demo_model(2, 1, 2))
    assert f"per worker rank (1, 2): {n} tensors bit-exact" in out, out
    assert "connected: processes up in " in out and ", handshake " in out, out
    assert time.monotonic() - t0 < 240


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_tqdm_on_a_terminal_and_absent_in_a_log() -> None:
    pytest.importorskip("tqdm")  # in the test and demo extras
    err, out = _Terminal(), io.StringIO()
    shown = _display(err, out)
    shown.progress(1, 2, 1_000_000, 5_000_000)
    shown.line("round 1/2: version 1")
    assert "round 1/2:" in err.getvalue() and "5.00M" in err.getvalue(), err.getvalue()
    assert out.getvalue() == "round 1/2: version 1\n"
    err, out = io.StringIO(), io.StringIO()  # a log or a pipe: result lines only
    quiet = _display(err, out)
    quiet.progress(1, 2, 1_000_000, 5_000_000)
    quiet.line("x")
    assert (err.getvalue(), out.getvalue()) == ("", "x\n")


def test_progress_without_tqdm_is_plain_lines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm raises ImportError
    err, out = _Terminal(), io.StringIO()
    shown = _display(err, out)
    assert isinstance(shown, _LineDisplay) and type(_display(io.StringIO(), out)) is _Display
    shown.every = 0.0
    shown.progress(1, 2, 2_000_000, 5_000_000)
    shown.progress(1, 2, 5_000_000, 5_000_000)  # the round's own line follows: none here
    shown.line("round 1/2: version 1")
    assert err.getvalue() == "round 1/2: 2.0 of 5.0 MB received (40%)\n", err.getvalue()
    assert out.getvalue() == "round 1/2: version 1\n"


def test_connect_time_separates_process_start_from_the_handshake() -> None:
    # Rank 0 was up early and waited in connect for rank 1: that wait is process start (the
    # last rank's), not the handshake, which runs from rank 1's call to the last return.
    ready = {0: Ready(0, 1, "gloo", "why", 10, connecting_at=101.0, connected_at=110.0),
             1: Ready(1, 1, "gloo", "why", 10, connecting_at=108.0, connected_at=110.5)}
    line = _connected_line(ready, spawned_at=100.0)
    assert line.startswith("connected: processes up in 8.0 s (spawn, import torch, build "
                           "shards), handshake 2.5 s; generation 1, transport gloo (why)"), line


@pytest.mark.parametrize("trainers,workers,fault,expect", [
    # The survivors' own errors depend on where each stood when rank 2 died; the demo's
    # verdict must name the dead rank either way.
    (1, 2, "exit:2:2", ["rank 2 (worker): process exited with code 9"]),
    # Killed halfway through writing an event: the other ranks must still be heard (a queue
    # shared by the ranks once lost every survivor's report when its lock died with rank 2).
    (1, 2, "torn:2:2", ["rank 2 (worker): process exited with code 9"]),
    (1, 1, "corrupt:1:1", ["rank 1 (worker): round 1: 1 of", "differ from the recomputation"]),
])
def test_demo_fails_loudly_and_reaps_children(monkeypatch: pytest.MonkeyPatch, trainers: int,
                                              workers: int, fault: str,
                                              expect: list[str]) -> None:
    monkeypatch.setenv("M2N_DEMO_FAULT", fault)  # spawned children inherit the environment
    out, err = io.StringIO(), io.StringIO()
    before = _children()
    t0 = time.monotonic()
    code = run_demo(trainers=trainers, workers=workers, rounds=2, size_mb=2,
                    round_timeout=60, out=out, err=err)
    elapsed = time.monotonic() - t0
    assert code == 1, out.getvalue() + err.getvalue()
    text = err.getvalue()
    assert "m2n-async demo FAILED" in text
    for piece in expect:
        assert piece in text, text
    if fault.startswith(("exit", "torn")):  # every survivor failed too, and says so
        # (their error names rank 2 too, as the cause: only the dead rank's own line goes)
        survivors = [ln for ln in text.splitlines()[1:]
                     if not ln.strip().startswith("rank 2 (worker)")]
        assert survivors and all("Error" in ln for ln in survivors), text
    assert elapsed < 120, elapsed  # failures end the job promptly, well inside the deadline
    _no_children_left(before)


def test_demo_rejects_bad_arguments() -> None:
    err = io.StringIO()
    assert run_demo(trainers=0, workers=2, out=io.StringIO(), err=err) == 2
    assert "--trainers" in err.getvalue()


def test_cpu_sync_bench_tiny(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    marks = tmp_path / "marks"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_sync_bench.py"), "--tiny",
                           "--api-marks", str(marks)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for piece in ("sync_weights / raw gloo", "host overhead per parameter",
                  "the fast pass (dtype, shape", "re-check of chunks that passed",
                  "event-loop lag p99",
                  # the settings the flags change, and both goals of BENCHMARKS.md
                  "settings: EngineConfig(transport='gloo', bucket_bytes=64 MiB, "
                  "max_inflight=3); parts mixed, aligned, tiny (--tiny sizes)",
                  "bucket 64 MiB, max_inflight 3, 2 rounds each",
                  "\n1a. throughput, mixed", "\n1b. throughput, aligned",
                  "\n2. 2,000 tiny params", "(goal <= 20 us) ", "(stretch goal <= 0.5 us) "):
        assert piece in out, out
    # --api-marks: every rank's steps, per part (the tiny part's worker is engine rank 1)
    steps = out[out.index("the public API's steps"):]
    for piece in ("rank 0 (trainer): mixed", "rank 3 (worker): aligned",
                  "rank 1 (worker): tiny", "round.publish_start", "round.wait_start",
                  "sources.bucket", "lane.stage", "lane.unpack", "round._outcome"):
        assert piece in steps, steps


def test_cpu_sync_bench_tiny_masters() -> None:
    # part 2 from fp32 masters onto a bf16 wire: the floors cast too
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_sync_bench.py"), "--tiny",
                           "--parts", "tiny", "--tiny-masters", "--tiny-rounds", "3"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for piece in ("2,000 tiny params (16 x bf16 = 32 B each on the wire, fp32 masters cast "
                  "while packing)", "raw gloo of the same 0.1 MB", "host overhead per parameter",
                  "floor: raw gloo + the same copies through address tables"):
        assert piece in proc.stdout, proc.stdout


def _cpu_sync_bench() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("cpu_sync_bench",
                                                  ROOT / "bench" / "cpu_sync_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("cpu_sync_bench", module)
    spec.loader.exec_module(module)
    return module


def test_cpu_sync_bench_flags_given_win_over_tiny() -> None:
    bench = _cpu_sync_bench()
    ns = bench.parse_args(["--tiny", "--rounds", "1"])
    assert (ns.size_mb, ns.rounds, ns.tiny_params, ns.tiny_rounds) == (4.0, 1, 2000, 2)
    ns = bench.parse_args(["--tiny-rounds", "7"])
    assert (ns.size_mb, ns.rounds, ns.tiny_params, ns.tiny_rounds) == (350.0, 5, 100_000, 7)
    # every flag says what it is and its default; --tiny says what it sets
    helps = {a.dest: a.help for a in bench.build_parser()._actions if a.dest != "help"}
    assert all(h and "default" in h for h in helps.values()), helps
    assert "--size-mb 4, --rounds 2, --tiny-params 2000, --tiny-rounds 2" in helps["tiny"]


@pytest.mark.parametrize("argv,message", [
    (["--parts", "foo"], "argument --parts: unknown part 'foo'; the parts are mixed, aligned, "
                         "tiny"),
    (["--parts", "Tiny"], "argument --parts: unknown part 'Tiny'"),
    (["--rounds", "0"], "argument --rounds: must be > 0, got 0"),
])
def test_cpu_sync_bench_refuses_bad_flags_before_it_starts(argv: list[str],
                                                           message: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_sync_bench.py"), *argv],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert message in proc.stderr and proc.stdout == "", proc.stderr


def test_cpu_sync_bench_numbers_a_part_alike_whichever_parts_run() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_sync_bench.py"), "--tiny",
                           "--parts", "aligned", "--rounds", "1"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "\n1b. throughput, aligned" in out and "1 round each" in out, out
    assert "\n1a." not in out and "\n2. " not in out and "during part 1b sync_weights" in out


def test_demo_dumps_the_stacks_of_a_hung_rank(monkeypatch: pytest.MonkeyPatch,
                                              capfd: pytest.CaptureFixture[str]) -> None:
    # Rank 1 blocks its own event loop as round 2 begins and never reports: the trainer fails
    # on the round deadline, the grace runs out, and before the kill the demo has the hung
    # rank print every thread's Python stack — a hang in CI then says where it hung.
    from m2n_async import _demo

    monkeypatch.setenv("M2N_DEMO_FAULT", "hang:1:2")
    monkeypatch.setattr(_demo, "_FAIL_GRACE", 1.0)
    out, err = io.StringIO(), io.StringIO()
    before = _children()
    # An overall deadline far beyond the trainer's failure report (round deadline, then
    # abort grace and close), so the verdict comes from the 1 s grace, not the deadline.
    code = run_demo(trainers=1, workers=1, rounds=2, size_mb=2, round_timeout=3,
                    timeout=120, out=out, err=err)
    assert code == 1, out.getvalue() + err.getvalue()
    assert "rank 1 (worker): no report within 1 s of the first failure (killed)" in \
        err.getvalue(), err.getvalue()
    dumped = capfd.readouterr().err
    assert "m2n-demo-rank1 still running at the end" in dumped, dumped
    assert "most recent call first" in dumped and "in _fault" in dumped, dumped
    _no_children_left(before)
