"""The ``hf-layerswap prune`` verb: remove layers (scored or explicit) through
:func:`hf_layerswap.pipeline.prune` and save a plain transformers checkpoint with its card."""

from __future__ import annotations

from pathlib import Path

from ..config import LayerSwapConfig
from ..pipeline import prune
from ..report import SwapReport
from ..scoring.processes import is_main_process
from .common import (
    HELP_FORMATTER,
    add_calibration_args,
    add_config_options,
    add_model_args,
    add_resume_arg,
    add_scoring_memory_arg,
    calibration_source,
    check_before_loading,
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
    add_config_options(p.add_mutually_exclusive_group(required=True), ["num_to_remove", "layers"])
    p.add_argument("--report", default=None, help="reuse an existing report JSON instead of scoring")
    add_calibration_args(p)
    add_scoring_memory_arg(p)
    add_config_options(p, ["max_gap", "strategy", "objective", "max_evaluations", "protocol", "spacing", "protect",
                           "recovery", "sparsity", "allocation", "pruner", "sparsity_pattern"],
                       types={"sparsity": fraction}, options={"protect": {"nargs": "*"}})
    add_resume_arg(p)
    p.set_defaults(func=run_prune)
    return p


def prune_config(args):
    """The :class:`~hf_layerswap.LayerSwapConfig` of the prune verb's flags (checked here,
    before any model loads).

    Raises:
        ValueError: a bad or contradictory flag value (the message names it).
    """
    if args.max_evaluations is not None and args.strategy != "search":
        raise ValueError(f"--max-evaluations applies to --strategy search, not {args.strategy!r}")
    return LayerSwapConfig(
        num_to_remove=args.num_to_remove, layers=args.layers, protocol=args.protocol, max_gap=args.max_gap,
        spacing=args.spacing, protect=args.protect, calibration=calibration_source(args.calibration),
        num_prompts=prompt_count(args.num_prompts), seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
        strategy=args.strategy, objective=args.objective, max_evaluations=args.max_evaluations,
        recovery=args.recovery, sparsity=args.sparsity, allocation=args.allocation, pruner=args.pruner,
        sparsity_pattern=args.sparsity_pattern, progress=True,
    )


def run_prune(args) -> int:
    """The ``prune`` verb: every flag checked, then load, :func:`~hf_layerswap.pipeline.prune`, save."""
    config = prune_config(args)
    check_before_loading(args, outputs=[("output", args.output, "new folder"), ("--resume", args.resume, "folder")])
    if args.resume is not None and (args.layers is not None or args.report):
        given = "--layers" if args.layers is not None else "--report"
        raise ValueError(f"--resume resumes scoring, but with {given} nothing is scored: drop --resume")
    report = None
    if args.report:
        if not Path(args.report).is_file():
            raise FileNotFoundError(f"--report {args.report!r} is not a file; give a report JSON written by 'score'")
        report = SwapReport.from_json(args.report)
    model, tokenizer = load(args)
    result = prune(
        model, config, tokenizer=tokenizer, report=report, checkpoint_path=args.resume, max_memory=args.scoring_memory,
    )
    if not is_main_process():  # under accelerate launch every process scores its share; the first one writes
        return 0
    out = save_pruned(model, tokenizer, result.report, Path(args.output))
    print(f"removed layers {result.removed} (0-based); pruned checkpoint written to {out}")
    return 0
