"""The ``hf-layerswap prune`` verb: remove layers (scored or explicit) through
:func:`hf_layerswap.pipeline.prune` and save a plain transformers checkpoint with its card."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..config import LayerSwapConfig
from ..pipeline import prune
from ..report import SwapReport
from ..recovery import RECOVERY_METHODS
from ..protocols import SWAP_PROTOCOLS
from ..scoring.processes import is_main_process
from ..selection import STRATEGIES
from ..selection.core import selection_protocols
from ..selection.objectives import OBJECTIVES
from ..sparsity import ALLOCATORS, PRUNERS
from .common import (
    HELP_FORMATTER,
    add_calibration_args,
    add_model_args,
    add_scoring_memory_arg,
    calibration_source,
    check_output,
    count,
    fraction,
    load,
    prompt_count,
    save_pruned,
)

__all__ = ["add_parser", "prune_config", "run_prune"]


def add_parser(subparsers):
    """Register the ``prune`` verb on ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    p = subparsers.add_parser("prune", formatter_class=HELP_FORMATTER,
                              help="remove layers (scored or explicit) and save a plain transformers checkpoint")
    add_model_args(p)
    p.add_argument("output", help="directory for the pruned checkpoint (a new or empty folder)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--num-layers", type=count(1), help="remove this many layers chosen by swap-KL")
    group.add_argument("--layers", type=int, nargs="+", help="remove exactly these 0-based layers")
    p.add_argument("--report", default=None, help="reuse an existing report JSON instead of scoring")
    add_calibration_args(p)
    add_scoring_memory_arg(p)
    p.add_argument("--protocols", nargs="+", default=None, choices=list(SWAP_PROTOCOLS),
                   help="deprecated and ignored: the protocols scored follow --strategy and --protocol")
    p.add_argument("--max-gap", type=count(1), default=1, help="pair distance bound: 1 = adjacent pairs")
    _add_selection_args(p)
    _add_repair_args(p)
    p.set_defaults(func=run_prune)
    return p


def _add_selection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default="search", choices=sorted(STRATEGIES),
                   help="how the set is chosen: search = candidate sets from both protocols scored on the calibration "
                        "prompts and refined by local moves; greedy = the paper's rule on --protocol; auto = the better "
                        "protocol's greedy set")
    p.add_argument("--objective", default=None, choices=list(OBJECTIVES),
                   help="what --strategy search minimises on the calibration prompts (default removal_kl)")
    p.add_argument("--max-evaluations", type=count(1), default=None,
                   help="most candidate sets search scores in all (default: no cap beyond each budget's "
                        "allowance of one set per removable block)")
    p.add_argument("--protocol", default="interchange", choices=list(selection_protocols()),
                   help="protocol of --strategy greedy")
    p.add_argument("--spacing", type=count(0), default=None,
                   help="selected layers stay more than this apart (default: 1 for greedy/auto, 0 for search)")
    p.add_argument("--protect", type=int, nargs="*", default=None,
                   help="layers never removed (negative = from the end; default 0 -1 for a scored selection, "
                        "none for --layers)")


def _add_repair_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recovery", default=None, choices=[m for m in RECOVERY_METHODS if m != "none"],
                   help="repair the cut: ghosted (Ghosted Layers operators) or fused (folded into down_proj)")
    p.add_argument("--sparsity", type=fraction, default=None,
                   help="one-shot sparsity target in [0, 1) after removal (default: none)")
    p.add_argument("--allocation", default="pals", choices=list(ALLOCATORS),
                   help="per-block sparsity rule of --sparsity")
    p.add_argument("--sparsity-method", default="wanda", choices=list(PRUNERS),
                   help="pruner of --sparsity")
    p.add_argument("--sparsity-pattern", default=None, help="N:M pattern of --sparsity, e.g. 2:4 (default unstructured)")


def prune_config(args):
    """The :class:`~hf_layerswap.LayerSwapConfig` of the prune verb's flags (checked here,
    before any model loads).

    Raises:
        ValueError: a bad or contradictory flag value (the message names it).
    """
    if args.max_evaluations is not None and args.strategy != "search":
        raise ValueError(f"--max-evaluations applies to --strategy search, not {args.strategy!r}")
    return LayerSwapConfig(
        num_layers=args.num_layers, layers=args.layers, protocol=args.protocol, max_gap=args.max_gap,
        spacing=args.spacing, protect=args.protect, calibration=calibration_source(args.calibration),
        num_prompts=prompt_count(args.num_prompts), seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
        strategy=args.strategy, objective=args.objective, max_evaluations=args.max_evaluations,
        recovery=args.recovery, sparsity=args.sparsity, allocation=args.allocation, method=args.sparsity_method,
        sparsity_pattern=args.sparsity_pattern, progress=True,
    )


def run_prune(args) -> int:
    """The ``prune`` verb: every flag checked, then load, :func:`~hf_layerswap.pipeline.prune`, save."""
    check_output(args.output)
    config = prune_config(args)
    report = None
    if args.report:
        if not Path(args.report).is_file():
            raise FileNotFoundError(f"--report {args.report!r} is not a file; give a report JSON written by 'score'")
        report = SwapReport.from_json(args.report)
    if args.protocols is not None:
        print("note: --protocols is ignored by prune; the protocols scored follow --strategy and --protocol",
              file=sys.stderr)
    model, tokenizer = load(args)
    result = prune(model, config, tokenizer=tokenizer, report=report, max_memory=args.scoring_memory)
    if not is_main_process():  # under accelerate launch every process scores its share; the first one writes
        return 0
    out = save_pruned(model, tokenizer, result.report, Path(args.output))
    print(f"removed layers {result.removed} (0-based); pruned checkpoint written to {out}")
    return 0
