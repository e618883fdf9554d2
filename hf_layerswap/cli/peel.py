"""The ``hf-layerswap peel`` verb: its arguments (:func:`add_peel_arguments`) and its run
(:func:`run_peel`) on top of :mod:`hf_layerswap.peeling`, registered by :func:`add_parser`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..utils.jsonio import atomic_path, write_text_atomic
from ..models import load_model
from ..peeling import (
    DEFAULT_RIDGE,
    DEFAULT_TAU,
    REFERENCES,
    TARGETS,
    peel,
    peel_plot,
    peel_table_markdown,
    peel_trajectory,
    trajectory_plot,
    trajectory_table_markdown,
)
from .options import (
    HELP_FORMATTER,
    add_device_args,
    add_overwrite_arg,
    check_devices,
    check_paths,
    device_options,
    input_paths,
)

__all__ = ["add_parser", "add_peel_arguments", "run_peel"]


def add_parser(subparsers):
    """Register the ``peel`` verb on ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    peel_parser = subparsers.add_parser(
        "peel", formatter_class=HELP_FORMATTER,
        help="per-layer peeling reference bounds (linear reference vs the trained blocks)",
    )
    add_peel_arguments(peel_parser).set_defaults(func=run_peel)
    return peel_parser


def add_peel_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``peel`` verb's arguments to ``parser`` (an ``add_subparsers`` child).

    One MODEL: peel that checkpoint. Several: a training trajectory (checkpoint
    directories in training order), peeled and scored with both swap-KL protocols.
    """
    parser.description = (
        "Per-layer peeling reference bounds (Eamaz et al., arXiv 2605.02853): replace blocks k..k+m-1 by a "
        "reference fitted on calibration text and report the held-out CE change with a bootstrap CI."
    )
    parser.add_argument("model", nargs="+", help="checkpoint dir, GGUF file, Hub id or bundled name; several "
                        "checkpoint dirs = a training trajectory")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside MODEL (one model only)")
    parser.add_argument("--revision", default=None, help="Hub revision (one model only)")
    add_device_args(parser)
    parser.add_argument("--calibration", default="embedded", help="text the references are fitted on: a file or 'embedded'")
    parser.add_argument("--eval-text", default="embedded", help="held-out text the hybrids are scored on: a file or "
                        "'embedded' (must not overlap the calibration text)")
    parser.add_argument("--num-prompts", type=int, default=64, help="calibration prompts")
    parser.add_argument("--seq-len", type=int, default=128, help="calibration tokens per prompt")
    parser.add_argument("--eval-prompts", type=int, default=32, help="evaluation prompts")
    parser.add_argument("--eval-seq-len", type=int, default=128, help="evaluation tokens per prompt")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass")
    parser.add_argument("--seed", type=int, default=0, help="paragraph shuffle and bootstrap seed")
    parser.add_argument("--spans", type=int, nargs="+", default=[1, 2], help="blocks replaced per probe")
    parser.add_argument("--targets", default="own+later", choices=list(TARGETS))
    parser.add_argument("--reference", nargs="+", default=["linear"], choices=list(REFERENCES))
    parser.add_argument("--ridge", type=float, default=DEFAULT_RIDGE, help="relative ridge toward the identity")
    parser.add_argument("--no-bias", action="store_true", help="fit linear (not affine) maps")
    parser.add_argument("--tau", type=float, default=DEFAULT_TAU, help="'matched' threshold in nats")
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples")
    parser.add_argument("--sites", type=int, nargs="+", default=None, help="sites to probe (0-based; default all)")
    parser.add_argument("--gradient-steps", type=int, default=100, help="AdamW steps of a gradient reference")
    parser.add_argument("--gradient-lr", type=float, default=1e-3, help="learning rate of a gradient reference")
    parser.add_argument("--protocols", nargs="*", default=["replacement", "interchange"],
                        choices=["replacement", "interchange"], help="swap-KL protocols of a trajectory")
    parser.add_argument("--max-gap", type=int, default=1, help="swap-KL pair distance bound (trajectory)")
    parser.add_argument("--output", "-o", default="peel_report.json",
                        help="report JSON path (an existing file only with --overwrite)")
    parser.add_argument("--plot", default=None, help="also write the PNG plot here")
    parser.add_argument("--table", default=None, help="also write the markdown table here")
    add_overwrite_arg(parser)
    parser.add_argument("--progress", action="store_true", help="show a progress bar")
    return parser


def _peel_kwargs(args) -> dict:
    return dict(
        spans=tuple(args.spans), targets=args.targets, reference=tuple(args.reference), ridge=args.ridge,
        bias=not args.no_bias, tau=args.tau, bootstrap=args.bootstrap, sites=args.sites,
        num_prompts=args.num_prompts, seq_len=args.seq_len, eval_prompts=args.eval_prompts,
        eval_seq_len=args.eval_seq_len, gradient_steps=args.gradient_steps, gradient_lr=args.gradient_lr,
    )


def run_peel(args) -> int:
    """Run the ``peel`` verb (see :func:`add_peel_arguments`); returns the exit code."""
    models = [("MODEL", model) for model in args.model]
    if args.gguf_file is not None:
        models.append(("--gguf-file", Path(args.model[0]).expanduser() / args.gguf_file))
    check_devices(args)
    check_paths(outputs=[(option, path, "file") for option, path in
                         (("--output", args.output), ("--plot", args.plot), ("--table", args.table))],
                reads=[*models, *input_paths(args)], overwrite=args.overwrite)
    eval_text = None if args.eval_text == "embedded" else args.eval_text
    if len(args.model) == 1:
        model, tokenizer = load_model(args.model[0], gguf_file=args.gguf_file, revision=args.revision,
                                      **device_options(args))
        report = peel(model, args.calibration, eval_text, tokenizer=tokenizer, batch_size=args.batch_size,
                      seed=args.seed, progress=args.progress, **_peel_kwargs(args))
        report.to_json(args.output, overwrite=args.overwrite)
        table = peel_table_markdown(report)
        if args.plot:
            with atomic_path(args.plot, suffix=".png", overwrite=args.overwrite) as tmp:
                peel_plot(report, tmp)
    else:
        if args.gguf_file or args.revision:
            raise SystemExit("--gguf-file/--revision apply to one model; a trajectory takes checkpoint directories")
        traj = peel_trajectory(args.model, args.calibration, eval_text, protocols=tuple(args.protocols),
                               max_gap=args.max_gap, batch_size=args.batch_size, seed=args.seed,
                               progress=args.progress, **_peel_kwargs(args))
        traj.to_json(args.output, overwrite=args.overwrite)
        table = trajectory_table_markdown(traj)
        if args.plot:
            with atomic_path(args.plot, suffix=".png", overwrite=args.overwrite) as tmp:
                trajectory_plot(traj, tmp)
    if args.table:
        write_text_atomic(table, args.table, overwrite=args.overwrite)
    print(table)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
