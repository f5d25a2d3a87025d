"""Public test helpers: an in-memory store and a local multi-process world."""

from m2n_async.testing._memory import MemoryStore

__all__: list[str] = ["MemoryStore"]
