"""White-box tests of the sans-IO StoreCore: bounds and parsing the drivers rely on."""

from __future__ import annotations

import pytest

from m2n_async import PeerLostError, StoreError
from m2n_async._store._core import StaleGenerationError, StoreCore, _generation_of


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


def test_parked_gathers_on_nested_prefixes_do_not_each_index_the_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Gathers parked on 100 nested prefixes ("", "a", "aa", ...), each of which every key
    # below matches: past MAX_TRACKED_KEYS (here 5000) the prefixes only count their keys,
    # so the store's keys are not indexed once more per prefix (which made 0.2 MB of keys
    # cost ~20 MB of index, outside every quota).
    import tracemalloc

    from m2n_async._store import _core

    monkeypatch.setattr(_core, "MAX_TRACKED_KEYS", 5000, raising=False)
    core = StoreCore()
    s = core.open_session()
    base = "a" * 100
    waiters = [core.begin_gather(s, base[:i], 10**6, (), lambda: None) for i in range(100)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for j in range(2000):
            core.set(s, f"{base}/{j}", b"")
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 4 * core.nbytes, (grown, core.nbytes)
    assert core._tracked <= 5000
    # The counts still complete a gather, and still follow deletes.
    core.delete(s, f"{base}/0")
    done = core.begin_gather(s, base, 1999, (), lambda: None)
    assert done.done and len(done.result.items) == 1999  # type: ignore[union-attr]
    notified: list[int] = []
    w = core.begin_gather(s, base + "/", 2000, (), lambda: notified.append(1))
    core.set(s, f"{base}/0", b"back")
    assert notified == [1] and w.done and len(w.result.items) == 2000  # type: ignore[union-attr]
    for waiter in waiters:
        core.cancel(waiter)
    assert core._prefixes == {} and core._tracked == 0


def test_parked_prefixes_are_found_by_length_exactly_as_by_testing_each() -> None:
    # A new key looks up its own prefix of each parked length; the gathers it completes and
    # the counts it moves must be those of testing every parked prefix, as waiters come and
    # go (a cancel drops a prefix and, with its last one, a length).
    import random

    rng = random.Random(7)
    core = StoreCore()
    s = core.open_session()
    alphabet = "ab/"
    parked: dict[str, list] = {}
    for _ in range(300):
        prefix = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 5)))
        parked.setdefault(prefix, []).append(
            core.begin_gather(s, prefix, 10**6, (), lambda: None))
    for prefix in rng.sample(sorted(parked), len(parked) // 2):
        for waiter in parked.pop(prefix):  # its last waiter gone, the prefix goes
            core.cancel(waiter)
    assert sorted(core._prefixes) == sorted(parked)
    assert core._prefix_lens == {n: sum(len(p) == n for p in parked)
                                 for n in {len(p) for p in parked}}
    for _ in range(200):
        key = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 7)))
        want = sorted(p for p in core._prefixes if key.startswith(p))
        assert sorted(p for p, _ in core._tracks_of(key)) == want, key
        before = {p: core._prefixes[p].count for p in want}
        had = key in core._data
        core.set(s, key, b"v")
        assert all(core._prefixes[p].count == before[p] + (not had) for p in want), key


def test_each_key_is_charged_its_entry_so_max_bytes_bounds_many_small_keys() -> None:
    # Empty values under short keys: each still costs the server ~85 B (objects and dict
    # entry). Charged at _KEY_ENTRY_COST, 100 kB of quota holds ~1,000 of them, not 20,000.
    from m2n_async import StoreLimitError
    from m2n_async._store._core import _KEY_ENTRY_COST

    core = StoreCore(max_bytes=100_000)
    s = core.open_session()
    held = 0
    with pytest.raises(StoreLimitError, match="max_bytes"):
        for i in range(100_000):
            core.set(s, f"k{i:04d}", b"")
            held += 1
    assert held == 100_000 // (5 + _KEY_ENTRY_COST), held
    core.delete(s, "k0000")  # a delete gives back what the key was charged
    assert core.nbytes == (held - 1) * (5 + _KEY_ENTRY_COST)


