"""Trainer side: derive ``ParamSpec``s from a torch module and hand out its local shards.

Theory of operation: a DTensor already carries everything a ``ParamSpec`` needs — global
shape, dtype, the device mesh (a tensor of global ranks) and one placement per mesh axis. We
map it onto the core's vocabulary and refuse, *by parameter name and with the fix*, whatever
the core cannot express:

- a 1-D device mesh of ``n`` ranks becomes ``Mesh((n, 1))``; a 2-D one keeps its shape; more
  dims are refused (flatten the mesh first);
- the mesh's ranks must be a contiguous row-major interval — M2N's mesh model — so a
  sub-mesh taken across a strided axis (e.g. the data-parallel group of a ``(dp, tp)`` mesh)
  is refused;
- ``Replicate()`` → ``REPLICATE``; ``Shard(d)`` → ``d``; a shard along a mesh axis of size 1
  is the same as a replica and is written as one (the core has one spelling per layout);
  two axes sharding the *same* dim nest row-major, exactly like a 1-D mesh of all the ranks,
  so they are re-factored to ``(size, 1)``; two axes sharding *different* dims (FSDP2 + TP),
  strided shards and ``Partial`` sums are refused;
- uneven shards are refused: M2N and the planner need equal slabs.

Plain (non-DTensor) tensors are taken as fully replicated on a mesh the caller names (by
default every rank of the default process group), which is right for DDP-style trainers.

``module_shards`` is the lazy counterpart the engine calls when ``sync_weights`` is given a
module: it resolves names once, then computes each local shard (``to_local()``, detached,
optionally cast) only when the pipeline looks it up, bucket by bucket, and keeps no cache.
The engine calls it without ``dtype``: shards keep the module's dtype (fp32 master weights
stay fp32) and the transports cast them to the wire dtype while packing, in the copy that
packs, so ``specs_from_module(model, dtype=torch.bfloat16)`` + ``sync_weights(model)`` needs
no cast copy at all. ``ModuleShards.dtype_of`` tells the engine each shard's dtype without
computing it, so a dtype that cannot be cast is refused before the round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from m2n_async._proto.errors import PlanError
from m2n_async._proto.layout import REPLICATE, Layout, Mesh
from m2n_async._proto.params import ParamSpec

if TYPE_CHECKING:
    import torch

__all__ = ["ModuleShards", "module_shards", "named_tensors", "specs_from_module"]

# Wrapper modules that insert a path segment without changing what a parameter *is*:
# torch.compile, activation checkpointing and FSDP1's wrapper. Dropping them keeps the plan's
# names equal to the unwrapped model's (and to the names inference engines load by).
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})

Rename = Callable[[str], "str | None"]


def _clean(fqn: str) -> str:
    return ".".join(s for s in fqn.split(".") if s not in _WRAPPER_SEGMENTS)


def _is_dtensor(t: object) -> bool:
    # Import lazily: torch.distributed.tensor is heavy and absent on some builds.
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def named_tensors(module: torch.nn.Module, *, buffers: bool = False,
                  rename: Rename | None = None) -> dict[str, torch.Tensor]:
    """The module's parameters (and, with ``buffers=True``, persistent buffers) by plan name.

    Names are the module's fully qualified names with wrapper segments (``_orig_mod``,
    ``_checkpoint_wrapped_module``, ``_fsdp_wrapped_module``) removed, then passed through
    ``rename`` if given; ``rename`` returning ``None`` leaves the tensor out. Tied parameters
    appear once, under their first name (as ``named_parameters`` yields them). Two tensors
    mapping to one name raise ``PlanError``.
    """
    for path, sub in module.named_modules():
        state = getattr(sub, "training_state", None)
        if type(sub).__name__ == "FullyShardedDataParallel" and \
                getattr(state, "name", None) != "SUMMON_FULL_PARAMS":
            raise PlanError(
                f"module {path or '<root>'!r} is FSDP1 (FullyShardedDataParallel): outside "
                f"FSDP.summon_full_params its parameters are 1-D fragments of a flat shard "
                f"with no per-parameter layout. Use FSDP2 (fully_shard), or derive specs and "
                f"sync inside FSDP.summon_full_params(model)")
    items: list[tuple[str, torch.Tensor]] = []
    for fqn, p in module.named_parameters():
        if type(p).__name__ == "FlatParameter":
            raise PlanError(
                f"parameter {fqn!r} is an FSDP1 FlatParameter (many tensors flattened into "
                f"one); its shards have no per-parameter layout. Use FSDP2 (fully_shard), "
                f"whose parameters are DTensors, or sync a full state dict")
        items.append((fqn, p))
    if buffers:
        for fqn, b in module.named_buffers():
            owner_path, _, leaf = fqn.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            # Non-persistent buffers (e.g. rotary caches) are derived state, not weights.
            if leaf in getattr(owner, "_non_persistent_buffers_set", ()):
                continue
            items.append((fqn, b))
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for fqn, t in items:
        name = _clean(fqn)
        if rename is not None:
            mapped = rename(name)
            if mapped is None:
                continue
            if not isinstance(mapped, str) or not mapped:
                raise PlanError(f"rename({name!r}) returned {mapped!r}; it must return a "
                                f"non-empty str, or None to leave the tensor out")
            name = mapped
        if name in out:
            raise PlanError(f"tensors {origin[name]!r} and {fqn!r} both map to plan name "
                            f"{name!r}; make rename() give them distinct names")
        out[name] = t
        origin[name] = fqn
    return out


def default_mesh() -> Mesh:
    """Every rank of the default process group as ``(world_size, 1)``; ``(1, 1)`` without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Mesh((dist.get_world_size(), 1), 0)
    return Mesh((1, 1), 0)


