"""The ``m2n-async`` command: ``demo``, ``store``, ``plan``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m2n-async", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="sync weights between local trainer and worker processes")
    args = parser.parse_args(argv)
    if args.command == "demo":
        print("m2n-async demo: not yet available (the engine is being built)")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
