"""What several ``hf-layerswap`` verbs share: argument types (a bad value exits 2 with an
``error:`` line), the model and calibration options, and the checks and loading that run
before a model is touched."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..calibration import read_text_file
from ..hub import save_for_hub
from ..models import load_model
from ..scoring.settings import parse_memory

__all__ = [
    "HELP_FORMATTER",
    "add_calibration_args",
    "add_model_args",
    "calibration_source",
    "check_output",
    "check_text_files",
    "count",
    "count_or_auto",
    "fraction",
    "load",
    "needs_tokenizer",
    "positive_seconds",
    "prompt_count",
    "save_pruned",
]

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, less the appended ``(default: ...)`` where the help
    text already states its default or the default is ``None`` (nothing to show)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or "default" in text:
            return text
        return super()._get_help_string(action)


#: The verbs' help formatter: every option's default shown once.
HELP_FORMATTER = HelpFormatter


def count(minimum: int):
    """argparse ``type=``: an int >= ``minimum`` (a bad value exits 2 with an ``error:`` line)."""

    def parse(text):
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"{text!r} is not an int; expected an int >= {minimum}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an int >= {minimum}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def count_or_auto(text):
    """argparse ``type=`` of the demo's --num-prompts: ``auto`` or an int >= 1."""
    return text if text == "auto" else count(1)(text)


def fraction(text):
    """argparse ``type=``: a float in [0, 1)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected a float in [0, 1)") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a float in [0, 1)")
    return value


def positive_seconds(text):
    """argparse ``type=``: a positive number of seconds."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected seconds > 0") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds > 0")
    return value


def add_model_args(p: argparse.ArgumentParser, *, positional: bool = True) -> None:
    """MODEL (unless ``positional=False``), --gguf-file, --revision and --tokenizer."""
    if positional:
        p.add_argument("model", help="local checkpoint dir, GGUF file, Hub id, or a bundled name (smollm2-135m, gemma3-270m)")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside MODEL (dequantized on load)")
    p.add_argument("--revision", default=None, help="Hub revision")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or Hub id, for a checkpoint that has none (default: the model's own)")


def add_calibration_args(p: argparse.ArgumentParser, *, num_prompts_default="64") -> None:
    """--calibration, --num-prompts (``"auto"`` as default: also 'auto'), --seq-len, --batch-size, --seed."""
    p.add_argument(
        "--calibration", default="embedded",
        help="calibration text: a text file (e.g. WikiText-2 valid.txt) or 'embedded' (prose shipped with Python)",
    )
    auto = num_prompts_default == "auto"
    p.add_argument(
        "--num-prompts", default=num_prompts_default, type=count_or_auto if auto else count(1),
        help="calibration prompts: an int >= 1" + (", or 'auto' to fit --scoring-seconds" if auto else ""),
    )
    p.add_argument("--seq-len", type=count(2), default=128, help="tokens per prompt (truncation)")
    p.add_argument("--batch-size", type=count(1), default=8, help="prompts per forward pass")
    p.add_argument("--seed", type=int, default=0, help="paragraph shuffle seed")


def scoring_memory(text):
    """argparse ``type=`` of --scoring-memory: ``auto`` or a size such as ``2GiB``."""
    if text == "auto":
        return text
    try:
        parse_memory(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 'auto' or a size of at least 1MiB such as 800MiB or 2GB") from None
    return text


def add_scoring_memory_arg(p: argparse.ArgumentParser) -> None:
    """--scoring-memory: the scoring engine's working-memory budget (``max_memory``)."""
    p.add_argument("--scoring-memory", type=scoring_memory, default="auto",
                   help="working memory of scoring beyond the weights, e.g. 2GiB; auto = a share of the device's "
                        "free memory (at most 1 GiB on a CPU, 8 GiB on an accelerator)")


def prompt_count(value) -> int:
    """--num-prompts as an int (argparse has checked it; a direct caller gets ValueError)."""
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--num-prompts {value!r}: expected an int >= 1") from None
    if n < 1:
        raise ValueError(f"--num-prompts {value!r}: expected an int >= 1")
    return n


def check_text_files(args) -> None:
    """Refuse a --calibration or --eval-text that is missing or not UTF-8 text before the model loads."""
    for flag in ("calibration", "eval_text"):
        value = getattr(args, flag, "embedded")
        if value != "embedded":
            option = "--" + flag.replace("_", "-")
            if not Path(value).is_file():
                raise FileNotFoundError(f"{option} {value!r} is not a file; give a text file or 'embedded'")
            read_text_file(value, option)


def load(args):
    """``(model, tokenizer)`` of ``args.model`` (after :func:`check_text_files`)."""
    check_text_files(args)

    name = getattr(args, "model", None)
    print(f"loading {name} ...", file=sys.stderr, flush=True)
    return load_model(name, gguf_file=args.gguf_file, revision=args.revision, tokenizer=getattr(args, "tokenizer", None))


def calibration_source(value: str):
    """--calibration as a config value: ``embedded`` is the default source (``None``)."""
    return None if value == "embedded" else value


def needs_tokenizer(tokenizer, model_name, what: str) -> None:
    """Refuse a missing tokenizer, naming ``what`` needs it and the --tokenizer fix."""
    if tokenizer is None:
        raise ValueError(f"{what} needs a tokenizer and the checkpoint {model_name!r} has none: "
                         "pass --tokenizer with a tokenizer folder or Hub id")


def check_output(output) -> None:
    """Refuse an output folder that exists and is not empty (before any model loads)."""
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"output {output} exists and is not an empty folder; choose another or remove it")


def save_pruned(model, tokenizer, report, output: Path, evaluation: dict | None = None) -> Path:
    """The checkpoint, tokenizer, card, report sidecar and plots, written atomically."""
    check_output(output)
    return save_for_hub(model, output, tokenizer=tokenizer, report=report, evaluation=evaluation)