def _mesh_of(name: str, device_mesh: Any) -> tuple[Mesh, int]:
    """Core ``Mesh`` of a DeviceMesh and its number of axes (1 or 2)."""
    ndim = int(device_mesh.ndim)
    shape = tuple(int(s) for s in device_mesh.mesh.shape)
    if ndim > 2:
        raise PlanError(
            f"parameter {name!r}: its device mesh has {ndim} dims {shape}; m2n_async meshes "
            f"have 1 or 2. Flatten the mesh axes the parameter is replicated over (e.g. "
            f"build the model on a 2-D mesh, or DeviceMesh._flatten()) before syncing")
    ranks = [int(r) for r in device_mesh.mesh.flatten().tolist()]
    start = ranks[0]
    if ranks != list(range(start, start + len(ranks))):
        raise PlanError(
            f"parameter {name!r}: its device mesh ranks {ranks} are not a contiguous "
            f"row-major interval; m2n_async (like NCCL M2N) places meshes on ranks "
            f"[start, start + size) in row-major order. Shard this parameter on a mesh over "
            f"consecutive ranks (a sub-mesh across a strided axis cannot be expressed)")
    dims = (shape[0], 1) if ndim == 1 else (shape[0], shape[1])
    return Mesh(dims, start), ndim


def _axis_placement(name: str, axis: int, placement: Any, tensor_ndim: int) -> int:
    kind = type(placement).__name__
    if placement.is_partial():
        raise PlanError(
            f"parameter {name!r}: placement {placement!r} on mesh axis {axis} holds unreduced "
            f"partial values, and m2n_async moves values, it does not sum them. Reduce first, "
            f"e.g. p.redistribute(placements=[Replicate() or Shard(d) per axis])")
    if placement.is_replicate():
        return REPLICATE
    if kind == "_StridedShard" or not placement.is_shard():
        raise PlanError(
            f"parameter {name!r}: placement {placement!r} on mesh axis {axis} is not a plain "
            f"Shard(d) or Replicate() (strided shards come from FSDP2 over tensor "
            f"parallelism). Redistribute the parameter to Shard/Replicate placements, or "
            f"derive specs from a module sharded one way")
    dim = int(placement.dim)
    return dim + tensor_ndim if dim < 0 else dim


