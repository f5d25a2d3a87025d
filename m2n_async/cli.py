"""The ``m2n-async`` command: ``demo``, ``store``, ``plan``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from m2n_async._demo import add_demo_command, run_demo_command
from m2n_async._integrations.planfile import add_plan_command, run_plan_command
from m2n_async._store._cli import add_store_command, run_store_command


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="m2n-async", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_command(sub)  # `demo` (issue 5): lives in _demo.py
    add_plan_command(sub)  # `plan` (issue 8): lives in _integrations/planfile.py
    add_store_command(sub)  # `store` (issue 3): lives in _store/_cli.py
    args = parser.parse_args(argv)
    if args.command == "plan":
        return run_plan_command(args)
    if args.command == "store":
        return run_store_command(args)
    if args.command == "demo":
        return run_demo_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
