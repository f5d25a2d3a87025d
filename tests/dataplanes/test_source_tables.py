"""The m2n lane's source pointer tables: kept per stacked call for the last few source sets.

A trainer packs a stacked call's members with one Triton copy that reads the members' base
addresses from a device table. Building and uploading that table costs more than the copy's
launch, so the lane keeps the tables of the last ``SOURCE_TABLES`` source sets per call and
reuses one when every address matches. These tests drive ``_source_table`` with a counting
stand-in for ``pointer_table`` (the real table needs CUDA; ``tests/gpu`` runs the real one
bit-exact with alternating bf16 and fp32 sources).
"""

from __future__ import annotations

import types
from typing import Any

import pytest

from m2n_async._data import m2n as m2n_lane


class _Source:
    """A stand-in source tensor: only what ``_source_table`` reads."""

    is_cuda = True


def _lane(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[list[int]]]:
    built: list[list[int]] = []

    def pointer_table(tensors: Any, device: Any, ptrs: Any = None) -> tuple[str, int]:
        assert ptrs == tensors[0].ptrs  # the addresses the lane read, passed on
        built.append(list(tensors[0].ptrs))
        return ("table", len(built))  # unique per build: which build a round got

    monkeypatch.setattr(m2n_lane, "kernels_available", lambda: True)
    monkeypatch.setattr(m2n_lane, "pointer_table", pointer_table)
    lane = types.SimpleNamespace(_src_tables={}, device="cuda:0")
    return lane, built


def _take(lane: Any, ptrs: list[int], k: int = 0) -> Any:
    src = _Source()
    src.ptrs = ptrs  # type: ignore[attr-defined]
    st = types.SimpleNamespace(bucket=types.SimpleNamespace(index=0), sources=[])
    table = m2n_lane.M2NTransport._source_table(lane, st, k, (src,), ptrs)
    # the staging keeps the table until the copy ran
    assert st.sources == ([table] if table is not None else [])
    return table


def test_alternating_source_sets_build_each_table_once(monkeypatch: pytest.MonkeyPatch) -> None:
    lane, built = _lane(monkeypatch)
    a, b = [0x1000, 0x2000], [0x9000, 0xA000]
    got = [_take(lane, a), _take(lane, b), _take(lane, a), _take(lane, b), _take(lane, a)]
    assert built == [a, b]
    assert got == [("table", 1), ("table", 2), ("table", 1), ("table", 2), ("table", 1)]


def test_a_moved_member_builds_a_new_table(monkeypatch: pytest.MonkeyPatch) -> None:
    lane, built = _lane(monkeypatch)
    _take(lane, [0x1000, 0x2000])
    assert _take(lane, [0x1000, 0x3000]) == ("table", 2)  # one member elsewhere: not reused
    assert built == [[0x1000, 0x2000], [0x1000, 0x3000]]


def test_only_the_latest_sets_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    lane, built = _lane(monkeypatch)
    n = m2n_lane.SOURCE_TABLES
    sets = [[0x1000 * (i + 1)] for i in range(n + 1)]
    for s in sets:
        _take(lane, s)
    assert len(lane._src_tables[0, 0]) == n
    _take(lane, sets[-1])  # still kept: no build
    assert len(built) == n + 1
    _take(lane, sets[0])  # the oldest was let go: built again
    assert len(built) == n + 2
    # a set found again moves to the front, so a steady set is never the one let go
    _take(lane, sets[2])
    assert lane._src_tables[0, 0][0][0] == sets[2]


def test_tables_are_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    lane, built = _lane(monkeypatch)
    _take(lane, [0x1000], k=0)
    _take(lane, [0x1000], k=1)  # the same addresses in another call: its own table
    assert len(built) == 2


def test_no_table_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    lane, built = _lane(monkeypatch)
    monkeypatch.setattr(m2n_lane, "kernels_available", lambda: False)
    assert _take(lane, [0x1000]) is None
    assert built == []


def test_the_real_table_holds_the_addresses_and_their_alignment() -> None:
    import torch

    from m2n_async._data import _kernels

    flat = torch.zeros(64, dtype=torch.float32)
    pieces = [flat[i:i + 4] for i in (0, 8, 17)]  # 0, 32 and 68 bytes in: 4-byte aligned
    ptrs = [t.data_ptr() for t in pieces]
    for given in (None, ptrs):
        table = _kernels.pointer_table(pieces, "cpu", given)
        assert table.table.dtype == torch.int64 and table.table.tolist() == ptrs
        assert table.align == _kernels.address_align(ptrs) == 4
