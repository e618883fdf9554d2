"""``hf-layerswap`` command line: ``demo``, ``score``, ``prune``, ``push``, ``peel``, ``eval`` and ``export-gguf``
(``--help`` of each verb shows its defaults).

Every verb takes the same options as the Python API (0-based layer indices everywhere).
Every argparse parser of the command lives in this package: one module per verb (its
``add_parser(subparsers)`` and its ``run_*`` on top of the library's public functions) and
:mod:`.common` for the options and checks several verbs share. ``optimum-cli layerswap``
runs the same parser (:func:`build_parser`).
"""

from __future__ import annotations

import argparse
import sys

from . import demo, export_gguf, peel, prune, push, score
from . import eval as eval_verb
from .demo import DEFAULT_MODEL, demo_config, run_demo
from .eval import add_eval_arguments, run_eval
from .export_gguf import add_export_gguf_arguments, run_export_gguf
from .peel import add_peel_arguments, run_peel
from .prune import prune_config, run_prune
from .push import add_push_arguments, run_push
from .score import format_scores_table, run_score

__all__ = ["build_parser", "main"]

#: The verbs in the order ``--help`` lists them.
VERBS = (demo, score, prune, push, peel, eval_verb, export_gguf)


def build_parser(prog: str = "hf-layerswap") -> argparse.ArgumentParser:
    """The ``hf-layerswap`` argument parser (shared with ``optimum-cli layerswap``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Swap-KL layer redundancy (replacement vs interchange), layer removal and publishing.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for verb in VERBS:
        verb.add_parser(sub)
    return parser


def main(argv=None, prog: str = "hf-layerswap") -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the verb; returns the exit status.

    An argument error exits 2 (argparse's ``error:`` line) before any model loads; a
    ``ValueError``, ``FileNotFoundError`` or ``FileExistsError`` of the run is printed as
    ``error: ...`` and returns 2.
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
