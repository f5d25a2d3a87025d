"""Store core: the CPU one write of a new key costs the sans-IO ``StoreCore``, by how many
gathers are parked and on how many distinct prefixes; and what a generation's advance, a new
prefix's gather and a ``delete_prefix`` within one job cost while other jobs hold many keys.

A new key must find the parked gathers whose prefix it starts with. A collective parks a few
(each rank's gather of one call's prefix); a client may park up to 4,096 per session, each
on a prefix of its own. No sockets, no event loop: the core alone, one process.

A job's ``add`` that advances its generation purges the job's older generations; a gather on
a prefix no one waits on yet collects its keys; ``delete_prefix`` finds its keys. Each must
read the keys of its job, not every key of the store: a token holder's few bytes of such
requests would otherwise each cost a scan of the whole store (docs/security.md).

Usage: ``python bench/store_core_bench.py [--keys 20000] [--parked 1,64,4096,40960]
[--held 0,200000]``
"""

from __future__ import annotations

import argparse
import time

from m2n_async._store._core import StoreCore


def per_set(keys: int, parked: int) -> float:
    """Microseconds per ``set`` of a new key, with ``parked`` gathers parked on distinct
    prefixes (none of which the new keys start with) by sessions of 4,096 each."""
    core = StoreCore(max_bytes=None)
    for i in range(parked):
        if i % 4096 == 0:
            s = core.open_session()
        core.begin_gather(s, f"parked/{i}/", 2, (), lambda: None)
    w = core.open_session()
    t0 = time.perf_counter()
    for j in range(keys):
        core.set(w, f"job/1/g/call/{j}", b"v")
    return (time.perf_counter() - t0) / keys * 1e6


def per_job_request(held: int, rounds: int = 200) -> tuple[float, float, float]:
    """Microseconds per generation-advancing ``add``, per gather on a new prefix and per
    ``delete_prefix`` of one job holding 10 keys a generation, while ``held`` keys of other
    jobs are in the store."""
    core = StoreCore(max_bytes=None)
    s = core.open_session()
    for i in range(held):
        core.set(s, f"other{i % 64}/0/{i}", b"v")
    advance = gather = delete = 0.0
    for generation in range(rounds):
        for i in range(10):
            core.set(s, f"job/{generation}/k{i}", b"v")
        t0 = time.perf_counter()
        core.add(s, "job/generation", 1)  # purges the generation before
        t1 = time.perf_counter()
        core.begin_gather(s, f"job/{generation + 1}/", 0, (), lambda: None)
        t2 = time.perf_counter()
        core.delete_prefix(s, f"job/{generation + 1}/")
        t3 = time.perf_counter()
        advance, gather, delete = advance + t1 - t0, gather + t2 - t1, delete + t3 - t2
    return advance / rounds * 1e6, gather / rounds * 1e6, delete / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=20000)
    ap.add_argument("--parked", default="0,1,64,4096,40960")
    ap.add_argument("--held", default="0,200000",
                    help="keys other jobs hold, for the per-job requests (comma-separated)")
    args = ap.parse_args()
    for n in (int(x) for x in args.parked.split(",") if x):
        print(f"parked {n:>6}: {per_set(args.keys, n):8.2f} us per set of a new key")
    for n in (int(x) for x in args.held.split(",") if x):
        advance, gather, delete = per_job_request(n)
        print(f"held {n:>7}: {advance:10.2f} us per generation advance, {gather:10.2f} per "
              f"new-prefix gather, {delete:10.2f} per delete_prefix, within one job")


if __name__ == "__main__":
    main()
