"""Public test helpers: an in-memory store and a local multi-process world."""

__all__: list[str] = []
