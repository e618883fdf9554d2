"""What every model-reading criterion shares: its result type, budgets, protection and the
cost of the swap-KL scoring it builds on.

Every criterion reads the same calibration prompts (a
:class:`~hf_layerswap.calibration.CalibrationSet`), takes a budget ``n`` (blocks to remove,
or a list of budgets served by one run) and returns a :class:`CriterionResult`: the
removed blocks (0-based, ascending), per-layer scores where the method has them, and its
cost in calibration forward passes, block passes and seconds.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from ..calibration import CalibrationSet, build_calibration
from ..utils.jsonio import JsonResult
from ..layerplan import interchange_plan, num_blocks, replacement_plan
from ..scoring.report import SwapReport
from ..utils.jsonio import decode_tree, encode_tree
from ..scoring.rule import resolve_protect
from ..scoring import score_layers
from .objectives import plans_cost
from .registry import keyword_options

__all__ = [
    "CriterionResult", "as_strategy", "allowed_blocks", "parse_budgets", "as_calibration", "check_resume",
    "adjacent_report", "criterion_output", "report_cost", "same_prompts", "score_adjacent", "setup_criterion",
]


@dataclass
class CriterionResult(JsonResult):
    """What a criterion chose for budget ``n`` and what it cost.

    Attributes:
        name: criterion name (a key of :func:`hf_layerswap.comparison.harness_criteria`).
        n: the budget (number of blocks removed).
        removed: removed blocks, 0-based, ascending (for ``random``: the first draw; all
            draws are in ``details["draws"]``).
        scores: per-layer scores (length L, low = removable) when the method has them,
            else ``None`` (angular distance is per run: ``details["distance_by_start"]``).
        forward_passes: calibration-set sweeps spent to obtain this set.
        block_passes: block forward calls over the calibration set (a full forward = L).
        seconds: wall-clock seconds spent (measured; for iterative methods cumulative up
            to this ``n``).
        evaluator_calls: candidate sets scored by a search (SLEB, beam); ``None`` for
            one-shot methods.
        details: method-specific facts (parameters, per-step tables, beams, draws).
    """

    name: str
    n: int
    removed: list[int]
    scores: list[float] | None
    forward_passes: int
    block_passes: int
    seconds: float
    evaluator_calls: int | None = None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(encode_tree(asdict(self)), allow_nan=False))

    @classmethod
    def from_dict(cls, data: Mapping) -> CriterionResult:
        data = decode_tree(dict(data))
        return cls(**data)


def as_calibration(model, calibration, tokenizer) -> CalibrationSet:
    """``calibration`` as a :class:`~hf_layerswap.calibration.CalibrationSet` (built with ``tokenizer``, else the model's own)."""
    if isinstance(calibration, CalibrationSet):
        return calibration
    if tokenizer is None:
        tokenizer = getattr(model, "layerswap_tokenizer", None)
    return build_calibration(calibration, tokenizer)


def parse_budgets(n, num_blocks: int) -> tuple[list[int], bool]:
    """(sorted unique budgets, whether a single int was given)."""
    single = isinstance(n, int) and not isinstance(n, bool)
    values = [n] if single else list(n)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= num_blocks - 1:
            raise ValueError(f"budget n={v!r}: allowed ints 1..{num_blocks - 1} for a model with {num_blocks} blocks")
    if not values:
        raise ValueError("no budget given: pass n as an int or a non-empty list of ints")
    return sorted(set(values)), single


def criterion_output(results: dict[int, CriterionResult], single: bool):
    """The one result when a single int budget was given, else ``{budget: result}``."""
    return next(iter(results.values())) if single else results


def allowed_blocks(num_blocks: int, protect) -> list[int]:
    """The blocks of a model with ``num_blocks`` blocks that ``protect`` leaves removable (0-based, ascending)."""
    protected = resolve_protect(protect, num_blocks)
    return [i for i in range(num_blocks) if i not in protected]


def setup_criterion(model, calibration, tokenizer, n) -> tuple[CalibrationSet, int, list[int], bool]:
    """(calibration set, L, sorted budgets, whether one int budget was given)."""
    calib = as_calibration(model, calibration, tokenizer)
    total = num_blocks(model)
    if total < 2:
        raise ValueError(f"the model has {total} block(s); layer removal needs at least 2")
    budgets, single = parse_budgets(n, total)
    return calib, total, budgets, single


def check_resume(resume: CriterionResult, name: str, budgets: Sequence[int], **expected) -> None:
    """Raise ``ValueError`` unless ``resume`` is a ``name`` result for a budget below ``budgets`` run with the ``expected`` details."""
    if resume.name != name or resume.n >= min(budgets):
        raise ValueError(
            f"resume must be a {name!r} result for a budget below {min(budgets)}; got {resume.name!r} at n={resume.n}"
        )
    for key, value in expected.items():
        if resume.details.get(key) != value:
            raise ValueError(f"resume was run with {key}={resume.details.get(key)!r}, not {value!r}")


def same_prompts(report: SwapReport, calibration) -> bool | None:
    """Whether ``report`` was scored on ``calibration``'s prompts (a
    :class:`~hf_layerswap.CalibrationSet`): its calibration content hash is
    ``calibration.content_hash``; ``None`` when the report records none. A value of
    ``report.removal_kl`` is written only where this is not ``False`` and taken as this
    model's only where it is ``True``."""
    recorded = (report.metadata.get("calibration") or {}).get("content_hash")
    return None if recorded is None else recorded == calibration.content_hash


def adjacent_report(report: SwapReport) -> SwapReport:
    """The adjacent-pair part of a report (the paper's selection uses gap-1 scores)."""
    if report.max_gap == 1:
        return report
    sub = SwapReport(report.num_blocks, [p for p in report.pairs if p.gap == 1], protocols=report.protocols,
                     max_gap=1, metadata=report.metadata)
    sub.removal_kl = report.removal_kl
    return sub


def report_cost(report: SwapReport, protocols: Sequence[str]) -> tuple[int, int, float, bool]:
    """(forward passes, block passes, seconds, estimated) of scoring the adjacent pairs of
    ``protocols`` with prefix reuse.

    Passes are exact counts of the probes. Seconds are the report's measured time when it
    scored exactly these probes; otherwise that time scaled by the share of block passes,
    and ``estimated`` is True."""
    num_blocks = report.num_blocks

    def plans_for(pairs, protos):
        plans = {}
        for p in pairs:
            if "interchange" in protos:
                plans[("interchange", p.i, p.j)] = interchange_plan(num_blocks, p.i, p.j)
            if "replacement" in protos:
                plans[("replacement_ij", p.i, p.j)] = replacement_plan(num_blocks, p.i, p.j)
                plans[("replacement_ji", p.i, p.j)] = replacement_plan(num_blocks, p.j, p.i)
        return plans

    passes, blocks = plans_cost(plans_for([p for p in report.pairs if p.gap == 1], protocols), num_blocks)
    all_passes, all_blocks = plans_cost(plans_for(report.pairs, report.protocols), num_blocks)
    seconds = float(report.metadata.get("seconds", 0.0))
    estimated = (passes, blocks) != (all_passes, all_blocks)
    if estimated:
        seconds *= blocks / all_blocks
    return passes, blocks, seconds, estimated


def score_adjacent(model, calib, protocols, batch_size, checkpoint_path=None) -> SwapReport:
    """Swap-KL scores of the adjacent pairs (``max_gap=1``) under ``protocols``, quietly (no progress bar)."""
    return score_layers(model, calib, protocols=protocols, max_gap=1, batch_size=batch_size, progress=False,
                        checkpoint_path=checkpoint_path)


def as_strategy(name: str, criterion: Callable, *, reads_report: bool = False) -> Callable:
    """A criterion ``(model, calibration, n, **kw) -> CriterionResult`` as a selection
    strategy (see :func:`~hf_layerswap.selection.register_strategy`): it returns the
    removed blocks and appends ``{"strategy", "num_to_remove", "selected", "cost"}`` to
    ``report.selections``. Its ``options`` attribute names the criterion's keyword
    arguments a caller may set. With ``reads_report`` the criterion gets the report
    (``report=``) and the objective as its ``evaluator``; otherwise an objective is refused.
    A criterion with a ``max_memory`` keyword gets ``select_layers``' working-memory budget.
    """

    takes_budget = "max_memory" in inspect.signature(criterion).parameters

    def run(report, num_to_remove, *, protect, model, calibration, batch_size, objective, options, max_memory=None,
            **_):
        kwargs = dict(options)
        if takes_budget:  # the one working-memory budget select_layers was given
            kwargs["max_memory"] = max_memory
        if reads_report:
            kwargs.setdefault("report", report)
            if objective is not None:
                kwargs["evaluator"] = objective
        elif objective is not None:
            raise TypeError(f"strategy {name!r} takes no objective")
        result = criterion(model, calibration, num_to_remove, protect=protect, batch_size=batch_size, **kwargs)
        report.selections.append({
            "strategy": name, "num_to_remove": num_to_remove, "selected": list(result.removed),
            "cost": {"evaluator_calls": result.evaluator_calls, "forward_passes": result.forward_passes,
                     "block_passes": result.block_passes, "seconds": round(result.seconds, 3)},
        })
        return list(result.removed)

    run.__doc__ = f"The ``{name}`` criterion (:func:`{criterion.__module__}.{criterion.__name__}`) as a strategy."
    fixed = ("model", "calibration", "n", "protect", "batch_size", "tokenizer", "max_memory") + (("report", "evaluator") if reads_report else ())
    run.options = keyword_options(criterion, fixed)  # type: ignore[attr-defined]  # what select_layers accepts (register_strategy reads it)
    return run
