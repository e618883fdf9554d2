"""The field's stream-geometry criteria: ShortGPT's Block Influence and Gromov et al.'s
angular distance, from one stream-capture sweep.

``block_influence``
    ShortGPT (Men et al., arXiv 2403.03853): BI(l) = 1 - cos(x_l, x_{l+1}) between the raw
    residual stream entering and leaving block l, per real token, averaged (mean over the
    real tokens of a prompt, then over prompts); the n lowest go. Captured with forward
    hooks on the blocks (:func:`~hf_layerswap.layerplan.capture_residual_stream`), not
    ``output_hidden_states``, whose last entry is after the final norm.
``angular_distance``
    Gromov et al., "The Unreasonable Ineffectiveness of the Deeper Layers" (arXiv
    2403.17887): d(l, n) = arccos(cos(x_l, x_{l+n})) / pi between the stream entering block
    l and the stream leaving block l+n-1, at the last real token of each prompt, averaged
    over prompts; the contiguous run ``l..l+n-1`` with the smallest d goes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..calibration import CalibrationSet
from ..utils.devices import input_device
from ..layerplan import capture_residual_stream, num_blocks
from ..scoring.report import score_key, set_key
from ..scoring.rule import greedy_select, resolve_protect
from .criterion import CriterionResult, criterion_output, setup_criterion, as_strategy
from .finite import record_layer_values, record_set_values
from .registry import NO_PROTOCOL, Criterion, register_strategy

__all__ = ["angular_distance", "block_influence"]


@torch.no_grad()
def _stream_geometry(model, calibration: CalibrationSet, batch_size: int):
    """One stream-capture sweep: per-prompt BI per block ``(N, L)`` (float64) and the
    residual stream at each prompt's last real token for every slot ``(N, L+1, H)``."""
    total = num_blocks(model)
    bi_rows, last_rows = [], []
    device = input_device(model)
    was_training = model.training
    model.eval()
    try:
        for ids, mask in calibration.batches(batch_size):
            ids, mask = ids.to(device), mask.to(device)
            streams, _ = capture_residual_stream(model, ids, mask)
            # the streams of blocks on different devices meet on the CPU, in float64
            real = mask.bool().cpu()
            per_prompt = mask.sum(dim=1).double().cpu()
            bi = torch.empty(ids.shape[0], total, dtype=torch.float64)
            for layer in range(total):
                cos = F.cosine_similarity(streams[layer].double().cpu(), streams[layer + 1].double().cpu(), dim=-1)
                bi[:, layer] = ((1.0 - cos) * real).sum(dim=1) / per_prompt
            last = (mask.sum(dim=1) - 1).cpu()
            rows = torch.arange(ids.shape[0])
            stacked = torch.stack([streams[s].double().cpu()[rows, last] for s in range(total + 1)], dim=1)
            bi_rows.append(bi)
            last_rows.append(stacked)
            del streams
    finally:
        model.train(was_training)
    return torch.cat(bi_rows), torch.cat(last_rows)


def block_influence(
    model: nn.Module,
    calibration,
    n: int | Sequence[int],
    *,
    tokenizer=None,
    protect: Sequence[int] = (),
    batch_size: int = 8,
):
    """ShortGPT's Block Influence: remove the ``n`` blocks with the lowest BI.

    BI(l) = 1 - cos(x_l, x_{l+1}), where x_l ``(B, T, H)`` is the raw residual stream
    entering block l and x_{l+1} the stream leaving it (both captured by forward hooks, so
    the last block's output is taken before the final norm). Per token, cosine over the
    hidden dimension in float64; averaged over the real tokens of each prompt, then over
    prompts. Dimensionless, in [0, 2]; low = the block barely turns the stream.

    Args:
        model: a transformers causal LM.
        calibration: a :class:`~hf_layerswap.calibration.CalibrationSet` or any source
            :func:`~hf_layerswap.calibration.build_calibration` accepts (with ``tokenizer``).
        n: budget, or a list of budgets (then a dict ``{n: CriterionResult}`` is returned,
            all from one sweep).
        protect: blocks never removed (ShortGPT protects none; negative = from the end).
        batch_size: prompts per forward pass.

    Returns:
        :class:`CriterionResult` (``scores`` = BI per block). Cost: one forward pass (no
        logits).

    Raises:
        ValueError: a budget outside ``1..L-1`` or larger than the unprotected blocks.
    """
    calib, num_blocks, budgets, single = setup_criterion(model, calibration, tokenizer, n)
    t0 = time.perf_counter()
    bi, _ = _stream_geometry(model, calib, batch_size)
    seconds = time.perf_counter() - t0
    scores = [float(v) for v in bi.mean(dim=0)]
    record_layer_values(scores)
    results = {}
    for b in budgets:
        removed = greedy_select(scores, b, spacing=0, protect=protect)
        results[b] = CriterionResult(
            "block_influence", b, removed, scores, 1, num_blocks, seconds,
            details={"protect": sorted(resolve_protect(protect, num_blocks)), "token_averaging": "per prompt, then prompts",
                     "capture": "forward hooks on the blocks (raw residual stream, before the final norm)"},
        )
    return criterion_output(results, single)


