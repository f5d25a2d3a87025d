"""vLLM's MTP completeness switch (a context variable)."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

_enabled = contextvars.ContextVar("mtp_check", default=True)


def enabled() -> bool:
    return _enabled.get()


@contextmanager
def disable_mtp_completeness_check() -> Iterator[None]:
    token = _enabled.set(False)
    try:
        yield
    finally:
        _enabled.reset(token)
