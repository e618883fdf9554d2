"""The one pruning pipeline: calibration -> scores -> selection -> removal -> repair -> sparsity.

:func:`prune` is the only path that turns a :class:`~hf_layerswap.LayerSwapConfig` into a
pruned model. ``from_pretrained(..., quantization_config=LayerSwapConfig(...))`` (the
quantizer plugin), :func:`~hf_layerswap.prune_loaded_model`, ``hf-layerswap prune`` and the
final cut of ``hf-layerswap demo`` all call it, so the same cut gets the same
``config.json`` record and the same model card whichever entry point made it.

Each step is a plain call with typed inputs and outputs:

1. calibration: :func:`~hf_layerswap.calibration.build_calibration` (skipped when a
   :class:`~hf_layerswap.calibration.CalibrationSet` is passed, or when nothing needs text);
2. scores: :func:`~hf_layerswap.scoring.score_layers` (skipped when ``report=`` is passed or
   the blocks are given explicitly); only the configured protocol is scored for the
   paper's greedy rule on one protocol, both otherwise;
3. selection: :func:`~hf_layerswap.selection.select_layers` with the config's strategy;
4. removal: :func:`~hf_layerswap.surgery.remove_layers`, or
   :func:`~hf_layerswap.recovery.recover` when a repair is configured; the step's
   :class:`~hf_layerswap.report.PruneProvenance` is written into
   ``model.config.layerswap["steps"][-1]`` once, here;
5. healing: :func:`~hf_layerswap.healing.heal` when ``config.heal`` is set: the pruned (and
   repaired) model is distilled from a copy of the dense model taken just before the
   removal (one extra copy of the dense weights in memory until healing ends);
6. sparsity: :func:`~hf_layerswap.sparsity.sparsify` when configured (never together with
   healing, see :class:`~hf_layerswap.HealConfig`).

Healing is a field of the config rather than a separate call so that
``from_pretrained(path, quantization_config=LayerSwapConfig(num_to_remove=2, heal="lora"))``
returns the finished model in one call: the dense teacher is exactly the model being
loaded, which only this step still holds before the cut; a separate step after loading
would have to load the base model a second time.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from transformers import AutoTokenizer

from .calibration import CalibrationSet, build_calibration
from .config import LayerSwapConfig, check_against_model, protect_clash
from .healing import HealReport, heal
from .healing.measure import HealMeasures, max_positions
from .healing.teacher import check_in_memory as check_heal_in_memory
from .models import has_tokenizer_files
from .provenance import public_name
from .plan import num_blocks
from .recovery import RecoveryReport, recover
from .report import PruneProvenance, SwapReport
from .scoring import score_layers
from .cost_steps import warn_step_memory
from .scoring.settings import resolve_memory
from .rule import check_budget
from .selection import check_report_matches, select_layers
from .selection.registry import strategy_entry
from .sparsity import SparsityReport, check_in_memory as check_sparsity_in_memory, sparsify
from .surgery import remove_layers

__all__ = ["PruneResult", "prune"]


@dataclass
class PruneResult:
    """What :func:`prune` did.

    Attributes:
        model: the pruned model (the object passed in, modified in place).
        removed: 0-based indices removed in this step, numbered as the blocks of the model
            passed in (``[]`` when the config only scores or sparsifies).
        report: the :class:`SwapReport` the set was chosen from (``None`` for explicit
            blocks without a given report); also on ``model.layerswap_report``.
        calibration: the prompts used (``None`` when no step needed text).
        provenance: the record written into the removal step (``None`` when nothing was
            removed).
        recovery_report: the repair's report when ``recovery`` was configured.
        sparsity_report: the sparsification's report when ``sparsity`` was configured.
        heal_report: the healing's report when ``heal`` was configured (also on
            ``model.layerswap_heal_report``).
    """

    model: nn.Module
    removed: list[int]
    report: SwapReport | None = None
    calibration: CalibrationSet | None = None
    provenance: PruneProvenance | None = None
    recovery_report: RecoveryReport | None = None
    sparsity_report: SparsityReport | None = None
    heal_report: HealReport | None = None


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
    """Score, select, remove, repair and sparsify ``model`` as ``config`` says.

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
            keep within it warns ``MemoryBudgetWarning`` first (:func:`~.cost_steps.warn_step_memory`).
        heal_checkpoint_dir: a folder that makes the healing resumable (``checkpoint_dir``
            of :func:`~hf_layerswap.heal`); needs ``config.heal``.

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
    if heal_checkpoint_dir is not None and cfg.heal is None:
        raise ValueError(f"heal_checkpoint_dir={os.fspath(heal_checkpoint_dir)!r} resumes healing, but the config "
                         "heals nothing: set heal= or drop heal_checkpoint_dir")
    strategy = strategy_entry(cfg.strategy).strategy_for(cfg.protocol)
    entry = strategy_entry(strategy)
    total = num_blocks(model)
    _check_before_work(model, cfg, report, strategy, total)
    _check_heal_measures(model, cfg, tokenizer)
    if checkpoint_path is not None and (cfg.layers is not None or report is not None):
        given = "explicit layers" if cfg.layers is not None else "a report"
        raise ValueError(f"checkpoint_path={os.fspath(checkpoint_path)!r} resumes scoring, but with {given} nothing "
                         "is scored: drop checkpoint_path")
    budget = resolve_memory(max_memory, model)  # one budget for every step; a bad value before any work
    source = cfg.calibration if calibration is None else calibration
    selects = cfg.layers is None and cfg.num_to_remove is not None
    needs_text = (
        (cfg.layers is None and report is None)  # scoring
        or (selects and entry.calibrated())  # the strategy reads the model on the prompts
        or cfg.recovery is not None
        or cfg.sparsity is not None
    )
    calib = _calibration(model, cfg, source, tokenizer) if needs_text or isinstance(source, CalibrationSet) else None
    warn_step_memory(model, cfg, calib, budget.bytes)  # before the scoring: what a later step cannot slice
    if cfg.layers is None and report is None:
        protocols = entry.scores(cfg.protocol)
        report = score_layers(
            model, calib, protocols=protocols, max_gap=min(cfg.max_gap, total - 1), batch_size=cfg.batch_size,
            progress=cfg.progress, seed=cfg.seed, checkpoint_path=checkpoint_path, max_memory=budget,
        )
    if report is not None:
        model.layerswap_report = report
    result = PruneResult(model=model, removed=[], report=report, calibration=calib)
    if cfg.layers is None and cfg.num_to_remove is None:  # score only; a requested sparsity still applies
        return _sparsify(result, cfg)

    if cfg.layers is not None:
        layers = list(cfg.layers)
        provenance = PruneProvenance(selection="explicit layers", config=cfg.to_dict())
    else:
        before = len(report.selections)
        layers = select_layers(
            report, cfg.num_to_remove, protocol=cfg.protocol, spacing=cfg.spacing, protect=cfg.protect,
            model=model, calibration=calib, batch_size=cfg.batch_size, strategy=strategy, max_memory=budget,
            **entry.config_options(cfg),
        )
        decision = report.selections[-1] if len(report.selections) > before else None
        provenance = PruneProvenance(
            selection=entry.rule_text(cfg), protocol=cfg.protocol, strategy=strategy, config=cfg.to_dict(),
            scores=report.summary_dict(), decision=None if decision is None else entry.provenance(decision),
        )
    if calib is not None:
        provenance.calibration = calib.spec()
    result.provenance = provenance
    teacher = copy.deepcopy(model) if cfg.heal is not None else None  # the dense model, before the cut
    if cfg.recovery is not None:
        rec = cfg.recovery
        result.recovery_report = recover(model, layers, calib, method=rec.method, num_tokens=rec.num_tokens,
                                         epsilon=rec.epsilon, batch_size=cfg.batch_size, max_memory=budget)
        model.layerswap_recovery_report = result.recovery_report
        _annotate_last_step(model, provenance.to_dict())
    else:
        remove_layers(model, layers, provenance=provenance.to_dict())
    result.removed = list(model.config.layerswap["steps"][-1]["removed_layers"])
    if teacher is not None:
        result.heal_report = _heal(model, teacher, cfg, source, tokenizer, heal_checkpoint_dir)
        del teacher
    return _sparsify(result, cfg)


