"""The ``m2n-async`` command: ``demo``, ``store``, ``plan``.

The subcommands' help comes from their modules' docstrings, written for developers (RST
literals, a "Theory of operation" lead-in); ``_plain`` turns them into text for a person at a
terminal, so the docstrings stay the single source.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence

from m2n_async._demo import add_demo_command, run_demo_command
from m2n_async._integrations.planfile import add_plan_command, run_plan_command
from m2n_async._store._cli import add_store_command, run_store_command

DESCRIPTION = ("Move model weights from trainer ranks to inference worker ranks. Commands: "
               "demo (a local trainer/worker job, verified bit-exact), plan (validate a plan "
               "file offline), store (run the control-plane store server).")


def _plain(text: str | None) -> str | None:
    """A docstring as terminal help: no RST literals, no "Theory of operation" lead-in, no
    leading "``m2n-async x``:" title (the usage line already names the command)."""
    if not text:
        return text
    text = re.sub(r"^``m2n-async [a-z]+``:\s*", "", text.strip())
    text = re.sub(r"Theory of operation:\s*(\w)", lambda m: m.group(1).upper(), text)
    text = text.replace("``", "")
    return text[:1].upper() + text[1:]


# The status of a command killed by SIGPIPE (128 + 13), which is what `cmd | head` expects.
_BROKEN_PIPE_STATUS = 141


def main(argv: Sequence[str] | None = None) -> int:
    try:
        status = _dispatch(argv)
        sys.stdout.flush()  # a reader that went away shows here, not in the flush at exit
    except BrokenPipeError:
        # `m2n-async plan big.toml | head`: the reader has what it wanted. Stop quietly, as a
        # command killed by SIGPIPE does, with stdout on /dev/null so that the interpreter's
        # own flush at exit does not raise again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return _BROKEN_PIPE_STATUS
    return status


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="m2n-async", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    add_demo_command(sub)  # `demo`: lives in _demo.py
    add_plan_command(sub)  # `plan`: lives in _integrations/planfile.py
    add_store_command(sub)  # `store`: lives in _store/_cli.py
    for command in sub.choices.values():
        command.description = _plain(command.description)
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
