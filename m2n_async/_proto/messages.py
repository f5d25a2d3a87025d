"""Wire types: every envelope the control plane carries, as msgspec Structs.

Theory of operation: one tagged union (``Envelope``) and one reusable msgpack encoder and
decoder. Structs are frozen and forbid unknown fields, so a peer speaking another protocol
version fails loudly at decode time instead of being misread. ``PROTO_VERSION`` travels in the
first envelope (``Hello``) and must be equal on every rank.

Sections: plan records (core), handshake envelopes (handshake), round messages (engine).
"""

from __future__ import annotations

from typing import Final

PROTO_VERSION: Final[int] = 1

# --- plan records (core, issue 2) ---

# --- handshake envelopes (issue 4) ---

# --- round messages (engine, issue 5) ---

# --- the union, encoder, decoder ---