def _heal(model, teacher, cfg: LayerSwapConfig, source, tokenizer, checkpoint_dir) -> HealReport:
    """Distil ``model`` from ``teacher`` as ``cfg.heal`` says, on its own calibration text or
    else the removal's source (a text source read with the model's tokenizer); the
    perplexity stages and lm-eval tasks ``cfg.heal`` asks for are measured by :func:`heal`
    (the teacher is the dense model just before the cut, so "after the cut" of a repaired
    model is measured too)."""
    text = cfg.heal.calibration if cfg.heal.calibration is not None else source
    if isinstance(text, CalibrationSet):  # heal draws its own prompts at its own length
        text = cfg.calibration
    measures = cfg.heal.perplexity_text is not None or cfg.heal.eval_tasks is not None
    tok = None
    if measures or not isinstance(text, Mapping):
        tok = _tokenizer_for(model, tokenizer if tokenizer is not None else cfg.tokenizer)
    return heal(model, teacher, text, tokenizer=tok, progress=cfg.progress, checkpoint_dir=checkpoint_dir,
                **cfg.heal.heal_kwargs())


def _as_config(config) -> LayerSwapConfig:
    if config is None:
        return LayerSwapConfig()
    if isinstance(config, LayerSwapConfig):
        return config
    if isinstance(config, Mapping):
        return LayerSwapConfig.from_dict(config)
    raise TypeError(f"config must be a LayerSwapConfig or a dict of its fields, got {type(config).__name__}")


