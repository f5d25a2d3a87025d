"""m2n_async: move model weights from trainer meshes to inference worker meshes.

Only the names in ``__all__`` are public; everything under ``_proto``, ``_store``, ``_data``
and ``_engine`` is private and may change.
"""

from m2n_async._proto.errors import (
    AuthenticationError,
    EnginePoisonedError,
    LocalProtocolError,
    M2NError,
    PeerLostError,
    PhaseTimeoutError,
    PlanError,
    PreflightError,
    ProtocolError,
    RemoteProtocolError,
    StoreError,
    TransferError,
)

# --- core ---
from m2n_async._proto.layout import REPLICATE, Box, Layout, Mesh
from m2n_async._proto.params import M2N_DTYPES, ParamSpec, ParamTransfer, dtype_name
from m2n_async._proto.plan import (
    Bucket,
    Piece,
    TransferPlan,
    check_plan_limits,
    complete_plan_digest,
    source_plan_digest,
)

# --- store ---
from m2n_async._store import (
    ControlGroup,
    JobClaimedError,
    StaleGenerationError,
    Store,
    StoreClient,
    StoreLimitError,
    StoreServer,
    StoreThread,
    SupportsExchange,
    current_generation,
    generation_namespace,
    next_generation,
)

# --- handshake ---
# isort: split
from m2n_async._engine._preflight import PreflightOutcome
from m2n_async._proto.handshake import TRANSITIONS as PREFLIGHT_TRANSITIONS
from m2n_async._proto.handshake import Phase as PreflightPhase
from m2n_async._proto.handshake import PreflightPlan

# --- engine ---
# isort: split
from m2n_async._data._transport import LoadCallback
from m2n_async._engine._config import EngineConfig, EngineState, SyncResult
from m2n_async._engine._engine import TrainerEngine, WorkerEngine

# --- ecosystem: torch modules and plan files in ---
# isort: split
from m2n_async._integrations.planfile import PlanSummary, load_plan_file
from m2n_async._integrations.planfile import summarize as summarize_plan
from m2n_async._integrations.sources import ModuleShards, module_shards, specs_from_module
from m2n_async._integrations.targets import (
    LoadTarget,
    WorkerTargets,
    fused_targets,
    targets_from_module,
)

# --- blocking facade (synchronous callers) ---
# isort: split
from m2n_async.blocking import BlockingTrainer, BlockingWorker

__version__ = "0.1.0"

__all__ = [
    # core
    "M2N_DTYPES",
    "REPLICATE",
    "Box",
    "Bucket",
    "Layout",
    "Mesh",
    "ParamSpec",
    "ParamTransfer",
    "Piece",
    "TransferPlan",
    "check_plan_limits",
    "complete_plan_digest",
    "dtype_name",
    "source_plan_digest",
    # errors
    "AuthenticationError",
    "EnginePoisonedError",
    "LocalProtocolError",
    "M2NError",
    "PeerLostError",
    "PhaseTimeoutError",
    "PlanError",
    "PreflightError",
    "ProtocolError",
    "RemoteProtocolError",
    "StoreError",
    "TransferError",
    # store
    "ControlGroup",
    "JobClaimedError",
    "StaleGenerationError",
    "StoreLimitError",
    "Store",
    "StoreClient",
    "StoreServer",
    "StoreThread",
    "SupportsExchange",
    "current_generation",
    "generation_namespace",
    "next_generation",
    # handshake
    "PREFLIGHT_TRANSITIONS",
    "PreflightOutcome",
    "PreflightPhase",
    "PreflightPlan",
    # engine
    "EngineConfig",
    "EngineState",
    "LoadCallback",
    "SyncResult",
    "TrainerEngine",
    "WorkerEngine",
    # ecosystem: torch modules and plan files in
    "LoadTarget",
    "ModuleShards",
    "PlanSummary",
    "WorkerTargets",
    "fused_targets",
    "load_plan_file",
    "module_shards",
    "specs_from_module",
    "summarize_plan",
    "targets_from_module",
    # blocking facade (synchronous callers)
    "BlockingTrainer",
    "BlockingWorker",
    "__version__",
]
