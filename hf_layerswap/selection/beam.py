"""The paper's interchange-seeded beam search (No Free Swap, App. G/K), scored on the
calibration prompts only (strategy ``beam``)."""

from __future__ import annotations

import copy
import inspect
import math
from functools import partial
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from ..layerplan import removal_plan
from ..scoring.report import SwapReport, score_key, set_key
from ..scoring.rule import greedy_select, resolve_protect
from .criterion import CriterionResult, allowed_blocks, check_resume, adjacent_report, criterion_output, report_cost, score_adjacent, setup_criterion, as_strategy
from .objectives import removal_kl_values, removal_nll_values
from .registry import Criterion, register_strategy
from ..utils.registry import Options, option

__all__ = ["BEAM_EVALUATORS", "BeamOptions", "interchange_beam"]

#: Beam evaluators: joint removal KL (nats) or calibration NLL (nats per token).
BEAM_EVALUATORS = ("removal_kl", "nll")


@dataclass(frozen=True)
class BeamOptions(Options):
    """The typed options of ``strategy="beam"`` (:func:`interchange_beam`)."""

    width: int = option(3, help="the sets each level keeps (the beam width)", ge=1)
    seed_size: int = option(12, help="the unprotected blocks with the lowest gap-1 interchange scores that seed "
                                     "level 1", ge=1)
    include_greedy: bool = option(True, help="the interchange-guided greedy set of each size joins that level's pool")


