"""Where a public-API round's time goes: a timeline of every ``sync_weights`` / ``receive``.

``install(directory)`` wraps, in the calling process, the steps a round goes through between
the caller's ``await engine.sync_weights(...)`` (or ``receive()``) and its return: the source
checks (``sources.precheck`` before the round, ``sources.bucket`` per bucket), rank 0's
``round.publish_start`` and the others' ``round.wait_start``, the round driver (``round.run``,
``round._part``: the pipeline, ``round._outcome``: report and gather), the lane's ``stage`` /
``transfer`` / ``unpack`` and completion waits, and every store request (``store.*``, the
watchdog's wait and rank 0's cleanup of old rounds included). Each API call's steps are
recorded as (start, end) offsets from the call's start, and after every call the process's
rounds are written to ``directory/marks-PID.json``. Nothing is recorded outside API calls.

``summarize(directory)`` prints, per rank, the median start and end of each step over the
rounds (the first ``skip`` dropped: connections and caches warm up). A step that runs twice
in a round (two store gathers, two buckets) is numbered ``#1``, ``#2`` in order of start.

Reading it: the offsets of one rank are from that rank's own call, and the ranks enter their
calls at different moments (rank 0 last, where its loop serves the store), so compare steps
within a rank, and across ranks only through durations. The public API's time over the
pipeline's (``pipeline``) is the round's fixed cost: the checks before the first stage, the
start's round trip, the outcome's report and gather, the teardown after it.

Usage, through the benches (each rank process installs it):

    python3 bench/gpu_sync_bench.py --model moe --no-broadcast --api-marks DIR
    python3 bench/cpu_sync_bench.py --parts tiny --api-marks DIR
    python3 bench/api_marks.py DIR            # the summary again

The wrappers are the bench's, not the engine's: they patch private names of this checkout and
cost a few microseconds per step, so read the figures for where, not for how much.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

_clock = time.perf_counter
#: The steps of the API call in flight on this process: (label, start, end), or None.
_current: list[tuple[str, float, float]] | None = None
_rounds: list[dict[str, Any]] = []
_installed: str | None = None
_tag = ""


def set_tag(tag: str) -> None:
    """Label the API calls that follow (``summarize`` reports each label apart): a bench
    that times two kinds of round in one process (bf16 and fp32 sources) tags each."""
    global _tag
    _tag = tag


def _record(label: str, t0: float) -> None:
    if _current is not None:
        _current.append((label, t0, _clock()))


def _wrap_async(owner: Any, name: str, label: str) -> None:
    orig = owner.__dict__.get(name)
    if orig is None:  # an older or newer checkout without this step
        return

    @functools.wraps(orig)
    async def step(*a: Any, **kw: Any) -> Any:
        t0 = _clock()
        try:
            return await orig(*a, **kw)
        finally:
            _record(label, t0)

    setattr(owner, name, step)


def _wrap_sync(owner: Any, name: str, label: str) -> None:
    orig = owner.__dict__.get(name)
    if orig is None:
        return

    @functools.wraps(orig)
    def step(*a: Any, **kw: Any) -> Any:
        t0 = _clock()
        try:
            return orig(*a, **kw)
        finally:
            _record(label, t0)

    setattr(owner, name, step)


def _wrap_api(owner: Any, name: str, directory: str) -> None:
    orig = owner.__dict__[name]

    @functools.wraps(orig)
    async def call(self: Any, *a: Any, **kw: Any) -> Any:
        global _current
        _current = steps = []
        t0 = _clock()
        try:
            return await orig(self, *a, **kw)
        finally:
            t1 = _clock()
            _current = None
            role = "trainer" if self.rank < self.trainer_ranks else "worker"
            _rounds.append({"tag": _tag, "rank": self.rank, "role": role,
                            "steps": [(name, 0.0, (t1 - t0) * 1e3)] + [
                                (label, (a0 - t0) * 1e3, (a1 - t0) * 1e3)
                                for label, a0, a1 in steps]})
            path = Path(directory) / f"marks-{os.getpid()}.json"
            path.write_text(json.dumps(_rounds))

    setattr(owner, name, call)


def install(directory: str) -> None:
    """Record every public-API round of this process into ``directory`` (module doc).
    Idempotent per process."""
    global _installed
    if _installed is not None:
        return
    _installed = directory
    os.makedirs(directory, exist_ok=True)
    from m2n_async._data import _cuda, _transport
    from m2n_async._engine import _engine, _pipeline, _round, _sources
    from m2n_async._store import _client

    _wrap_api(_engine.TrainerEngine, "sync_weights", directory)
    _wrap_api(_engine.WorkerEngine, "receive", directory)
    for name in ("publish_start", "wait_start", "run", "_part", "_outcome", "_forget"):
        _wrap_async(_round.RoundDriver, name, f"round.{name}")
    _wrap_async(_sources._Sources, "precheck", "sources.precheck")
    _wrap_async(_sources._Sources, "__call__", "sources.bucket")
    run_pipeline = _pipeline.run_pipeline

    async def pipeline(*a: Any, **kw: Any) -> Any:
        t0 = _clock()
        try:
            return await run_pipeline(*a, **kw)
        finally:
            _record("pipeline", t0)

    _engine.run_pipeline = pipeline  # the engine's own reference is the one it calls
    for name in ("set", "get", "gather", "compare_set", "delete_prefix"):
        _wrap_async(_client.StoreClient, name, f"store.{name}")
    _wrap_async(_cuda.CudaCompletion, "wait", "completion.wait")
    _wrap_async(_transport.NativeCompletion, "wait", "completion.wait")
    lanes: list[Any] = []
    from m2n_async._data import gloo

    lanes.append(gloo.GlooTransport)
    try:
        from m2n_async._data import m2n, nccl
    except ImportError:  # a checkout without a GPU lane module: the gloo lane only
        pass
    else:
        lanes += [m2n.M2NTransport, nccl.NcclTransport]
    for lane in lanes:
        _wrap_async(lane, "stage", "lane.stage")
        _wrap_sync(lane, "transfer", "lane.transfer")
        _wrap_async(lane, "unpack", "lane.unpack")
    from m2n_async._engine import _targets

    _wrap_async(_targets.TargetCheck, "__call__", "targets.check")
    if len(lanes) > 1:  # the m2n lane's host steps inside stage and unpack
        for name in ("_pack", "_stacks", "_source_table", "_table", "_span", "_target_span",
                     "_scatter_lists"):
            _wrap_sync(m2n.M2NTransport, name, f"m2n.{name}")
        _wrap_sync(_cuda.GpuTransportBase, "begin_transfer", "gpu.begin_transfer")
        _wrap_async(_cuda.GpuTransportBase, "finish_unpack", "gpu.finish_unpack")
        # m2n imported these by name: wrap the module's own references
        for name in ("copy_many", "pointer_table"):
            if name in m2n.__dict__:
                _wrap_sync(m2n, name, f"m2n.{name}")


def summarize(directory: str, *, skip: int = 3) -> str:
    """Per rank (and tag), the median start / end (ms from the call's start) of each step
    (module doc)."""
    groups: dict[tuple[str, int, str], list[list[Any]]] = {}
    for path in sorted(Path(directory).glob("marks-*.json")):
        for r in json.loads(path.read_text()):
            groups.setdefault((r["tag"], r["rank"], r["role"]), []).append(r["steps"])
    tags = list(dict.fromkeys(tag for tag, _, _ in groups))  # in the order they ran
    out: list[str] = []
    for (tag, rank, role), rounds in sorted(groups.items(),
                                            key=lambda kv: (tags.index(kv[0][0]), kv[0][1])):
        out += _rank_table(f"rank {rank} ({role}):" + (f" {tag}" if tag else ""),
                           rounds[skip:])
    return "\n".join(out) if out else f"no API rounds recorded under {directory}"


def _rank_table(title: str, rounds: list[list[Any]]) -> list[str]:
    out: list[str] = []
    if rounds:
        spans: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
        for steps in rounds:
            seen: collections.Counter[str] = collections.Counter()
            for label, a, b in steps:
                seen[label] += 1
                spans[f"{label}#{seen[label]}" if seen[label] > 1 else label].append((a, b))
        rows = []
        for label, got in spans.items():
            if len(got) * 2 < len(rounds):  # a step of some rounds only: not typical
                continue
            rows.append((statistics.median(a for a, _ in got),
                         statistics.median(b for _, b in got), label))
        out.append(f"{title} medians of {len(rounds)} rounds, ms from the call's start")
        out.append(f"    {'step':24s} {'start':>8s} {'end':>8s} {'took':>8s}")
        out += [f"    {label:24s} {a:8.3f} {b:8.3f} {b - a:8.3f}" for a, b, label in sorted(rows)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory")
    ap.add_argument("--skip", type=int, default=3, help="warm-up rounds to drop (default 3)")
    args = ap.parse_args()
    print(summarize(args.directory, skip=args.skip))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
