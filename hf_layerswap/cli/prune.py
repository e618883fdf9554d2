"""The ``hf-layerswap prune`` verb: remove layers (scored or explicit) through
:func:`hf_layerswap.pipeline.prune` and save a plain transformers checkpoint with its card."""

from __future__ import annotations

import argparse
import shlex
import shutil
import sys
import warnings
from pathlib import Path

import torch
from accelerate import infer_auto_device_map

from ..calibration import CalibrationShortfallWarning
from ..config import RECIPE_STEPS, HealConfig, LayerSwapConfig, RecoveryConfig, SparsityConfig
from ..cost import estimate_cost
from ..cost.estimate import meta_model
from ..utils.devices import input_device
from ..layerplan import decoder_blocks
from ..models import DEVICE_MAP_STRATEGIES, resolve_placement
from ..pipeline import prune
from ..scoring.report import SwapReport
from ..scoring.processes import is_main_process
from ..selection.registry import strategies_taking, strategy_entry
from ..healing import HEAL_METHODS
from ..healing.distill import RUN_FILE
from .heal import add_heal_args, checkpoint_folder, heal_config
from .options import (
    HELP_FORMATTER,
    add_calibration_args,
    add_config_options,
    add_model_args,
    add_resume_arg,
    add_scoring_memory_arg,
    calibration_source,
    check_before_loading,
    check_devices,
    check_output,
    check_paths,
    check_text_files,
    config_help,
    fraction,
    load,
    prompt_count,
    save_pruned,
)

__all__ = ["add_parser", "prune_config", "recipe_kinds", "run_prune"]


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
                           "recovery", "sparsity", "allocation", "pruner", "sparsity_pattern", "score_protocols"],
                       types={"sparsity": fraction}, options={"protect": {"nargs": "*"}, "score_protocols": {"nargs": "+"}})
    p.add_argument("--strategy-option", action="append", default=None, metavar="KEY=VALUE", dest="strategy_option",
                   help="one of the strategy's own options, e.g. width=4 for beam, max_rounds=2 for search "
                        "(repeatable; the value read as the option's type; the docs' method options list them); "
                        "LayerSwapConfig(strategy_options=...)")
    p.add_argument("--heal", nargs="?", const="lora", default=None, choices=sorted(HEAL_METHODS), metavar="METHOD",
                   help=config_help("heal") + f"; METHOD one of {sorted(HEAL_METHODS)}, lora without a value")
    add_heal_args(p, prefix="heal-")
    p.add_argument("--recipe", default=None, metavar="STEPS",
                   help="the steps after the removal, in the order they run, comma-separated from "
                        f"{list(RECIPE_STEPS)}, e.g. heal,sparsify,heal: each repair takes --recovery, each heal "
                        "--heal [METHOD] (lora without it) and the --heal-* options, each sparsify --sparsity and "
                        "its options (default: repair, heal, sparsify as those options are given)")
    add_resume_arg(p)
    p.add_argument("--dry-run", action="store_true",
                   help="print the estimated cost (block/head passes, FLOPs, peak memory, seconds; "
                        "hl.estimate_cost on the meta device, no weight read) and exit without writing anything")
    p.set_defaults(func=run_prune)
    return p


def prune_config(args):
    """The :class:`~hf_layerswap.LayerSwapConfig` of the prune verb's flags (checked here,
    before any model loads).

    Raises:
        ValueError: a bad or contradictory flag value (the message names it).
    """
    takers = strategies_taking("max_evaluations")
    if args.max_evaluations is not None and args.strategy not in takers:
        raise ValueError(f"--max-evaluations applies to --strategy {' or '.join(takers)}, not {args.strategy!r}")
    recipe = recipe_kinds(args.recipe) if getattr(args, "recipe", None) is not None else None
    heals = recipe is not None and "heal" in recipe
    heal = heal_config(args, prefix="heal-", method=args.heal or "lora") if args.heal is not None or heals else None
    defaults = vars(_defaults(args))  # the --heal-* values as given, not a HealConfig (no method is chosen)
    if heal is None and any(value != defaults[key] for key, value in vars(args).items() if key.startswith("heal_")):
        raise ValueError("--heal-* options given without --heal: add --heal [METHOD] to heal after the cut")
    if args.sparsity is None:
        given = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in ("allocation", "pruner", "sparsity_pattern")
                 if getattr(args, name) != _parser_default(name)]
        if given:
            raise ValueError(f"{', '.join(given)} given without --sparsity: add --sparsity FRACTION to sparsify after "
                             "the cut")
    after = {"recovery": args.recovery, "sparsity": args.sparsity, "heal": heal}
    sparse = {"allocation": args.allocation, "pruner": args.pruner, "sparsity_pattern": args.sparsity_pattern}
    steps = None
    if recipe is not None:
        steps = _recipe(recipe, args, heal)
        after = dict.fromkeys(after)
        sparse = {}
    return LayerSwapConfig(
        strategy_options=strategy_options(args), score_protocols=args.score_protocols,
        num_to_remove=args.num_to_remove, layers=args.layers, protocol=args.protocol, max_gap=args.max_gap,
        spacing=args.spacing, protect=args.protect, calibration=calibration_source(args.calibration),
        num_prompts=prompt_count(args.num_prompts), seq_len=args.seq_len, batch_size=args.batch_size, seed=args.seed,
        strategy=args.strategy, objective=args.objective, max_evaluations=args.max_evaluations,
        recipe=steps, progress=True, **after, **sparse,
    )


