"""``hf-layerswap eval``: perplexity (:func:`~hf_layerswap.evaluate_perplexity`) and lm-eval
tasks (:func:`~hf_layerswap.evaluate_tasks`) of one checkpoint, written as one JSON result.

With neither ``--text`` nor ``--tasks`` it measures perplexity on the embedded evaluation
text under the default (``matched``) contract. The JSON holds ``{"model": identity and block count,
"perplexity": PerplexityResult dict or null, "tasks": TaskResults dict or null}``; the
contract (text hash, window, stride, BOS, dtype, versions) is inside each result.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..calibration import read_text_file
from ..evaluation import evaluate_perplexity
from ..utils.extras import require
from ..utils.jsonio import encode_tree, write_json_atomic
from ..models import load_model
from ..utils.provenance import model_identity
from ..layerplan import num_blocks
from ..evaluation.tasks import evaluate_tasks
from .options import (
    HELP_FORMATTER,
    add_device_args,
    add_overwrite_arg,
    check_devices,
    check_paths,
    device_options,
    input_paths,
)

__all__ = ["CONTRACT_CHOICES", "add_eval_arguments", "add_parser", "run_eval", "task_limit"]

CONTRACT_CHOICES = ("matched", "full", "rolling")


def task_limit(value: str):
    """lm-eval's ``limit``: documents per task (int) or a fraction in (0, 1)."""
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--limit {value!r}: an int >= 1 or a fraction in (0, 1)") from None
    if number >= 1 and number.is_integer():
        return int(number)
    if 0 < number < 1:
        return number
    raise argparse.ArgumentTypeError(f"--limit {value!r}: an int >= 1 or a fraction in (0, 1)")


def add_parser(subparsers):
    """Register the ``eval`` verb on ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    evaluate = subparsers.add_parser("eval", formatter_class=HELP_FORMATTER,
                                     help="perplexity and/or lm-eval tasks of a checkpoint, as JSON")
    add_eval_arguments(evaluate).set_defaults(func=run_eval)
    return evaluate


def add_eval_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``eval`` verb's arguments to ``parser`` (an ``add_subparsers`` child)."""
    parser.description = (
        "Evaluate one checkpoint: perplexity under a named contract and/or lm-eval tasks; writes one JSON result."
    )
    parser.add_argument("model", help="checkpoint dir, GGUF file, Hub id or bundled name (smollm2-135m, gemma3-270m)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside MODEL (dequantized on load)")
    parser.add_argument("--revision", default=None, help="Hub revision")
    add_device_args(parser)
    ppl = parser.add_argument_group("perplexity")
    ppl.add_argument("--text", default=None,
                     help="UTF-8 text file (e.g. WikiText-2 wiki.test.raw) or 'embedded'; default 'embedded' unless "
                          "--tasks is given alone")
    ppl.add_argument("--contract", default="matched", choices=CONTRACT_CHOICES,
                     help="matched: 5,000 words, window 512, stride 256; full: all text, window 2048; rolling: "
                          "lm-eval's loglikelihood_rolling windowing")
    ppl.add_argument("--window", type=int, default=None, help="override the contract's window (tokens)")
    ppl.add_argument("--stride", type=int, default=None, help="override the contract's stride (tokens; not with rolling)")
    ppl.add_argument("--max-words", type=int, default=None, help="override the contract's word limit (not with rolling)")
    ppl.add_argument("--bootstrap", type=int, default=1000, help="window resamples for the 95%% CI (0 = none)")
    ppl.add_argument("--batch-size", type=int, default=2, help="windows (or lm-eval requests) per forward pass")
    ppl.add_argument("--add-bos", default=None, action=argparse.BooleanOptionalAction,
                     help="force BOS on/off (default: the tokenizer's own choice)")
    tasks = parser.add_argument_group("lm-eval tasks (the lm-eval extra)")
    tasks.add_argument("--tasks", nargs="+", default=None, help="lm-eval task names")
    tasks.add_argument("--include-path", nargs="+", default=None,
                       help="folders of task YAML files (lm-eval's built-in index is then not scanned)")
    tasks.add_argument("--num-fewshot", type=int, default=0, help="few-shot examples per prompt")
    tasks.add_argument("--limit", type=task_limit, default=None, help="documents per task (int) or fraction (0, 1)")
    tasks.add_argument("--max-length", type=int, default=None, help="lm-eval context length (default: the model's)")
    parser.add_argument("--output", "-o", default="layerswap_eval.json",
                        help="result JSON path (an existing file only with --overwrite)")
    add_overwrite_arg(parser)
    return parser


def _check_args(args) -> None:
    """Everything that can be refused before the model loads."""
    output = Path(args.output)
    if output.is_dir():
        raise FileExistsError(f"--output {args.output} is a folder; give the result's file path, e.g. {output / 'eval.json'}")
    if args.text not in (None, "embedded"):
        read_text_file(args.text, "--text")
    if args.contract == "rolling" and (args.stride is not None or args.max_words is not None):
        raise ValueError("--contract rolling takes --window (lm-eval's max_length) only, not --stride/--max-words")
    if args.num_fewshot < 0:
        raise ValueError(f"--num-fewshot {args.num_fewshot}: must be >= 0")
    for path in args.include_path or []:
        if not Path(path).is_dir():
            raise FileNotFoundError(f"--include-path {path!r} is not a folder of task YAML files")
    if args.tasks:
        require("lm_eval", "--tasks (lm-evaluation-harness)")
    check_devices(args)
    check_paths(model=args.model, revision=args.revision, gguf_file=args.gguf_file,
                outputs=[("--output", args.output, "file")], reads=input_paths(args), overwrite=args.overwrite)


def run_eval(args: argparse.Namespace) -> int:
    """The ``eval`` verb: load, evaluate, write ``args.output``, print a summary."""
    _check_args(args)
    text = args.text if args.text is not None or args.tasks else "embedded"
    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, revision=args.revision, **device_options(args))
    identity = {k: v for k, v in model_identity(model).items() if k != "path"}  # no local paths in results
    result = {"model": {**identity, "num_blocks": num_blocks(model)}, "perplexity": None, "tasks": None}
    if text is not None:
        ppl = evaluate_perplexity(
            model, None if text == "embedded" else text, tokenizer=tokenizer, contract=args.contract,
            window=args.window, stride=args.stride, max_words=args.max_words, bootstrap=args.bootstrap,
            batch_size=args.batch_size, add_bos=args.add_bos,
        )
        result["perplexity"] = ppl.to_dict()
        print(f"perplexity {ppl.ppl:.4f} (95% CI {ppl.ci_text()}): {ppl.tokens} tokens in {ppl.windows} windows, "
              f"contract {args.contract}")
    if args.tasks:
        tasks = evaluate_tasks(
            model, args.tasks, tokenizer=tokenizer, num_fewshot=args.num_fewshot, limit=args.limit,
            include_path=args.include_path, batch_size=args.batch_size, max_length=args.max_length,
            add_bos_token=args.add_bos,
        )
        result["tasks"] = tasks.to_dict()
        for task, metrics in tasks.results.items():
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if v is not None and not k.endswith("_stderr"))
            print(f"{task}: {shown} ({tasks.n_samples[task]} documents)")
    write_json_atomic(encode_tree(result), args.output, overwrite=args.overwrite)
    print(f"result written to {args.output}")
    return 0
