"""One-shot ranking by the single-block removal KL d_skip({l}) (the output-grounded baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..layerplan import removal_plan
from ..scoring.rule import greedy_select, resolve_protect
from .criterion import CriterionResult, check_resume, criterion_output, setup_criterion, as_strategy
from .finite import record_layer_values
from .objectives import removal_kl_values
from .registry import NO_PROTOCOL, Criterion, register_strategy

__all__ = ["single_removal_kl"]


def single_removal_kl(
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
    """One-shot ranking by the single-block removal KL d_skip({l}) = E_x KL(p_M || p_{M-{l}})
    (nats; mean over real tokens per prompt, then over prompts; fp32 log-softmax).

    Every block is scored (L removal probes sharing one reference sweep, with prefix
    reuse); the ``n`` unprotected blocks with the lowest values are removed (no spacing).

    Args:
        resume: a result of this criterion for a smaller budget with the same ``protect``:
            its per-block scores (and their cost) are reused, nothing is scored again.
        max_memory: the working-memory budget of the removal probes (bytes, a size, a
            ``MemoryBudget``; default ``"auto"``, :func:`~hf_layerswap.scoring.settings.resolve_memory`).

    Returns:
        :class:`CriterionResult` (``scores`` = d_skip per block). Cost: L+1 forward passes.

    Raises:
        ValueError: a budget outside ``1..L-1`` or more than the unprotected blocks, or a
            ``resume`` of another criterion, budget or protection.
    """
    calib, num_blocks, budgets, single = setup_criterion(model, calibration, tokenizer, n)
    if resume is not None:
        check_resume(resume, "single_removal_kl", budgets, protect=sorted(resolve_protect(protect, num_blocks)))
        values = list(resume.scores)
        stats: dict = {"forward_passes": resume.forward_passes, "block_passes": resume.block_passes, "seconds": resume.seconds}
    else:
        values, stats = removal_kl_values(model, calib, [[i] for i in range(num_blocks)], batch_size,
                                          max_memory=max_memory)
    record_layer_values(values)
    results = {}
    for b in budgets:
        removed = greedy_select(values, b, spacing=0, protect=protect)
        results[b] = CriterionResult(
            "single_removal_kl", b, removed, values, stats["forward_passes"], stats["block_passes"], stats["seconds"],
            details={"protect": sorted(resolve_protect(protect, num_blocks)), "unit": "nats"},
        )
    return criterion_output(results, single)


def _single_removal_cost(plan) -> dict:
    """One removal-KL call over every block's single removal, planned by the engine (exact)."""
    total = plan.num_blocks
    return plan.counts(plan.engine({i: removal_plan(total, [i]) for i in range(total)}), exact=True,
                       note="one removal-KL call over every block's single removal (the engine's own plan)")


register_strategy(
    "single_removal_kl", needs_model=True, help="the blocks whose removal alone costs the least KL on the calibration prompts", cost=_single_removal_cost, guided_by=NO_PROTOCOL, criteria={"single_removal_kl": Criterion(single_removal_kl, resumes=True)},
)(as_strategy("single_removal_kl", single_removal_kl))