def strategy_options(args) -> dict | None:
    """``--strategy-option KEY=VALUE`` values as the options of the strategy that runs, each
    read as its field's type (:meth:`~hf_layerswap.utils.registry.Options.parse_text`);
    ``None`` when none is given.

    Raises:
        ValueError: an item without ``=``, an option the strategy does not take or a value it
            does not allow (the message names it and what is allowed).
    """
    items = getattr(args, "strategy_option", None)
    if not items:
        return None
    entry = strategy_entry(strategy_entry(args.strategy).strategy_for(args.protocol))
    try:
        return entry.option_class.parse_text(items, owner=f"--strategy {entry.name}")
    except ValueError as err:
        raise ValueError(f"--strategy-option: {err}") from None


def recipe_kinds(value: str) -> list[str]:
    """``--recipe``'s value: comma-separated step kinds of :data:`~hf_layerswap.config.RECIPE_STEPS`.

    Raises:
        ValueError: an empty list or an unknown kind (named, with the allowed ones).
    """
    kinds = [kind.strip() for kind in value.split(",")]
    unknown = [kind for kind in kinds if kind not in RECIPE_STEPS]
    if not value.strip() or unknown:
        raise ValueError(f"--recipe {value!r}: give comma-separated steps from {list(RECIPE_STEPS)}, e.g. "
                         "heal,sparsify,heal" + (f" ({unknown} unknown)" if unknown else ""))
    return kinds


def _recipe(kinds: list[str], args, heal) -> list:
    """The recipe of ``--recipe``: each kind's config from its options; an option no step of
    the recipe reads, or a step whose option is missing, is refused."""
    missing = [flag for kind, flag, value in (("repair", "--recovery", args.recovery),
                                              ("sparsify", "--sparsity", args.sparsity)) if kind in kinds and value is None]
    if missing:
        raise ValueError(f"--recipe {','.join(kinds)} needs {' and '.join(missing)} for its "
                         f"{' and '.join(k for k in ('repair', 'sparsify') if k in kinds)} step")
    unused = [flag for kind, flag, value in (("repair", "--recovery", args.recovery), ("heal", "--heal", args.heal),
                                             ("sparsify", "--sparsity", args.sparsity))
              if kind not in kinds and value is not None]
    if unused:
        raise ValueError(f"{' and '.join(unused)} given but --recipe {','.join(kinds)} has no such step: add it to "
                         "--recipe or drop the option")
    sparsity = None if args.sparsity is None else SparsityConfig(args.sparsity, allocation=args.allocation,
                                                                 pruner=args.pruner, pattern=args.sparsity_pattern)
    made = {"repair": lambda: RecoveryConfig(args.recovery), "heal": lambda: heal, "sparsify": lambda: sparsity}
    return [made[kind]() for kind in kinds]


def _parser_default(name: str):
    """The ``prune`` parser's default of the config option ``name``."""
    parser = argparse.ArgumentParser()
    add_config_options(parser, [name])
    return parser.get_default(name)


def _defaults(args):
    """``args`` with every ``--heal-*`` option at its parser default."""
    parser = argparse.ArgumentParser()
    add_heal_args(parser, prefix="heal-")
    return argparse.Namespace(**{**vars(args), **vars(parser.parse_args([]))})


def run_prune(args) -> int:
    """The ``prune`` verb: every flag checked, then load, :func:`~hf_layerswap.pipeline.prune`, save."""
    config = prune_config(args)
    if args.resume is not None and (args.layers is not None or args.report or not config.scored_protocols()):
        given = ("--layers" if args.layers is not None else "--report" if args.report else
                 f"--strategy {args.strategy}, which reads no swap-KL score (no --score-protocols),")
        raise ValueError(f"--resume resumes scoring, but with {given} nothing is scored: drop --resume")
    _check_resume_outside_output(args)
    if args.dry_run:
        return _dry_run(args, config)
    check_before_loading(args, outputs=[("output", args.output, "new folder"), ("--resume", args.resume, "folder")]
                         + ([("--heal", checkpoint_folder(args.output), "folder")] if _heals(config) else []))
    report = None
    if args.report:
        if not Path(args.report).is_file():
            raise FileNotFoundError(f"--report {args.report!r} is not a file; give a report JSON written by 'score'")
        report = SwapReport.from_json(args.report)
    heal_dir = checkpoint_folder(args.output) if _heals(config) else None
    model, tokenizer = load(args)
    steps_after = bool(config.after_removal())
    if report is None and (args.layers is None or steps_after) and is_main_process():
        with warnings.catch_warnings():  # the run builds the same calibration and warns of a shortfall itself
            warnings.simplefilter("ignore", CalibrationShortfallWarning)
            estimate = estimate_cost(model, config, device=input_device(model), tokenizer=tokenizer,
                                     max_memory=args.scoring_memory)
        print("\n".join(estimate.lines()), flush=True)
    try:
        result = prune(
            model, config, tokenizer=tokenizer, report=report, checkpoint_path=args.resume,
            max_memory=args.scoring_memory, heal_checkpoint_dir=heal_dir,
        )
    except BaseException:
        _resume_hint(args, heal_dir)
        raise
    if not is_main_process():  # under accelerate launch every process scores its share; the first one writes
        return 0
    out = save_pruned(model, tokenizer, result.report, Path(args.output))
    if heal_dir is not None:
        shutil.rmtree(heal_dir, ignore_errors=True)
    print(f"removed layers {result.removed} (0-based); pruned checkpoint written to {out}")
    return 0