def layout_of_dtensor(name: str, t: Any) -> Layout:
    """The core ``Layout`` of DTensor ``t`` (parameter ``name``), or ``PlanError`` saying why not.

    A 1-D mesh maps to ``(n, 1)``; see the module docstring for every rule.
    """
    mesh, ndim = _mesh_of(name, t.device_mesh)
    shape = tuple(int(s) for s in t.shape)
    raw = [_axis_placement(name, a, p, len(shape)) for a, p in enumerate(t.placements)]
    if ndim == 1:
        raw.append(REPLICATE)
    # A shard over an axis of size 1 holds the whole dim: the same bytes as a replica.
    pl = [REPLICATE if p != REPLICATE and mesh.dims[a] == 1 else p for a, p in enumerate(raw)]
    if pl[0] != REPLICATE and pl[1] != REPLICATE:
        if pl[0] != pl[1]:
            raise PlanError(
                f"parameter {name!r}: mesh axes 0 and 1 shard different tensor dims "
                f"({t.placements} on mesh {mesh.dims}, e.g. FSDP2 over tensor parallelism); "
                f"m2n_async layouts shard along one mesh axis. Redistribute the parameter so "
                f"one axis replicates (p.redistribute(placements=[Replicate(), Shard(d)])) "
                f"or sync from a module sharded one way")
        # Shard(d) on both axes nests row-major: rank (i, j) holds slab i * dims[1] + j,
        # which is exactly a 1-D mesh of all the ranks sharding d.
        mesh = Mesh((mesh.size, 1), mesh.start_rank)
        pl = [pl[0], REPLICATE]
    if pl[0] == REPLICATE and pl[1] == REPLICATE:
        return Layout(mesh, None)
    layout = Layout(mesh, (pl[0], pl[1]))
    dim = layout.shard_dim
    assert dim is not None
    if dim >= len(shape):
        raise PlanError(f"parameter {name!r}: placement shards dim {dim} of a tensor of rank "
                        f"{len(shape)} (shape {shape})")
    if shape[dim] % layout.num_shards:
        raise PlanError(
            f"parameter {name!r}: dim {dim} of size {shape[dim]} is split {layout.num_shards} "
            f"ways unevenly ({t.placements} on mesh {mesh.dims}); m2n_async needs equal "
            f"shards. Use a mesh size that divides {shape[dim]}, pad the dim, shard another "
            f"dim (FSDP2: fully_shard(..., shard_placement_fn=...)), or replicate it")
    return layout


def specs_from_module(module: torch.nn.Module, *, mesh: Mesh | None = None,
                      dtype: torch.dtype | str | None = None, buffers: bool = False,
                      rename: Rename | None = None) -> list[ParamSpec]:
    """Derive the trainer-side ``ParamSpec`` list of ``module``, in ``named_parameters`` order.

    DTensor parameters (FSDP2, tensor parallel) give their global shape, dtype and layout:
    a 1-D device mesh maps to ``Mesh((n, 1))``, a 2-D one to ``Mesh((a, b))``, ``Shard(d)``
    to ``d`` and ``Replicate()`` to ``REPLICATE``; the mesh's global ranks are the plan's
    ranks, so the trainer's process group ranks must be the engine's trainer ranks ``[0, T)``.
    Plain tensors are fully replicated on ``mesh`` (default: every rank of the default process
    group, ``(world_size, 1)``; ``(1, 1)`` when none is initialized, so T > 1 trainers without
    a process group pass ``mesh=Mesh((T, 1))``).

    Args:
        module: the trainer's model (wrappers from ``torch.compile``, activation
            checkpointing and FSDP are looked through for names).
        mesh: the mesh plain tensors are replicated on.
        dtype: the wire dtype for floating-point tensors (e.g. ``torch.bfloat16`` when the
            trainer keeps fp32 master weights); integer and bool tensors keep theirs.
            ``sync_weights(module)`` then casts the fp32 shards while packing; there is no
            need to pass ``dtype`` to ``module_shards`` (doing so casts a copy first).
        buffers: include persistent buffers too.
        rename: maps each name to its plan name, or to ``None`` to leave the tensor out.

    Raises:
        PlanError: naming the parameter, for ``Partial`` placements, strided shards, two mesh
            axes sharding different dims, uneven shards, meshes with more than 2 dims or
            non-contiguous ranks, FSDP1 flat parameters, unsupported dtypes, or two tensors
            renamed to one name — each with what to do instead.
    """
    plain_layout = Layout(mesh if mesh is not None else default_mesh(), None)
    specs: list[ParamSpec] = []
    for name, t in named_tensors(module, buffers=buffers, rename=rename).items():
        layout = layout_of_dtensor(name, t) if _is_dtensor(t) else plain_layout
        wire = dtype if dtype is not None and t.is_floating_point() else t.dtype
        specs.append(ParamSpec(name, wire, tuple(int(s) for s in t.shape), layout))
    return specs


