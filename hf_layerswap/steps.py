"""The steps of a prune: score, select, remove, repair, heal, sparsify, each with one life.

:func:`recipe_steps` turns a :class:`~hf_layerswap.LayerSwapConfig` into the ordered list of
:class:`Step` objects a prune runs: scoring and selection (when the blocks are not given),
the removal, then :meth:`~hf_layerswap.LayerSwapConfig.after_removal` (the config's
``recipe``, or ``recovery`` -> ``heal`` -> ``sparsity``). Every step has the same life:

- :meth:`Step.check` against the model's shape (a meta-device model will do), before any work;
  :meth:`Step.check_loaded` what only a loaded model can tell (offloaded weights, a given
  report), also before any work;
- :meth:`Step.needs_calibration`: whether it reads the calibration prompts;
- :meth:`Step.estimate`: its cost phase for :func:`~hf_layerswap.cost.estimate_cost`, planned
  by the per-step code of :mod:`~hf_layerswap.cost.steps` that the plan it is given carries
  (:class:`~hf_layerswap.cost.StepPlan`; or the engine's own plan for the scoring and the
  selection), ``None`` when it costs nothing;
- :meth:`Step.apply`: does it on the shared :class:`Run` and returns its record, the entry
  :func:`~hf_layerswap.prune` appends to ``config.layerswap["recipe"]``;
- its card cell: the record, rendered by its ``kind``'s entry of
  :data:`hf_layerswap.card.steps.STEP_CELLS` (the card is rendered from the saved record, so
  the card layer, above this one, holds the cells).

:func:`~hf_layerswap.prune`, :func:`~hf_layerswap.cost.estimate_cost` and the card each loop
over these steps, so a recipe such as remove -> heal -> sparsify -> heal is run, priced and
listed in its own order.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from torch import nn
from transformers import AutoTokenizer

from .calibration import CalibrationSet
from .config import HealConfig, LayerSwapConfig, RecoveryConfig, SparsityConfig, check_against_model, protect_clash
from .healing import HealReport, heal
from .healing.measure import HealMeasures, max_positions
from .healing.teacher import check_in_memory as check_heal_in_memory
from .models import has_tokenizer_files
from .layerplan import num_blocks
from .utils.provenance import public_name
from .recovery import RecoveryReport, recover
from .scoring.report import PruneProvenance, SwapReport
from .scoring.rule import check_budget
from .scoring import score_layers
from .selection import check_report_matches, select_layers
from .selection.registry import strategy_entry
from .sparsity import SparsityReport, check_in_memory as check_sparsity_in_memory, sparsify
from .sparsity.report import config_record
from .surgery import remove_layers

__all__ = ["HealStep", "RemoveStep", "RepairStep", "Run", "ScoreStep", "SelectStep", "SparsifyStep", "Step",
           "recipe_steps", "tokenizer_for"]


@dataclass
class Run:
    """What the steps of one prune share while they run.

    Attributes:
        model: the model being pruned (in place). cfg: the config.
        tokenizer: the tokenizer given to the prune (``None``: ``cfg.tokenizer`` or the model's own).
        source: the calibration source (the given one, else ``cfg.calibration``).
        report: the scores (given, or set by the score step).
        calibration: the prompts, when a step reads them.
        budget: the working-memory budget (:func:`~hf_layerswap.scoring.settings.resolve_memory`).
        checkpoint_path, heal_checkpoint_dir: the resumable folders of the scoring and healing.
        layers: the blocks to remove (current numbering), set by the select or remove step.
        provenance: the removal step's record. teacher: the dense model before the cut,
            while a heal step is still to run.
        removed, recovery_report, heal_report, heal_reports, sparsity_report: what the
            steps did (for :class:`~hf_layerswap.pipeline.PruneResult`).
    """

    model: nn.Module
    cfg: LayerSwapConfig
    tokenizer: Any = None
    source: Any = None
    report: SwapReport | None = None
    calibration: CalibrationSet | None = None
    budget: Any = None
    checkpoint_path: str | os.PathLike | None = None
    heal_checkpoint_dir: str | os.PathLike | None = None
    layers: list[int] | None = None
    provenance: PruneProvenance | None = None
    teacher: nn.Module | None = None
    removed: list[int] = field(default_factory=list)
    recovery_report: RecoveryReport | None = None
    heal_report: HealReport | None = None
    heal_reports: list[HealReport] = field(default_factory=list)
    sparsity_report: SparsityReport | None = None
    heals_left: int = 0


class Step(Protocol):
    """One step of a prune (see the module's text): ``kind`` names it in the record
    (``"score"``, ``"select"``, ``"remove"``, ``"repair"``, ``"heal"``, ``"sparsify"``),
    ``phase`` in :attr:`~hf_layerswap.cost.CostEstimate.phases`."""

    kind: ClassVar[str]
    phase: ClassVar[str]

    def check(self, model: nn.Module) -> None: ...

    def check_loaded(self, run: Run) -> None: ...

    def needs_calibration(self, run: Run | None) -> bool: ...

    def memory_view(self) -> LayerSwapConfig | None: ...

    def estimate(self, plan) -> dict | None: ...

    def apply(self, run: Run) -> dict | None: ...


class _StepBase:
    """What every step does unless it says otherwise: no check, no prompts, no cost."""

    kind: ClassVar[str] = ""
    phase: ClassVar[str] = ""

    def __init__(self, cfg: LayerSwapConfig, settings=None):
        self.cfg, self.settings = cfg, settings

    def check(self, model: nn.Module) -> None:
        """Refuse, before any work, what the model's shape cannot take (``ValueError``)."""

    def check_loaded(self, run: Run) -> None:
        """Refuse, before any work, what only the loaded model (or a given report) tells."""

    def needs_calibration(self, run: Run | None) -> bool:
        """Whether the step reads the calibration prompts (``run``: ``None`` when estimating)."""
        return False

    def memory_view(self) -> LayerSwapConfig | None:
        """The config as :func:`~hf_layerswap.prune` reads this step to warn, before any work,
        when what it needs beyond the weights and cannot slice exceeds the one budget
        (``None``: the step's memory is the engine's, within the budget by construction)."""
        return None

    def estimate(self, plan) -> dict | None:
        """The step's cost phase (``None``: it costs nothing)."""
        return None

    def apply(self, run: Run) -> dict | None:
        """Do the step on ``run``; its record (``None``: nothing to record)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings!r})" if self.settings is not None else f"{type(self).__name__}()"


def _strategy(cfg: LayerSwapConfig) -> str:
    return strategy_entry(cfg.strategy).strategy_for(cfg.protocol)


class ScoreStep(_StepBase):
    """Swap-KL scores of the pairs (:func:`~hf_layerswap.score_layers`), or a given report."""

    kind, phase = "score", "scoring"

    def protocols(self) -> list[str]:
        """The protocols scored (:meth:`~hf_layerswap.LayerSwapConfig.scored_protocols`:
        ``score_protocols``, else those the strategy reads; none for a strategy that reads no
        swap-KL score)."""
        return self.cfg.scored_protocols()

    def check_loaded(self, run: Run) -> None:
        report, cfg = run.report, self.cfg
        if report is None:
            return
        if not isinstance(report, SwapReport):
            raise TypeError(f"report must be a SwapReport, got {type(report).__name__}")
        check_report_matches(report, run.model)
        strategy = _strategy(cfg)
        missing = [p for p in strategy_entry(strategy).reads(cfg.protocol) if p not in report.protocols]
        if cfg.layers is None and cfg.num_to_remove is not None and missing:
            raise ValueError(f"the report scored {list(report.protocols)} but strategy={strategy!r} with "
                             f"protocol={cfg.protocol!r} reads {missing}: score those protocols or choose another "
                             "strategy")
        asked = [p for p in cfg.score_protocols or () if p not in report.protocols]
        if asked:  # a given report is used as scored: the tables asked for would silently be missing
            raise ValueError(f"the report scored {list(report.protocols)} but score_protocols={cfg.score_protocols!r} "
                             f"asks for {asked}: give a report that scored them, or drop score_protocols")

    def needs_calibration(self, run: Run | None) -> bool:
        return (run is None or run.report is None) and bool(self.protocols())

    def estimate(self, plan) -> dict | None:
        return plan.scoring(self.protocols())

    def apply(self, run: Run) -> dict | None:
        cfg = self.cfg
        if run.report is None and not self.protocols():  # the strategy reads no swap-KL score: none measured
            run.model.layerswap_report = None  # not a report of an earlier prune of this model object
            return {"protocols": [], "pairs": 0,
                    "skipped": f"strategy `{_strategy(cfg)}` reads no swap-KL score"}
        if run.report is None:
            total = num_blocks(run.model)
            run.report = score_layers(
                run.model, run.calibration, protocols=self.protocols(), max_gap=min(cfg.max_gap, total - 1),
                batch_size=cfg.batch_size, progress=cfg.progress, seed=cfg.seed,
                checkpoint_path=run.checkpoint_path, max_memory=run.budget,
            )
        run.model.layerswap_report = run.report
        # the same record whether scored here or given (the demo scores before its final cut)
        return {"protocols": list(run.report.protocols), "pairs": len(run.report.pairs)}


class SelectStep(_StepBase):
    """The blocks to remove, chosen by the config's strategy (:func:`~hf_layerswap.select_layers`)."""

    kind, phase = "select", "selection"

    def check(self, model: nn.Module) -> None:
        total = num_blocks(model)  # an impossible budget costs no scoring
        check_budget(self.cfg.num_to_remove, total, spacing=self.cfg.spacing, protect=self.cfg.protect)
        strategy_entry(_strategy(self.cfg)).check_config(self.cfg, total)  # nor what it refuses after the scoring

    def needs_calibration(self, run: Run | None) -> bool:
        return strategy_entry(_strategy(self.cfg)).calibrated()

    def estimate(self, plan) -> dict | None:
        return plan.selection()

    def apply(self, run: Run) -> dict | None:
        cfg = self.cfg
        # a strategy that reads no swap-KL score gets a report of no pair: its decision record lands there
        report = run.report if run.report is not None else SwapReport(num_blocks(run.model), [], protocols=())
        strategy = _strategy(cfg)
        entry = strategy_entry(strategy)
        before = len(report.selections)
        options = cfg.selection_options()
        run.layers = select_layers(
            report, cfg.num_to_remove, protocol=cfg.protocol, spacing=cfg.spacing, protect=cfg.protect,
            model=run.model, calibration=run.calibration, batch_size=cfg.batch_size, strategy=strategy,
            max_memory=run.budget, **options,
        )
        decision = report.selections[-1] if len(report.selections) > before else None
        typed = {k: v for k, v in options.items() if k in entry.option_class.names()}
        used = entry.option_class.from_mapping(typed).to_dict()  # every typed option as it ran, defaults too
        selection = entry.rule_text(cfg) + (f"; options {_options_text(typed)}" if cfg.strategy_options else "")
        run.provenance = PruneProvenance(
            selection=selection, protocol=cfg.protocol, strategy=strategy, config=cfg.to_dict(),
            scores=report.summary_dict() if run.report is not None else None,
            decision=None if decision is None else entry.provenance(decision),
        )
        return {"strategy": strategy, "selection": selection, "layers": list(run.layers),
                **({"options": used} if used else {})}


class RemoveStep(_StepBase):
    """The cut (:func:`~hf_layerswap.remove_layers`: the surgery, carrying the operators an
    earlier repair attached); with a repair right after it, the repair makes the cut
    (:func:`~hf_layerswap.recover` fits it on the dense model's streams)."""

    kind, phase = "remove", "removal"

    def __init__(self, cfg: LayerSwapConfig, repaired: bool = False, heals: int = 0):
        super().__init__(cfg)
        self.repaired, self.heals = repaired, heals

    def check(self, model: nn.Module) -> None:
        cfg = self.cfg
        if cfg.layers is not None and getattr(cfg, "_protect_given", False):  # -1 and L-1 are one block
            total = num_blocks(model)
            clash = sorted({i % total for i in cfg.layers if -total <= i < total}
                           & {i % total for i in cfg.protect if -total <= i < total})
            if clash:
                raise ValueError(protect_clash(cfg.layers, cfg.protect, clash))

    def apply(self, run: Run) -> dict | None:
        cfg = self.cfg
        if cfg.layers is not None:
            run.layers = list(cfg.layers)
            run.provenance = PruneProvenance(selection="explicit layers", config=cfg.to_dict())
        if run.calibration is not None:
            run.provenance.calibration = run.calibration.spec()
        run.heals_left = self.heals
        if self.heals:  # the dense model, before the cut: the teacher of every heal step
            run.teacher = copy.deepcopy(run.model)
        record = {"layers": list(run.layers)}
        if self.repaired:
            return {**record, "repair": self.cfg.repair().method}
        remove_layers(run.model, run.layers, provenance=run.provenance.to_dict())
        run.removed = list(run.model.config.layerswap["steps"][-1]["removed_layers"])
        return record


class RepairStep(_StepBase):
    """The repair of the cut (:func:`~hf_layerswap.recover`), right after the removal."""

    kind, phase = "repair", "recovery"

    def memory_view(self) -> LayerSwapConfig | None:
        return _view(self.cfg, recovery=self.settings)

    def check(self, model: nn.Module) -> None:
        check_against_model(self.cfg, model)  # a repair the architecture cannot run (fused on post-norm blocks)

    def needs_calibration(self, run: Run | None) -> bool:
        return True

    def estimate(self, plan) -> dict | None:
        teacher = plan.shape.weight_bytes if _heals(self.cfg) else 0  # healing's dense copy, held from before the cut
        return plan.recovery_phase(plan.shape, plan.calib, _view(self.cfg, recovery=self.settings), teacher, plan.budget,
                                   plan.accelerator)

    def apply(self, run: Run) -> dict | None:
        rec, model = self.settings, run.model
        run.recovery_report = recover(model, run.layers, run.calibration, method=rec.method, num_tokens=rec.num_tokens,
                                      epsilon=rec.epsilon, batch_size=self.cfg.batch_size, max_memory=run.budget)
        model.layerswap_recovery_report = run.recovery_report
        record = getattr(model.config, "layerswap", None)
        if record and record.get("steps"):  # the selection record joins the step recover wrote (its own fields win)
            for key, value in run.provenance.to_dict().items():
                record["steps"][-1].setdefault(key, value)
        run.removed = list(model.config.layerswap["steps"][-1]["removed_layers"])
        return {"method": rec.method}


class HealStep(_StepBase):
    """Healing (:func:`~hf_layerswap.heal`): the pruned model distilled from the dense model
    taken just before the cut; on a sparsified model its zeros are kept."""

    kind, phase = "heal", "healing"

    def memory_view(self) -> LayerSwapConfig | None:
        return _view(self.cfg, heal=self.settings)

    def __init__(self, cfg: LayerSwapConfig, settings: HealConfig, run_index: int = 1, after_sparsify: bool = False):
        super().__init__(cfg, settings)
        self.run_index, self.after_sparsify = run_index, after_sparsify

    def check_loaded(self, run: Run) -> None:
        check_heal_in_memory(run.model)  # an offloaded model can be scored and cut, not trained
        heal_cfg = self.settings
        if heal_cfg.perplexity_text is None and heal_cfg.eval_tasks is None:
            return  # its perplexity text and lm-eval task names are refused before the scoring, not when measured
        tok = tokenizer_for(run.model, run.tokenizer if run.tokenizer is not None else self.cfg.tokenizer)
        HealMeasures(heal_cfg.perplexity_text, heal_cfg.eval_tasks, heal_cfg.eval_tasks_path,
                     heal_cfg.eval_tasks_limit, tok, positions=max_positions(run.model)).check_sources()

    def estimate(self, plan) -> dict | None:
        removed = len(self.cfg.layers) if self.cfg.layers is not None else self.cfg.num_to_remove
        view = _view(self.cfg, heal=self.settings, recovery=self.cfg.repair())
        return plan.healing_phase(plan.shape, view, plan.calibration, removed, plan.tokenizer, rates=plan.rates,
                             earlier=self.run_index > 1 and not self.after_sparsify, sparse=self.after_sparsify)

    def apply(self, run: Run) -> dict | None:
        heal_cfg, cfg = self.settings, self.cfg
        text = heal_cfg.calibration if heal_cfg.calibration is not None else run.source
        if isinstance(text, CalibrationSet):  # heal draws its own prompts at its own length
            text = cfg.calibration
        measures = heal_cfg.perplexity_text is not None or heal_cfg.eval_tasks is not None
        tok = None
        if measures or not isinstance(text, Mapping):
            tok = tokenizer_for(run.model, run.tokenizer if run.tokenizer is not None else cfg.tokenizer)
        folder = run.heal_checkpoint_dir
        if folder is not None and self.run_index > 1:  # each heal step resumes from its own folder
            folder = Path(folder) / f"heal-{self.run_index}"
        report = heal(run.model, run.teacher, text, tokenizer=tok, progress=cfg.progress, checkpoint_dir=folder,
                      **heal_cfg.heal_kwargs())
        run.heal_report = report
        run.heal_reports.append(report)
        run.heals_left -= 1
        if run.heals_left == 0:
            run.teacher = None  # the last heal step: the dense copy is no longer needed
        record = {"method": report.method, "run": len(run.model.config.layerswap.get("healing") or []),
                  "kl_before": report.kl_before, "kl_after": report.kl_after}
        if report.kept_zeros:
            record["kept_zeros"] = report.kept_zeros["zeros"]
        return record


class SparsifyStep(_StepBase):
    """One-shot sparsification (:func:`~hf_layerswap.sparsify`); a target of 0 zeroes
    nothing and records nothing."""

    kind, phase = "sparsify", "sparsity"

    def memory_view(self) -> LayerSwapConfig | None:
        return _view(self.cfg, sparsity=self.settings)

    def check_loaded(self, run: Run) -> None:
        check_sparsity_in_memory(run.model)

    def needs_calibration(self, run: Run | None) -> bool:
        return True

    def estimate(self, plan) -> dict | None:
        removed = (len(self.cfg.layers) if self.cfg.layers is not None else self.cfg.num_to_remove) or 0
        return plan.sparsity_phase(plan.shape, plan.calib, _view(self.cfg, sparsity=self.settings), removed)

    def apply(self, run: Run) -> dict | None:
        sp = self.settings
        if not sp.sparsity > 0:
            return None
        # sparsify also leaves its report on model.layerswap_sparsity_report
        run.sparsity_report = sparsify(run.model, run.calibration, sparsity=sp.sparsity, allocation=sp.allocation,
                                       pruner=sp.pruner, pattern=sp.pattern)
        record = config_record(run.sparsity_report)
        return {k: record[k] for k in ("method", "allocation", "pattern", "target_sparsity", "achieved_sparsity",
                                       "num_zeros")}


def _options_text(options: Mapping) -> str:
    """Options as the rule text names them: ``width=4, seed_size=8``."""
    return ", ".join(f"{key}={value!r}" for key, value in options.items())


def _heals(cfg: LayerSwapConfig) -> int:
    return sum(isinstance(step, HealConfig) for step in cfg.after_removal())


def _view(cfg: LayerSwapConfig, **fields) -> LayerSwapConfig:
    """``cfg`` as one step after the removal sees it: a shallow copy whose ``recovery``,
    ``heal`` and ``sparsity`` are those of the step (read, never validated again)."""
    view = copy.copy(cfg)
    view.__dict__.update(recovery=None, heal=None, sparsity=None, recipe=None)
    view.__dict__.update(fields)
    return view


def recipe_steps(cfg: LayerSwapConfig) -> list[Step]:
    """The steps a prune with ``cfg`` runs, in order: :class:`ScoreStep` (unless the blocks are
    given), :class:`SelectStep` (a budget), :class:`RemoveStep` (anything removed), then one
    step per entry of :meth:`~hf_layerswap.LayerSwapConfig.after_removal`."""
    removes = cfg.layers is not None or cfg.num_to_remove is not None
    after = cfg.after_removal()
    steps: list[Step] = []
    if cfg.layers is None:
        steps.append(ScoreStep(cfg))
    if cfg.layers is None and cfg.num_to_remove is not None:
        steps.append(SelectStep(cfg))
    if removes:
        steps.append(RemoveStep(cfg, repaired=bool(after) and isinstance(after[0], RecoveryConfig),
                                heals=_heals(cfg)))
    heals, sparse = 0, False  # a heal right after a sparsify (no heal between) starts after the sparsification
    for settings in after:
        if isinstance(settings, RecoveryConfig):
            steps.append(RepairStep(cfg, settings))
        elif isinstance(settings, HealConfig):
            heals += 1
            steps.append(HealStep(cfg, settings, heals, after_sparsify=sparse))
            sparse = False
        elif isinstance(settings, SparsityConfig):
            steps.append(SparsifyStep(cfg, settings))
            sparse = sparse or settings.sparsity > 0
    return steps


def tokenizer_for(model, tokenizer):
    """``tokenizer``, else the one of the model's checkpoint (``name_or_path``).

    Raises:
        ValueError: none given and none can be loaded (the message says to pass ``tokenizer=``).
    """
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
