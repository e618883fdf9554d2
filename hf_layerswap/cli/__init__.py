"""``hf-layerswap`` command line: ``demo``, ``score``, ``prune``, ``heal``, ``push``, ``peel``, ``eval`` and ``export-gguf``
(``--help`` of each verb shows its defaults).

Every verb takes the same options as the Python API (0-based layer indices everywhere).
Every argparse parser of the command lives in this package: one module per verb (its
``add_parser(subparsers)`` and its ``run_*`` on top of the library's public functions) and
:mod:`.options` for the options and checks several verbs share. ``optimum-cli layerswap``
runs the same parser (:func:`build_parser`).
"""

from __future__ import annotations

import argparse
import sys

from ..utils.extras import MissingExtraError
from ..utils.provenance import __version__
from . import demo, export_gguf, heal, peel, prune, push, score
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
VERBS = (demo, score, prune, heal, push, peel, eval_verb, export_gguf)


def build_parser(prog: str = "hf-layerswap") -> argparse.ArgumentParser:
    """The ``hf-layerswap`` argument parser (shared with ``optimum-cli layerswap``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Swap-KL layer redundancy (replacement vs interchange), layer removal and publishing.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for verb in VERBS:
        verb.add_parser(sub)
    return parser


def main(argv=None, prog: str = "hf-layerswap") -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the verb; returns the exit status.

    Exit statuses, each failure reported as one line on stderr:

    - 2: an argument error (argparse's ``error:`` line) or a ``ValueError``,
      ``FileNotFoundError`` or ``FileExistsError`` of the run (``error: ...``); the paths
      are checked before any model loads (:func:`~hf_layerswap.cli.options.check_paths`);
      an optional package the run needs and does not find
      (:class:`~hf_layerswap.utils.extras.MissingExtraError`, naming the extra to install);
    - 1: any other ``OSError`` while the verb runs, e.g. a full disk (``error: ...``; the
      writes are all or nothing, so nothing half-written is left);
    - 130: interrupted (Ctrl-C, SIGINT): ``interrupted ...``; with ``--resume DIR`` the
      same command continues where it stopped.
    """
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    args.command_line = [prog, *(sys.argv[1:] if argv is None else argv)]  # what a hint to rerun names
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, FileExistsError, MissingExtraError) as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        resume = getattr(args, "resume", None)
        hint = f"; run the same command again to continue from the checkpoint in {resume}" if resume else ""
        print(f"\ninterrupted{hint}", file=sys.stderr)
        return 130


def _one_line(err: BaseException) -> str:
    """The error's message on one line (libraries' multi-line messages joined)."""
    return " ".join(str(err).split())
