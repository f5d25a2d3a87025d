"""``m2n-async plan SPEC``: file schema, validation errors, summary figures, exit status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from m2n_async import PlanError
from m2n_async._integrations import planfile
from m2n_async._integrations.planfile import (
    format_summary,
    load_plan_file,
    parse_placements,
    parse_size,
    summarize,
)
from m2n_async._proto.layout import REPLICATE
from m2n_async.cli import main

SPEC = """
trainer_mesh = [2, 2]
worker_mesh = [4]
bucket_bytes = "256KiB"

[[params]]
name = "embed.weight"
dtype = "bfloat16"
shape = [1024, 256]
source = ["replicate", "shard(0)"]
dest = ["shard(0)"]

[[params]]
name = "layers.{i}.up.weight"
repeat = 3
dtype = "float32"
shape = [512, 256]
source = [0, -1]
dest = ["Shard(dim=1)"]

[[params]]
name = "layers.{i}.norm.weight"
repeat = 3
dtype = "float32"
shape = [256]
source_mesh = [4]
"""


def _write(tmp_path: Path, text: str, name: str = "plan.toml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_summary_figures_are_the_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, SPEC)
    rc, out, err = _run(capsys, str(path), "--json", "--bandwidth", "2")
    assert (rc, err) == (0, "")
    s = json.loads(out)
    assert s["params"] == 7 and s["trainer_ranks"] == 4 and s["worker_ranks"] == 4
    assert s["dtypes"] == {"bfloat16": 1, "float32": 6}
    embed, up, norm = 1024 * 256 * 2, 512 * 256 * 4, 256 * 4
    assert s["total_bytes"] == embed + 3 * up + 3 * norm
    # every worker rank holds a quarter of each sharded param and all of each norm
    for r in s["ranks"][4:]:
        assert (r["role"], r["send_bytes"]) == ("worker", 0)
        assert r["recv_bytes"] == embed // 4 + 3 * up // 4 + 3 * norm
    # the trainers send what the workers receive
    assert sum(r["send_bytes"] for r in s["ranks"]) == sum(r["recv_bytes"] for r in s["ranks"])
    assert s["moved_bytes"] == sum(r["recv_bytes"] for r in s["ranks"])
    busiest = max(max(r["send_bytes"], r["recv_bytes"]) for r in s["ranks"])
    assert s["lower_bound_seconds"] == pytest.approx(busiest / 2e9)
    # embed: source shards dim 0 into 2, dest into 4 -> each dest shard reads 1 source shard,
    # each source shard feeds 2; up: dim 0 in 2 vs dim 1 in 4 -> fan-in 2, fan-out 4
    assert s["fan_in"] == {"value": 2, "param": "layers.0.up.weight"}
    assert s["fan_out"] == {"value": 4, "param": "layers.0.up.weight"}
    # a param's bucket cost is its busiest rank's bytes: 128 KiB for embed and each up
    # (a quarter of 512 KiB), so [embed, up0] [up1, up2] [norms] at 256 KiB
    assert s["bucket_bytes"] == 256 << 10
    assert (s["buckets"], s["largest_bucket_bytes"]) == (3, 256 << 10)
    assert s["transports"] == {"m2n": "ok", "nccl": "ok", "gloo": "ok"}


def test_text_report_and_bucket_override(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, SPEC)
    rc, out, _ = _run(capsys, str(path), "--bucket-bytes", "64MiB")
    assert rc == 0
    assert "buckets      1 at 64.0 MiB" in out
    assert "fan-in max   2 (layers.0.up.weight)" in out
    assert "m2n   ok" in out and "gloo  ok" in out
    assert out.count(" worker ") == 4 and out.count(" trainer ") == 4


def test_json_file_gives_the_same_plan(tmp_path: Path) -> None:
    import tomllib

    toml_path = _write(tmp_path, SPEC)
    json_path = _write(tmp_path, json.dumps(tomllib.loads(SPEC)), "plan.json")
    a, bucket_a = load_plan_file(toml_path)
    b, bucket_b = load_plan_file(json_path)
    assert summarize(a).digest == summarize(b).digest and bucket_a == bucket_b == 256 << 10


def test_transport_limits_are_reported_and_require(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    # int16 is not an M2N dtype; 32 source shards into one destination shard exceeds fan-in 16
    path = _write(tmp_path, """
