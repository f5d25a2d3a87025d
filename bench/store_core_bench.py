"""Store core: the CPU one write of a new key costs the sans-IO ``StoreCore``, by how many
gathers are parked and on how many distinct prefixes.

A new key must find the parked gathers whose prefix it starts with. A collective parks a few
(each rank's gather of one call's prefix); a client may park up to 4,096 per session, each
on a prefix of its own. No sockets, no event loop: the core alone, one process.

Usage: ``python bench/store_core_bench.py [--keys 20000] [--parked 1,64,4096,40960]``
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=20000)
    ap.add_argument("--parked", default="0,1,64,4096,40960")
    args = ap.parse_args()
    for n in (int(x) for x in args.parked.split(",")):
        print(f"parked {n:>6}: {per_set(args.keys, n):8.2f} us per set of a new key")


if __name__ == "__main__":
    main()
