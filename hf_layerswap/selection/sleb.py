"""SLEB (Song et al., ICML 2024): iterative greedy block removal by calibration NLL."""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn

from ..calibration import CalibrationSet
from ..layerplan import removal_plan
from ..scoring.report import score_key
from ..scoring.rule import resolve_protect
from ..scoring.probes import make_probes, schedule_blocks
from ..scoring.reference import ReferenceCache
from ..scoring.settings import resolve_memory
from .criterion import CriterionResult, allowed_blocks, check_resume, criterion_output, setup_criterion, as_strategy
from .objectives import removal_nll_values
from .registry import NO_PROTOCOL, Criterion, register_strategy

__all__ = ["sleb"]


def sleb(
    model: nn.Module,
    calibration,
    n: int | Sequence[int],
    *,
    tokenizer=None,
    protect: Sequence[int] = (0, -1),
    batch_size: int = 8,
    resume: CriterionResult | None = None,
    max_memory=None,
):
    """SLEB (Song et al., ICML 2024): iterative greedy block removal by calibration NLL.

    Step k tentatively removes each remaining unprotected block from the current set
    (a removal plan, no weight copies), computes the calibration NLL per token
    (:func:`plan_nll`; nats, pooled over all predicted tokens, i.e. log PPL), and removes
    the block with the lowest NLL (ties: lowest index). All remaining blocks are
    re-scored after each removal. SLEB's first and last blocks are never removed
    (``protect=(0, -1)``, its ``early_barrier``/``latter_barrier`` of 1).

    Cost: the same engine tricks as the search's evaluator. Each candidate starts at its
    first removed block from the dense model's stream, the candidates of a step share
    their common prefixes as a tree (:func:`plan_nll`), and the dense reference (the
    streams entering every block) is computed once for all steps while it fits the
    working-memory budget (:class:`~hf_layerswap.scoring.reference.ReferenceCache`, as
    :class:`~hf_layerswap.selection.objectives.SetObjective` keeps it). A resumed run
    computes it once more.

    Args:
        n: budget or list of budgets; the search runs once to the largest, and each
            budget's result is the prefix of that run with the cost spent up to it.
        resume: a SLEB result for a smaller budget on the same model, prompts and
            ``protect``: the search continues from it (same sets and costs as one run).
        max_memory: the working-memory budget (bytes, a size, a ``MemoryBudget``; default
            ``"auto"``: :func:`~hf_layerswap.scoring.settings.resolve_memory` on the model's
            devices); the kept dense reference takes its
            :data:`~hf_layerswap.scoring.settings.REFERENCE_SHARE`, as the search's does
            and as the cost estimate plans it; each step's NLL (:func:`plan_nll`) the rest,
            its output head on row slices sized from it.

    Returns:
        :class:`CriterionResult`: ``scores`` = the first step's NLL per block (``None``
        for protected blocks); ``details["steps"]`` = per step the chosen block and every
        candidate's NLL; ``details["head_passes"]`` = output-head passes over the prompts,
        ``details["head_loads"]`` = whole reads of an offloaded head's weight (0 in memory;
        :func:`plan_nll`). ``evaluator_calls`` = candidate sets scored.

    Raises:
        ValueError: a budget outside ``1..L-1`` or more than the unprotected blocks.
    """
    calib, num_blocks, budgets, single = setup_criterion(model, calibration, tokenizer, n)
    allowed = allowed_blocks(num_blocks, protect)
    if budgets[-1] > len(allowed):
        raise ValueError(f"n={budgets[-1]} exceeds the {len(allowed)} unprotected blocks (protect={list(protect)})")
    removed: list[int] = []
    steps, results = [], {}
    passes = blocks = calls = heads = loads = 0
    seconds = 0.0
    first_scores: list[float | None] = [None] * num_blocks
    base_nll = None
    first_step = 1
    if resume is not None:
        check_resume(resume, "sleb", budgets, protect=sorted(resolve_protect(protect, num_blocks)))
        removed, steps = list(resume.removed), copy.deepcopy(resume.details["steps"])
        passes, blocks, calls, seconds = resume.forward_passes, resume.block_passes, resume.evaluator_calls, resume.seconds
        heads = resume.details.get("head_passes", 0)
        loads = resume.details.get("head_loads", 0)
        first_scores, base_nll, first_step = list(resume.scores), resume.details["base_nll"], resume.n + 1
    kept, working = resolve_memory(max_memory, model).split()
    reference = ReferenceCache(kept.bytes)
    for k in range(first_step, budgets[-1] + 1):
        candidates = [b for b in allowed if b not in removed]
        sets = [sorted(removed + [b]) for b in candidates]
        nll, stats = removal_nll_values(model, calib, sets, batch_size, reference_cache=reference,
                                         max_memory=working)
        if base_nll is None:
            base_nll = float(stats["base"].sum()) / float(_num_targets(calib))
        passes += stats["forward_passes"]
        blocks += stats["block_passes"]
        heads += stats["head_passes"]
        loads += stats["head_loads"]
        seconds += stats["seconds"]
        calls += len(sets)
        best = min(range(len(candidates)), key=lambda c: (score_key(nll[c]), candidates[c]))
        if k == 1:
            for b, v in zip(candidates, nll):
                first_scores[b] = v
        removed = sets[best]
        steps.append({"removed": candidates[best], "nll": nll[best], "candidates": dict(zip(map(str, candidates), nll))})
        if k in budgets:
            results[k] = CriterionResult(
                "sleb", k, list(removed), first_scores, passes, blocks, seconds, evaluator_calls=calls,
                details={"protect": sorted(resolve_protect(protect, num_blocks)), "base_nll": base_nll,
                         "unit": "nats per token", "head_passes": heads, "head_loads": loads, "steps": copy.deepcopy(steps)},
            )
    return criterion_output(results, single)


