"""Parameter specs and the dtype table.

Theory of operation: a ``ParamSpec`` is what the trainer side declares about one tensor — its
name, dtype, global shape and source ``Layout``; a ``ParamTransfer`` adds the destination layout
the workers asked for. The core never touches torch: a dtype is kept as its canonical name
(``"bfloat16"``), and ``dtype_name`` turns a ``torch.dtype`` (or numpy dtype, or a name) into
it by its ``str()``, so user code may pass ``torch.bfloat16`` directly.

Construction checks what one spec can check on its own (name, dtype known and fixed-width,
positive shape, shard dim exists and divides evenly) and names the parameter and side in the
``PlanError``; transport-specific rules (M2N dtypes, tensor rank) and whole-plan rules
(duplicates, mesh coverage, fan-in/out) live in ``plan.py``. The same checks run when a spec is
decoded off the wire, so a malformed peer record fails at decode time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

import msgspec

from m2n_async._proto.errors import PlanError
from m2n_async._proto.layout import Layout, _index_int

__all__ = [
    "DTYPE_ITEMSIZE",
    "M2N_DTYPES",
    "ParamSpec",
    "ParamTransfer",
    "dtype_itemsize",
    "dtype_name",
]

# Every fixed-width dtype the gloo/nccl transports can move as bytes. Sub-byte types (the
# packed 4-bit ones) are left out: their "element" is not addressable, so boxes would be wrong.
DTYPE_ITEMSIZE: Final[dict[str, int]] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
}

# The twelve dtypes NCCL M2N accepts (docs/nccl-m2n.md §1): no bool, int16 or 4-bit types.
M2N_DTYPES: Final[frozenset[str]] = frozenset({
    "int8", "uint8", "float8_e4m3fn", "float8_e5m2", "float16", "bfloat16",
    "int32", "uint32", "float32", "int64", "uint64", "float64",
})

# torch spells some dtypes two ways; str(torch.half) is already "torch.float16", these cover
# names typed by hand.
_ALIASES: Final[dict[str, str]] = {
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "short": "int16",
    "int": "int32",
    "long": "int64",
    "chalf": "complex32",
    "cfloat": "complex64",
    "cdouble": "complex128",
}


def dtype_name(dtype: object) -> str:
    """Canonical dtype name of a ``torch.dtype``, a numpy dtype or a name (``"torch.half"``).

    Raises ``PlanError`` for a dtype that is not fixed-width (or not known).
    """
    text = dtype if isinstance(dtype, str) else str(dtype)
    name = text.removeprefix("torch.")
    name = _ALIASES.get(name, name)
    if name not in DTYPE_ITEMSIZE:
        raise PlanError(f"unsupported dtype {text!r}: not a fixed-width dtype this package can "
                        f"move (supported: {', '.join(sorted(DTYPE_ITEMSIZE))})")
    return name


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name`` (canonical or alias)."""
    return DTYPE_ITEMSIZE[dtype_name(name)]


def _shape_tuple(name: str, shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of ints (``torch.Size`` and numpy ints accepted), or PlanError."""
    try:
        items: tuple[object, ...] = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise PlanError(f"parameter {name!r}: shape must be a sequence of ints, got "
                        f"{shape!r}") from None
    out = []
    for n in items:
        v = _index_int(n)  # numpy/torch ints accepted; bool (True is no size) is not
        if v is None or v < 1:
            raise PlanError(f"parameter {name!r}: shape must hold positive ints, got "
                            f"{shape!r}")
        out.append(v)
    return tuple(out)


class ParamSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One tensor as the trainer (source) side declares it.

    ``ParamSpec(name, torch.bfloat16, (rows, cols), layout)``: ``dtype`` may be a
    ``torch.dtype`` or a name and is stored as the canonical name; ``shape`` is the global
    shape; ``layout`` the source layout on the trainer mesh.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: Layout

    if TYPE_CHECKING:  # the constructor accepts torch dtypes and sequences; see __post_init__
        def __init__(self, name: str, dtype: object, shape: Sequence[int],
                     layout: Layout) -> None: ...

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not name:
            raise PlanError(f"parameter name must be a non-empty str, got {name!r}")
        if not name.isascii():  # the fast path: ASCII is UTF-8
            try:
                name.encode()
            except UnicodeEncodeError as e:
                # Names travel as UTF-8 (digests, the handshake): refused here, naming it,
                # not later in a phase whose encoder cannot say which name it was.
                raise PlanError(f"parameter {name!r}: the name is not valid UTF-8 text "
                                f"({e.reason} at position {e.start})") from None
        if type(self.dtype) is not str or self.dtype not in DTYPE_ITEMSIZE:
            try:
                canon = dtype_name(self.dtype)
            except PlanError as e:
                raise PlanError(f"parameter {name!r}: {e}") from None
            msgspec.structs.force_setattr(self, "dtype", canon)
        shape = self.shape
        # Fast path (every decoded spec): an exact tuple of positive exact ints.
        if type(shape) is not tuple or not all(type(n) is int and n > 0 for n in shape):
            msgspec.structs.force_setattr(self, "shape", _shape_tuple(name, shape))
        if math.prod(self.shape) >= 2**63:  # sizes travel as int64 (msgpack stops at 2**64)
            raise PlanError(f"parameter {name!r}: shape {self.shape} has 2**63 or more "
                            "elements")
        if type(self.layout) is not Layout:
            raise PlanError(f"parameter {name!r}: layout must be a Layout, got "
                            f"{type(self.layout).__name__}")
        problem = self.layout.shape_problem(self.shape)
        if problem is not None:
            raise PlanError(f"parameter {name!r} (source side): {problem}")

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        """Number of elements of the global tensor."""
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the global tensor."""
        return self.numel * DTYPE_ITEMSIZE[self.dtype]


class ParamTransfer(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    """One parameter of a plan: its source spec and the destination layout on the workers."""

    spec: ParamSpec
    dst: Layout

    def __post_init__(self) -> None:
        if not isinstance(self.spec, ParamSpec) or not isinstance(self.dst, Layout):
            raise PlanError(f"ParamTransfer needs a ParamSpec and a Layout, got "
                            f"{type(self.spec).__name__} and {type(self.dst).__name__}")
        problem = self.dst.shape_problem(self.spec.shape)
        if problem is not None:
            raise PlanError(f"parameter {self.spec.name!r} (destination side): {problem}")

    @property
    def name(self) -> str:
        """The parameter name."""
        return self.spec.name

    @property
    def src(self) -> Layout:
        """The source layout (``spec.layout``)."""
        return self.spec.layout