def angular_distance(
    model: nn.Module,
    calibration,
    n: int | Sequence[int],
    *,
    tokenizer=None,
    protect: Sequence[int] = (),
    batch_size: int = 8,
):
    """Gromov et al. (arXiv 2403.17887): remove the contiguous run of ``n`` blocks whose
    input and output are closest in angle.

    d(l, n) = arccos(cos(x_l, x_{l+n})) / pi, where x_l ``(H,)`` is the raw residual
    stream entering block l and x_{l+n} the stream leaving block l+n-1, both at the last
    real token of a prompt; averaged over prompts. In [0, 1]. The run ``l*..l*+n-1`` with
    the smallest d is removed (ties: the earliest start); runs touching a protected block
    are skipped.

    Args:
        n: budget or list of budgets (one sweep serves all).
        protect: blocks a run may not contain (the paper scans every start: default none).
        Others as in :func:`block_influence`.

    Returns:
        :class:`CriterionResult` with ``scores=None`` and ``details["distance_by_start"]``
        (length L-n+1; ``None`` for runs touching a protected block). Cost: one forward
        pass (no logits).

    Raises:
        ValueError: a budget outside ``1..L-1``, or no run of ``n`` unprotected blocks.
    """
    calib, num_blocks, budgets, single = setup_criterion(model, calibration, tokenizer, n)
    protected = resolve_protect(protect, num_blocks)
    t0 = time.perf_counter()
    _, last = _stream_geometry(model, calib, batch_size)
    seconds = time.perf_counter() - t0
    results = {}
    for b in budgets:
        distances: list[float | None] = []
        for start in range(num_blocks - b + 1):
            if protected & set(range(start, start + b)):
                distances.append(None)
                continue
            cos = F.cosine_similarity(last[:, start], last[:, start + b], dim=-1).clamp(-1.0, 1.0)
            distances.append(float((torch.arccos(cos) / math.pi).mean()))
        valid = [(d, s) for s, d in enumerate(distances) if d is not None]
        if not valid:
            raise ValueError(f"no run of {b} consecutive blocks avoids protect={sorted(protected)}")
        best = min(valid, key=lambda t: (score_key(t[0]), t[1]))[1]
        record_set_values({set_key(range(s, s + b)): d for d, s in valid})
        results[b] = CriterionResult(
            "angular_distance", b, list(range(best, best + b)), None, 1, num_blocks, seconds,
            details={"distance_by_start": distances, "best_start": best, "protect": sorted(protected),
                     "token": "last real token of each prompt"},
        )
    return criterion_output(results, single)


def _sweep_cost(plan) -> dict:
    """One stream-capture sweep: every block over every batch, no output head (exact)."""
    return plan.counts(plan.forwards(plan.num_blocks), exact=True,
                       note="one stream-capture sweep: every block over each batch, no output head")


register_strategy("block_influence", needs_model=True, help="ShortGPT's Block Influence: the blocks whose input and output streams are closest in cosine", cost=_sweep_cost, guided_by=NO_PROTOCOL,
                  criteria={"block_influence": Criterion(block_influence)})(
    as_strategy("block_influence", block_influence))
register_strategy("angular_distance", needs_model=True, help="Gromov et al.: the contiguous run of blocks whose input and output are closest in angle", cost=_sweep_cost, guided_by=NO_PROTOCOL,
                  criteria={"angular_distance": Criterion(angular_distance)})(
    as_strategy("angular_distance", angular_distance))
