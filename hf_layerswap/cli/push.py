"""The ``hf-layerswap push`` verb: load a checkpoint folder with its sidecars and publish
it with :func:`~hf_layerswap.push_to_hub` (one commit), or write the folder that would be
uploaded with :func:`~hf_layerswap.save_for_hub` (``--output-dir``). Exit status: 0 ok,
1 upload failed, 2 refused."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from ..card import EVALUATION_FILE, REPORT_FILE, SPARSITY_FILE
from ..hub import HubPushError, PushRefusedError, push_to_hub, read_evaluation_file, save_for_hub
from ..card.healing import HEALING_FILE
from ..healing import HealReport
from ..scoring.report import SwapReport
from ..sparsity import SparsityReport
from .options import check_paths

__all__ = ["PUSH_EXAMPLES", "PUSH_HELP", "add_parser", "add_push_arguments", "run_push"]

PUSH_HELP = "publish a pruned checkpoint folder to the Hub with its model card and diagnostics (one commit)"
PUSH_EXAMPLES = """examples:
  hf-layerswap push out/smollm2-pruned me/SmolLM2-135M-layerswap-26L
  hf-layerswap push out/smollm2-pruned me/SmolLM2-135M-layerswap-26L --private --license apache-2.0
  hf-layerswap push out/smollm2-pruned me/SmolLM2-135M-layerswap-26L --output-dir publish/  # no upload

The token comes from HF_TOKEN or `hf auth login`; prefer those to --token (shell history).
"""


def add_parser(subparsers):
    """Register the ``push`` verb on ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    push = subparsers.add_parser("push", help="upload a pruned checkpoint with its card to the Hub")
    add_push_arguments(push).set_defaults(func=run_push)
    return push


def add_push_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``push`` verb's arguments to ``parser`` (an ``add_subparsers`` child)."""
    parser.description = PUSH_HELP
    parser.epilog = PUSH_EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("directory", help="checkpoint folder (config.json + safetensors), e.g. written by `prune`")
    parser.add_argument("repo_id", help="Hub repository id, owner/name")
    parser.add_argument("--report", help=f"SwapReport JSON (default: DIRECTORY/{REPORT_FILE} if present)")
    parser.add_argument("--evaluation", help=f"perplexity JSON {{base, pruned}}, each a perplexity result or an `hf-layerswap eval` result "
                        f"(default: DIRECTORY/{EVALUATION_FILE} if present)")
    parser.add_argument("--sparsity-report", help=f"SparsityReport JSON (default: DIRECTORY/{SPARSITY_FILE} if present)")
    parser.add_argument("--base-model", help="Hub id of the base model, for the card (default: from the removal record)")
    parser.add_argument("--license", help="license id for the card (default: the base model's when known)")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    parser.add_argument("--revision", help="branch to commit to (default: main)")
    parser.add_argument("--commit-message", help="commit message (default names the removed blocks)")
    parser.add_argument("--endpoint", help="Hub endpoint URL (default: HF_ENDPOINT or https://huggingface.co)")
    parser.add_argument("--token", help="Hub token (default: HF_TOKEN or the stored login)")
    parser.add_argument("--no-tokenizer", action="store_true", help="do not publish the folder's tokenizer files")
    parser.add_argument("--output-dir", help="write the folder that would be uploaded here, and do not contact the Hub")
    return parser


def _load_folder(args):
    """The folder's model, tokenizer and sidecars; every sidecar is read (and refused) before the model loads."""
    directory = Path(args.directory)
    if not (directory / "config.json").is_file():
        raise PushRefusedError(f"{directory} is not a checkpoint folder (no config.json)")
    report, evaluation, sparsity_report = _read_sidecars(args, directory)
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype="auto")
    tokenizer = None
    if not args.no_tokenizer and any((directory / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    if (directory / HEALING_FILE).is_file():  # the healing plot is drawn again from it
        model.layerswap_heal_report = HealReport.from_json(directory / HEALING_FILE)
    return model, tokenizer, report, evaluation, sparsity_report


def _read_sidecars(args, directory: Path):
    """``(report, evaluation, sparsity_report)`` from the options or the folder's own files."""
    report_path = Path(args.report) if args.report else directory / REPORT_FILE
    if args.report and not report_path.is_file():
        raise PushRefusedError(f"--report {report_path} does not exist")
    report = SwapReport.from_json(report_path) if report_path.is_file() else None
    eval_path = Path(args.evaluation) if args.evaluation else directory / EVALUATION_FILE
    if args.evaluation and not eval_path.is_file():
        raise PushRefusedError(f"--evaluation {eval_path} does not exist")
    evaluation = read_evaluation_file(eval_path) if eval_path.is_file() else None
    sparsity_path = Path(args.sparsity_report) if args.sparsity_report else directory / SPARSITY_FILE
    if args.sparsity_report and not sparsity_path.is_file():
        raise PushRefusedError(f"--sparsity-report {sparsity_path} does not exist")
    sparsity_report = None
    if sparsity_path.is_file():
        try:
            sparsity_report = SparsityReport.from_json(sparsity_path)
        except (ValueError, KeyError, TypeError) as err:
            raise PushRefusedError(f"{sparsity_path} is not a SparsityReport JSON file: {err!r}") from None
    return report, evaluation, sparsity_report


def run_push(args: argparse.Namespace) -> int:
    """Run the ``push`` verb. Returns the exit status (0 ok, 1 upload failed, 2 refused)."""
    check_paths(inputs=[("--report", args.report), ("--evaluation", args.evaluation),
                        ("--sparsity-report", args.sparsity_report)],
                outputs=[("--output-dir", args.output_dir, "new folder")], reads=[("DIRECTORY", args.directory)])
    try:
        model, tokenizer, report, evaluation, sparsity_report = _load_folder(args)
        common = dict(tokenizer=tokenizer, report=report, evaluation=evaluation, base_model=args.base_model,
                      license=args.license, sparsity_report=sparsity_report)
        if args.output_dir:
            path = save_for_hub(model, args.output_dir, repo_id=args.repo_id, **common)
            print(f"wrote {path} (nothing uploaded)")
            return 0
        info = push_to_hub(
            model, args.repo_id, private=args.private, token=args.token, revision=args.revision,
            commit_message=args.commit_message, endpoint=args.endpoint, **common,
        )
    except (PushRefusedError, FileExistsError, TypeError) as err:
        print(f"hf-layerswap push: refused: {err}", file=sys.stderr)
        return 2
    except HubPushError as err:
        print(f"hf-layerswap push: failed: {err}", file=sys.stderr)
        return 1
    print(info.commit_url)
    return 0
