"""The ``hf-layerswap score`` verb: score block pairs (:func:`~hf_layerswap.score_layers`)
and write the :class:`~hf_layerswap.SwapReport` JSON; :func:`format_scores_table` is the
per-layer table it (and ``demo``) prints."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

from ..scoring.protocols import SWAP_PROTOCOLS
from ..scoring.rule import NonFiniteScoresWarning, nonfinite_message
from ..scoring import score_layers
from ..scoring.processes import is_main_process
from .options import (
    HELP_FORMATTER,
    add_calibration_args,
    add_config_options,
    add_model_args,
    add_overwrite_arg,
    add_resume_arg,
    add_scoring_memory_arg,
    check_before_loading,
    load,
    needs_tokenizer,
    prompt_count,
)

__all__ = ["add_parser", "format_scores_table", "run_score"]


def add_parser(subparsers):
    """Register the ``score`` verb on ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    score = subparsers.add_parser("score", formatter_class=HELP_FORMATTER,
                                  help="score block pairs and write the SwapReport JSON")
    add_model_args(score)
    add_calibration_args(score)
    add_scoring_memory_arg(score)
    score.add_argument("--protocols", nargs="+", default=["replacement", "interchange"],
                       choices=list(SWAP_PROTOCOLS))
    add_config_options(score, ["max_gap"])
    score.add_argument("--output", "-o", default="layerswap_report.json",
                       help="report JSON path (an existing file only with --overwrite)")
    add_overwrite_arg(score)
    add_resume_arg(score)
    score.set_defaults(func=run_score)
    return score


def run_score(args) -> int:
    """The ``score`` verb: load, score, write ``args.output``, print the table; non-finite
    values are kept and named in one ``warning:`` line on stderr."""
    if Path(args.output).is_dir():  # found out before loading and scoring, not after
        example = Path(args.output) / "layerswap_report.json"
        raise FileExistsError(f"--output {args.output} is a folder; give the report's file path, e.g. {example}")
    check_before_loading(args, outputs=[("--output", args.output, "file"), ("--resume", args.resume, "folder")])
    model, tokenizer = load(args)
    needs_tokenizer(tokenizer, args.model, f"--calibration {args.calibration}")
    with warnings.catch_warnings():  # said once below, naming the values
        warnings.simplefilter("ignore", NonFiniteScoresWarning)
        report = score_layers(
            model, args.calibration, tokenizer=tokenizer, protocols=args.protocols, max_gap=args.max_gap,
            num_prompts=prompt_count(args.num_prompts), seq_len=args.seq_len, batch_size=args.batch_size,
            seed=args.seed, checkpoint_path=args.resume, max_memory=args.scoring_memory,
        )
    if not is_main_process():  # under accelerate launch every process scores its share; the first one writes
        return 0
    path = report.to_json(args.output, overwrite=args.overwrite)
    print(format_scores_table(report))
    print(f"report written to {path}")
    bad = report.nonfinite_values()
    if bad:
        print("warning: " + nonfinite_message(f"{len(bad)} swap-KL value(s) are kept in the report as results", bad,
                                              (report.metadata.get("nonfinite") or {}).get("first_batch")),
              file=sys.stderr)
    return 0


def format_scores_table(report) -> str:
    """Per-layer scores of both protocols side by side (nats), with ranks."""
    protocols = list(report.protocols)
    scores = {p: report.layer_scores(p) for p in protocols}
    ranks = {p: {layer: r + 1 for r, layer in enumerate(report.ranking(p))} for p in protocols}
    header = "| layer | " + " | ".join(f"{p} s(i) | rank" for p in protocols) + " |"
    sep = "|---:|" + "---:|---:|" * len(protocols)
    lines = [header, sep]
    for layer in range(report.num_blocks):
        cells = " | ".join(f"{_fmt(scores[p][layer])} | {ranks[p][layer]}" for p in protocols)
        lines.append(f"| {layer} | {cells} |")
    return "\n".join(lines)


def _fmt(x) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4f}" if abs(x) >= 1e-3 else f"{x:.2e}"