trainer_mesh = [32]
worker_mesh = [1]
[[params]]
name = "counts"
dtype = "int16"
shape = [64]
source = ["shard(0)"]
[[params]]
name = "w"
dtype = "bfloat16"
shape = [64, 4]
source = ["shard(0)"]
""")
    rc, out, err = _run(capsys, str(path))
    assert rc == 0 and err == ""
    assert "m2n   no: parameter 'counts' (source and destination): dtype int16" in out
    assert "nccl  ok" in out
    assert "(the 8 busiest of 33 ranks; --all-ranks lists every one)" in out
    assert "m2n stacks" not in out  # no m2n calls to list for a plan m2n cannot carry
    rc, out, err = _run(capsys, str(path), "--require", "m2n")
    assert rc == 1 and "transport 'm2n' cannot carry this plan" in err
    rc, _, _ = _run(capsys, str(path), "--require", "gloo")
    assert rc == 0
    path.write_text(path.read_text().replace('"int16"', '"int32"'))
    rc, out, err = _run(capsys, str(path), "--json")
    assert rc == 0
    verdict = json.loads(out)["transports"]["m2n"]
    assert "parameter 'counts': fan-in 32" in verdict and "M2N limit 16" in verdict


@pytest.mark.parametrize(("edit", "message"), [
    (("shape = [512, 256]", "shape = [511, 256]"),
     r"params\[1\] \('layers.\{i\}.up.weight'\): parameter 'layers.0.up.weight' \(source side\)"
     r": dim 0 of size 511 does not divide evenly into 2 shards"),
    (("repeat = 3\ndtype = \"float32\"\nshape = [512",
      "repeat = 3\ncolour = 1\ndtype = \"float32\"\nshape = [512"),
     r"unknown field `colour` - at `\$.params\[1\]`"),
    (('dest = ["shard(0)"]', 'dest = ["spread(0)"]'),
     r"params\[0\] \('embed.weight'\) dest: cannot read placement 'spread\(0\)'"),
    (('dest = ["shard(0)"]', 'dest = "shard(0)"'), r"a single placement 'shard\(0\)' is ambiguous"),
    (('name = "layers.{i}.norm.weight"', 'name = "norm"'),
     r"params\[2\] \('norm'\): repeat = 3 needs \"\{i\}\""),
    (("source_mesh = [4]", "source_mesh = [8]"),
     r"source_mesh \(8, 1\) has 8 ranks but the source side has 4"),
    (('dtype = "bfloat16"', 'dtype = "int4"'), r"parameter 'embed.weight': unsupported dtype"),
    (("worker_mesh = [4]", "worker_mesh = [4, 2, 1]"), r"worker_mesh: a mesh has 1 or 2 dims"),
    (("trainer_mesh = [2, 2]", "trainer_mesh = [2, 2"), r"not valid TOML"),
    (('dest = ["shard(0)"]', "dest = null"),
     r"not valid TOML: .*; TOML has no null \(line \d+\): write \"replicate\" for a fully "
     r"replicated tensor, or leave the key out"),
])
def test_invalid_files_name_what_is_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          edit: tuple[str, str], message: str) -> None:
    old, new = edit
    assert old in SPEC
    path = _write(tmp_path, SPEC.replace(old, new, 1))
    rc, out, err = _run(capsys, str(path))
    assert rc == 1 and out == ""
    assert err.startswith("m2n-async plan: invalid plan: ")
    import re

    assert re.search(message, err), err


def test_unreadable_file_and_bad_options(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = _run(capsys, str(tmp_path / "missing.toml"))
    assert rc == 2 and "cannot read" in err
    path = _write(tmp_path, SPEC)
    rc, _, err = _run(capsys, str(path), "--bucket-bytes", "lots")
    assert rc == 2 and "--bucket-bytes: cannot read 'lots' as a size" in err
    rc, _, err = _run(capsys, str(path), "--bandwidth", "0")
    assert rc == 2 and "--bandwidth must be > 0" in err


def test_parse_helpers() -> None:
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1GB") == 10**9
    assert parse_size("1.5 KiB") == 1536
    assert parse_size(4096) == 4096
    for bad in ("0", "-1MiB", "12 parsecs", True):
        with pytest.raises(PlanError):
            parse_size(bad)  # type: ignore[arg-type]
    assert parse_placements(None, "x") is None
    assert parse_placements("Replicate()", "x") is None
    assert parse_placements(["r", "R"], "x") is None
    assert parse_placements(["s(1)"], "x") == (1, REPLICATE)
    assert parse_placements([-1, "2"], "x") == (REPLICATE, 2)
    for bad in ([], [0, 0, 0], ["shard(-1)"], [-2], [True]):
        with pytest.raises(PlanError):
            parse_placements(bad, "x")  # type: ignore[arg-type]


def test_placements_have_one_entry_per_axis_as_the_mesh_is_written() -> None:
    assert parse_placements(["s(0)"], "x", [8]) == (0, REPLICATE)
    assert parse_placements(["r", "s(1)"], "x", [2, 4]) == (REPLICATE, 1)
    # A shard along an axis of size 1 is the whole tensor: one spelling, one digest.
    assert parse_placements(["s(0)", "s(1)"], "x", [1, 4]) == (REPLICATE, 1)
    assert parse_placements(["s(0)", "r"], "x", [1, 4]) is None
    with pytest.raises(PlanError, match=r"the mesh \[8\] has 1, got 2"):
        parse_placements(["replicate", "shard(0)"], "x", [8])
    with pytest.raises(PlanError, match=r"the mesh \[2, 4\] has 2, got 1"):
        parse_placements(["shard(0)"], "x", [2, 4])
    with pytest.raises(PlanError, match="cannot read placement"):
        parse_placements(["\u00b2"], "x", [8])  # a superscript two is no dim


def test_a_plan_file_with_a_placement_list_longer_than_its_mesh_is_refused(
        tmp_path: Path) -> None:
    text = SPEC.replace('dest = ["shard(0)"]', 'dest = ["replicate", "shard(0)"]', 1)
    with pytest.raises(PlanError, match=r"params\[0\] \('embed.weight'\) dest: placements "
                                        r"need one entry per mesh axis"):
        load_plan_file(_write(tmp_path, text))


def test_the_documented_example_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/plan.toml is what docs/concepts.md shows; keep the two in step."""
    example = Path(__file__).resolve().parents[2] / "examples" / "plan.toml"
    plan, bucket = load_plan_file(example)
    s = summarize(plan, bucket_bytes=bucket or 0, bandwidth_bytes_per_second=370e9)
    assert (s.params, s.trainer_ranks, s.worker_ranks, s.buckets) == (291, 8, 8, 8)
    assert (s.fan_in.value, s.fan_out.value) == (8, 4)
    assert s.transports == {"m2n": "ok", "nccl": "ok", "gloo": "ok"}
    assert round(s.lower_bound_seconds, 4) == 0.0109
    concepts = (example.parents[1] / "docs" / "concepts.md").read_text()
    # every line the docs show (the per-rank rows they elide with "...") is what it prints
    shown = concepts.split("$ m2n-async plan examples/plan.toml --bandwidth 370\n", 1)[1]
    shown = shown.split("```", 1)[0].splitlines()
    printed = format_summary(summarize(plan, source="examples/plan.toml", bucket_bytes=bucket,
                                       bandwidth_bytes_per_second=370e9)).splitlines()
    assert len(shown) > 12
    for line in shown:
        assert line.strip() == "..." or line in printed, line