def _index_of(spaces: object) -> list[str]:
    keys = spaces._keys  # type: ignore[attr-defined]
    assert sorted(keys) == sorted(s for job in spaces._jobs.values()  # type: ignore[attr-defined]
                                  for s in job)
    return sorted(k for space in keys.values() for k in space)


def test_the_job_indexes_find_exactly_what_a_scan_of_the_store_finds() -> None:
    # Keys, waited keys and parked prefixes are indexed by job and generation; a prefix's
    # keys through the index, and a generation's purge, must be what testing every key gives,
    # as keys, waiters and generations come and go.
    import random

    rng = random.Random(11)
    segments = ["", "1", "10", "01", "2", "x", "1x", "9" * 19, "\u0663"]
    parts = ["j", "k", ""]

    def name() -> str:
        out = rng.choice(parts)
        for _ in range(rng.randrange(0, 3)):
            out += "/" + rng.choice(segments)
        return out + rng.choice(["", "/", "/y"])

    core = StoreCore()
    s = core.open_session()
    waiters = []
    for step in range(1500):
        key = name()
        roll = rng.random()
        try:
            if roll < 0.5:
                core.set(s, key, b"v")
            elif roll < 0.6:
                core.delete(s, key)
            elif roll < 0.7:
                waiters.append(core.begin_wait(s, [key, name()], (), lambda: None))
            elif roll < 0.8:
                waiters.append(core.begin_gather(s, key, 10**6, (), lambda: None))
            elif roll < 0.85:
                core.delete_prefix(s, key)
            elif roll < 0.9 and waiters:
                core.cancel(waiters.pop(rng.randrange(len(waiters))))
            elif roll < 0.93:
                core.add(s, f"{rng.choice('jk')}/generation", rng.randrange(0, 2))
            else:
                prefix = name()[: rng.randrange(0, 8)]
                want = sorted(k for k in core._data if k.startswith(prefix))
                got = sorted(k for k in core._held.under(prefix, core._data)
                             if k.startswith(prefix))
                assert got == want, prefix
        except StoreError:
            pass  # stale keys and protected counters are refused, as before
        if step % 50 == 0:
            with_job = [k for k in core._data if k.find("/") > 0]
            assert _index_of(core._held) == sorted(with_job)
            assert _index_of(core._waited) == sorted(k for k in core._key_waiters
                                                     if k.find("/") > 0)
            assert _index_of(core._parked) == sorted(p for p in core._prefixes
                                                     if p.find("/") > 0)
            for job, current in core._generations.items():
                assert not [k for k in core._data if (g := _generation_of(k)) is not None
                            and g[0] == job and g[1] < current]


def test_a_generation_advance_reads_only_that_job() -> None:
    # The purge of a job's older generations goes through the index: with the rest of the
    # store unreadable, advancing, gathering in and deleting under a job still work.
    class Unscannable(dict):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            raise AssertionError("the whole store was scanned")

    core = StoreCore()
    s = core.open_session()
    for i in range(100):
        core.set(s, f"other/0/{i}", b"v")
        core.set(s, f"job/0/{i}", b"v")
    core.set(s, "job/1/a", b"v")
    parked = core.begin_gather(s, "job/0/p/", 5, (), lambda: None)
    waited = core.begin_wait(s, ["job/0/w"], (), lambda: None)
    core._data = Unscannable(core._data)
    assert core.add(s, "job/generation", 1) == 1
    assert isinstance(parked.error, StaleGenerationError)
    assert isinstance(waited.error, StaleGenerationError)
    assert "job/0/5" not in core._data and core.get(s, "other/0/5") == b"v"
    done = core.begin_gather(s, "job/1/", 1, (), lambda: None)
    assert done.done and list(done.result.items) == ["job/1/a"]  # type: ignore[union-attr]
    assert core.delete_prefix(s, "other/") == 100
