"""The paper's rule per protocol (``greedy``), the better of the two protocols' sets
(``auto``), and both as criteria of the comparison harness (:func:`swap_guided`).

No Free Swap (arXiv 2605.16234): layer scores s(i) = min over adjacent partners of the
replacement or interchange swap-KL (nats), taken greedily in ascending order
(:func:`~hf_layerswap.scoring.rule.greedy_select`); ``auto`` evaluates each protocol's set by its
joint removal KL d_skip(S) on the calibration prompts and keeps the lower.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

from ..calibration import CalibrationSet
from ..layerplan import removal_plan
from ..scoring.protocols import PROTOCOLS
from ..scoring.report import SwapReport, score_key, set_key
from ..scoring.rule import greedy_select, resolve_protect
from ..layerplan import as_index
from ..scoring import removal_kl
from ..scoring.layerscores import calibration_from_args
from .criterion import (CriterionResult, adjacent_report, criterion_output, report_cost, same_prompts, score_adjacent,
                        setup_criterion)
from .dispatch import candidates_set, select_layers
from .objectives import plans_cost, removal_kl_values
from .registry import Criterion, check_options, register_strategy

__all__ = ["swap_guided"]


def _rule_text(cfg) -> str:
    return f"greedy min-over-partners, spacing={cfg.spacing}, protect={cfg.protect}"


def _greedy_reason(record, kl, indices) -> str:
    selection = record.selection if record.selection != "not recorded" else "greedy"
    return f"greedy selection on the **{record.protocol}** scores ({selection})."


def _auto_reason(record, kl, indices) -> str:
    auto = record.decision or {}
    values = auto.get("removal_kl", {})
    return (
        "`protocol='auto'`: both candidate sets were evaluated by their joint removal KL on the "
        f"calibration prompts (interchange {kl(values.get('interchange'))}, replacement "
        f"{kl(values.get('replacement'))} nats) and the **{auto.get('chosen_protocol')}** set was kept "
        f"({auto.get('reason')})."
    )


def _auto_values(decision) -> list:
    chosen = decision.get("chosen_protocol")
    value = (decision.get("removal_kl") or {}).get(chosen) if chosen in PROTOCOLS else None
    return [] if value is None else [("its joint removal KL", value)]


def _greedy_cost(plan) -> dict:
    return plan.counts(exact=True, note="the paper's rule reads the scores: no pass of its own")


def _auto_cost(plan) -> dict:
    """An upper bound: when the two protocols' greedy sets differ, one removal-KL call over
    both, each from the first removable block with no prefix shared (none when they agree)."""
    return plan.counts(plan.evaluator(2, plan.num_to_remove), exact=False,
                       note="an upper bound: the joint removal KL of two different candidate sets, each from the "
                            "first removable block (none when both protocols select the same set)")


@register_strategy(
    "greedy", options=(), help="the paper's greedy rule on one protocol's layer scores (lowest first, with spacing and protect)", cost=_greedy_cost, spacing=1, scores=lambda protocol: (protocol,), reads=lambda protocol: (protocol,),
    resolve=lambda protocol: "auto" if protocol == "auto" else "greedy", describe=_rule_text, ranks_by_scores=True,
    card_reason=_greedy_reason,
    criteria={p: Criterion(lambda model, calib, n, p=p, **kw: swap_guided(model, calib, n, protocol=p, **kw), reads=(p,))
              for p in PROTOCOLS},
)
def _greedy(report, num_to_remove, *, protocol, spacing, protect, options, **_):
    """The paper's rule on one protocol's layer scores."""
    if protocol == "auto":
        raise ValueError("strategy='greedy' needs protocol='interchange' or 'replacement' (or use strategy='auto')")
    check_options("greedy", options)
    return greedy_select(report.layer_scores(protocol), num_to_remove, spacing=spacing, protect=protect)


@register_strategy(
    "auto", options=(), help="each protocol's greedy set; the one with the lower joint removal KL on the calibration prompts", spacing=1, cost=_auto_cost, reads_calibration=True, scores=lambda protocol: PROTOCOLS,
    reads=lambda protocol: PROTOCOLS, config_options=lambda cfg: {}, describe=_rule_text, ranks_by_scores=True,
    guided_by=lambda decision, protocol: decision.get("chosen_protocol") or protocol, values=_auto_values,
    card_reason=_auto_reason,
    criteria={"auto": Criterion(lambda model, calib, n, **kw: swap_guided(model, calib, n, protocol="auto", **kw),
                                reads=PROTOCOLS)},
)
def _auto(report, num_to_remove, *, spacing, protect, model, calibration, tokenizer, batch_size, options,
          max_memory=None, **_):
    """Each protocol's greedy set; the one with the lower joint removal KL is kept."""
    check_options("auto", options)
    candidates = {
        p: greedy_select(report.layer_scores(p), num_to_remove, spacing=spacing, protect=protect) for p in PROTOCOLS
    }
    keys = {p: set_key(s) for p, s in candidates.items()}
    distinct = list(dict.fromkeys(keys.values()))
    values = {k: report.removal_kl[k] for k in distinct if k in report.removal_kl}
    # the prompts the values are of: a CalibrationSet as given, a source built only when a value is missing
    calib = calibration if isinstance(calibration, CalibrationSet) else None
    if calib is None and len(distinct) > 1 and model is not None and len(values) < len(distinct):
        calib = calibration_from_args(model, calibration, tokenizer, report.metadata.get("num_prompts", 64),
                                      report.metadata.get("seq_len", 128), report.metadata.get("seed", 0))
    if len(distinct) > 1 and model is not None and calib is not None:
        here = same_prompts(report, calib) is not False  # the report's values are of these prompts
        values = values if here else {}
        missing = [k for k in distinct if k not in values]
        if missing:
            measured = dict(zip(missing, removal_kl(model, calib, [candidates_set(k) for k in missing],
                                                    batch_size=batch_size, max_memory=max_memory)))
            values.update(measured)
            if here:  # of other prompts they stay in this decision's record only
                report.removal_kl.update(measured)
    if len(distinct) > 1 and len(values) < len(distinct):
        raise ValueError(
            "protocol='auto' needs the joint removal KL of both candidate sets "
            f"{candidates}: pass model= and calibration= (the same prompts used for scoring)"
        )
    if len(distinct) == 1:
        chosen_protocol = "interchange"
        reason = "both protocols select the same set"
    else:
        ki, kr = values[keys["interchange"]], values[keys["replacement"]]
        chosen_protocol = "replacement" if score_key(kr) < score_key(ki) else "interchange"
        reason = "lower joint removal KL on the calibration prompts"
    record = {
        "num_to_remove": as_index(num_to_remove),
        "spacing": as_index(spacing),
        "protect": sorted(resolve_protect(protect, report.num_blocks)),
        "candidates": {p: candidates[p] for p in PROTOCOLS},
        "removal_kl": {p: values.get(keys[p]) for p in PROTOCOLS},
        "chosen_protocol": chosen_protocol,
        "selected": candidates[chosen_protocol],
        "reason": reason,
    }
    report.selections.append(record)
    return list(candidates[chosen_protocol])


