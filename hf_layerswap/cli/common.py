"""What several ``hf-layerswap`` verbs share: argument types (a bad value exits 2 with an
``error:`` line), the model and calibration options, and the checks and loading that run
before a model is touched."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from accelerate.utils import convert_file_size_to_int

from ..calibration import read_text_file
from ..hub import save_for_hub
from ..models import DTYPES, load_model

__all__ = [
    "HELP_FORMATTER",
    "add_calibration_args",
    "add_device_args",
    "add_model_args",
    "calibration_source",
    "check_output",
    "check_text_files",
    "count",
    "count_or_auto",
    "device_options",
    "fraction",
    "load",
    "max_memory_map",
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
    """MODEL (unless ``positional=False``), --gguf-file, --revision, --tokenizer and
    :func:`add_device_args`."""
    if positional:
        p.add_argument("model", help="local checkpoint dir, GGUF file, Hub id, or a bundled name (smollm2-135m, gemma3-270m)")
    p.add_argument("--gguf-file", default=None, help="GGUF file name inside MODEL (dequantized on load)")
    p.add_argument("--revision", default=None, help="Hub revision")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or Hub id, for a checkpoint that has none (default: the model's own)")
    add_device_args(p)


def max_memory_map(text) -> dict:
    """argparse ``type=`` of --max-memory: accelerate's per-device limits, ``0=20GiB,cpu=60GiB``
    -> ``{0: "20GiB", "cpu": "60GiB"}`` (a GPU index becomes an int; each size is checked
    with accelerate's own parser)."""
    limits: dict = {}
    for item in str(text).split(","):
        device, sep, size = (part.strip() for part in item.partition("="))
        if not sep or not device or not size:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected DEVICE=SIZE pairs separated by commas, e.g. 0=20GiB,cpu=60GiB")
        try:
            if not size.isdigit():  # bytes as a plain int, else a size with its unit
                convert_file_size_to_int(size)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: size {size!r} of {device!r} is not a size; expected e.g. 20GiB, 500MB or bytes") from None
        limits[int(device) if device.isdigit() else device] = int(size) if size.isdigit() else size
    return limits


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--dtype, --device-map and --max-memory (what :func:`~hf_layerswap.models.load_model` takes)."""
    p.add_argument("--dtype", choices=list(DTYPES), default="auto",
                   help="parameter dtype; 'auto' = the checkpoint's own (GGUF input: fp32, its dequantized values)")
    p.add_argument("--device-map", default="auto",
                   help="accelerate device map ('auto', 'cpu', 'cuda:0', 'balanced', 'sequential'); 'auto' "
                        "spreads the model over the accelerators when one is present (and over --max-memory), "
                        "else keeps it in CPU memory")
    p.add_argument("--max-memory", type=max_memory_map, default=None,
                   help="per-device memory for the device map, accelerate's format: 0=20GiB,cpu=60GiB")


def device_options(args) -> dict:
    """``dtype``, ``device_map`` and ``max_memory`` of :func:`add_device_args` for ``load_model``."""
    return {"dtype": getattr(args, "dtype", "auto"), "device_map": getattr(args, "device_map", "auto"),
            "max_memory": getattr(args, "max_memory", None)}


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
    return load_model(name, gguf_file=args.gguf_file, revision=args.revision, tokenizer=getattr(args, "tokenizer", None),
                      **device_options(args))


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
