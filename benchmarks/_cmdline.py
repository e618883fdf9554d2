"""The command line a benchmark page records at its top."""

from __future__ import annotations

import shlex
import sys


def command_line(script: str, argv=None, drop: str = "--merge-from") -> str:
    """``python benchmarks/<script> ...`` less ``drop`` and its values (local paths of
    pieces run in other processes: with every piece cached, the command without them gives
    the same page)."""
    args, kept, skipping = sys.argv[1:] if argv is None else list(argv), [], False
    for a in args:
        if a == drop or a.startswith(drop + "="):
            skipping = a == drop
            continue
        if skipping and not a.startswith("-"):
            continue
        skipping = False
        kept.append(a)
    return f"python benchmarks/{script} " + " ".join(shlex.quote(a) for a in kept)