def swap_guided(
    model: nn.Module,
    calibration,
    n: int | Sequence[int],
    *,
    protocol: str = "interchange",
    report: SwapReport | None = None,
    tokenizer=None,
    spacing: int = 1,
    protect: Sequence[int] = (0, -1),
    batch_size: int = 8,
):
    """No Free Swap's guided selection (arXiv 2605.16234, Table 17 rule).

    Layer scores s(i) = min over adjacent partners of the replacement or interchange
    swap-KL (nats); :func:`~hf_layerswap.selection.select_layers` takes them greedily in
    ascending order keeping selected blocks more than ``spacing`` apart. ``"auto"`` selects
    with both protocols and keeps the set with the lower joint removal KL on the
    calibration prompts.

    Args:
        protocol: ``"replacement"``, ``"interchange"`` or ``"auto"``.
        report: a :class:`~hf_layerswap.scoring.report.SwapReport` of this model on these
            calibration prompts (any ``max_gap``; its adjacent pairs are used). Without
            one, the needed protocols are scored here (``max_gap=1``).

    Returns:
        :class:`CriterionResult` (``scores`` = s(i) of the protocol; for ``"auto"`` those
        of the chosen protocol). Cost: the scoring probes of the protocols used (1 +
        (L-1) forward passes for interchange, 1 + 2(L-1) for replacement), plus for
        ``"auto"`` the removal-KL sweeps of the two candidate sets when they differ.
        ``details["seconds_estimated"]`` is True when the report scored more than the
        protocol needs and its time was apportioned by block passes.

    Raises:
        ValueError: an unknown protocol, a report lacking the protocol, or an unmeetable budget.
    """
    if protocol not in ("replacement", "interchange", "auto"):
        raise ValueError(f"protocol={protocol!r}: allowed 'replacement', 'interchange' or 'auto'")
    calib, num_blocks, budgets, single = setup_criterion(model, calibration, tokenizer, n)
    needed = ("replacement", "interchange") if protocol == "auto" else (protocol,)
    if report is None:
        report = score_adjacent(model, calib, needed, batch_size)
    missing = [p for p in needed if p not in report.protocols]
    if missing:
        raise ValueError(f"the report did not score {missing} (scored: {list(report.protocols)})")
    if report.num_blocks != num_blocks:
        raise ValueError(f"the report has {report.num_blocks} blocks but the model has {num_blocks}")
    sub = adjacent_report(report)
    if same_prompts(report, calib) is False:  # its set values are of other prompts: neither read nor written
        sub = copy.copy(sub)
        sub.removal_kl = {}
    passes, blocks, seconds, estimated = report_cost(report, needed)
    results = {}
    for b in budgets:
        extra_passes = extra_blocks = 0
        extra_seconds = 0.0
        details = {"protocol": protocol, "spacing": spacing, "protect": sorted(resolve_protect(protect, num_blocks)),
                   "score_pairs": "adjacent (gap 1)", "seconds_estimated": estimated, "unit": "nats"}
        if protocol == "auto":
            candidates = {p: greedy_select(sub.layer_scores(p), b, spacing=spacing, protect=protect) for p in needed}
            distinct = {set_key(s): s for s in candidates.values()}
            todo = [s for k, s in distinct.items() if k not in sub.removal_kl]
            if len(distinct) > 1:
                extra_passes, extra_blocks = plans_cost(
                    {k: removal_plan(num_blocks, s) for k, s in distinct.items()}, num_blocks)
                if todo:
                    values, stats = removal_kl_values(model, calib, todo, batch_size)
                    sub.removal_kl.update({set_key(s): v for s, v in zip(todo, values)})
                    extra_seconds = stats["seconds"]
            removed = select_layers(sub, b, protocol="auto", spacing=spacing, protect=protect)
            record = sub.selections[-1]
            chosen = record["chosen_protocol"]
            details.update({"candidates": record["candidates"], "removal_kl": record["removal_kl"],
                            "chosen_protocol": chosen, "reason": record["reason"]})
            scores = sub.layer_scores(chosen)
        else:
            removed = select_layers(sub, b, protocol=protocol, spacing=spacing, protect=protect)
            scores = sub.layer_scores(protocol)
        results[b] = CriterionResult(
            protocol, b, removed, scores, passes + extra_passes, blocks + extra_blocks, seconds + extra_seconds,
            details=details,
        )
    return criterion_output(results, single)
