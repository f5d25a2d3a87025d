"""Worker side: declare destination tensors and placements from a module and a TP plan.

Theory of operation: an inference worker's model holds, per parameter, the *local* shard it
serves with — a plain tensor already cut by tensor parallelism (vLLM/SGLang style) or a
DTensor on the worker's TP mesh. ``WorkerEngine.connect(targets=...)`` wants, per plan name,
that local tensor plus its placements on the worker mesh ``(replicas, tp)``: ``(REPLICATE,
d)`` for a tensor sharded along dim ``d`` by tensor parallelism, ``None`` for a replicated one.

For plain tensors the placement comes from a *TP plan*: glob patterns over module or
parameter names mapped to ``"colwise"``, ``"rowwise"``, ``"replicate"``, a tensor dim, or
torch's own ``ColwiseParallel()``/``RowwiseParallel()`` styles — the same vocabulary as
``parallelize_module``, so a framework's existing plan can be reused as is. The styles mean
what they mean in torch for the module type: for a Linear (weight ``[out, in]``) colwise
shards weight and bias along dim 0 and rowwise shards the weight along dim 1 and replicates
the bias; for an Embedding (``[num, dim]``) colwise shards dim 1, rowwise dim 0.

Some destinations cannot be written in place: a fused QKV/gate-up tensor whose parts are not
contiguous slices, or a quantized copy that needs scales. For those a ``LoadTarget`` declares
the received shard's local shape, dtype and placements plus a ``load(name, tensor)``
callback; the engine hands the callback to the transport as the unpack sink (the data plane's
``LoadCallback``), so the shard lives only in transport staging and no long-lived scratch copy
is kept. Contract: DEVELOPERS.md "Ecosystem". ``fused_targets`` splits one fused local
tensor into per-part targets: contiguous slices are written in place, others are loaded.
"""

from __future__ import annotations

import fnmatch
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from m2n_async._integrations.sources import (
    Rename,
    _clean,
    _is_dtensor,
    layout_of_dtensor,
    named_tensors,
)
from m2n_async._proto.errors import PlanError
from m2n_async._proto.layout import REPLICATE

if TYPE_CHECKING:
    import torch

__all__ = [
    "LoadTarget",
    "TPStyle",
    "Target",
    "WorkerTargets",
    "fused_targets",
    "targets_from_module",
]

