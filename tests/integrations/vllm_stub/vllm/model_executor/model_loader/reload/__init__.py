"""vLLM's layerwise reload hooks, recording their calls per model (``OPEN`` holds the ids
of models whose reload is initialized and not finalized)."""

from __future__ import annotations

from typing import Any

CALLS: list[tuple[str, int]] = []
OPEN: set[int] = set()


def initialize_layerwise_reload(model: Any) -> None:
    assert id(model) not in OPEN, "initialize_layerwise_reload twice"
    CALLS.append(("initialize", id(model)))
    OPEN.add(id(model))


def finalize_layerwise_reload(model: Any, model_config: Any) -> None:
    CALLS.append(("finalize", id(model)))
    OPEN.discard(id(model))