def _num_targets(calib: CalibrationSet) -> int:
    m = calib.attention_mask
    return int((m[:, 1:] * m[:, :-1]).sum())


def _sleb_cost(plan) -> dict:
    """Step 1 exactly (every single removal, the shared prefix tree, one reference sweep);
    step k > 1 bounded: its U - k + 1 candidate sets each from the first removable block,
    and a reference sweep per step unless every batch's reference fits the kept budget. Its
    working memory beside the kept reference: the NLL's (row slices of the head under the
    engine calls' share of the budget, :meth:`~hf_layerswap.cost.SelectionPlan.nll_working`);
    ``head_loads``: the whole reads of an offloaded head (one per head phase,
    :meth:`~hf_layerswap.cost.SelectionPlan.nll_head_loads`; 0 in memory)."""
    total, n, allowed = plan.num_blocks, plan.num_to_remove, plan.allowed
    _, probes, _ = make_probes({b: removal_plan(total, [b]) for b in allowed}, total)
    weight = plan.model.get_input_embeddings().weight
    stream = weight.shape[-1] * weight.element_size()  # bytes per position of one residual stream
    entries = sum((total - 1) * positions * stream + 8 * plan.config.batch_size for positions, _ in plan.batches)
    sweeps = 1 if n == 1 or entries <= plan.memory_budget else n
    later_sets = sum(len(allowed) - k + 1 for k in range(2, n + 1))
    later_blocks = sum((len(allowed) - k + 1) * plan.probe_blocks(k) for k in range(2, n + 1))
    per_batch = sweeps * total + schedule_blocks(list(probes.values()), "shared") + later_blocks
    # head passes per batch of each step's call: the reference's where it sweeps it, one per candidate
    calls = [1 + len(probes)] + [int(sweeps > 1) + len(allowed) - k + 1 for k in range(2, n + 1)]
    return plan.counts(plan.forwards(per_batch, sweeps + len(probes) + later_sets, predicted_rows=True), exact=n == 1,
                       note="exact for one block; for more an upper bound: each later step's candidates from the "
                            "first removable block, a reference sweep per step unless the kept reference fits",
                       sweeps=sweeps + len(probes) + later_sets, working_bytes=plan.nll_working(passes=max(calls)),
                       head_loads=plan.nll_head_loads(calls))


register_strategy("sleb", needs_model=True, help="SLEB: one block at a time, the removal of lowest calibration NLL", cost=_sleb_cost, guided_by=NO_PROTOCOL, keeps_reference=True, criteria={"sleb": Criterion(sleb, resumes=True)})(as_strategy("sleb", sleb))
