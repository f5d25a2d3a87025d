"""White-box tests of the sans-IO StoreCore: bounds and parsing the drivers rely on."""

from __future__ import annotations

import pytest

from m2n_async import PeerLostError, StoreError
from m2n_async._store._core import StoreCore, _generation_of


def test_tombstones_are_a_bounded_fifo() -> None:
    core = StoreCore(max_tombstones=3)
    for i in range(5):
        s = core.open_session()
        core.set(s, f"alive/{i}", b"", ephemeral=True)
        core.close_session(s)
    assert core.tombstones == 3
    watcher = core.open_session()
    # The oldest losses were evicted: watching them no longer fails...
    w = core.begin_get(watcher, "k", ["alive/0", "alive/1"], lambda: None)
    assert not w.done
    core.cancel(w)
    # ...the newest still do.
    with pytest.raises(PeerLostError):
        core.begin_get(watcher, "k", ["alive/4"], lambda: None)
    assert core.pending_waiters == 0


def test_waiter_limit_and_cleanup_on_session_end() -> None:
    core = StoreCore(max_waiters_per_session=2)
    s = core.open_session()
    core.begin_get(s, "a", (), lambda: None)
    core.begin_gather(s, "p/", 3, ("w",), lambda: None)
    with pytest.raises(StoreError, match="limit"):
        core.begin_wait(s, ["b"], (), lambda: None)
    assert core.pending_waiters == 2
    core.close_session(s)
    assert core.pending_waiters == 0
    assert core._watchers == {} and core._prefixes == {} and core._key_waiters == {}


def test_notify_called_exactly_once() -> None:
    core = StoreCore()
    s, t = core.open_session(), core.open_session()
    calls: list[str] = []
    w = core.begin_wait(s, ["a", "b"], (), lambda: calls.append("done"))
    core.set(t, "a", b"1")
    core.set(t, "a", b"2")
    assert calls == []
    core.set(t, "b", b"1")
    core.set(t, "b", b"2")
    assert calls == ["done"] and w.done and w.error is None


@pytest.mark.parametrize(("key", "expected"), [
    ("job/3/x", ("job", 3)),
    ("job/3", ("job", 3)),
    ("job/3/", ("job", 3)),
    ("job/generation", None),
    ("job/x3/y", None),
    ("/3/y", None),
    ("job/\u0663/y", None),  # a non-ASCII digit is not a generation
    ("job", None),
])
def test_generation_parsing(key: str, expected: tuple[str, int] | None) -> None:
    assert _generation_of(key) == expected
