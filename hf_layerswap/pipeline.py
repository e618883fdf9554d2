"""The one pruning pipeline: calibration, then the config's steps in their order.

:func:`prune` is the only path that turns a :class:`~hf_layerswap.LayerSwapConfig` into a
pruned model. ``from_pretrained(..., quantization_config=LayerSwapConfig(...))`` (the
quantizer plugin), :func:`~hf_layerswap.prune_loaded_model`, ``hf-layerswap prune`` and the
final cut of ``hf-layerswap demo`` all call it, so the same cut gets the same
``config.json`` record and the same model card whichever entry point made it.

It is one loop over :func:`~hf_layerswap.steps.recipe_steps` (:mod:`hf_layerswap.steps`):
every step checked against the model before any work, the calibration built once when a
step reads it (:func:`~hf_layerswap.calibration.build_calibration`; skipped when a
:class:`~hf_layerswap.calibration.CalibrationSet` is passed), then each step applied in
order:

1. score: :func:`~hf_layerswap.scoring.score_layers` (a given ``report=`` is used instead;
   no scoring for explicit blocks); the protocols the strategy reads
   (:meth:`~hf_layerswap.LayerSwapConfig.scored_protocols`: only the configured protocol for
   the paper's greedy rule on one protocol, none for a strategy guided by no protocol such
   as ``sleb``, both otherwise), or the config's ``score_protocols``;
2. select: :func:`~hf_layerswap.selection.select_layers` with the config's strategy;
3. remove: :func:`~hf_layerswap.surgery.remove_layers` (or, with a repair right after it,
   :func:`~hf_layerswap.recovery.recover`); the step's
   :class:`~hf_layerswap.scoring.report.PruneProvenance` is written into
   ``model.config.layerswap["steps"][-1]`` once;
4. the steps after the removal, in the order of
   :meth:`~hf_layerswap.LayerSwapConfig.after_removal` (the config's ``recipe``, or
   repair -> heal -> sparsify from the ``recovery``/``heal``/``sparsity`` fields): a heal
   distils the pruned model from a copy of the dense model taken just before the removal
   (one extra copy of the dense weights in memory until the last heal ends), keeping the
   zeros of a model sparsified before it.

The steps that ran are appended, in their order, to ``config.layerswap["recipe"]`` (the
card lists them). Healing is a step of the config rather than a separate call so that
``from_pretrained(path, quantization_config=LayerSwapConfig(num_to_remove=2, heal="lora"))``
returns the finished model in one call: the dense teacher is exactly the model being
loaded, which only this pipeline still holds before the cut.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import nn

from .calibration import CalibrationSet, build_calibration
from .config import LayerSwapConfig
from .cost.steps import ModelShape, recovery_phase, sparsity_phase
from .healing import HealReport
from .recovery import RecoveryReport
from .scoring.report import PruneProvenance, SwapReport
from .scoring.settings import MemoryBudgetWarning, resolve_memory
from .sparsity import SparsityReport
from .steps import HealStep, Run, recipe_steps, tokenizer_for
from .utils.devices import input_device

__all__ = ["PruneResult", "prune"]


@dataclass
class PruneResult:
    """What :func:`prune` did.

    Attributes:
        model: the pruned model (the object passed in, modified in place).
        removed: 0-based indices removed in this step, numbered as the blocks of the model
            passed in (``[]`` when the config only scores or sparsifies).
        report: the :class:`SwapReport` the set was chosen from (``None`` when nothing was
            scored: explicit blocks, or a strategy that reads no swap-KL score without
            ``score_protocols``, both without a given report); also on ``model.layerswap_report``.
        calibration: the prompts used (``None`` when no step needed text).
        provenance: the record written into the removal step (``None`` when nothing was
            removed).
        recovery_report: the repair's report when ``recovery`` was configured.
        sparsity_report: the sparsification's report when ``sparsity`` was configured.
        heal_report: the last healing's report when a heal step ran (also on
            ``model.layerswap_heal_report``).
        heal_reports: every heal step's report, in the order they ran (a recipe may heal
            more than once).
    """

    model: nn.Module
    removed: list[int]
    report: SwapReport | None = None
    calibration: CalibrationSet | None = None
    provenance: PruneProvenance | None = None
    recovery_report: RecoveryReport | None = None
    sparsity_report: SparsityReport | None = None
    heal_report: HealReport | None = None
    heal_reports: list[HealReport] = field(default_factory=list)


def prune(
    model: nn.Module,
    config: LayerSwapConfig | Mapping | None = None,
    *,
    tokenizer=None,
    report: SwapReport | None = None,
    calibration=None,
    checkpoint_path: str | os.PathLike | None = None,
    max_memory: int | str | None = None,
    heal_checkpoint_dir: str | os.PathLike | None = None,
) -> PruneResult:
    """Score, select and remove blocks of ``model``, then run the steps after the removal
    (repair, heal, sparsify: ``config.recipe`` in its order, else in that order) as ``config`` says.

    Args:
        model: a loaded transformers causal LM; modified in place.
        config: a :class:`~hf_layerswap.LayerSwapConfig`, or a dict of its fields
            (:meth:`~hf_layerswap.LayerSwapConfig.from_dict`); ``None`` = the defaults
            (score only).
        tokenizer: tokenizer for text calibration; default ``config.tokenizer``, else
            loaded from the model's ``name_or_path``.
        report: a precomputed :class:`SwapReport` of this model (nothing is scored again);
            it must carry the protocols the strategy reads. The selection record is
            appended to its ``selections``.
        calibration: precomputed prompts (a :class:`CalibrationSet`, used as is) or any
            source :func:`~hf_layerswap.calibration.build_calibration` accepts; default
            ``config.calibration``. Pass the prompts ``report`` was scored on.
        checkpoint_path: a folder that makes the scoring resumable
            (:func:`~hf_layerswap.score_layers`' ``checkpoint_path``): completed probes are
            kept there, and the same call after an interruption continues where it
            stopped. Only the scoring is resumed; what follows it (the selection search,
            the repair) runs again.
        max_memory: the one working-memory budget beyond the weights (bytes, ``"2GiB"``,
            ``None``/``"auto"``: from the device's free memory) for every step; a step that cannot
            keep within it warns ``MemoryBudgetWarning`` first (:func:`_warn_step_memory`).
        heal_checkpoint_dir: a folder that makes the healing resumable (``checkpoint_dir``
            of :func:`~hf_layerswap.heal`); needs a heal step. A recipe's second and later
            heal steps keep theirs in its subfolders ``heal-2``, ``heal-3``, ...

    Returns:
        A :class:`PruneResult`.

    Raises:
        ValueError: an impossible budget or contradictory ``layers``/``protect`` (before
            any scoring), a healing perplexity text or lm-eval task that healing would refuse
            (before any scoring too; FileNotFoundError for a missing text), a ``report`` of another model or without the protocol the
            strategy reads, ``checkpoint_path`` when nothing is scored, a text calibration
            without a tokenizer to read it (the message says to pass ``tokenizer=``), and
            the errors of the steps (see
            :func:`~hf_layerswap.score_layers`, :func:`~hf_layerswap.select_layers`,
            :func:`~hf_layerswap.remove_layers`).
        TypeError: ``config`` or ``report`` of the wrong type.
    """
    cfg = _as_config(config)
    steps = recipe_steps(cfg)
    if heal_checkpoint_dir is not None and not any(isinstance(step, HealStep) for step in steps):
        raise ValueError(f"heal_checkpoint_dir={os.fspath(heal_checkpoint_dir)!r} resumes healing, but the config "
                         "heals nothing: set heal= or drop heal_checkpoint_dir")
    run = Run(model=model, cfg=cfg, tokenizer=tokenizer, report=report, checkpoint_path=checkpoint_path,
              heal_checkpoint_dir=heal_checkpoint_dir, source=cfg.calibration if calibration is None else calibration)
    for step in steps:  # everything that can be refused before a forward pass
        step.check(model)
    for step in steps:
        step.check_loaded(run)
    if checkpoint_path is not None and (cfg.layers is not None or report is not None or not cfg.scored_protocols()):
        given = ("explicit layers" if cfg.layers is not None else "a report" if report is not None else
                 f"strategy={cfg.strategy!r}, which reads no swap-KL score (score_protocols not set),")
        raise ValueError(f"checkpoint_path={os.fspath(checkpoint_path)!r} resumes scoring, but with {given} nothing "
                         "is scored: drop checkpoint_path")
    run.budget = resolve_memory(max_memory, model)  # one budget for every step; a bad value before any work
    if any(step.needs_calibration(run) for step in steps) or isinstance(run.source, CalibrationSet):
        run.calibration = _calibration(model, cfg, run.source, tokenizer)
    for step in steps:  # before the scoring: what a later step cannot slice to the budget warns
        view = step.memory_view()
        if view is not None:
            _warn_step_memory(model, view, run.calibration, run.budget.bytes)
    ran = []
    for step in steps:
        record = step.apply(run)
        if record is not None:
            ran.append({"step": step.kind, **record})
    _record_recipe(model, ran)
    return PruneResult(model=model, removed=run.removed, report=run.report, calibration=run.calibration,
                       provenance=run.provenance, recovery_report=run.recovery_report,
                       sparsity_report=run.sparsity_report, heal_report=run.heal_report,
                       heal_reports=run.heal_reports)


def _record_recipe(model, ran: list[dict]) -> None:
    """Append the steps that ran, in their order, to ``config.layerswap["recipe"]`` (each with
    the removal step it belongs to); nothing when nothing was removed."""
    record = getattr(model.config, "layerswap", None)
    if not record or not any(entry["step"] == "remove" for entry in ran):
        return
    step = len(record.get("steps") or []) - 1
    model.config.layerswap = {**record, "recipe": list(record.get("recipe") or [])
                              + [{**entry, "removal_step": step} for entry in ran]}


def _as_config(config) -> LayerSwapConfig:
    if config is None:
        return LayerSwapConfig()
    if isinstance(config, LayerSwapConfig):
        return config
    if isinstance(config, Mapping):
        return LayerSwapConfig.from_dict(config)
    raise TypeError(f"config must be a LayerSwapConfig or a dict of its fields, got {type(config).__name__}")


def _calibration(model, cfg: LayerSwapConfig, source, tokenizer) -> CalibrationSet:
    if isinstance(source, CalibrationSet):
        return source
    if not isinstance(source, Mapping):  # text sources need a tokenizer
        tokenizer = tokenizer_for(model, tokenizer if tokenizer is not None else cfg.tokenizer)
    return build_calibration(source, tokenizer, num_prompts=cfg.num_prompts, seq_len=cfg.seq_len, seed=cfg.seed)


def _warn_step_memory(model: nn.Module, cfg: LayerSwapConfig, calib: CalibrationSet | None, budget: int) -> None:
    """Warn :class:`~hf_layerswap.scoring.settings.MemoryBudgetWarning`, before any work of
    :func:`~hf_layerswap.prune`, for each later step whose working memory beyond the weights
    exceeds the one ``budget`` (bytes) in what it cannot slice: the repair's fit as it will
    run under the budget (:func:`~hf_layerswap.cost.steps.recovery_phase`; blocks not chosen yet: the deepest cuts),
    the sparsification's cached block inputs and outputs (:func:`~hf_layerswap.cost.steps.sparsity_phase`), healing's
    dense teacher (its optimizer state and activations come on top: ``estimate_cost``'s
    healing phase). Each message names the step, its need and the budget."""
    shape = ModelShape(model)
    removed = len(cfg.layers) if cfg.layers is not None else int(cfg.num_to_remove or 0)
    needs = []
    if cfg.recovery is not None and calib is not None and removed:
        accelerator = input_device(model).type != "cpu"
        phase = recovery_phase(shape, calib, cfg, 0, budget, accelerator)
        if not phase["within_budget"]:
            needs.append((f"the {cfg.recovery.method} repair's fit (float64 moments and a "
                          f"{phase['batch_size']}-prompt batch's captures)", phase["working_bytes"]))
    if cfg.sparsity is not None and calib is not None:
        phase = sparsity_phase(shape, calib, cfg, removed)
        needs.append(("the sparsification (every calibration batch's block inputs and outputs, per-linear "
                      "statistics)", phase["working_bytes"]))
    if cfg.heal is not None:
        needs.append(("healing (the dense teacher beside the student; its optimizer state and activations come "
                      "on top, see estimate_cost)", shape.weight_bytes))
    for what, need in needs:
        if need > budget:
            warnings.warn(MemoryBudgetWarning(
                f"{what} needs {need / 2**20:,.1f} MiB beyond the weights, more than max_memory="
                f"{budget / 2**20:,.1f} MiB, and does not slice it: raise max_memory, or expect that much more"),
                stacklevel=3)
