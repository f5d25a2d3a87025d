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
    PlanError,
    PreflightError,
    ProtocolError,
    RemoteProtocolError,
    StoreError,
    TransferError,
)

# --- core (issue 2) ---
# --- store (issue 3) ---
# --- handshake (issue 4) ---
# --- engine (issue 5/6) ---

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "EnginePoisonedError",
    "LocalProtocolError",
    "M2NError",
    "PeerLostError",
    "PlanError",
    "PreflightError",
    "ProtocolError",
    "RemoteProtocolError",
    "StoreError",
    "TransferError",
    "__version__",
]