def test_a_reader_that_went_away_ends_the_command_quietly() -> None:
    # `m2n-async plan examples/plan.toml | head`, with the reader gone before the first
    # write (so the pipe is broken whatever the output size): no traceback, SIGPIPE's status.
    root = Path(__file__).resolve().parents[2]
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "m2n_async.cli", "plan",
                               str(root / "examples" / "plan.toml")], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=60, cwd=root)
    finally:
        os.close(write)
    assert proc.stderr == "" and proc.returncode == 141, (proc.returncode, proc.stderr)


def test_summary_counts_the_buckets_the_engine_runs(tmp_path: Path) -> None:
    # 10,000 tiny params fit one 512 MiB byte budget, but the engine cuts buckets into runs
    # of at most MAX_BUCKET_PARAMS (4096) parameters: 3 buckets.
    text = """
trainer_mesh = [1]
worker_mesh = [1]

[[params]]
name = "experts.{i}.w"
repeat = 10000
dtype = "bfloat16"
shape = [64, 64]
"""
    plan, _ = load_plan_file(_write(tmp_path, text))
    summary = summarize(plan, bucket_bytes=512 << 20)
    assert summary.buckets == 3, summary.buckets


def test_without_a_bucket_size_the_engines_default_is_counted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Neither the file nor the command line sets a bucket size: the summary counts the buckets
    # an engine with EngineConfig.bucket_bytes=None runs on the transport auto picks.
    from types import SimpleNamespace

    from m2n_async import EngineConfig, TrainerEngine

    text = """
trainer_mesh = [1]
worker_mesh = [1]

[[params]]
name = "layers.{i}.w"
repeat = 6
dtype = "bfloat16"
shape = [51200, 1024]
"""
    path = _write(tmp_path, text)
    plan, bucket = load_plan_file(path)
    assert bucket is None
    summary = summarize(plan)
    engine = TrainerEngine._bucket_bytes(SimpleNamespace(config=EngineConfig()),  # type: ignore[arg-type]
                                         summary.auto)
    assert (summary.auto, summary.bucket_bytes) == ("m2n", engine)
    assert summary.buckets == 3  # 100 MiB params, two to a 256 MiB bucket
    rc, out, _ = _run(capsys, str(path), "--json")
    assert rc == 0 and (json.loads(out)["bucket_bytes"], json.loads(out)["buckets"]) == (engine, 3)
    rc, out, _ = _run(capsys, str(path), "--json", "--bucket-bytes", "512MiB")
    assert rc == 0 and json.loads(out)["buckets"] == 2


