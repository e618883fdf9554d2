"""``optimum-cli layerswap ...``: the ``hf-layerswap`` verbs under optimum's CLI.

optimum-cli imports every module of the ``optimum.commands.register`` namespace package
(PEP 420: this folder must never hold an ``__init__.py``) and registers the commands in
its ``REGISTER_COMMANDS``. This module stays import-light: ``hf_layerswap`` (and with it
torch and transformers) is imported only when the command runs or prints its help.

Everything after ``optimum-cli layerswap`` is handed to the parser that
``hf_layerswap.cli.build_parser()`` builds, so both entry points expose the same verbs
with the same arguments.
"""

from __future__ import annotations

import argparse
import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo

PROG = "optimum-cli layerswap"


def _layerswap_parser() -> argparse.ArgumentParser:
    from hf_layerswap.cli import build_parser

    return build_parser(PROG)


def _print_layerswap_help(file=None) -> None:
    _layerswap_parser().print_help(file)


def run_layerswap(argv: list[str]) -> int:
    """Parse ``argv`` with hf-layerswap's parser and run the chosen verb; returns the exit status."""
    from hf_layerswap.cli import main

    if not argv:
        _print_layerswap_help()
        return 0
    return int(main(argv, prog=PROG) or 0)


class LayerSwapCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(
        name="layerswap",
        help="swap-KL layer redundancy, decoder-layer removal and Hub publishing (the hf-layerswap verbs)",
    )

    @staticmethod
    def parse_args(parser: argparse.ArgumentParser):
        parser.add_argument(
            "layerswap_argv",
            nargs=argparse.REMAINDER,
            metavar="VERB ...",
            help="an hf-layerswap verb and its arguments (`optimum-cli layerswap VERB --help`)",
        )
        # `optimum-cli layerswap -h` shows the hf-layerswap verbs, loaded only when asked for
        parser.print_help = _print_layerswap_help

    def run(self):
        sys.exit(run_layerswap(list(self.args.layerswap_argv)))


REGISTER_COMMANDS = [LayerSwapCommand]