class ModuleShards(Mapping[str, "torch.Tensor"]):
    """A read-only mapping plan name → this rank's local shard of a module's tensor, lazily.

    Looking a name up computes the shard then: ``to_local()`` for a DTensor (no
    communication for ``Shard``/``Replicate``), the tensor itself otherwise, detached, cast to
    ``dtype`` if given (floating point only). Nothing is cached, so a bucket-by-bucket caller
    holds at most one bucket of cast copies. Iteration order is ``names`` order (or the
    module's). The mapping holds the parameter objects captured at construction; build it
    after the optimizer step, once FSDP2 has resharded (its default after backward).
    """

    def __init__(self, module: torch.nn.Module, names: Sequence[str] | None = None, *,
                 dtype: torch.dtype | str | None = None, buffers: bool = False,
                 rename: Rename | None = None) -> None:
        found = named_tensors(module, buffers=buffers, rename=rename)
        if names is not None:
            missing = [n for n in names if n not in found]
            if missing:
                shown = ", ".join(repr(n) for n in missing[:5])
                more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                raise PlanError(
                    f"{len(missing)} plan parameter(s) not found in the module: {shown}{more} "
                    f"(the module has {len(found)} tensors; check rename= and buffers= match "
                    f"what specs_from_module was given)")
            # The module's tensors the plan does not carry: not sent (the engine warns once).
            # None when the counts match: every plan name is in the module (just checked),
            # so the sets are equal, and the round pays no set of 10^5 names.
            planned = set(names) if len(found) != len(names) else None
            self.unplanned: tuple[str, ...] = () if planned is None else tuple(
                n for n in found if n not in planned)
            found = {n: found[n] for n in names}
        else:
            self.unplanned = ()
        self._tensors = found
        self._dtype = _torch_dtype(dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            t = self._tensors[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not in this module's shards") from None
        import torch

        with torch.no_grad():
            local = t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]
            local = local.detach()
            if self._dtype is not None and local.is_floating_point() \
                    and local.dtype != self._dtype:
                local = local.to(self._dtype)
            # The engine packs contiguous shards; a module may hold channels_last or
            # transposed parameters, and the caller who passed a module cannot fix that.
            local = local.contiguous()
        return local

    def dtype_of(self, name: str) -> torch.dtype:
        """The dtype ``self[name]`` has, read from the module without computing the shard
        (the engine refuses a dtype it cannot cast to the wire dtype before a round)."""
        try:
            t = self._tensors[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not in this module's shards") from None
        if self._dtype is not None and t.is_floating_point():
            return self._dtype
        return t.dtype

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors


def _torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or not isinstance(dtype, str):
        return dtype
    import torch

    from m2n_async._proto.params import dtype_name

    resolved = getattr(torch, dtype_name(dtype), None)
    if not isinstance(resolved, torch.dtype):
        raise PlanError(f"dtype {dtype!r} is not a torch dtype")
    return resolved


def module_shards(module: torch.nn.Module, names: Sequence[str] | None = None, *,
                  dtype: torch.dtype | str | None = None, buffers: bool = False,
                  rename: Rename | None = None) -> ModuleShards:
    """This rank's local shards of ``module`` as a lazy ``Mapping[str, torch.Tensor]``.

    What ``TrainerEngine.sync_weights`` uses when given a module; pass the result yourself
    when ``specs_from_module`` had non-default ``buffers``/``rename`` (give the same ones
    here). A ``dtype`` here casts each shard on lookup, a copy per bucket; without it the
    transports cast fp32 shards to a bf16 wire dtype while packing, at no extra memory.
    ``names`` restricts and orders the mapping (the plan's names); any name not in the module
    raises ``PlanError`` listing the missing ones, before any round starts; the module's
    tensors that are not among them are in ``unplanned`` (not sent).
    """
    return ModuleShards(module, names, dtype=dtype, buffers=buffers, rename=rename)
