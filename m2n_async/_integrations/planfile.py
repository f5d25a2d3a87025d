"""``m2n-async plan SPEC``: validate a plan described in a file, offline, and summarize it.

Theory of operation: the file (TOML or JSON, same schema) describes meshes and parameters in
the words of the docs; ``load_plan_file`` turns it into the very ``TransferPlan`` the engine
agrees on in its handshake, so "the file validates" means "this plan would pass the plan
checks of preflight" — same code, no GPU, no torch. ``summarize`` then asks the plan the
questions a deployment asks first: bytes per rank, fan-in/out, buckets, a lower-bound time at a
given link bandwidth, and which transports can carry it (and if not, why).

Schema (every key is checked; unknown keys are errors)::

    trainer_mesh = [2, 4]          # trainer ranks [0, 8), row-major; [n] means (n, 1)
    worker_mesh = [2, 4]           # worker ranks [8, 16)
    bucket_bytes = "512MiB"        # optional; --bucket-bytes overrides

    [[params]]
    name = "layers.{i}.mlp.up.weight"   # "{i}" expands over range(repeat)
    repeat = 32                         # optional, default 1
    dtype = "bfloat16"
    shape = [14336, 4096]
    source = ["shard(0)"]               # one entry per mesh axis (source_mesh is 1-D);
                                        # "replicate", or the key left out: fully
                                        # replicated (TOML has no null; JSON's null too)
    dest = ["replicate", "shard(0)"]
    source_mesh = [8]                   # optional re-factoring of the same trainer ranks
    dest_mesh = [1, 8]                  # optional re-factoring of the same worker ranks

A placement entry is ``"replicate"`` (``"r"``, ``"Replicate()"``, ``-1``) or ``"shard(d)"``
(``"s(d)"``, ``"Shard(d)"``, ``d``); a one-entry list is for a 1-D mesh.

Limits (module constants, read at each call; docs/concepts.md): a file of at most
``MAX_FILE_BYTES``, at most ``MAX_MESH_RANKS`` ranks in any mesh, at most ``MAX_PARAMS``
parameters, ``MAX_NAME_BYTES`` bytes of parameter names and ``MAX_SHAPE_DIMS`` shape entries
once ``repeat`` is expanded. The file is read at most one byte past its limit; the others are
checked by arithmetic on the file's numbers before anything is expanded or built. A file past
one is refused at once with a ``PlanError`` naming the file, the key and the limit, instead of
costing minutes and GBs first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import stat
import sys
import tomllib
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path

import msgspec

from m2n_async._proto import lanes
from m2n_async._proto.cost import (
    COSTS_ENV,
    DEFAULT_LANES,
    cost_inputs,
    describe_terms,
    m2n_round_calls,
    parse_costs,
    pick,
    predict,
)
from m2n_async._proto.errors import PlanError
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamSpec, ParamTransfer
from m2n_async._proto.plan import (
    MAX_BUCKET_PARAMS,
    TransferPlan,
    carry_problem,
    complete_plan_digest,
    split_buckets,
)
from m2n_async._proto.stacking import COALESCE_BELOW_BYTES

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_MESH_RANKS",
    "MAX_NAME_BYTES",
    "MAX_PARAMS",
    "MAX_SHAPE_DIMS",
    "LanePrediction",
    "PlanFile",
    "add_plan_command",
    "check_limits",
    "run_plan_command",
    "PlanSummary",
    "StackCall",
    "format_summary",
    "load_plan_file",
    "parse_placements",
    "parse_size",
    "plan_from_file",
    "summarize",
]

PlacementEntry = int | str
PlacementsField = str | list[PlacementEntry] | None


class ParamEntry(msgspec.Struct, forbid_unknown_fields=True):
    """One ``[[params]]`` table (before ``{i}`` expansion)."""

    name: str
    dtype: str
    shape: list[int]
    source: PlacementsField = None
    dest: PlacementsField = None
    repeat: int = 1
    source_mesh: list[int] | None = None
    dest_mesh: list[int] | None = None


class PlanFile(msgspec.Struct, forbid_unknown_fields=True):
    """The whole file."""

    trainer_mesh: list[int]
    worker_mesh: list[int]
    params: list[ParamEntry]
    bucket_bytes: int | str | None = None


class RankLoad(msgspec.Struct, frozen=True):
    """Bytes one rank sends and receives over the whole plan."""

    rank: int
    role: str
    send_bytes: int
    recv_bytes: int


class Extreme(msgspec.Struct, frozen=True):
    """The largest value of a per-parameter figure and the first parameter that has it."""

    value: int
    param: str


class StackCall(msgspec.Struct, frozen=True):
    """One stacked reshard the ``m2n`` lane issues per round: ``members`` (in stack order,
    which is plan order) of one geometry, in bucket ``bucket``. Laid out back to back in that
    order in one buffer, they are resharded in place (docs/tuning.md)."""

    bucket: int
    shape: list[int]
    dtype: str
    members: list[str]


class LanePrediction(msgspec.Struct, frozen=True):
    """One lane's predicted round (``_proto.cost.predict``), in numbers: ``seconds`` for
    ``calls`` native calls, the busiest rank's bytes moved at ``bytes_per_second``, the rate
    of the lane's cost terms (not ``--bandwidth``). ``below_lower_bound``: ``seconds`` is
    less than the summary's lower bound at its bandwidth, so the terms assume a faster link
    than the one the bound describes."""

    lane: str
    seconds: float
    calls: int
    bytes_per_second: float
    below_lower_bound: bool


class PlanSummary(msgspec.Struct, frozen=True):
    """What ``m2n-async plan`` prints (``--json`` prints this struct)."""

    source: str
    params: int
    total_bytes: int
    moved_bytes: int
    dtypes: dict[str, int]
    trainer_ranks: int
    worker_ranks: int
    digest: str
    fan_in: Extreme
    fan_out: Extreme
    bucket_bytes: int
    buckets: int
    largest_bucket_bytes: int
    ranks: list[RankLoad]
    bandwidth_bytes_per_second: float
    lower_bound_seconds: float
    transports: dict[str, str]  # transport -> "ok" or why it cannot carry the plan
    #: transport -> predicted round with the default cost terms (``_proto.cost``), m2n with
    #: coalescing at its default threshold; only transports that can carry the plan
    predicted: dict[str, str]
    auto: str  # what transport="auto" would choose on a host that runs every transport
    #: the m2n lane's calls per round at its bucket size and the default ``coalesce_below``
    m2n_calls: int = 0
    #: the stacked ones among them
    stacks: list[StackCall] = []
    #: lane -> (call_seconds, param_seconds, bytes_per_second) the prediction used
    cost_terms: dict[str, tuple[float, float, float]] = {}
    default_costs: bool = True  # those are ``DEFAULT_LANES`` (no --costs, no M2N_ASYNC_COSTS)
    #: the m2n lane's ``coalesce_below`` the prediction and stacks used (0: coalescing off)
    coalesce_below: int = COALESCE_BELOW_BYTES
    #: ``predicted`` in numbers, per lane (the same lanes)
    predictions: dict[str, LanePrediction] = {}


#: Sizes travel as int64 (``ParamSpec`` refuses 2**63 elements likewise); past 2**1024 the
#: cost model's float arithmetic overflows.
_MAX_SIZE = 2**63

# What a plan file may make loading do. Generous for real models (bench/plan_bench.py's
# DeepSeek-V3-scale plan: 10**5 params over 64 + 64 ranks; examples/plan.toml: 291 params in
# 2 KiB); without them a careless or hostile file costs minutes and GBs before any error.
#: Bytes a plan file may have; it is read with a bounded read, so /dev/zero or a pipe that
#: never ends is refused after ``MAX_FILE_BYTES + 1`` bytes.
MAX_FILE_BYTES = 64 << 20
#: Ranks a mesh (trainer_mesh, worker_mesh, a param's source_mesh or dest_mesh) may have;
#: the summary's per-rank work and the geometry of a sharded param grow with it.
MAX_MESH_RANKS = 1 << 20
#: Parameters the file may declare, every ``repeat`` expanded (about 400 bytes each in memory).
MAX_PARAMS = 10**7
#: UTF-8 bytes of all parameter names, every ``repeat`` expanded: a long name times a large
#: repeat is as costly as many params.
MAX_NAME_BYTES = 2 << 30
#: Entries of all parameter shapes, every ``repeat`` expanded: each copy holds and checks a
#: shape of its own, so a long shape times a large repeat is as costly as many params.
MAX_SHAPE_DIMS = 10**8
_LIMITS_HOME = "m2n_async._integrations.planfile"  # where the constants live, for messages

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
          "gb": 10**9, "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20,
          "gib": 1 << 30, "tib": 1 << 40, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30}


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"1GB"``, ``"65536"``."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE_RE.match(str(value))
        unit = (m.group(2) or "").lower() if m else None
        if m is None or unit not in _UNITS:
            raise PlanError(f"{what}: cannot read {value!r} as a size (e.g. 512MiB, 1GB, "
                            f"65536)")
        # Exact: a float loses digits past 2**53 ("9007199254740993" read one byte short)
        # and overflows to inf on a long digit string.
        n = int(Fraction(m.group(1)) * _UNITS[unit])
    if n < 1:
        raise PlanError(f"{what}: must be at least 1 byte, got {value!r}")
    if n >= _MAX_SIZE:
        raise PlanError(f"{what}: {value!r} is 2**63 bytes or more (sizes travel as int64)")
    return n


_SHARD_RE = re.compile(r"^(?:s|shard)\(\s*(?:dim\s*=\s*)?(-?[0-9]+)\s*\)$", re.IGNORECASE)


def _entry(value: PlacementEntry, where: str) -> int:
    if isinstance(value, bool):
        raise PlanError(f"{where}: placement {value!r} is not a placement")
    if isinstance(value, int):
        if value < REPLICATE:
            raise PlanError(f"{where}: placement {value} must be -1 (replicate) or a dim >= 0")
        return value
    text = value.strip()
    if text.lower() in ("r", "replicate", "replicate()"):
        return REPLICATE
    if text.isascii() and text.isdigit():  # not "²": isdigit alone accepts it, int() not
        return int(text)
    m = _SHARD_RE.match(text)
    if m is None or int(m.group(1)) < 0:
        raise PlanError(f"{where}: cannot read placement {value!r} (use \"replicate\" or "
                        f"\"shard(d)\" with d >= 0)")
    return int(m.group(1))


def parse_placements(value: PlacementsField, where: str,
                     mesh_dims: Sequence[int] | None = None) -> tuple[int, int] | None:
    """Core placements from a file entry: ``None``/"replicate", or a list per mesh axis.

    With ``mesh_dims`` (the mesh as the file writes it: ``[n]`` or ``[a, b]``) a list must
    have exactly one entry per axis, and a shard along an axis of size 1 (one piece: the
    whole tensor) is read as replicate, so that every spelling of a layout has one digest.
    """
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() in ("r", "replicate", "replicate()"):
            return None
        raise PlanError(f"{where}: a single placement {value!r} is ambiguous; give a list "
                        f"with one entry per mesh axis, e.g. [\"replicate\", {value!r}]")
    if not 1 <= len(value) <= 2:
        raise PlanError(f"{where}: placements need one entry per mesh axis (1 or 2), got "
                        f"{len(value)}")
    if mesh_dims is not None and len(value) != len(mesh_dims):
        raise PlanError(f"{where}: placements need one entry per mesh axis: the mesh "
                        f"{list(mesh_dims)} has {len(mesh_dims)}, got {len(value)} "
                        f"({list(value)})")
    got = [_entry(v, where) for v in value]
    if len(got) == 1:
        got.append(REPLICATE)
    if mesh_dims is not None:
        got = [REPLICATE if axis < len(mesh_dims) and mesh_dims[axis] == 1 else p
               for axis, p in enumerate(got)]
    if got == [REPLICATE, REPLICATE]:
        return None
    return (got[0], got[1])


def _mesh(dims: Sequence[int], start: int, where: str) -> Mesh:
    if not 1 <= len(dims) <= 2:
        raise PlanError(f"{where}: a mesh has 1 or 2 dims, got {list(dims)}")
    pair = (dims[0], 1) if len(dims) == 1 else (dims[0], dims[1])
    try:
        return Mesh(pair, start)
    except PlanError as e:
        raise PlanError(f"{where}: {e}") from None


def _digits_below(n: int) -> int:
    """Decimal digits of ``str(i)`` for every ``i`` in ``range(n)``, summed, in O(digits of n)."""
    total, width, low = 0, 1, 0
    while low < n:
        high = 10**width
        total += (min(n, high) - low) * width
        width, low = width + 1, high
    return total


def _over(prefix: str, where: str, what: str, limit: str, name: str) -> PlanError:
    return PlanError(f"{prefix}{where}: {what}, over the limit of {limit} ({name} in "
                     f"{_LIMITS_HOME}; set it higher there to load such a file)")


def check_limits(spec: PlanFile, source: str | None = None) -> None:
    """Raise ``PlanError`` if ``spec`` is past ``MAX_MESH_RANKS``, ``MAX_PARAMS``,
    ``MAX_NAME_BYTES`` or ``MAX_SHAPE_DIMS``, by arithmetic on its fields alone: nothing is
    expanded or built.

    The message names ``source`` (the file), the key (``params[3].repeat``) and the limit.
    """
    prefix = f"{source}: " if source else ""
    # Read now, not bound at import: a program that needs more sets the constants first.
    max_ranks, max_params, max_names = MAX_MESH_RANKS, MAX_PARAMS, MAX_NAME_BYTES
    max_dims = MAX_SHAPE_DIMS
    meshes = [("trainer_mesh", spec.trainer_mesh), ("worker_mesh", spec.worker_mesh)]
    for k, entry in enumerate(spec.params):
        meshes += [(f"params[{k}].{key}", dims)
                   for key, dims in (("source_mesh", entry.source_mesh),
                                     ("dest_mesh", entry.dest_mesh)) if dims is not None]
    for where, dims in meshes:
        # Only a mesh _mesh would accept: the product of a long list of huge ints is itself
        # costly, and _mesh refuses it with its own message.
        if 1 <= len(dims) <= 2 and all(d >= 1 for d in dims):
            ranks = dims[0] * (dims[1] if len(dims) == 2 else 1)
            if ranks > max_ranks:
                raise _over(prefix, where, f"{list(dims)} has {ranks} ranks",
                            f"{max_ranks} ranks per mesh", "MAX_MESH_RANKS")
    params = names = entries = 0
    for k, entry in enumerate(spec.params):
        # The name cut short: the one past MAX_NAME_BYTES may be most of the file.
        shown = entry.name if len(entry.name) <= 80 else entry.name[:60] + "..."
        where = f"params[{k}].repeat ({shown!r})"
        n = max(entry.repeat, 0)  # repeat < 1 is refused, with its own message, when built
        params += n
        if params > max_params:
            raise _over(prefix, where, f"repeat = {n} brings the expanded parameters to "
                        f"{params}", str(max_params), "MAX_PARAMS")
        # Each copy is the name with every "{i}" (3 bytes) replaced by the digits of i.
        length = len(entry.name.encode("utf-8", "surrogatepass"))
        names += n * length + entry.name.count("{i}") * (_digits_below(n) - 3 * n)
        if names > max_names:
            raise _over(prefix, where, f"the expanded names come to {names} bytes "
                        f"({length}-byte name, repeat = {n})", f"{max_names} bytes",
                        "MAX_NAME_BYTES")
        entries += n * len(entry.shape)
        if entries > max_dims:
            raise _over(prefix, f"params[{k}].shape ({shown!r})", f"{len(entry.shape)} "
                        f"entries, repeat = {n}, bring the expanded shape entries to {entries}",
                        str(max_dims), "MAX_SHAPE_DIMS")


def plan_from_file(spec: PlanFile, source: str | None = None) -> tuple[TransferPlan, int | None]:
    """Build (and validate) the ``TransferPlan`` a decoded file describes.

    Returns the plan and the file's ``bucket_bytes`` (``None`` if absent). Raises
    ``PlanError`` naming the parameter (and its ``[[params]]`` position) that is wrong; a
    spec past the limits (``check_limits``; ``source``: the file, for its messages) before
    anything is built.
    """
    check_limits(spec, source)
    trainer = _mesh(spec.trainer_mesh, 0, "trainer_mesh")
    workers = _mesh(spec.worker_mesh, trainer.size, "worker_mesh")
    transfers: list[ParamTransfer] = []
    declared: dict[str, int] = {}  # expanded name -> its [[params]] entry
    for k, entry in enumerate(spec.params):
        where = f"params[{k}] ({entry.name!r})"
        if entry.repeat < 1:
            raise PlanError(f"{where}: repeat must be >= 1, got {entry.repeat}")
        if entry.repeat > 1 and "{i}" not in entry.name:
            raise PlanError(f"{where}: repeat = {entry.repeat} needs \"{{i}}\" in the name so "
                            f"the copies get distinct names")
        src_mesh = (_mesh(entry.source_mesh, 0, f"{where} source_mesh")
                    if entry.source_mesh is not None else trainer)
        dst_mesh = (_mesh(entry.dest_mesh, trainer.size, f"{where} dest_mesh")
                    if entry.dest_mesh is not None else workers)
        for label, mesh, full in (("source_mesh", src_mesh, trainer),
                                  ("dest_mesh", dst_mesh, workers)):
            if mesh.size != full.size:
                raise PlanError(f"{where}: {label} {mesh.dims} has {mesh.size} ranks but the "
                                f"{label.split('_')[0]} side has {full.size}; a per-param mesh "
                                f"re-factors the same ranks")
        try:
            src = Layout(src_mesh, parse_placements(
                entry.source, f"{where} source",
                entry.source_mesh if entry.source_mesh is not None else spec.trainer_mesh))
            dst = Layout(dst_mesh, parse_placements(
                entry.dest, f"{where} dest",
                entry.dest_mesh if entry.dest_mesh is not None else spec.worker_mesh))
            for i in range(entry.repeat):
                name = entry.name.replace("{i}", str(i))
                first = declared.setdefault(name, k)
                if first != k:
                    raise PlanError(f"{where}: declares {name!r}, which params[{first}] "
                                    f"({spec.params[first].name!r}) already declares")
                spec_ = ParamSpec(name, entry.dtype, tuple(entry.shape), src)
                transfers.append(ParamTransfer(spec_, dst))
        except PlanError as e:
            msg = str(e)
            raise PlanError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    if not transfers:
        raise PlanError("the file declares no [[params]]")
    plan = TransferPlan(transfers, trainer_ranks=trainer.size,
                        world_size=trainer.size + workers.size)
    bucket = (parse_size(spec.bucket_bytes, "bucket_bytes")
              if spec.bucket_bytes is not None else None)
    return plan, bucket


_TOML_NULL = re.compile(rb"^\s*[\w.\"'-]+\s*=\s*null\s*(#.*)?$", re.M)


def _null_hint(kind: str, raw: bytes) -> str:
    # JSON's null (the same schema's "absent") is the natural guess; TOML has no such value.
    m = _TOML_NULL.search(raw) if kind == "TOML" else None
    if m is None:
        return ""
    line = raw.count(b"\n", 0, m.start()) + 1
    return (f"; TOML has no null (line {line}): write \"replicate\" for a fully replicated "
            f"tensor, or leave the key out")


def load_plan_file(path: str | Path) -> tuple[TransferPlan, int | None]:
    """Read a TOML (``.toml``) or JSON file and build its plan (see ``plan_from_file``).

    Raises ``PlanError`` for a plan that is invalid or a file that does not match the schema
    (the message gives the key path), ``OSError`` for a file that cannot be read.
    """
    p = Path(path)
    raw = _read_bounded(p, MAX_FILE_BYTES)  # the constant read now, as in check_limits
    try:
        if p.suffix.lower() == ".json":
            obj = json.loads(raw)
        else:
            obj = tomllib.loads(raw.decode())
    # RecursionError: arrays or tables nested thousands deep (both parsers recurse)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        kind = "JSON" if p.suffix.lower() == ".json" else "TOML"
        raise PlanError(f"{p}: not valid {kind}: {e}{_null_hint(kind, raw)}") from None
    try:
        spec = msgspec.convert(obj, PlanFile)
    except msgspec.ValidationError as e:
        raise PlanError(f"{p}: {e}") from None
    return plan_from_file(spec, str(p))


def _read_bounded(p: Path, limit: int) -> bytes:
    """The file's bytes; ``PlanError`` past ``limit``, having read at most ``limit + 1``."""
    def too_big(what: str) -> PlanError:
        return PlanError(f"{p}: the file {what} the limit of {limit} bytes "
                         f"({human_bytes(limit)}; MAX_FILE_BYTES in {_LIMITS_HOME}; set it "
                         f"higher there to load such a file)")
    with p.open("rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_ISREG(st.st_mode) and st.st_size > limit:
            raise too_big(f"has {st.st_size} bytes, over")  # its size says so: nothing read
        # Bounded whatever the file is: /dev/zero, a pipe or a file still growing end only
        # here, one byte past the limit.
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise too_big("goes on past")
    return raw


def summarize(plan: TransferPlan, *, source: str = "", bucket_bytes: int | None = None,
              bandwidth_bytes_per_second: float = 50e9,
              coalesce_below: int = COALESCE_BELOW_BYTES,
              cost_terms: Mapping[str, tuple[float, float, float]] | None = None
              ) -> PlanSummary:
    """Everything ``m2n-async plan`` reports about ``plan``.

    ``bucket_bytes`` None: each transport's default, as an engine whose config leaves it None
    runs; the buckets reported are then those of the transport ``auto`` would choose.
    ``coalesce_below``: the m2n lane's threshold (``EngineConfig.coalesce_below``; 0: an
    engine with ``coalesce=False``). ``cost_terms``: per-lane terms the prediction uses
    (``EngineConfig.costs``; None: ``DEFAULT_LANES``)."""
    # Checked here: further down a str is int()'s ValueError and a float is truncated.
    if bucket_bytes is not None and (type(bucket_bytes) is not int
                                     or not 1 <= bucket_bytes < _MAX_SIZE):
        raise PlanError(f"bucket_bytes must be None or an int in [1, 2**63), got "
                        f"{bucket_bytes!r} (parse_size reads sizes such as \"512MiB\")")
    if type(coalesce_below) is not int or not 0 <= coalesce_below < _MAX_SIZE:
        raise PlanError(f"coalesce_below must be an int in [0, 2**63) (0: coalescing off), got "
                        f"{coalesce_below!r}")
    dtypes: dict[str, int] = {}
    best_in, best_out = Extreme(0, ""), Extreme(0, "")
    for i, p in enumerate(plan.params):
        dtypes[p.spec.dtype] = dtypes.get(p.spec.dtype, 0) + 1
        fi, fo = plan.fan_in(i), plan.fan_out(i)
        if fi > best_in.value:
            best_in = Extreme(fi, p.name)
        if fo > best_out.value:
            best_out = Extreme(fo, p.name)
    transports = {t: carry_problem(plan, t) or "ok" for t in lanes.LANES}
    ok = [t for t in lanes.LANES if transports[t] == "ok"]
    sizes = {t: lanes.bucket_bytes(t, bucket_bytes) for t in DEFAULT_LANES}
    terms = dict(DEFAULT_LANES if cost_terms is None else {**DEFAULT_LANES, **cost_terms})
    costs = cost_inputs(terms, sizes, coalesce_below)
    predicted = predict(plan, costs, ok)
    auto = pick(predicted, ok)[0] if ok else "none"
    # What the engine runs: byte-budget buckets cut into runs of at most MAX_BUCKET_PARAMS,
    # at the size of the transport it would run (auto's choice; else the first lane).
    size = lanes.bucket_bytes(auto if ok else lanes.LANES[0], bucket_bytes)
    buckets = split_buckets(plan, plan.buckets(size), MAX_BUCKET_PARAMS)
    calls = list(m2n_round_calls(plan, lanes.bucket_bytes("m2n", bucket_bytes), coalesce_below))
    stacks = [StackCall(b, list(plan.params[call[0]].spec.shape), plan.params[call[0]].spec.dtype,
                        [plan.params[i].name for i in call])
              for b, call in calls if len(call) > 1]
    lower_bound = plan.lower_bound_seconds(bandwidth_bytes_per_second)
    ranks = [RankLoad(r, "trainer" if r < plan.trainer_ranks else "worker",
                      plan.send_bytes(r), plan.recv_bytes(r)) for r in range(plan.world_size)]
    return PlanSummary(
        source=source,
        params=len(plan.params),
        total_bytes=sum(p.spec.nbytes for p in plan.params),
        moved_bytes=plan.total_bytes(),
        dtypes=dict(sorted(dtypes.items())),
        trainer_ranks=plan.trainer_ranks,
        worker_ranks=plan.worker_ranks,
        digest=complete_plan_digest(plan),
        fan_in=best_in,
        fan_out=best_out,
        bucket_bytes=size,
        buckets=len(buckets),
        largest_bucket_bytes=max((b.nbytes for b in buckets), default=0),
        ranks=ranks,
        bandwidth_bytes_per_second=bandwidth_bytes_per_second,
        lower_bound_seconds=lower_bound,
        transports=transports,
        predicted={t: predicted[t].describe().removeprefix(f"{t} ") for t in ok},
        predictions={t: LanePrediction(t, predicted[t].seconds, predicted[t].calls,
                                       terms[t][2], predicted[t].seconds < lower_bound)
                     for t in ok},
        auto=auto,
        m2n_calls=len(calls),
        stacks=stacks,
        cost_terms={t: terms[t] for t in sorted(terms)},
        default_costs=cost_terms is None,
        coalesce_below=coalesce_below,
    )


def human_bytes(n: float) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_summary(s: PlanSummary, *, all_ranks: bool = False, stacks: bool = False) -> str:
    """The human-readable report; ranks are listed in full up to 16 (or with ``all_ranks``),
    the m2n lane's stacked calls with ``stacks``."""
    lines = [
        f"plan {s.source}" if s.source else "plan",
        f"  params       {s.params} ({human_bytes(s.total_bytes)}; "
        + ", ".join(f"{d} x{n}" for d, n in s.dtypes.items()) + ")",
        f"  ranks        trainers [0, {s.trainer_ranks}), workers [{s.trainer_ranks}, "
        f"{s.trainer_ranks + s.worker_ranks})",
        f"  digest       {s.digest[:16]}",
        f"  moved        {human_bytes(s.moved_bytes)}",
        f"  fan-in max   {s.fan_in.value} ({s.fan_in.param})",
        f"  fan-out max  {s.fan_out.value} ({s.fan_out.param})",
        f"  buckets      {s.buckets} at {human_bytes(s.bucket_bytes)} "
        f"(largest {human_bytes(s.largest_bucket_bytes)})",
        f"  lower bound  {s.lower_bound_seconds:.4f} s at "
        f"{s.bandwidth_bytes_per_second / 1e9:g} GB/s per rank and direction",
        "  per rank     rank  role      send        recv",
    ]
    rows = s.ranks
    if not all_ranks and len(rows) > 16:
        busiest = sorted(rows, key=lambda r: -max(r.send_bytes, r.recv_bytes))[:8]
        rows = sorted(busiest, key=lambda r: r.rank)
        lines.append(f"               (the 8 busiest of {len(s.ranks)} ranks; --all-ranks "
                     f"lists every one)")
    for r in rows:
        lines.append(f"               {r.rank:<5} {r.role:<9} {human_bytes(r.send_bytes):<11} "
                     f"{human_bytes(r.recv_bytes)}")
    lines.append("  transports   (can express the plan; the runtime is checked at connect)")
    for t, verdict in s.transports.items():
        lines.append(f"    {t:<5} {'ok' if verdict == 'ok' else 'no: ' + verdict}")
    if s.predicted:
        which = ("the default cost terms (docs/tuning.md)" if s.default_costs
                 else f"the cost terms of --costs / ${COSTS_ENV}")
        lines.append(f"  predicted    one round with {which}, {_coalescing(s.coalesce_below)}")
        for t, text in s.predicted.items():
            terms = "" if s.default_costs else f"   [{describe_terms(s.cost_terms[t])}]"
            lines.append(f"    {t:<5} {text}{terms}{'   <- auto' if t == s.auto else ''}")
        lines += _rate_lines(s)
    stacked = sum(len(c.members) for c in s.stacks)
    if s.transports.get("m2n") != "ok":
        return "\n".join(lines)
    lines.append(f"  m2n stacks   {len(s.stacks)} stacked calls of {stacked} params, "
                 f"{s.m2n_calls - len(s.stacks)} single; {s.m2n_calls} calls a round"
                 + ("" if stacks or not s.stacks else " (--stacks lists them)"))
    if stacks:
        for c in s.stacks:
            lines.append(f"    bucket {c.bucket}: {len(c.members)} of global shape "
                         f"{tuple(c.shape)} {c.dtype}, in this order: {', '.join(c.members)}")
    return "\n".join(lines)


def _coalescing(coalesce_below: int) -> str:
    """How the m2n lane's calls were counted, for the ``predicted`` heading."""
    if coalesce_below <= 0:
        return "m2n not coalesced (one reshard per parameter)"
    if coalesce_below == COALESCE_BELOW_BYTES:
        return "m2n coalesced"
    return f"m2n coalesced below {human_bytes(coalesce_below)}"


def _rate_lines(s: PlanSummary) -> list[str]:
    """The rate each prediction assumed (its cost terms', not ``--bandwidth``), and what to
    do when that puts a prediction below the lower bound."""
    if not s.predictions:
        return []
    rates = ", ".join(f"{t} {p.bytes_per_second / 1e9:g}" for t, p in s.predictions.items())
    lines = [f"               at each lane's own rate ({rates} GB/s per rank), not --bandwidth"]
    fast = [p for p in s.predictions.values() if p.below_lower_bound]
    if fast:
        bw = s.bandwidth_bytes_per_second
        # Every lane's terms (pasting them must not drop the others'), the flagged ones at
        # --bandwidth, in JSON's exact float text: the suggestion reproduces itself.
        slow = {p.lane for p in fast}
        costs = json.dumps({t: [*s.cost_terms[t][:2], bw if t in slow else s.cost_terms[t][2]]
                            for t in s.predictions})[1:-1]
        lines += [
            f"  warning      below the lower bound ({s.lower_bound_seconds:.4f} s at "
            f"{bw / 1e9:g} GB/s): "
            + ", ".join(f"{p.lane} (at {p.bytes_per_second / 1e9:g} GB/s)" for p in fast),
            "               their terms assume a faster link than --bandwidth; on this "
            "network predict",
            "               with its own terms (docs/tuning.md, \"How auto chooses\"), e.g.",
            f"               --costs '{{{costs}}}'",
        ]
    return lines


# -- the subcommand ---------------------------------------------------------------------------


def add_plan_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``plan`` on the ``m2n-async`` subparsers."""
    p = sub.add_parser(
        "plan", help="validate a plan file (TOML/JSON) offline and summarize it",
        description="Validate a plan described in a TOML or JSON file (meshes, params, "
                    "placements) with the same checks the engine's handshake runs, and print "
                    "bytes per rank, fan-in/out, buckets, a lower-bound time, which "
                    "transports can carry it and each one's predicted round (at its cost "
                    "terms' rate, not --bandwidth). Exit status: 0 valid, 1 invalid (or "
                    "--require not met), 2 unreadable file or bad option.")
    p.add_argument("spec", help="plan file: .toml or .json (schema: docs/concepts.md)")
    p.add_argument("--bandwidth", type=float, default=50.0, metavar="GB_PER_S",
                   help="link bandwidth per rank and direction in GB/s for the lower bound "
                        "(default 50: a 400 Gb/s NIC, 50 GB/s raw; NVLink4 reaches about "
                        "370 with NCCL); the predictions use their cost terms' rate "
                        "(--costs)")
    defaults = ", ".join(f"{human_bytes(n)} on {t}" for t, n in lanes.DEFAULT_BUCKET_BYTES.items())
    p.add_argument("--bucket-bytes", default=None, metavar="SIZE",
                   help=f"bucket size, e.g. 512MiB (default: the file's, else the engine's "
                        f"default of the transport auto picks: {defaults})")
    p.add_argument("--require", choices=lanes.LANES, default=None,
                   help="exit 1 unless this transport can carry the plan")
    p.add_argument("--all-ranks", action="store_true", help="list every rank")
    p.add_argument("--coalesce-below", default=None, metavar="SIZE",
                   help="the m2n lane's coalesce_below, e.g. 1MiB; 0 for coalesce=False "
                        "(default: the engine's, "
                        f"{human_bytes(COALESCE_BELOW_BYTES)})")
    p.add_argument("--costs", default=None, metavar="JSON",
                   help='per-lane cost terms for the prediction, as EngineConfig.costs: '
                        '{"m2n": [call_s, param_s, bytes_per_s], ...} (default: '
                        f'${COSTS_ENV}, else the built-in terms)')
    p.add_argument("--stacks", action="store_true",
                   help="list the m2n lane's stacked calls, each with its members in stack "
                        "order (the order to lay them out in one buffer for in-place "
                        "reshards)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")


def _cost_terms(value: str | None) -> dict[str, tuple[float, float, float]] | None:
    """``--costs``, else ``$M2N_ASYNC_COSTS`` (as an engine reads it), else None."""
    text, where = ((value, "--costs") if value is not None
                   else (os.environ.get(COSTS_ENV, ""), f"${COSTS_ENV}"))
    if not text.strip():
        return None
    try:
        return parse_costs(text)
    except PlanError as e:  # the terms may come from the environment: say which
        raise PlanError(f"{where} {text!r}: {e}") from None


def _coalesce_below(value: str | None) -> int:
    """``--coalesce-below``: the engine's default when absent, 0 (coalescing off), a size."""
    if value is None:
        return COALESCE_BELOW_BYTES
    m = _SIZE_RE.match(value)
    if m is not None and Fraction(m.group(1)) == 0:  # "0", "0.0", "0B": off, however written
        return 0
    return parse_size(value, "--coalesce-below")


def run_plan_command(args: argparse.Namespace) -> int:
    """Run ``m2n-async plan``; returns the exit status."""
    if not args.spec:  # Path("") is ".": without this, "cannot read : Is a directory"
        print("m2n-async plan: SPEC '': an empty path names no file", file=sys.stderr)
        return 2
    try:  # the options first: a usage error (2) is said before the file is read
        given_bucket = (parse_size(args.bucket_bytes, "--bucket-bytes")
                        if args.bucket_bytes is not None else None)
        # finite too: inf (or 1e400, read as inf) gives a lower bound of 0 s and a JSON null
        if not (args.bandwidth > 0 and math.isfinite(args.bandwidth)):
            raise PlanError(f"--bandwidth must be > 0 GB/s and finite, got {args.bandwidth}")
        coalesce_below = _coalesce_below(args.coalesce_below)
        cost_terms = _cost_terms(args.costs)
    except PlanError as e:
        print(f"m2n-async plan: {e}", file=sys.stderr)
        return 2
    try:
        plan, file_bucket = load_plan_file(args.spec)
    except OSError as e:
        print(f"m2n-async plan: cannot read {args.spec}: {e.strerror or e}", file=sys.stderr)
        return 2
    except PlanError as e:
        print(f"m2n-async plan: invalid plan: {e}", file=sys.stderr)
        return 1
    try:
        summary = summarize(plan, source=str(args.spec),
                            bucket_bytes=given_bucket if given_bucket is not None
                            else file_bucket,
                            bandwidth_bytes_per_second=args.bandwidth * 1e9,
                            coalesce_below=coalesce_below, cost_terms=cost_terms)
    except PlanError as e:
        print(f"m2n-async plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(msgspec.json.encode(summary).decode())
    else:
        print(format_summary(summary, all_ranks=args.all_ranks, stacks=args.stacks))
    carriers = [t for t, v in summary.transports.items() if v == "ok"]
    if args.require is not None and args.require not in carriers:
        print(f"m2n-async plan: transport {args.require!r} cannot carry this plan: "
              f"{summary.transports[args.require]}", file=sys.stderr)
        return 1
    if not carriers:
        print("m2n-async plan: no transport can carry this plan", file=sys.stderr)
        return 1
    return 0
