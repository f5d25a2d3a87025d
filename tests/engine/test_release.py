"""``close()`` frees the Gloo data plane deterministically: with the garbage collector off,
a process's thread and fd counts after each connect / round / close cycle stay at what the
first cycle left (the threads a process keeps anyway, e.g. anyio's thread pool), after
rounds that succeeded and after rounds that failed, on both sides. Nothing of a cycle may
need the collector: a failed op kept alive by a traceback keeps its Gloo context (a thread,
four fds), and a helper thread that is still exiting when ``close()`` returns counts too."""

from __future__ import annotations

from ._world import RankPool


def _run(pool: RankPool, store_address: str, job: str, fail: str | None, cycles: int = 4
         ) -> list[list[tuple[int, int]]]:
    jobs = [("engine._release_scenarios.cycles",
             dict(address=store_address, job=job, rank=r, cycles=cycles, fail=fail))
            for r in range(2)]
    out = []
    for i, (kind, value) in enumerate(pool.run(jobs)):
        assert kind == "ok", f"rank {i}: {value}"
        out.append([tuple(c) for c in value])  # type: ignore[union-attr]
    return out  # type: ignore[return-value]


def test_close_after_success_frees_threads_and_fds(pool: RankPool, store_address: str,
                                                  job: str) -> None:
    for rank, counts in enumerate(_run(pool, store_address, job, fail=None)):
        assert all(c == counts[0] for c in counts), f"rank {rank}: {counts}"


def test_close_after_failure_frees_the_data_plane(pool: RankPool, store_address: str,
                                                  job: str) -> None:
    for rank, counts in enumerate(_run(pool, store_address, job, fail="shard")):
        assert all(c == counts[0] for c in counts), f"rank {rank}: {counts}"


def test_close_after_a_round_past_its_deadline_frees_the_data_plane(
        pool: RankPool, store_address: str, job: str) -> None:
    # The trainer's buckets queued behind the one that timed out fail their waits on the
    # deadline; what those waits would have taken must not outlive close in a traceback.
    for rank, counts in enumerate(_run(pool, store_address, job, fail="deadline", cycles=3)):
        assert all(c == counts[0] for c in counts), f"rank {rank}: {counts}"
