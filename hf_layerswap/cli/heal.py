"""The ``hf-layerswap heal`` verb: distil a pruned checkpoint from its dense base
(:func:`hf_layerswap.healing.heal`) and save a plain transformers checkpoint with its card;
and the healing options that ``prune --heal`` shares, built from
:class:`~hf_layerswap.HealConfig`'s fields (their ``help`` metadata is the one source of
the texts)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Any
from dataclasses import MISSING, fields
from pathlib import Path

from ..config import HealConfig
from ..card.format import REPORT_FILE
from ..healing import HEAL_METHODS, heal
from ..healing.teacher import check_in_memory
from ..models import load_model
from ..layerplan import num_blocks
from ..scoring.report import SwapReport
from .eval import task_limit
from .options import (
    HELP_FORMATTER,
    add_model_args,
    calibration_source,
    check_before_loading,
    check_paths,
    count,
    device_options,
    load,
    save_pruned,
)

__all__ = ["add_heal_args", "add_parser", "checkpoint_folder", "heal_config", "method_options_help", "run_heal"]

#: HealConfig fields whose default is ``None``: their argparse type.
_NONE_TYPES = {"teacher_top_k": count(1), "patience": count(1), "calibration": str, "eval_tasks_path": str,
               "eval_tasks_limit": task_limit, "max_tokens": count(1)}
#: HealConfig fields with a flag other than their name, and their argparse keywords.
_SPECIAL: dict[str, tuple[str, dict[str, Any]]] = {"perplexity_text": ("perplexity", dict(nargs="?", const="embedded", metavar="TEXT")),
            "eval_tasks": ("eval-tasks", dict(nargs="+", metavar="TASK"))}
#: The least value of HealConfig's int fields on the command line.
_INT_MINIMUM = {"seq_len": 2, "seed": -(2**63)}


def _option_value(text: str):
    """``KEY=VALUE`` of ``--option``: the value as an int, float or string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. lora_r=8 or k=3")
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def _finite(text):
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def method_options_help() -> str:
    """Each registered healing method's options, from its typed options (its entry's
    ``option_class``): the end of ``--heal-option``'s help."""
    return "".join(f"; {name}: {cls.option_class.describe()}" for name, cls in sorted(HEAL_METHODS.items()))


def add_heal_args(p: argparse.ArgumentParser, *, prefix: str = "") -> None:
    """One option per :class:`~hf_layerswap.HealConfig` field, ``--{prefix}{field}`` (``prefix``
    ``"heal-"`` on ``prune``, whose ``--heal [METHOD]`` names the method), its help the
    field's metadata; ``options`` becomes ``--{prefix}option KEY=VALUE`` (repeatable), a bool
    field a pair ``--{prefix}{field}`` / ``--no-{prefix}{field}``."""
    for f in fields(HealConfig):
        if prefix and f.name == "method":
            continue
        flag = "--" + prefix + f.name.replace("_", "-")
        text = f.metadata["help"]
        if f.name == "options":
            p.add_argument("--" + prefix + "option", dest=prefix.replace("-", "_") + "options", action="append",
                           type=_option_value, default=None, metavar="KEY=VALUE", help=text + method_options_help())
        elif f.name == "method":
            p.add_argument(flag, default=f.default, choices=sorted(HEAL_METHODS), help=text)
        elif isinstance(f.default, bool):  # --packing / --no-packing
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=text,
                           dest=(prefix + f.name).replace("-", "_"))
        elif f.name in _SPECIAL:
            name, keywords = _SPECIAL[f.name]
            p.add_argument("--" + prefix + name, default=None, help=text, dest=(prefix + f.name).replace("-", "_"),
                           **keywords)
        else:
            default = None if f.default is MISSING else f.default
            kind = _NONE_TYPES.get(f.name) or (count(_INT_MINIMUM.get(f.name, 1)) if isinstance(default, int) else _finite)
            if f.name == "seed":
                kind = int
            p.add_argument(flag, type=kind, default=default, help=text, dest=(prefix + f.name).replace("-", "_"))


def heal_config(args, *, prefix: str = "", method: str | None = None) -> HealConfig:
    """The :class:`~hf_layerswap.HealConfig` of the options :func:`add_heal_args` added.

    Raises:
        ValueError: a bad value (the message names the field and what is allowed).
    """
    dest = prefix.replace("-", "_")
    values = {f.name: getattr(args, dest + f.name) for f in fields(HealConfig)
              if f.name not in ("method", "options") or (f.name == "method" and not prefix)}
    if prefix:
        values["method"] = method
    values["options"] = dict(getattr(args, dest + "options") or [])
    return HealConfig(**values)