def _check_before_work(model, cfg: LayerSwapConfig, report, strategy: str, total: int) -> None:
    """Everything that can be refused before a forward pass."""
    check_against_model(cfg, model)  # what the architecture cannot run (a fused repair of post-norm blocks)
    if cfg.heal is not None:  # an offloaded model can be scored and cut, not trained or sparsified
        check_heal_in_memory(model)
    if cfg.sparsity is not None:
        check_sparsity_in_memory(model)
    if cfg.layers is None and cfg.num_to_remove is not None:  # an impossible budget costs no scoring
        check_budget(cfg.num_to_remove, total, spacing=cfg.spacing, protect=cfg.protect)
        strategy_entry(strategy).check_config(cfg, total)  # nor what the strategy refuses after the scoring
    if cfg.layers is not None and getattr(cfg, "_protect_given", False):  # -1 and L-1 are one block
        clash = sorted({i % total for i in cfg.layers if -total <= i < total}
                       & {i % total for i in cfg.protect if -total <= i < total})
        if clash:
            raise ValueError(protect_clash(cfg.layers, cfg.protect, clash))
    if report is None:
        return
    if not isinstance(report, SwapReport):
        raise TypeError(f"report must be a SwapReport, got {type(report).__name__}")
    check_report_matches(report, model)
    needed = list(strategy_entry(strategy).reads(cfg.protocol))
    missing = [p for p in needed if p not in report.protocols]
    if cfg.layers is None and cfg.num_to_remove is not None and missing:
        raise ValueError(f"the report scored {list(report.protocols)} but strategy={strategy!r} with "
                         f"protocol={cfg.protocol!r} reads {missing}: score those protocols or choose another strategy")


def _check_heal_measures(model, cfg: LayerSwapConfig, tokenizer) -> None:
    """Healing's perplexity text and lm-eval task names, refused before the scoring rather
    than when healing measures them (:meth:`~hf_layerswap.healing.measure.HealMeasures.check_sources`)."""
    heal = cfg.heal
    if heal is None or (heal.perplexity_text is None and heal.eval_tasks is None):
        return
    tok = _tokenizer_for(model, tokenizer if tokenizer is not None else cfg.tokenizer)
    HealMeasures(heal.perplexity_text, heal.eval_tasks, heal.eval_tasks_path, heal.eval_tasks_limit, tok,
                 positions=max_positions(model)).check_sources()


def _calibration(model, cfg: LayerSwapConfig, source, tokenizer) -> CalibrationSet:
    if isinstance(source, CalibrationSet):
        return source
    if not isinstance(source, Mapping):  # text sources need a tokenizer
        tokenizer = _tokenizer_for(model, tokenizer if tokenizer is not None else cfg.tokenizer)
    return build_calibration(source, tokenizer, num_prompts=cfg.num_prompts, seq_len=cfg.seq_len, seed=cfg.seed)


def _tokenizer_for(model, tokenizer):
    if tokenizer is not None:
        return tokenizer
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", None)
    if not source:
        raise ValueError("text calibration needs a tokenizer and the model has no name_or_path to load one from: "
                         "pass tokenizer= (LayerSwapConfig(tokenizer=...) or prune(..., tokenizer=...)), or "
                         "tokenized calibration (a dict of input_ids and attention_mask)")
    why = None
    if os.path.isdir(source) and not has_tokenizer_files(source):
        why = "it has no tokenizer files"
    else:
        try:
            return AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError, TypeError) as err:
            why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    raise ValueError(
        f"text calibration needs a tokenizer and none could be loaded from the checkpoint {public_name(source)!r} "
        f"({why}): pass tokenizer= (LayerSwapConfig(tokenizer=...) or prune(..., tokenizer=...); --tokenizer on the "
        "command line), or tokenized calibration (a dict of input_ids and attention_mask)"
    )


def _sparsify(result: PruneResult, cfg: LayerSwapConfig) -> PruneResult:
    sp = cfg.sparsity
    if sp is not None and sp.sparsity > 0:  # zero zeroes nothing: no step, nothing recorded
        # sparsify also leaves its report on model.layerswap_sparsity_report
        result.sparsity_report = sparsify(result.model, result.calibration, sparsity=sp.sparsity,
                                          allocation=sp.allocation, pruner=sp.pruner, pattern=sp.pattern)
    return result


def _annotate_last_step(model, provenance: dict) -> None:
    """Add the selection record to the step ``recover`` wrote (its own fields win)."""
    record = getattr(model.config, "layerswap", None)
    if record and record.get("steps"):
        for key, value in provenance.items():
            record["steps"][-1].setdefault(key, value)