def _heals(config: LayerSwapConfig) -> bool:
    return any(isinstance(step, HealConfig) for step in config.after_removal())


def _check_resume_outside_output(args) -> None:
    """``--resume`` keeps the scoring's checkpoint while the run lasts; OUTPUT must be a new
    or empty folder when the pruned checkpoint is saved, so the two cannot be one folder
    (nor the first inside the second): refused before loading, not after the run."""
    if args.resume is None:
        return
    resume, output = Path(args.resume).expanduser().resolve(), Path(args.output).expanduser().resolve()
    if resume == output or output in resume.parents:
        where = "is OUTPUT" if resume == output else f"is inside OUTPUT {str(args.output)!r}"
        raise ValueError(f"--resume {str(args.resume)!r} {where}: the pruned checkpoint is saved into a new or empty "
                         "folder, so the scoring checkpoint needs a folder of its own (e.g. "
                         f"{str(output.with_name(output.name + '.scoring'))!r})")


def _resume_hint(args, heal_dir) -> None:
    """After an interruption or a failure of ``prune --heal`` whose healing had saved
    checkpoints: one line on stderr naming the command that resumes it."""
    if heal_dir is None or not (Path(heal_dir) / RUN_FILE).is_file() or not is_main_process():
        return
    command = shlex.join(getattr(args, "command_line", None) or ["hf-layerswap", "prune", args.model, args.output])
    print(f"\nhealing checkpoints kept in {heal_dir}: run the same command again to resume the healing from the last "
          f"one: {command}", file=sys.stderr)


def _dry_run(args, config) -> int:
    """``--dry-run``: what the real run checks before loading, less what writes (the text
    files, MODEL, ``--tokenizer``, an output folder that exists and is not empty), then
    :func:`~hf_layerswap.cost.estimate_cost` printed."""
    if args.gguf_file is not None:
        raise ValueError(f"--dry-run with --gguf-file {args.gguf_file!r}: the estimate reads a checkpoint's "
                         "config.json; give the (dequantized) checkpoint folder instead")
    if args.report:
        raise ValueError(f"--dry-run with --report {args.report!r}: the estimate plans a prune that scores the "
                         "model; drop --report to estimate that prune")
    check_text_files(args)
    check_devices(args)
    check_paths(model=args.model, revision=args.revision, tokenizer=args.tokenizer)
    check_output(args.output)
    dtype = None if args.dtype == "auto" else args.dtype
    estimate = estimate_cost(args.model, config, device=_compute_device(args.device_map), dtype=dtype,
                             tokenizer=args.tokenizer, max_memory=args.scoring_memory,
                             stream_weights=_offloads_blocks(args, dtype))
    print("\n".join(estimate.lines()))
    return 0


def _offloads_blocks(args, dtype) -> bool | None:
    """Whether the real run's load will offload decoder blocks (so scoring streams them):
    accelerate's own map (``infer_auto_device_map``) of the model built on the meta device,
    within the ``--max-memory`` limits the load takes (:func:`~hf_layerswap.models.resolve_placement`),
    a block on "disk", or on "cpu" beside an accelerator; None (the model as it loads)
    without a limit or an offload folder."""
    device_map, limits, _ = resolve_placement(args.device_map, max_memory=args.max_memory,
                                              offload_folder=args.offload_folder)
    if device_map not in DEVICE_MAP_STRATEGIES or (limits is None and args.offload_folder is None):
        return None
    model = meta_model(args.model, dtype)
    placed = infer_auto_device_map(model, max_memory=limits, no_split_module_classes=model._no_split_modules)
    _, _, blocks = decoder_blocks(model)
    names = {id(m): n for n, m in model.named_modules()}
    devices = {str(d) for name, d in placed.items() for b in blocks  # an entry of the block or of a module holding it
               if not name or f"{names[id(b)]}.".startswith(f"{name}.")}
    accelerators = {str(d) for d in placed.values()} - {"cpu", "disk"}
    return "disk" in devices or ("cpu" in devices and bool(accelerators))


def _compute_device(device_map: str) -> torch.device:
    """Where the real run computes (``input_device`` of the loaded model): the device
    ``--device-map`` names, else (``auto``, ``balanced``, ``sequential``) the first
    accelerator when one is present, else the CPU."""
    try:
        return torch.device(device_map)
    except RuntimeError:  # a placement strategy, not a device
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