def add_parser(subparsers):
    """Register the ``heal`` verb on ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    p = subparsers.add_parser("heal", formatter_class=HELP_FORMATTER,
                              help="distil a pruned checkpoint from its dense base and save a plain transformers "
                                   "checkpoint")
    p.add_argument("pruned", help="the pruned checkpoint folder (read only; never written)")
    p.add_argument("base", help="the dense base model it was pruned from: a folder, Hub id or bundled name")
    p.add_argument("output", help="directory for the healed checkpoint (a new or empty folder, not PRUNED)")
    add_model_args(p, positional=False)
    add_heal_args(p)
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="folder of the Trainer checkpoints (default: OUTPUT.heal-checkpoints next to OUTPUT, removed "
                        "after a successful save); the same command after an interruption continues from the last one")
    p.add_argument("--allow-foreign-teacher", action="store_true",
                   help="accept a BASE whose weights are not those PRUNED was cut from (its fingerprint differs from "
                        "the one config.layerswap recorded before the cut; refused by default): the report and the "
                        "card then name it as another teacher, never as the model PRUNED was cut from")
    p.set_defaults(func=run_heal)
    return p


def checkpoint_folder(output) -> Path:
    """The default Trainer checkpoint folder of ``heal OUTPUT``: ``OUTPUT.heal-checkpoints``
    next to it (a plain name: the cleaner of interrupted saves leaves it alone)."""
    output = Path(output)
    return output.with_name(output.name + ".heal-checkpoints")


def _check_distinct(args) -> None:
    pruned, output = Path(args.pruned).expanduser().resolve(), Path(args.output).expanduser().resolve()
    if pruned == output or pruned in output.parents:
        raise ValueError(f"OUTPUT {args.output} is PRUNED {args.pruned} or inside it: healing never writes into "
                         "its input; choose a new folder")
    if Path(args.base).expanduser().resolve() == output:
        raise ValueError(f"OUTPUT {args.output} is BASE: choose a new folder")
    if args.resume is not None:
        resume = Path(args.resume).expanduser().resolve()
        base = Path(args.base).expanduser()
        folders = [("PRUNED", pruned), ("OUTPUT", output)] + ([("BASE", base.resolve())] if base.is_dir() else [])
        for name, path in folders:
            if resume == path or path in resume.parents:
                raise ValueError(f"--resume {args.resume} is {name} {path} or inside it: the Trainer checkpoints "
                                 "need a folder of their own; choose another (default: OUTPUT.heal-checkpoints)")


def run_heal(args) -> int:
    """The ``heal`` verb: every path and option checked, then load both models, heal, save."""
    config = heal_config(args)
    _check_distinct(args)
    default_resume = args.resume is None
    args.resume = os.fspath(checkpoint_folder(args.output)) if default_resume else args.resume
    args.model = args.pruned
    args.calibration = config.calibration or "embedded"  # what check_text_files reads
    if not Path(args.pruned).is_dir():
        raise FileNotFoundError(f"PRUNED {args.pruned!r} is not a folder; give the pruned checkpoint folder")
    check_before_loading(args, outputs=[("OUTPUT", args.output, "new folder"), ("--resume", args.resume, "folder")])
    check_paths(model=args.base)
    model, tokenizer = load(args)
    check_in_memory(model)  # before the teacher loads
    record = getattr(model.config, "layerswap", None) or {}
    if not record.get("removed_layers"):
        raise ValueError(f"PRUNED {args.pruned!r} records no removed blocks (config.layerswap): prune it first")
    teacher, teacher_tokenizer = load_model(args.base, **device_options(args))
    original = record.get("original_num_hidden_layers")
    if original != num_blocks(teacher):
        raise ValueError(f"BASE {args.base!r} has {num_blocks(teacher)} blocks but PRUNED was cut "
                         f"from a model of {original}: give the model PRUNED was pruned from")
    if tokenizer is None:  # a pruned folder saved without its tokenizer: the base's reads the same ids
        if teacher_tokenizer is None:
            raise ValueError(f"neither PRUNED {args.pruned!r} nor BASE {args.base!r} has a tokenizer: pass --tokenizer "
                             "with a tokenizer folder or Hub id")
        tokenizer = teacher_tokenizer
        print(f"note: PRUNED {args.pruned!r} has no tokenizer: using BASE's, also saved into OUTPUT", file=sys.stderr)
    report = heal(model, teacher, calibration_source(args.calibration), tokenizer=tokenizer,
                  teacher_tokenizer=teacher_tokenizer, checkpoint_dir=args.resume, progress=True,
                  allow_foreign_teacher=args.allow_foreign_teacher, **config.heal_kwargs())
    del teacher
    sidecar = Path(args.pruned) / REPORT_FILE
    swap_report = SwapReport.from_json(sidecar) if sidecar.is_file() else None
    out = save_pruned(model, tokenizer, swap_report, Path(args.output))
    if default_resume:
        shutil.rmtree(args.resume, ignore_errors=True)
    verdict = "kept the starting weights (no held-out improvement)" if report.reverted else "healed"
    print(f"{verdict}: held-out KL {report.kl_before:.4f} -> {report.kl_after:.4f} nats after {report.tokens:,} tokens "
          f"({report.steps} steps); checkpoint written to {out}")
    return 0