def interchange_beam(
    model: nn.Module,
    calibration,
    n: int | Sequence[int],
    *,
    report: SwapReport | None = None,
    tokenizer=None,
    evaluator: str = "removal_kl",
    width: int = 3,
    seed_size: int = 12,
    protect: Sequence[int] = (0, -1),
    include_greedy: bool = True,
    batch_size: int = 8,
    resume: CriterionResult | None = None,
    max_memory=None,
):
    """The paper's interchange-seeded beam search (No Free Swap, App. G/K), scored on the
    calibration prompts only.

    Level 1 scores the single-block sets of the ``seed_size`` unprotected blocks with the
    lowest gap-1 interchange score s(i); level k > 1 expands each of the ``width`` best
    sets of level k-1 by every unprotected block not in it. Candidates are scored by the
    evaluator and cached (a set is never scored twice); the ``width`` lowest survive
    (ties: lexicographically smallest set). With ``include_greedy`` the interchange-guided
    greedy set of size k (Table 17 rule, spacing 1) also enters level k's pool, so the
    returned set never scores worse than it under the same evaluator. The paper scored
    candidates with the evaluation perplexity itself; here the evaluator only ever sees
    the calibration prompts, so the evaluation text stays held out.

    Args:
        evaluator: ``"removal_kl"`` (joint removal KL d_skip(S), nats) or ``"nll"``
            (calibration NLL per token, nats).
        width: beam width (paper: 3). seed_size: level-1 seeds (paper: 12; capped at the
            unprotected blocks).
        report: a SwapReport with the interchange protocol (adjacent pairs used); scored
            here when ``None``.
        n: budget or list of budgets; the search runs to the largest and reports each
            level's best set with the cost spent up to it.
        max_memory: the evaluator's working-memory budget (``select_layers``'; the NLL's head slices: ``plan_nll``).
        resume: a beam result for a smaller budget with the same settings: the search
            continues from its last level's beams (level k+1 only scores sets of size
            k+1, so the sets and costs equal those of one run).

    Returns:
        :class:`CriterionResult` with ``evaluator_calls`` (distinct sets scored up to this
        level), ``details["levels"]`` (per level: calls, the surviving beams and their
        scores, the greedy set's score) and ``details["score"]`` (the evaluator's value
        of the returned set). Cost includes the interchange scoring.

    Raises:
        ValueError: an unknown evaluator, ``width``/``seed_size`` < 1, a report without
            interchange scores, or a budget above the unprotected blocks.
    """
    if evaluator not in BEAM_EVALUATORS:
        raise ValueError(f"evaluator={evaluator!r}: allowed {list(BEAM_EVALUATORS)} (calibration prompts only)")
    for name, value in (("width", width), ("seed_size", seed_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an int >= 1")
    calib, num_blocks, budgets, single = setup_criterion(model, calibration, tokenizer, n)
    allowed = allowed_blocks(num_blocks, protect)
    if budgets[-1] > len(allowed):
        raise ValueError(f"n={budgets[-1]} exceeds the {len(allowed)} unprotected blocks (protect={list(protect)})")
    if report is None:
        report = score_adjacent(model, calib, ("interchange",), batch_size)
    if "interchange" not in report.protocols:
        raise ValueError(f"the beam is seeded by interchange scores; the report scored {list(report.protocols)}")
    sub = adjacent_report(report)
    passes, blocks, seconds, estimated = report_cost(report, ("interchange",))
    scores = sub.layer_scores("interchange")
    seeds = sorted(allowed, key=lambda i: (score_key(scores[i]), i))[:seed_size]
    score_fn = partial(removal_kl_values if evaluator == "removal_kl" else removal_nll_values, max_memory=max_memory)
    cache: dict[str, float] = {}
    beams: list[list[int]] = []
    levels, results = [], {}
    calls = 0
    first_level = 1
    if resume is not None:
        check_resume(resume, "interchange_beam", budgets, evaluator=evaluator, width=width, seed_size=seed_size,
                      seeds=seeds, include_greedy=include_greedy, protect=sorted(resolve_protect(protect, num_blocks)))
        levels = copy.deepcopy(resume.details["levels"])
        beams = [list(b["set"]) for b in levels[-1]["beams"]]
        passes, blocks, seconds, calls = resume.forward_passes, resume.block_passes, resume.seconds, resume.evaluator_calls
        first_level = resume.n + 1
    for level in range(first_level, budgets[-1] + 1):
        if level == 1:
            pool = [[s] for s in seeds]
        else:
            pool = [sorted(beam + [b]) for beam in beams for b in allowed if b not in beam]
        greedy = None
        if include_greedy:
            try:
                greedy = greedy_select(scores, level, spacing=1, protect=protect)
                pool.append(greedy)
            except ValueError:
                greedy = None
        pool = list({set_key(s): s for s in pool}.values())
        todo = [s for s in pool if set_key(s) not in cache]
        if todo:
            values, stats = score_fn(model, calib, todo, batch_size)
            cache.update({set_key(s): v for s, v in zip(todo, values)})
            passes += stats["forward_passes"]
            blocks += stats["block_passes"]
            seconds += stats["seconds"]
            calls += len(todo)
        ranked = sorted(pool, key=lambda s: (score_key(cache[set_key(s)]), s))
        beams = ranked[:width]
        levels.append({
            "level": level, "new_calls": len(todo), "pool": len(pool),
            "beams": [{"set": s, "score": cache[set_key(s)]} for s in beams],
            "greedy": None if greedy is None else {"set": greedy, "score": cache[set_key(greedy)]},
        })
        if level in budgets:
            results[level] = CriterionResult(
                "interchange_beam", level, list(beams[0]), scores, passes, blocks, seconds, evaluator_calls=calls,
                details={"evaluator": evaluator, "width": width, "seconds_estimated": estimated, "seed_size": seed_size, "seeds": seeds,
                         "protect": sorted(resolve_protect(protect, num_blocks)), "include_greedy": include_greedy,
                         "score": cache[set_key(beams[0])], "levels": copy.deepcopy(levels),
                         "unit": "nats" if evaluator == "removal_kl" else "nats per token"},
            )
    return criterion_output(results, single)


def _beam_cost(plan) -> dict:
    """An upper bound of the beam's evaluator calls (the interchange scores come from the
    pipeline's scoring): level 1 the seeds and the greedy set, level k the ``width`` beams
    grown by every remaining unprotected block and the greedy set (at most every set of k
    unprotected blocks), each set from the first removable block, no prefix shared; with the
    NLL evaluator its working memory (the head on row slices under the whole budget)."""
    options = plan.options  # the beam's typed options as the prune passes them (BeamOptions)
    width, seed_size, greedy = options.width, options.seed_size, int(options.include_greedy)
    evaluator = plan.config.objective or inspect.signature(interchange_beam).parameters["evaluator"].default
    total, unprotected = plan.num_blocks, len(plan.allowed)
    planned = plan.engine({0: removal_plan(total, [plan.allowed[0]])})["plan"] if evaluator == "removal_kl" else None
    parts, beams, sets_total, passes = [], 0, 0, []
    for level in range(1, plan.num_to_remove + 1):
        grown = min(seed_size, unprotected) if level == 1 else beams * (unprotected - level + 1)
        pool = min(grown + greedy, math.comb(unprotected, level))
        beams, sets_total = min(width, pool), sets_total + pool
        if evaluator == "removal_kl":
            parts.append(plan.evaluator(pool, level, planned))
        else:  # calibration NLL: a reference forward and one forward per set, each with the model's head
            parts.append(plan.forwards(total + pool * plan.probe_blocks(level), 1 + pool, predicted_rows=True))
            passes.append(1 + pool)  # the level's call: its reference and its sets, per batch
    # the NLL keeps no reference: its row slices of the head (an offloaded head's phases) have the whole budget
    whole = plan.settings.max_memory + plan.memory_budget
    nll = {} if evaluator == "removal_kl" else {"working_bytes": plan.nll_working(whole, max(passes)),
                                                "head_loads": plan.nll_head_loads(passes, whole)}
    return plan.counts(*parts, exact=False, sweeps=plan.num_to_remove + sets_total, **nll,
                       note=f"an upper bound: per level at most {width} beams grown by each unprotected block and "
                            "the greedy set, each set from the first removable block")


register_strategy("beam", needs_model=True, help="the paper's interchange-seeded beam search over sets, scored on the calibration prompts", option_class=BeamOptions, takes_objective=True, cost=_beam_cost, criteria={"interchange_beam": Criterion(interchange_beam, reads=("interchange",), resumes=True)})(
    as_strategy("beam", interchange_beam, reads_report=True))