Placements = tuple[int, int] | None
TPStyle = str | int | None | Any
"""A TP plan value: ``"colwise"``, ``"rowwise"``, ``"replicate"`` (or ``None``), a tensor dim,
or a torch ``ParallelStyle`` (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``)."""


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` returns a coroutine: an ``async def`` (also behind
    ``functools.partial``) or an object whose ``__call__`` is one. Callbacks the engine
    calls without awaiting (``LoadTarget.load``, ``progress``) must be neither."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


@dataclass(frozen=True, eq=False)
class LoadTarget:
    """A destination filled through a callback instead of written in place.

    This worker's shard of the parameter — local ``shape``, ``dtype``, sharded on the worker
    mesh as ``placements`` — is received into the transport's staging, and
    ``load(name, tensor)`` copies, fuses or quantizes it into the real destination. The
    tensor is valid only during the call (the staging is reused), so ``load`` copies what it
    needs before returning. Callbacks run one at a time, in plan order, once the bucket's
    bytes have arrived — on the transport's unpack thread (CPU) or after the unpack stream
    synchronized (CUDA) — so ``load`` must not touch the event loop. It is a plain
    function: an ``async def`` is refused here (``PlanError``), and an awaitable returned
    by ``load`` fails the round naming the parameter, since nothing would await it.

    Quacks like a tensor for plan validation (``shape``, ``dtype``, ``device``,
    ``is_contiguous()``), so the engine checks it against the plan like any target.
    """

    shape: tuple[int, ...]
    dtype: Any  # torch.dtype or a dtype name
    placements: Placements
    load: Callable[[str, torch.Tensor], None]
    device: Any = "cpu"  # the worker's device (e.g. "cuda:0"): torch.device or str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(n) for n in self.shape))
        if not callable(self.load):
            raise PlanError(f"LoadTarget.load must be callable, got {type(self.load).__name__}")
        if is_async_callable(self.load):
            # called on a thread and never awaited: the copy would never happen
            raise PlanError(f"LoadTarget.load must be a plain function, got an async one "
                            f"({self.load!r}): it is called on the transport's thread, off "
                            f"the event loop, and must copy before it returns")

    def is_contiguous(self) -> bool:
        """Always true: the engine stages the received shard contiguously."""
        return True

    @classmethod
    def into(cls, view: torch.Tensor, placements: Placements) -> LoadTarget:
        """Copy the received shard into ``view``: for non-contiguous slices of a fused tensor
        (e.g. one part of a dim-1 fused weight), which cannot be written in place.
        """
        view = view.detach()  # a Parameter's view: copy_ must not be an autograd op

        def load(_name: str, received: torch.Tensor) -> None:
            view.copy_(received)

        return cls(tuple(view.shape), view.dtype, placements, load, view.device)


def _into_parameter(name: str, param: torch.Tensor, placements: Placements) -> LoadTarget:
    """``LoadTarget.into`` for a module's own non-contiguous parameter: the copy goes into the
    parameter as it is at load time (storage it got since, ``param.data = ...``, is written),
    and storage of another dtype or shape fails the round naming it, as for a target written
    in place; never into a view of the storage it had at connect."""
    shape, dtype = tuple(param.shape), param.dtype

    def load(_name: str, received: torch.Tensor) -> None:
        if param.dtype != dtype or tuple(param.shape) != shape:
            raise PlanError(f"parameter {name!r}: the target changed after connect: "
                            f"{param.dtype} {tuple(param.shape)}, planned {dtype} {shape}")
        param.detach().copy_(received)  # detach(): never an autograd op, whatever the mode

    return LoadTarget(shape, dtype, placements, load, param.device)


Target = tuple["torch.Tensor", Placements] | LoadTarget


class WorkerTargets(dict[str, Target]):
    """``targets`` for ``WorkerEngine.connect``: plan name → ``(local tensor, placements)``
    or ``LoadTarget``. A plain dict, so it can be edited or merged before connecting.
    """

    @property
    def loaded_names(self) -> tuple[str, ...]:
        """Names delivered through a ``LoadTarget`` callback rather than in place."""
        return tuple(n for n, t in self.items() if isinstance(t, LoadTarget))

    def placements(self) -> dict[str, Placements]:
        """Plan name → placements on the worker mesh (what the destination phase sends)."""
        return {n: (t.placements if isinstance(t, LoadTarget) else t[1])
                for n, t in self.items()}


def fused_targets(fused: torch.Tensor, parts: Mapping[str, int], *, dim: int,
                  placements: Placements) -> dict[str, Target]:
    """Targets for the parts of one fused local tensor (vLLM's ``qkv_proj``, ``gate_up_proj``).

    ``parts`` maps each trainer-side name to its size along ``dim`` *in this worker's local
    shard*, in the order they are concatenated (e.g. ``{"q.weight": 1024, "k.weight": 256,
    "v.weight": 256}`` for a TP rank's fused QKV rows). A part that is a contiguous slice —
    always the case along dim 0 of a contiguous tensor — is a view the engine writes in
    place; any other part becomes ``LoadTarget.into(view)`` (received, then copied in).
    ``placements`` is each part's placement on the worker mesh (the fused tensor's).

    Raises ``PlanError`` if the sizes do not add up to ``fused.shape[dim]``.
    """
    ndim = fused.dim()
    d = dim + ndim if dim < 0 else dim
    if not 0 <= d < ndim:
        raise PlanError(f"fused_targets: dim {dim} out of range for a tensor of rank {ndim}")
    total = sum(parts.values())
    if total != fused.shape[d]:
        raise PlanError(f"fused_targets: parts {dict(parts)} add up to {total} along dim {d} "
                        f"but the fused tensor has {fused.shape[d]} (shape "
                        f"{tuple(fused.shape)}); give local (per TP rank) sizes")
    out: dict[str, Target] = {}
    start = 0
    for name, size in parts.items():
        if size < 1:
            raise PlanError(f"fused_targets: part {name!r} has size {size}")
        view = fused.narrow(d, start, size)
        start += size
        out[name] = (view, placements) if view.is_contiguous() else LoadTarget.into(
            view, placements)
    return out


def _style_name(name: str, style: TPStyle) -> str | int | None:
    if isinstance(style, bool):
        raise PlanError(f"TP plan entry for {name!r}: {style!r} is not a style or a tensor dim")
    if style is None or isinstance(style, int | str):
        if isinstance(style, str):
            key = style.lower()
            if key not in ("colwise", "rowwise", "replicate"):
                raise PlanError(f"TP plan entry for {name!r}: unknown style {style!r} (use "
                                f"'colwise', 'rowwise', 'replicate' or a tensor dim)")
            return None if key == "replicate" else key
        return style
    cls = type(style).__name__
    # Match by class name so torch.distributed.tensor.parallel need not be imported here;
    # only the weight placement matters to us, not the activation layouts. Walk the MRO:
    # torchao's Float8ColwiseParallel & co. subclass torch's styles.
    for base in (k.__name__ for k in type(style).__mro__):
        if base == "ColwiseParallel":
            return "colwise"
        if base == "RowwiseParallel":
            return "rowwise"
        if base in ("SequenceParallel", "PrepareModuleInput", "PrepareModuleOutput",
                    "PrepareModuleInputOutput"):
            return None
    raise PlanError(f"TP plan entry for {name!r}: unsupported style {cls}; use 'colwise', "
                    f"'rowwise', 'replicate' or a tensor dim")


def _glob(name: str, pattern: str) -> bool:
    """parallelize_module's rule: ``*`` matches within one dotted segment, never across."""
    parts, pats = name.split("."), pattern.split(".")
    return len(parts) == len(pats) and all(map(fnmatch.fnmatchcase, parts, pats))


def _shard_dim(modules: Mapping[str, torch.nn.Module], fqn: str, ndim: int,
               tp_plan: Mapping[str, TPStyle]) -> int | None:
    """Tensor dim parameter ``fqn`` is TP-sharded along, or ``None`` when replicated."""
    import torch

    owner_path, _, leaf = fqn.rpartition(".")
    # parallelize_module's rule first ('*' within one segment), so an entry for a block
    # ("layers.*") cannot shadow its children's; then '*' across dots ("*.q_proj").
    pattern = next((p for p in tp_plan if _glob(fqn, p) or _glob(owner_path, p)), None)
    if pattern is None:
        pattern = next((p for p in tp_plan if fnmatch.fnmatchcase(fqn, p)
                        or fnmatch.fnmatchcase(owner_path, p)), None)
    if pattern is None:
        return None
    kind = _style_name(pattern, tp_plan[pattern])
    if kind is None:
        return None
    if isinstance(kind, int):
        dim = kind + ndim if kind < 0 else kind
        if not 0 <= dim < max(ndim, 1):
            raise PlanError(f"parameter {fqn!r}: TP plan {pattern!r} shards dim {kind} "
                            f"of a tensor of rank {ndim}")
        return dim
    owner = modules.get(owner_path)
    if isinstance(owner, torch.nn.Embedding) and leaf == "weight":
        return 1 if kind == "colwise" else 0
    if ndim == 0:
        return None
    if kind == "colwise":
        return 0
    # rowwise: the input dim of a [out, in] weight; a 1-D bias is added after the
    # all-reduce, so every TP rank holds all of it.
    return 1 if ndim >= 2 else None


def _dtensor_placements(name: str, t: Any) -> Placements:
    layout = layout_of_dtensor(name, t)
    if t.device_mesh.ndim == 1:
        # A 1-D TP mesh is the worker mesh's TP axis (axis 1); replicas are axis 0.
        d = layout.shard_dim
        return None if d is None else (REPLICATE, d)
    if layout.mesh.dims != tuple(int(n) for n in t.device_mesh.mesh.shape):
        # layout_of_dtensor re-factored a 2-D mesh sharding one dim on both axes into
        # (size, 1); the worker mesh is (replicas, tp), so that cannot be said there.
        raise PlanError(
            f"parameter {name!r}: its placements {t.placements} shard one dim across both "
            f"axes of the worker's 2-D mesh; worker targets are placed on (replicas, tp), so "
            f"use a 1-D TP mesh (replicas = 1) or Replicate() on the replica axis")
    return layout.placements


def targets_from_module(module: torch.nn.Module, tp_plan: Mapping[str, TPStyle] | None = None,
                        *, loaders: Mapping[str, LoadTarget] | None = None,
                        buffers: bool = False, rename: Rename | None = None) -> WorkerTargets:
    """Declare a worker's destination tensors: plan name → ``(local tensor, placements)``.

    Each of the module's parameters (and persistent buffers with ``buffers=True``) becomes
    a target holding its local tensor, written in place by the engine (a non-contiguous one,
    e.g. channels_last, becomes a ``LoadTarget.into`` it, copied into). Placements are on
    the worker mesh ``(replicas, tp)``:

    - a DTensor parameter gives its own (its 1-D TP mesh is the worker mesh's axis 1);
    - a plain tensor, which must already be this worker's TP shard, takes them from
      ``tp_plan``: the first entry whose glob pattern matches the parameter name or its
      module's name decides — ``"colwise"``/``"rowwise"`` as torch's ``ColwiseParallel`` /
      ``RowwiseParallel`` (or a subclass) place that module type's weight and bias,
      ``"replicate"``/``None``, or an explicit tensor dim; no match means replicated.
      Patterns are read as ``parallelize_module`` reads them, ``*`` within one dotted
      segment (so an entry for a block, ``"layers.*"``, does not shadow its children's);
      only where none matches so, ``*`` may cross dots (``"*.q_proj"``).

    A plain parameter is the target itself, so storage the module gets later (``param.data
    = ...``, ``Module.to``) is written next round, or refused naming it; a DTensor's local
    shard is taken now, and storage it gets later is not followed.

    ``loaders`` adds or overrides names with ``LoadTarget``s (fused or quantized layouts),
    which the engine delivers through their callbacks instead of in place.
    Names use the same cleaning and ``rename`` as ``specs_from_module``, so the trainer's
    plan names line up; pattern matching uses the names before ``rename``.

    Raises:
        PlanError: naming the parameter, for a placement the core cannot express, an
            unknown TP style, or a name declared twice; naming the entries, for TP plan
            entries that match no module or parameter name (a typo, a missing prefix).
    """
    tp_plan = tp_plan or {}
    targets = WorkerTargets()
    loaders = dict(loaders or {})
    # Match the TP plan on clean names but key targets by plan names.
    clean = named_tensors(module, buffers=buffers)
    renamed = named_tensors(module, buffers=buffers, rename=rename) if rename else clean
    by_id = {id(t): n for n, t in renamed.items()}
    modules = {_clean(fqn): sub for fqn, sub in module.named_modules()}
    unmatched = [p for p in tp_plan
                 if not any(fnmatch.fnmatchcase(n, p) for n in (*modules, *clean))]
    if unmatched:
        raise PlanError(f"TP plan entries {unmatched} match no module or parameter name "
                        f"(names look like {next(iter(clean), '')!r}; a prefix such as "
                        f"'model.' missing?)")
    for fqn, t in clean.items():
        name = by_id.get(id(t))
        if name is None:
            continue  # rename() left it out
        if name in loaders:
            continue
        if _is_dtensor(t):
            placements = _dtensor_placements(name, t)
            # The local shard as of now: a DTensor given new storage later is not followed.
            local = t.to_local().detach()  # type: ignore[attr-defined]
        else:
            dim = _shard_dim(modules, fqn, t.dim(), tp_plan)
            placements = None if dim is None else (REPLICATE, dim)
            # The parameter itself, not a detached alias: the engine reads a target's
            # storage every round, so ``param.data = ...`` or ``module.to(...)`` between
            # rounds is followed (or refused), not silently left stale.
            local = t
        # A non-contiguous parameter (channels_last, a transposed view) cannot take a message
        # in place, and a .contiguous() copy would leave the model untouched: copy into it.
        targets[name] = ((local, placements) if local.is_contiguous()
                         else _into_parameter(name, local, placements))
    for name, target in loaders.items():
        if not isinstance(target, LoadTarget):
            raise PlanError(f"loaders[{name!r}] must be a LoadTarget, got "
                            f"{type(target).__name__}")
        targets[name] = target
    return targets