def test_a_duplicate_name_names_both_entries(tmp_path: Path) -> None:
    text = """
trainer_mesh = [2]
worker_mesh = [2]

[[params]]
name = "layers.{i}.w"
repeat = 32
dtype = "float32"
shape = [4]

[[params]]
name = "layers.3.w"
dtype = "float32"
shape = [4]
"""
    with pytest.raises(PlanError, match=r"params\[1\] \('layers.3.w'\): declares 'layers.3.w', "
                                        r"which params\[0\] \('layers.\{i\}.w'\) already"):
        load_plan_file(_write(tmp_path, text))


def test_stacks_are_the_m2n_lanes_calls_in_stack_order(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Two layers of interleaved experts (two geometries) and a norm per layer: the listing
    # must be exactly the calls the m2n lane issues, members in the order to lay them out.
    from m2n_async._proto.plan import M2N_MAX_CALL_BYTES, MAX_BUCKET_PARAMS, split_buckets
    from m2n_async._proto.stacking import COALESCE_BELOW_BYTES, bucket_calls

    text = """
trainer_mesh = [2]
worker_mesh = [2]
bucket_bytes = "1MiB"

[[params]]
name = "l0.e{i}.up"
repeat = 4
dtype = "bfloat16"
shape = [64, 32]

[[params]]
name = "l0.e{i}.down"
repeat = 4
dtype = "bfloat16"
shape = [32, 64]

[[params]]
name = "l0.norm"
dtype = "float32"
shape = [32]

[[params]]
name = "l1.e{i}.up"
repeat = 4
dtype = "bfloat16"
shape = [64, 32]
"""
    path = _write(tmp_path, text)
    plan, bucket = load_plan_file(path)
    s = summarize(plan, bucket_bytes=bucket)
    want = [[plan.params[i].name for i in call]
            for b in split_buckets(plan, plan.buckets(1 << 20), MAX_BUCKET_PARAMS)
            for call in bucket_calls(plan, b, coalesce_below=COALESCE_BELOW_BYTES,
                                     max_call_bytes=M2N_MAX_CALL_BYTES)]
    assert s.m2n_calls == len(want) == 3
    assert [c.members for c in s.stacks] == [m for m in want if len(m) > 1]
    assert s.stacks[0].members == [f"l0.e{i}.up" for i in range(4)] + [
        f"l1.e{i}.up" for i in range(4)]  # by geometry, not by name
    assert (s.stacks[1].shape, s.stacks[1].dtype) == ([32, 64], "bfloat16")
    rc, out, _ = _run(capsys, str(path))
    assert rc == 0 and ("m2n stacks   2 stacked calls of 12 params, 1 single; 3 calls a round "
                        "(--stacks lists them)") in out
    rc, out, _ = _run(capsys, str(path), "--stacks")
    assert rc == 0 and ("bucket 0: 4 of global shape (32, 64) bfloat16, in this order: "
                        "l0.e0.down, l0.e1.down, l0.e2.down, l0.e3.down") in out
    rc, out, _ = _run(capsys, str(path), "--json")
    assert rc == 0 and json.loads(out)["stacks"][1]["members"] == s.stacks[1].members
    # the job's own threshold: coalescing off, or below one expert's per-rank bytes
    for value in ("0", "1KiB"):
        rc, out, _ = _run(capsys, str(path), "--json", "--coalesce-below", value)
        got = json.loads(out)
        assert rc == 0 and (got["m2n_calls"], got["stacks"]) == (13, []), value
        assert "(13 calls)" in got["predicted"]["m2n"], got["predicted"]
    rc, _, err = _run(capsys, str(path), "--coalesce-below", "lots")
    assert rc == 2 and "--coalesce-below" in err


def test_the_prediction_takes_calibrated_cost_terms(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # As an engine: --costs (EngineConfig.costs), else $M2N_ASYNC_COSTS, else the defaults;
    # the report says which terms it used, and auto follows them.
    example = Path(__file__).resolve().parents[2] / "examples" / "plan.toml"
    monkeypatch.delenv("M2N_ASYNC_COSTS", raising=False)
    rc, out, _ = _run(capsys, str(example), "--json")
    default = json.loads(out)
    assert rc == 0 and default["default_costs"] and default["auto"] == "m2n"
    dear_m2n = '{"m2n": [0.001, 0, 1e11]}'
    rc, out, _ = _run(capsys, str(example), "--costs", dear_m2n)
    assert rc == 0 and "with the cost terms of --costs / $M2N_ASYNC_COSTS" in out
    assert "m2n   143 ms (103 calls)   [0.001 s/call, 0 s/param, 1e+11 B/s]" in out
    assert ("nccl  28.1 ms (8 calls)   [0.00015 s/call, 3.5e-05 s/param, 2.4e+11 B/s]"
            "   <- auto") in out
    monkeypatch.setenv("M2N_ASYNC_COSTS", dear_m2n)
    rc, out, _ = _run(capsys, str(example), "--json")
    got = json.loads(out)
    assert rc == 0 and not got["default_costs"] and got["auto"] == "nccl"
    assert got["cost_terms"]["m2n"] == [0.001, 0.0, 1e11]
    rc, _, err = _run(capsys, str(example), "--costs", '{"m2n": [1, 2]}')
    assert rc == 2 and "cost terms must be JSON like" in err


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plan.toml"


def test_predictions_say_their_rate_and_when_they_beat_the_lower_bound(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # The lanes' predictions move bytes at their cost terms' rate (240 GB/s by default), not
    # at --bandwidth: at 48 GB/s they come out below the bound, and the report says so and
    # what to pass instead.
    monkeypatch.delenv("M2N_ASYNC_COSTS", raising=False)
    rc, out, _ = _run(capsys, str(EXAMPLE), "--bandwidth", "48")
    assert rc == 0
    assert ("at each lane's own rate (m2n 240, nccl 240, gloo 2 GB/s per rank), not "
            "--bandwidth") in out
    assert ("warning      below the lower bound (0.0837 s at 48 GB/s): m2n (at 240 GB/s), "
            "nccl (at 240 GB/s)") in out
    suggested = out.split("--costs '", 1)[1].split("'", 1)[0]
    assert json.loads(suggested) == {"m2n": [8e-05, 1e-06, 4.8e10],  # every lane's terms
                                     "nccl": [0.00015, 3.5e-05, 4.8e10],
                                     "gloo": [0.001, 5e-06, 2e9]}
    # at a bandwidth that :g would round, the suggestion still ends the warning
    rc, out, _ = _run(capsys, str(EXAMPLE), "--bandwidth", "48.1234567")
    exact = out.split("--costs '", 1)[1].split("'", 1)[0]
    rc, out, _ = _run(capsys, str(EXAMPLE), "--bandwidth", "48.1234567", "--costs", exact)
    assert rc == 0 and "warning" not in out
    rc, out, _ = _run(capsys, str(EXAMPLE), "--bandwidth", "48", "--costs", suggested)
    assert rc == 0 and "warning" not in out
    assert "at each lane's own rate (m2n 48, nccl 48, gloo 2 GB/s per rank)" in out
    rc, out, _ = _run(capsys, str(EXAMPLE), "--bandwidth", "370")
    assert rc == 0 and "warning" not in out


def test_json_predictions_are_numbers(monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("M2N_ASYNC_COSTS", raising=False)
    rc, out, _ = _run(capsys, str(EXAMPLE), "--json", "--bandwidth", "48")
    got = json.loads(out)
    assert rc == 0 and got["predicted"]["m2n"] == "25.3 ms (103 calls)"  # the text stays
    m2n = got["predictions"]["m2n"]
    assert (m2n["lane"], m2n["calls"], m2n["bytes_per_second"]) == ("m2n", 103, 240e9)
    assert m2n["seconds"] == pytest.approx(0.0253, abs=5e-5)
    assert m2n["below_lower_bound"] and m2n["seconds"] < got["lower_bound_seconds"]
    assert sorted(got["predictions"]) == sorted(got["predicted"])
    assert not got["predictions"]["gloo"]["below_lower_bound"]
    assert got["coalesce_below"] == 16 << 20


def test_the_prediction_heading_follows_coalesce_below(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = _run(capsys, str(EXAMPLE), "--coalesce-below", "0")
    assert rc == 0 and ", m2n not coalesced (one reshard per parameter)\n" in out
    assert "m2n   40.3 ms (291 calls)" in out
    rc, out, _ = _run(capsys, str(EXAMPLE), "--coalesce-below", "1MiB")
    assert rc == 0 and ", m2n coalesced below 1.0 MiB\n" in out
    rc, out, _ = _run(capsys, str(EXAMPLE))
    assert rc == 0 and ", m2n coalesced\n" in out


def test_bad_options_exit_with_the_status_the_help_gives(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Exit status: 0 valid, 1 invalid (or --require not met), 2 unreadable file or " \
           "bad option." in help_text
    path = _write(tmp_path, SPEC)
    rc, out, err = _run(capsys, str(path), "--bucket-bytes", "0")
    assert (rc, out) == (2, "") and "--bucket-bytes: must be at least 1 byte" in err
    # a bad option is a usage error whatever the file holds: said first, with status 2
    bad = tmp_path / "bad.toml"
    bad.write_text("not = [a plan")
    for option in (["--bucket-bytes", "0"], ["--bandwidth", "-1"],
                   ["--coalesce-below", "lots"], ["--costs", "m2n=1"]):
        rc, out, err = _run(capsys, str(bad), *option)
        assert (rc, out) == (2, ""), (option, rc, err)
        assert "invalid plan" not in err, (option, err)


def test_the_bandwidth_default_is_described_as_in_the_tuning_guide(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    wording = "a 400 Gb/s NIC, 50 GB/s raw"
    assert f"(default 50: {wording};" in help_text
    tuning = (EXAMPLE.parents[1] / "docs" / "tuning.md").read_text()
    assert f"--bandwidth 50      # {wording}" in tuning
    assert "≈ 48" not in tuning


def test_the_tuning_guides_plan_commands_name_the_projects_environment() -> None:
    # `m2n-async` is on no PATH of a fresh shell: the commands shown run the venv's.
    tuning = (EXAMPLE.parents[1] / "docs" / "tuning.md").read_text()
    shown = [line for block in tuning.split("```bash\n")[1:]
             for line in block.split("```", 1)[0].splitlines() if "m2n-async" in line]
    assert shown and all(line.startswith(".venv/bin/m2n-async plan ") for line in shown), shown
    assert "DEVELOPERS.md#build" in tuning.split("## 1.", 1)[0]


def test_sizes_are_read_exactly_and_bounded_by_int64() -> None:
    # through a float, 2**53 + 1 came back one byte short
    assert parse_size(str(2**53 + 1)) == 2**53 + 1
    assert parse_size("0.5KiB") == 512
    assert parse_size(str(2**63 - 1)) == 2**63 - 1
    # a long digit string was a float overflow (OverflowError), not a PlanError
    for big in ("1" * 400, str(2**63), "8388608TiB", 2**63):
        with pytest.raises(PlanError, match=r"bucket_bytes: .* is 2\*\*63 bytes or more"):
            parse_size(big, "bucket_bytes")


def test_an_oversized_bucket_in_a_file_or_option_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, SPEC.replace('bucket_bytes = "256KiB"',
                                         f'bucket_bytes = "{"9" * 400}"', 1))
    rc, out, err = _run(capsys, str(path))
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert "invalid plan: bucket_bytes: " in err and "2**63 bytes or more" in err
    rc, out, err = _run(capsys, str(_write(tmp_path, SPEC)), "--bucket-bytes", "9" * 400)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "--bucket-bytes: " in err and "2**63 bytes or more" in err


@pytest.mark.parametrize(("name", "text"), [
    ("deep.json", "[" * 100_000 + "]" * 100_000),
    ("deep.toml", "a = " + "[" * 100_000 + "]" * 100_000),
    ("deep.toml", "a = " + "{b = " * 5_000 + "1" + "}" * 5_000),
])
def test_a_file_nested_too_deep_is_invalid_not_a_traceback(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str) -> None:
    rc, out, err = _run(capsys, str(_write(tmp_path, text, name)))
    assert rc == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("m2n-async plan: invalid plan: ") and "recursion" in err


def test_summarize_refuses_sizes_of_the_wrong_type(tmp_path: Path) -> None:
    plan, _ = load_plan_file(_write(tmp_path, SPEC))
    # a str was int()'s ValueError, a float or a bool silently truncated
    for bad in ("1MiB", 1.5, True, 0, 2**63):
        with pytest.raises(PlanError, match=r"bucket_bytes must be None or an int in \[1, "
                                            r"2\*\*63\), got "):
            summarize(plan, bucket_bytes=bad)  # type: ignore[arg-type]
    for bad in ("1", 1.5, True, None, -1, 2**63):
        with pytest.raises(PlanError, match=r"coalesce_below must be an int in \[0, 2\*\*63\)"):
            summarize(plan, coalesce_below=bad)  # type: ignore[arg-type]


# -- limits: a file past one is refused before the work it bounds -----------------------------

ROOT = Path(__file__).resolve().parents[2]

TINY = """
trainer_mesh = [2]
worker_mesh = [2]

[[params]]
name = "w{i}"
repeat = 1
dtype = "float32"
shape = [4]
"""


def _refused(path: Path, message: str) -> str:
    """The PlanError's text for ``path``, checked to name the file and match ``message``,
    and to come at once (the checks are arithmetic; the work they bound took minutes)."""
    start = time.monotonic()
    with pytest.raises(PlanError) as info:
        load_plan_file(path)
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert text.startswith(f"{path}: "), text
    assert re.search(message, text), text
    return text


@pytest.mark.parametrize(("old", "new", "message"), [
    ("trainer_mesh = [2]", "trainer_mesh = [100000, 100000]",
     r": trainer_mesh: \[100000, 100000\] has 10000000000 ranks, over the limit of 1048576 "
     r"ranks per mesh \(MAX_MESH_RANKS in m2n_async\._integrations\.planfile; "),
    ("worker_mesh = [2]", "worker_mesh = [1048577]",
     r": worker_mesh: \[1048577\] has 1048577 ranks, over the limit of 1048576 ranks per mesh"),
    ('shape = [4]', 'shape = [4]\ndest_mesh = [9223372036854775807, 2]',
     r": params\[0\]\.dest_mesh: \[9223372036854775807, 2\] has 18446744073709551614 ranks, "
     r"over the limit of 1048576 ranks per mesh"),
])
def test_a_mesh_past_the_rank_limit_is_refused_before_it_is_built(
        tmp_path: Path, old: str, new: str, message: str) -> None:
    _refused(_write(tmp_path, TINY.replace(old, new, 1)), message)


def test_a_mesh_at_the_rank_limit_loads(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    plan, _ = load_plan_file(_write(tmp_path, TINY.replace("trainer_mesh = [2]",
                                                           "trainer_mesh = [1024, 1024]")))
    assert plan.trainer_ranks == 1 << 20 == planfile.MAX_MESH_RANKS
    # the command says it in one line, as for any invalid plan
    path = _write(tmp_path, TINY.replace("trainer_mesh = [2]", "trainer_mesh = [1025, 1024]"))
    rc, out, err = _run(capsys, str(path))
    assert (rc, out) == (1, "") and err.count("\n") == 1
    assert err.startswith(f"m2n-async plan: invalid plan: {path}: trainer_mesh: ")


@pytest.mark.parametrize(("name", "text"), [
    ("plan.toml", TINY.replace("repeat = 1", "repeat = 1000000000")),
    ("plan.json", json.dumps({"trainer_mesh": [2], "worker_mesh": [2], "params": [
        {"name": "w{i}", "repeat": 10**30, "dtype": "float32", "shape": [4]}]})),
])
def test_a_repeat_past_the_param_limit_is_refused_before_it_is_expanded(
        tmp_path: Path, name: str, text: str) -> None:
    _refused(_write(tmp_path, text, name),
             r": params\[0\]\.repeat \('w\{i\}'\): repeat = 10+ brings the expanded parameters "
             r"to 10+, over the limit of 10000000 \(MAX_PARAMS in m2n_async\._integrations")


def test_the_param_limit_counts_every_entry(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planfile, "MAX_PARAMS", 10)
    two = TINY.replace("repeat = 1", "repeat = 6") + TINY.split("\n\n", 1)[1].replace(
        "w{i}", "v{i}")
    plan, _ = load_plan_file(_write(tmp_path, two.replace("repeat = 1", "repeat = 4")))
    assert len(plan.params) == 10
    _refused(_write(tmp_path, two.replace("repeat = 1", "repeat = 5")),
             r": params\[1\]\.repeat \('v\{i\}'\): repeat = 5 brings the expanded parameters to "
             r"11, over the limit of 10 \(MAX_PARAMS")


def test_the_expanded_names_are_bounded_in_bytes(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # "é{i}" (5 bytes: é is 2) x 12: é0..é9 are 3 bytes, é10 and é11 4: 38 bytes
    text = TINY.replace("repeat = 1", "repeat = 12").replace("w{i}", "\u00e9{i}")
    monkeypatch.setattr(planfile, "MAX_NAME_BYTES", 38)
    plan, _ = load_plan_file(_write(tmp_path, text))
    assert sum(len(p.name.encode()) for p in plan.params) == 38
    monkeypatch.setattr(planfile, "MAX_NAME_BYTES", 37)
    _refused(_write(tmp_path, text), r": params\[0\]\.repeat \('\u00e9\{i\}'\): the expanded "
             r"names come to 38 bytes \(5-byte name, repeat = 12\), over the limit of 37 bytes "
             r"\(MAX_NAME_BYTES")
    # at the real limit: a 4 KiB name a million times, refused with the name cut short
    monkeypatch.undo()
    long = "x" * 4096 + "{i}"
    text = TINY.replace("repeat = 1", "repeat = 1000000").replace("w{i}", long)
    msg = _refused(_write(tmp_path, text), r": params\[0\]\.repeat \('x{60}\.\.\.'\): the "
                   r"expanded names come to 4101888890 bytes .* over the limit of 2147483648")
    assert len(msg) < 400


def test_the_expanded_shape_entries_are_bounded(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Each copy holds and checks its own shape: a long shape times a large repeat costs as
    # many params do, though the count of params and the names stay small.
    text = TINY.replace("repeat = 1", "repeat = 5").replace("shape = [4]", "shape = [4, 1, 1]")
    monkeypatch.setattr(planfile, "MAX_SHAPE_DIMS", 15)
    plan, _ = load_plan_file(_write(tmp_path, text))
    assert sum(len(p.spec.shape) for p in plan.params) == 15
    monkeypatch.setattr(planfile, "MAX_SHAPE_DIMS", 14)
    _refused(_write(tmp_path, text), r": params\[0\]\.shape \('w\{i\}'\): 3 entries, repeat = 5, "
             r"bring the expanded shape entries to 15, over the limit of 14 \(MAX_SHAPE_DIMS in "
             r"m2n_async\._integrations\.planfile; ")
    # at the real limit: a 10**4-entry shape (20 kB of file) a million times
    monkeypatch.undo()
    shape = "shape = [" + ", ".join(["1"] * 10**4) + "]"
    text = TINY.replace("repeat = 1", "repeat = 1000000").replace("shape = [4]", shape)
    _refused(_write(tmp_path, text), r": params\[0\]\.shape \('w\{i\}'\): 10000 entries, "
             r"repeat = 1000000, bring the expanded shape entries to 10000000000, over the "
             r"limit of 100000000 \(MAX_SHAPE_DIMS")


def test_digit_counts_match_the_names_they_stand_for() -> None:
    for n in [*range(0, 1500), 10**6 - 1, 10**6, 10**6 + 1]:
        assert planfile._digits_below(n) == sum(len(str(i)) for i in range(n)), n


def test_a_file_past_the_size_limit_is_refused_after_a_bounded_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(tmp_path, TINY)
    size = path.stat().st_size
    monkeypatch.setattr(planfile, "MAX_FILE_BYTES", size)
    assert len(load_plan_file(path)[0].params) == 1  # exactly at the limit
    monkeypatch.setattr(planfile, "MAX_FILE_BYTES", size - 1)
    _refused(path, rf": the file has {size} bytes, over the limit of {size - 1} bytes "
                   r"\(.* B; MAX_FILE_BYTES in m2n_async\._integrations\.planfile; ")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")
def test_a_pipe_past_the_size_limit_is_refused_after_a_bounded_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pipe has no size to look at first: the read itself must stop one byte past the limit.
    monkeypatch.setattr(planfile, "MAX_FILE_BYTES", 1000)
    fifo = tmp_path / "plan.toml"
    os.mkfifo(fifo)

    def feed() -> None:  # more than the limit, then the end (or the reader leaves)
        try:
            with open(fifo, "wb") as w:
                w.write(TINY.encode() + b"#" * 50_000 + b"\n")
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    _refused(fifo, r": the file goes on past the limit of 1000 bytes \(1000 B; MAX_FILE_BYTES")
    writer.join(10)
    assert not writer.is_alive()


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero here")
def test_the_command_on_an_endless_file_exits_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "m2n_async.cli", "plan", "/dev/zero"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert (proc.returncode, proc.stdout) == (1, ""), (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert proc.stderr.startswith("m2n-async plan: invalid plan: /dev/zero: the file goes on "
                                  "past the limit of 67108864 bytes (64.0 MiB; "
                                  "MAX_FILE_BYTES in m2n_async._integrations.planfile; ")
