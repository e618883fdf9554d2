"""Layer-removal criteria, ours and the field's, measured in one harness.

Every criterion reads the same calibration prompts (a
:class:`~hf_layerswap.calibration.CalibrationSet`), takes the same budget ``n`` (blocks to
remove) and returns a :class:`CriterionResult`: the removed blocks (0-based, ascending),
per-layer scores where the method has them, and its cost in calibration forward passes
and seconds. :func:`compare_criteria` then evaluates every removed set with one
perplexity contract (:func:`~hf_layerswap.evaluation.evaluate_perplexity`) and one joint
removal KL on the calibration prompts, so the numbers are comparable.

Criteria (:data:`CRITERIA`):

``block_influence``
    ShortGPT (Men et al., arXiv 2403.03853): BI(l) = 1 - cos(x_l, x_{l+1}) between the raw
    residual stream entering and leaving block l, per real token, averaged (mean over the
    real tokens of a prompt, then over prompts); the n lowest go. Captured with forward
    hooks on the blocks (:func:`~hf_layerswap.plan.capture_residual_stream`), not
    ``output_hidden_states``, whose last entry is after the final norm.
``angular_distance``
    Gromov et al., "The Unreasonable Ineffectiveness of the Deeper Layers" (arXiv
    2403.17887): d(l, n) = arccos(cos(x_l, x_{l+n})) / pi between the stream entering block
    l and the stream leaving block l+n-1, at the last real token of each prompt, averaged
    over prompts; the contiguous run ``l..l+n-1`` with the smallest d goes.
``single_removal_kl``
    d_skip({l}) = E_x KL(p_M || p_{M-{l}}) for every block, one-shot ranking: the n lowest go.
``sleb``
    SLEB (Song et al., ICML 2024): iterative greedy removal; at each step every remaining
    block is removed tentatively and the one whose removal gives the lowest calibration
    NLL goes, then all remaining blocks are re-scored.
``random``
    n blocks drawn uniformly (seeded), ``draws`` independent draws (mean and spread).
``tail``
    The last n blocks before the final one: ``L-1-n .. L-2``.
``replacement`` / ``interchange`` / ``auto``
    No Free Swap (arXiv 2605.16234): the paper's greedy rule on the replacement or
    interchange swap-KL layer scores (:func:`~hf_layerswap.selection.select_layers`);
    ``auto`` keeps whichever protocol's set has the lower joint removal KL.
``interchange_beam``
    The paper's interchange-seeded beam search (App. G/K): the first level scores the
    ``seed_size`` layers with the lowest gap-1 interchange score, each later level expands
    every beam by every allowed block, ``width`` beams survive. Candidates are scored by
    an evaluator on the calibration prompts only (joint removal KL or NLL), never on the
    evaluation text; the number of evaluator calls is reported.

Cost units: a *forward pass* is one sweep of the model over every calibration prompt
(possibly starting at a later block by prefix reuse, see :mod:`hf_layerswap.scoring`);
*block passes* count block forward calls over the calibration set (a full forward of an
L-block model is L block passes).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import random as _random
import shutil
import statistics
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .calibration import CalibrationSet, build_calibration
from .plan import (
    apply_plan,
    capture_residual_stream,
    first_difference,
    interchange_plan,
    num_blocks,
    removal_plan,
    replacement_plan,
)
from .report import PairResult, SwapReport, _score_key, set_key, write_json_atomic
from .report import _decode_tree as _decode
from .report import _encode_tree as _encode
from .selection import greedy_select, resolve_protect, select_layers

__all__ = [
    "CRITERIA",
    "DEFAULT_CRITERIA",
    "CriterionComparison",
    "CriterionResult",
    "angular_distance",
    "block_influence",
    "compare_criteria",
    "interchange_beam",
    "merge_criteria_states",
    "merge_reports",
    "plan_nll",
    "protocol_gap_quartiles",
    "random_removal",
    "single_removal_kl",
    "sleb",
    "swap_guided",
    "tail_removal",
]

logger = logging.getLogger(__name__)

#: Beam evaluators: joint removal KL (nats) or calibration NLL (nats per token).
BEAM_EVALUATORS = ("removal_kl", "nll")


# ----------------------------------------------------------------------------- result type


@dataclass
class CriterionResult:
    """What a criterion chose for budget ``n`` and what it cost.

    Attributes:
        name: criterion name (a key of :data:`CRITERIA`).
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
        return json.loads(json.dumps(_encode(asdict(self)), allow_nan=False))

    @classmethod
    def from_dict(cls, data: Mapping) -> CriterionResult:
        data = _decode(dict(data))
        return cls(**data)


# ----------------------------------------------------------------------------- helpers


def _calibration(model, calibration, tokenizer) -> CalibrationSet:
    if isinstance(calibration, CalibrationSet):
        return calibration
    if tokenizer is None:
        tokenizer = getattr(model, "layerswap_tokenizer", None)
    return build_calibration(calibration, tokenizer)


def _budgets(n, num_layers: int) -> tuple[list[int], bool]:
    """(sorted unique budgets, whether a single int was given)."""
    single = isinstance(n, int) and not isinstance(n, bool)
    values = [n] if single else list(n)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= num_layers - 1:
            raise ValueError(f"budget n={v!r}: allowed ints 1..{num_layers - 1} for a model with {num_layers} blocks")
    if not values:
        raise ValueError("no budget given: pass n as an int or a non-empty list of ints")
    return sorted(set(values)), single


def _out(results: dict[int, CriterionResult], single: bool):
    return next(iter(results.values())) if single else results


def _allowed(num_layers: int, protect) -> list[int]:
    protected = resolve_protect(protect, num_layers)
    return [i for i in range(num_layers) if i not in protected]


def _plans_cost(plans: Mapping[Hashable, Sequence[int]], num_layers: int) -> tuple[int, int]:
    """(forward passes, block passes) of one reference sweep plus one sweep per plan with
    prefix reuse (the same accounting as :func:`~hf_layerswap.scoring.plan_kl`)."""
    blocks = num_layers
    for plan in plans.values():
        start = first_difference(plan, num_layers)
        if start >= len(plan) and len(plan) == num_layers:
            continue
        blocks += len(plan) - min(start, len(plan) - 1)
    return 1 + len(plans), blocks


def _setup(model, calibration, tokenizer, n) -> tuple[CalibrationSet, int, list[int], bool]:
    """(calibration set, L, sorted budgets, whether one int budget was given)."""
    calib = _calibration(model, calibration, tokenizer)
    num_layers = num_blocks(model)
    if num_layers < 2:
        raise ValueError(f"the model has {num_layers} block(s); layer removal needs at least 2")
    budgets, single = _budgets(n, num_layers)
    return calib, num_layers, budgets, single


# ----------------------------------------------------------------------------- NLL engine


def _masked_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-prompt summed next-token NLL (nats) over real targets: position t predicts t+1
    where both are real. Returns ``(B,)`` float64; fp32 log-softmax, chunked."""
    bsz, seqlen, vocab = logits.shape
    target_mask = (attention_mask[:, 1:] * attention_mask[:, :-1]).bool()
    rows = target_mask.reshape(-1).nonzero().squeeze(1)
    flat_logits = logits[:, :-1].reshape(-1, vocab)
    flat_targets = input_ids[:, 1:].reshape(-1)
    prompt_of_row = rows // (seqlen - 1)
    sums = torch.zeros(bsz, dtype=torch.float64)
    for start in range(0, rows.numel(), 256):
        idx = rows[start : start + 256]
        nll = F.cross_entropy(flat_logits.index_select(0, idx).float(), flat_targets.index_select(0, idx), reduction="none")
        sums.index_add_(0, prompt_of_row[start : start + 256].cpu(), nll.double().cpu())
    return sums


@torch.no_grad()
def plan_nll(
    model: nn.Module,
    calibration: CalibrationSet,
    plans: Mapping[Hashable, Sequence[int]],
    *,
    batch_size: int = 8,
) -> tuple[dict[Hashable, torch.Tensor], torch.Tensor, dict]:
    """Calibration next-token NLL of the model under every plan, with prefix reuse.

    The identity plan runs once per batch (it gives the reference NLL and the residual
    stream entering every slot); a plan that first differs from identity at slot s starts
    from the cached stream entering s.

    Args:
        model: a causal LM with L decoder blocks.
        calibration: ``N`` right-padded prompts.
        plans: name -> block plan (see :mod:`hf_layerswap.plan`).
        batch_size: prompts per forward pass.

    Returns:
        ``(values, counts, stats)``: ``values[name]`` is a ``(N,)`` float64 tensor of
        per-prompt summed NLL in nats (targets: every real token after the first);
        ``counts`` the ``(N,)`` number of predicted tokens per prompt; ``stats`` has
        ``base`` (``(N,)`` NLL sums of the unmodified model), ``forward_passes``,
        ``block_passes`` and ``seconds``. Calibration NLL per token of a plan is
        ``values[name].sum() / counts.sum()``.

    The model is left exactly as it was.
    """
    num_layers = num_blocks(model)
    plans = {name: list(plan) for name, plan in plans.items()}
    starts = {name: first_difference(plan, num_layers) for name, plan in plans.items()}
    needed = sorted({min(s, len(plans[k]) - 1) for k, s in starts.items() if 0 < min(s, len(plans[k]) - 1)})
    values: dict[Hashable, list[torch.Tensor]] = {name: [] for name in plans}
    base, counts = [], []
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    try:
        for ids, mask in calibration.batches(batch_size):
            ids, mask = ids.to(device), mask.to(device)
            streams, logits = capture_residual_stream(model, ids, mask, slots=needed or [0], compute_logits=True)
            ref = _masked_nll(logits, ids, mask)
            del logits
            base.append(ref)
            counts.append((mask[:, 1:] * mask[:, :-1]).sum(dim=1).cpu())
            for name, plan in plans.items():
                start = starts[name]
                if start >= len(plan) and len(plan) == num_layers:
                    values[name].append(ref.clone())
                    continue
                start = min(start, len(plan) - 1)
                kwargs = {"start": start, "start_hidden": streams[start]} if start > 0 else {}
                with apply_plan(model, plan, **kwargs):
                    out = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                values[name].append(_masked_nll(out, ids, mask))
                del out
            del streams
    finally:
        model.train(was_training)
    passes, blocks = _plans_cost(plans, num_layers)
    stats = {
        "base": torch.cat(base),
        "forward_passes": passes,
        "block_passes": blocks,
        "seconds": time.perf_counter() - t0,
    }
    return {name: torch.cat(v) for name, v in values.items()}, torch.cat(counts).long(), stats


def _removal_kl_values(model, calibration, sets: Sequence[Sequence[int]], batch_size: int) -> tuple[list[float], dict]:
    """Joint removal KL (nats) of each set, one shared reference sweep (plan_kl)."""
    from .scoring import plan_kl

    num_layers = num_blocks(model)
    plans = {k: removal_plan(num_layers, s) for k, s in enumerate(sets)}
    values, stats = plan_kl(model, calibration, plans, batch_size=batch_size)
    passes, blocks = _plans_cost(plans, num_layers)
    return [float(values[k].mean()) for k in range(len(sets))], {
        "forward_passes": passes,
        "block_passes": blocks,
        "seconds": stats["seconds"],
    }


def _removal_nll_values(model, calibration, sets: Sequence[Sequence[int]], batch_size: int) -> tuple[list[float], dict]:
    """Calibration NLL per token (nats) with each set removed, one shared reference sweep."""
    num_layers = num_blocks(model)
    plans = {k: removal_plan(num_layers, s) for k, s in enumerate(sets)}
    values, counts, stats = plan_nll(model, calibration, plans, batch_size=batch_size)
    total = float(counts.sum())
    return [float(values[k].sum()) / total for k in range(len(sets))], stats


# ----------------------------------------------------------------------------- geometry criteria


@torch.no_grad()
def _stream_geometry(model, calibration: CalibrationSet, batch_size: int):
    """One stream-capture sweep: per-prompt BI per block ``(N, L)`` (float64) and the
    residual stream at each prompt's last real token for every slot ``(N, L+1, H)``."""
    num_layers = num_blocks(model)
    bi_rows, last_rows = [], []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for ids, mask in calibration.batches(batch_size):
            ids, mask = ids.to(device), mask.to(device)
            streams, _ = capture_residual_stream(model, ids, mask)
            real = mask.bool()
            per_prompt = mask.sum(dim=1).double()
            bi = torch.empty(ids.shape[0], num_layers, dtype=torch.float64)
            for layer in range(num_layers):
                cos = F.cosine_similarity(streams[layer].double(), streams[layer + 1].double(), dim=-1)
                bi[:, layer] = ((1.0 - cos) * real).sum(dim=1).cpu() / per_prompt.cpu()
            last = mask.sum(dim=1) - 1
            rows = torch.arange(ids.shape[0], device=ids.device)
            stacked = torch.stack([streams[s][rows, last] for s in range(num_layers + 1)], dim=1)
            bi_rows.append(bi)
            last_rows.append(stacked.double().cpu())
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
    calib, num_layers, budgets, single = _setup(model, calibration, tokenizer, n)
    t0 = time.perf_counter()
    bi, _ = _stream_geometry(model, calib, batch_size)
    seconds = time.perf_counter() - t0
    scores = [float(v) for v in bi.mean(dim=0)]
    results = {}
    for b in budgets:
        removed = greedy_select(scores, b, spacing=0, protect=protect)
        results[b] = CriterionResult(
            "block_influence", b, removed, scores, 1, num_layers, seconds,
            details={"protect": sorted(resolve_protect(protect, num_layers)), "token_averaging": "per prompt, then prompts",
                     "capture": "forward hooks on the blocks (raw residual stream, before the final norm)"},
        )
    return _out(results, single)


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
    calib, num_layers, budgets, single = _setup(model, calibration, tokenizer, n)
    protected = resolve_protect(protect, num_layers)
    t0 = time.perf_counter()
    _, last = _stream_geometry(model, calib, batch_size)
    seconds = time.perf_counter() - t0
    results = {}
    for b in budgets:
        distances: list[float | None] = []
        for start in range(num_layers - b + 1):
            if protected & set(range(start, start + b)):
                distances.append(None)
                continue
            cos = F.cosine_similarity(last[:, start], last[:, start + b], dim=-1).clamp(-1.0, 1.0)
            distances.append(float((torch.arccos(cos) / math.pi).mean()))
        valid = [(d, s) for s, d in enumerate(distances) if d is not None]
        if not valid:
            raise ValueError(f"no run of {b} consecutive blocks avoids protect={sorted(protected)}")
        best = min(valid, key=lambda t: (_score_key(t[0]), t[1]))[1]
        results[b] = CriterionResult(
            "angular_distance", b, list(range(best, best + b)), None, 1, num_layers, seconds,
            details={"distance_by_start": distances, "best_start": best, "protect": sorted(protected),
                     "token": "last real token of each prompt"},
        )
    return _out(results, single)


# ----------------------------------------------------------------------------- output-grounded baselines


def single_removal_kl(
    model: nn.Module,
    calibration,
    n: int | Sequence[int],
    *,
    tokenizer=None,
    protect: Sequence[int] = (0, -1),
    batch_size: int = 8,
    resume: CriterionResult | None = None,
):
    """One-shot ranking by the single-block removal KL d_skip({l}) = E_x KL(p_M || p_{M-{l}})
    (nats; mean over real tokens per prompt, then over prompts; fp32 log-softmax).

    Every block is scored (L removal probes sharing one reference sweep, with prefix
    reuse); the ``n`` unprotected blocks with the lowest values are removed (no spacing).

    Args:
        resume: a result of this criterion for a smaller budget with the same ``protect``:
            its per-block scores (and their cost) are reused, nothing is scored again.

    Returns:
        :class:`CriterionResult` (``scores`` = d_skip per block). Cost: L+1 forward passes.

    Raises:
        ValueError: a budget outside ``1..L-1`` or more than the unprotected blocks, or a
            ``resume`` of another criterion, budget or protection.
    """
    calib, num_layers, budgets, single = _setup(model, calibration, tokenizer, n)
    if resume is not None:
        _check_resume(resume, "single_removal_kl", budgets, protect=sorted(resolve_protect(protect, num_layers)))
        values = list(resume.scores)
        stats = {"forward_passes": resume.forward_passes, "block_passes": resume.block_passes, "seconds": resume.seconds}
    else:
        values, stats = _removal_kl_values(model, calib, [[i] for i in range(num_layers)], batch_size)
    results = {}
    for b in budgets:
        removed = greedy_select(values, b, spacing=0, protect=protect)
        results[b] = CriterionResult(
            "single_removal_kl", b, removed, values, stats["forward_passes"], stats["block_passes"], stats["seconds"],
            details={"protect": sorted(resolve_protect(protect, num_layers)), "unit": "nats"},
        )
    return _out(results, single)


def sleb(
    model: nn.Module,
    calibration,
    n: int | Sequence[int],
    *,
    tokenizer=None,
    protect: Sequence[int] = (0, -1),
    batch_size: int = 8,
    resume: CriterionResult | None = None,
):
    """SLEB (Song et al., ICML 2024): iterative greedy block removal by calibration NLL.

    Step k tentatively removes each remaining unprotected block from the current set
    (a removal plan, no weight copies), computes the calibration NLL per token
    (:func:`plan_nll`; nats, pooled over all predicted tokens, i.e. log PPL), and removes
    the block with the lowest NLL (ties: lowest index). All remaining blocks are
    re-scored after each removal. SLEB's first and last blocks are never removed
    (``protect=(0, -1)``, its ``early_barrier``/``latter_barrier`` of 1).

    Args:
        n: budget or list of budgets; the search runs once to the largest, and each
            budget's result is the prefix of that run with the cost spent up to it.
        resume: a SLEB result for a smaller budget on the same model, prompts and
            ``protect``: the search continues from it (same sets and costs as one run).

    Returns:
        :class:`CriterionResult`: ``scores`` = the first step's NLL per block (``None``
        for protected blocks); ``details["steps"]`` = per step the chosen block and every
        candidate's NLL. ``evaluator_calls`` = candidate sets scored.

    Raises:
        ValueError: a budget outside ``1..L-1`` or more than the unprotected blocks.
    """
    calib, num_layers, budgets, single = _setup(model, calibration, tokenizer, n)
    allowed = _allowed(num_layers, protect)
    if budgets[-1] > len(allowed):
        raise ValueError(f"n={budgets[-1]} exceeds the {len(allowed)} unprotected blocks (protect={list(protect)})")
    removed: list[int] = []
    steps, results = [], {}
    passes = blocks = calls = 0
    seconds = 0.0
    first_scores: list[float | None] = [None] * num_layers
    base_nll = None
    first_step = 1
    if resume is not None:
        _check_resume(resume, "sleb", budgets, protect=sorted(resolve_protect(protect, num_layers)))
        removed, steps = list(resume.removed), copy.deepcopy(resume.details["steps"])
        passes, blocks, calls, seconds = resume.forward_passes, resume.block_passes, resume.evaluator_calls, resume.seconds
        first_scores, base_nll, first_step = list(resume.scores), resume.details["base_nll"], resume.n + 1
    for k in range(first_step, budgets[-1] + 1):
        candidates = [b for b in allowed if b not in removed]
        sets = [sorted(removed + [b]) for b in candidates]
        nll, stats = _removal_nll_values(model, calib, sets, batch_size)
        if base_nll is None:
            base_nll = float(stats["base"].sum()) / float(_num_targets(calib))
        passes += stats["forward_passes"]
        blocks += stats["block_passes"]
        seconds += stats["seconds"]
        calls += len(sets)
        best = min(range(len(candidates)), key=lambda c: (_score_key(nll[c]), candidates[c]))
        if k == 1:
            for b, v in zip(candidates, nll):
                first_scores[b] = v
        removed = sets[best]
        steps.append({"removed": candidates[best], "nll": nll[best], "candidates": dict(zip(map(str, candidates), nll))})
        if k in budgets:
            results[k] = CriterionResult(
                "sleb", k, list(removed), first_scores, passes, blocks, seconds, evaluator_calls=calls,
                details={"protect": sorted(resolve_protect(protect, num_layers)), "base_nll": base_nll,
                         "unit": "nats per token", "steps": copy.deepcopy(steps)},
            )
    return _out(results, single)


def _check_resume(resume: CriterionResult, name: str, budgets: Sequence[int], **expected) -> None:
    if resume.name != name or resume.n >= min(budgets):
        raise ValueError(
            f"resume must be a {name!r} result for a budget below {min(budgets)}; got {resume.name!r} at n={resume.n}"
        )
    for key, value in expected.items():
        if resume.details.get(key) != value:
            raise ValueError(f"resume was run with {key}={resume.details.get(key)!r}, not {value!r}")


def _num_targets(calib: CalibrationSet) -> int:
    m = calib.attention_mask
    return int((m[:, 1:] * m[:, :-1]).sum())


def random_removal(
    model_or_num_layers,
    n: int | Sequence[int],
    *,
    seed: int = 0,
    draws: int = 5,
    protect: Sequence[int] = (0, -1),
):
    """Random control: ``draws`` independent draws of ``n`` distinct unprotected blocks.

    Draws come from ``random.Random(seed + 1000 * n)`` (Python's Mersenne Twister), so a
    budget's draws are reproducible from the seed and independent of the other budgets.

    Args:
        model_or_num_layers: a model (its block count is used) or L.
        draws: at least 1 (the benchmark uses 5 and reports mean and spread).

    Returns:
        :class:`CriterionResult`: ``removed`` = the first draw; ``details["draws"]`` all
        draws (each ascending). No forward pass.

    Raises:
        ValueError: ``draws < 1`` or a budget larger than the unprotected blocks.
    """
    num_layers = model_or_num_layers if isinstance(model_or_num_layers, int) else num_blocks(model_or_num_layers)
    budgets, single = _budgets(n, num_layers)
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"draws={draws!r}: must be an int >= 1")
    allowed = _allowed(num_layers, protect)
    results = {}
    for b in budgets:
        if b > len(allowed):
            raise ValueError(f"n={b} exceeds the {len(allowed)} unprotected blocks (protect={list(protect)})")
        rng = _random.Random(seed + 1000 * b)
        sets = [sorted(rng.sample(allowed, b)) for _ in range(draws)]
        results[b] = CriterionResult(
            "random", b, sets[0], None, 0, 0, 0.0,
            details={"draws": sets, "seed": seed, "rng": "random.Random(seed + 1000 * n)",
                     "protect": sorted(resolve_protect(protect, num_layers))},
        )
    return _out(results, single)


def tail_removal(model_or_num_layers, n: int | Sequence[int]):
    """Tail control: remove the last ``n`` blocks before the final one, ``L-1-n .. L-2``.

    Raises:
        ValueError: a budget outside ``1..L-2``.
    """
    num_layers = model_or_num_layers if isinstance(model_or_num_layers, int) else num_blocks(model_or_num_layers)
    budgets, single = _budgets(n, num_layers)
    if budgets[-1] > num_layers - 1 - 1:
        raise ValueError(f"tail n={budgets[-1]}: at most L-2={num_layers - 2} blocks lie between the first and the last")
    results = {
        b: CriterionResult("tail", b, list(range(num_layers - 1 - b, num_layers - 1)), None, 0, 0, 0.0)
        for b in budgets
    }
    return _out(results, single)


# ----------------------------------------------------------------------------- ours


def merge_reports(*reports: SwapReport) -> SwapReport:
    """Merge swap-KL reports of the same model and calibration prompts (e.g. one per
    protocol, or a gap-1 report and a gap-2..3 extension) into one.

    Pair values present in several reports must agree exactly. ``metadata`` keeps the first
    report's fields, with ``forward_passes``/``block_evaluations``/``seconds`` summed and
    ``merged_from`` recording each part.

    Raises:
        ValueError: reports of different block counts or calibration content, or
            conflicting values for the same pair.
    """
    if not reports:
        raise ValueError("merge_reports needs at least one report")
    first = reports[0]
    hashes = {r.metadata.get("calibration", {}).get("content_hash") for r in reports}
    if len({r.num_layers for r in reports}) != 1 or len(hashes) != 1:
        raise ValueError("merge_reports: the reports differ in block count or calibration content hash")
    pairs: dict[tuple[int, int], dict] = {}
    value_fields = ("replacement_ij", "replacement_ji", "interchange")
    for r in reports:
        for p in r.pairs:
            slot = pairs.setdefault((p.i, p.j), {})
            for f in value_fields:
                v = getattr(p, f)
                if v is None:
                    continue
                if f in slot and not (slot[f] == v or (math.isnan(slot[f]) and math.isnan(v))):
                    raise ValueError(f"merge_reports: pair ({p.i}, {p.j}) has two different {f} values")
                slot[f] = v
                slot[f + "_se"] = getattr(p, f + "_se")
    protocols = tuple(p for p in ("replacement", "interchange") if any(p in r.protocols for r in reports))
    metadata = copy.deepcopy(first.metadata)
    for key in ("forward_passes", "block_evaluations", "seconds"):
        if all(key in r.metadata for r in reports):
            metadata[key] = sum(r.metadata[key] for r in reports)
    metadata["merged_from"] = [
        {"protocols": list(r.protocols), "max_gap": r.max_gap, "pairs": len(r.pairs),
         **{k: r.metadata.get(k) for k in ("forward_passes", "seconds")}}
        for r in reports
    ]
    merged = SwapReport(
        first.num_layers,
        [PairResult(i, j, **v) for (i, j), v in pairs.items()],
        protocols=protocols,
        max_gap=max(r.max_gap for r in reports),
        metadata=metadata,
    )
    for r in reports:
        merged.removal_kl.update(r.removal_kl)
    return merged


def _gap1(report: SwapReport) -> SwapReport:
    """The adjacent-pair part of a report (the paper's selection uses gap-1 scores)."""
    if report.max_gap == 1:
        return report
    sub = SwapReport(report.num_layers, [p for p in report.pairs if p.gap == 1], protocols=report.protocols,
                     max_gap=1, metadata=report.metadata)
    sub.removal_kl = report.removal_kl
    return sub


def _report_cost(report: SwapReport, protocols: Sequence[str]) -> tuple[int, int, float, bool]:
    """(forward passes, block passes, seconds, estimated) of scoring the adjacent pairs of
    ``protocols`` with prefix reuse.

    Passes are exact counts of the probes. Seconds are the report's measured time when it
    scored exactly these probes; otherwise that time scaled by the share of block passes,
    and ``estimated`` is True."""
    num_layers = report.num_layers

    def plans_for(pairs, protos):
        plans = {}
        for p in pairs:
            if "interchange" in protos:
                plans[("interchange", p.i, p.j)] = interchange_plan(num_layers, p.i, p.j)
            if "replacement" in protos:
                plans[("replacement_ij", p.i, p.j)] = replacement_plan(num_layers, p.i, p.j)
                plans[("replacement_ji", p.i, p.j)] = replacement_plan(num_layers, p.j, p.i)
        return plans

    passes, blocks = _plans_cost(plans_for([p for p in report.pairs if p.gap == 1], protocols), num_layers)
    all_passes, all_blocks = _plans_cost(plans_for(report.pairs, report.protocols), num_layers)
    seconds = float(report.metadata.get("seconds", 0.0))
    estimated = (passes, blocks) != (all_passes, all_blocks)
    if estimated:
        seconds *= blocks / all_blocks
    return passes, blocks, seconds, estimated


def _score(model, calib, protocols, batch_size, checkpoint_path=None) -> SwapReport:
    from .scoring import score_layers

    return score_layers(model, calib, protocols=protocols, max_gap=1, batch_size=batch_size, progress=False,
                        checkpoint_path=checkpoint_path)


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
        report: a :class:`~hf_layerswap.report.SwapReport` of this model on these
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
    calib, num_layers, budgets, single = _setup(model, calibration, tokenizer, n)
    needed = ("replacement", "interchange") if protocol == "auto" else (protocol,)
    if report is None:
        report = _score(model, calib, needed, batch_size)
    missing = [p for p in needed if p not in report.protocols]
    if missing:
        raise ValueError(f"the report did not score {missing} (scored: {list(report.protocols)})")
    if report.num_layers != num_layers:
        raise ValueError(f"the report has {report.num_layers} blocks but the model has {num_layers}")
    sub = _gap1(report)
    passes, blocks, seconds, estimated = _report_cost(report, needed)
    results = {}
    for b in budgets:
        extra_passes = extra_blocks = 0
        extra_seconds = 0.0
        details = {"protocol": protocol, "spacing": spacing, "protect": sorted(resolve_protect(protect, num_layers)),
                   "score_pairs": "adjacent (gap 1)", "seconds_estimated": estimated, "unit": "nats"}
        if protocol == "auto":
            candidates = {p: greedy_select(sub.layer_scores(p), b, spacing=spacing, protect=protect) for p in needed}
            distinct = {set_key(s): s for s in candidates.values()}
            todo = [s for k, s in distinct.items() if k not in sub.removal_kl]
            if len(distinct) > 1:
                extra_passes, extra_blocks = _plans_cost(
                    {k: removal_plan(num_layers, s) for k, s in distinct.items()}, num_layers)
                if todo:
                    values, stats = _removal_kl_values(model, calib, todo, batch_size)
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
    return _out(results, single)


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
    calib, num_layers, budgets, single = _setup(model, calibration, tokenizer, n)
    allowed = _allowed(num_layers, protect)
    if budgets[-1] > len(allowed):
        raise ValueError(f"n={budgets[-1]} exceeds the {len(allowed)} unprotected blocks (protect={list(protect)})")
    if report is None:
        report = _score(model, calib, ("interchange",), batch_size)
    if "interchange" not in report.protocols:
        raise ValueError(f"the beam is seeded by interchange scores; the report scored {list(report.protocols)}")
    sub = _gap1(report)
    passes, blocks, seconds, estimated = _report_cost(report, ("interchange",))
    scores = sub.layer_scores("interchange")
    seeds = sorted(allowed, key=lambda i: (_score_key(scores[i]), i))[:seed_size]
    score_fn = _removal_kl_values if evaluator == "removal_kl" else _removal_nll_values
    cache: dict[str, float] = {}
    beams: list[list[int]] = []
    levels, results = [], {}
    calls = 0
    first_level = 1
    if resume is not None:
        _check_resume(resume, "interchange_beam", budgets, evaluator=evaluator, width=width, seed_size=seed_size,
                      seeds=seeds, include_greedy=include_greedy, protect=sorted(resolve_protect(protect, num_layers)))
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
        ranked = sorted(pool, key=lambda s: (_score_key(cache[set_key(s)]), s))
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
                         "protect": sorted(resolve_protect(protect, num_layers)), "include_greedy": include_greedy,
                         "score": cache[set_key(beams[0])], "levels": copy.deepcopy(levels),
                         "unit": "nats" if evaluator == "removal_kl" else "nats per token"},
            )
    return _out(results, single)


# ----------------------------------------------------------------------------- registry


def _interchange(model, calib, n, **kw):
    return swap_guided(model, calib, n, protocol="interchange", **kw)


def _replacement(model, calib, n, **kw):
    return swap_guided(model, calib, n, protocol="replacement", **kw)


def _auto(model, calib, n, **kw):
    return swap_guided(model, calib, n, protocol="auto", **kw)


#: Criterion name -> function ``(model, calibration_set, budgets, **options) -> {n: CriterionResult}``.
CRITERIA: dict[str, Callable] = {
    "block_influence": block_influence,
    "angular_distance": angular_distance,
    "single_removal_kl": single_removal_kl,
    "sleb": sleb,
    "random": lambda model, calib, n, **kw: random_removal(model, n, **kw),
    "tail": lambda model, calib, n, **kw: tail_removal(model, n),
    "replacement": _replacement,
    "interchange": _interchange,
    "auto": _auto,
    "interchange_beam": interchange_beam,
    "search": lambda model, calib, n, **kw: _search_criterion(model, calib, n, objective="removal_kl", **kw),
    "search_ghosted": lambda model, calib, n, **kw: _search_criterion(model, calib, n, objective="ghosted", **kw),
}


def _search_criterion(model, calib, n, **kw):
    from .search import search_criterion

    return search_criterion(model, calib, n, **kw)

DEFAULT_CRITERIA = tuple(CRITERIA)

#: Criteria that can reuse a shared SwapReport (``report=``).
_REPORT_CRITERIA = {"replacement", "interchange", "auto", "interchange_beam", "search", "search_ghosted"}
#: Criteria that read both protocols' scores.
_BOTH_PROTOCOLS = {"auto", "search", "search_ghosted"}


# ----------------------------------------------------------------------------- protocol-gap summary


def protocol_gap_quartiles(report: SwapReport) -> dict:
    """Protocol-gap summary by pair distance: for each gap, the number of pairs with
    finite values, the fraction with interchange <= replacement, and the quartiles
    (25/50/75%) of I/R = d_inter / d_repl; plus the same over all pairs.

    Raises:
        ValueError: the report lacks one of the two protocols.
    """
    gap = report.protocol_gap()
    by_gap: dict[int, list] = {}
    for row in gap["pairs"]:
        if row["ratio"] is not None:
            by_gap.setdefault(row["gap"], []).append(row)

    def summary(rows):
        ratios = sorted(r["ratio"] for r in rows)
        q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
        return {
            "pairs": len(rows),
            "fraction_interchange_le_replacement": sum(r["interchange"] <= r["replacement"] for r in rows) / len(rows),
            "ratio_q25": q[0], "ratio_median": q[1], "ratio_q75": q[2],
            "ratio_min": ratios[0], "ratio_max": ratios[-1],
        }

    out = {"by_gap": {g: summary(rows) for g, rows in sorted(by_gap.items())}}
    all_rows = [r for rows in by_gap.values() for r in rows]
    out["all"] = summary(all_rows) if all_rows else None
    out["non_finite_pairs"] = gap["summary"]["pairs"] - gap["summary"]["finite_pairs"]
    return out


# ----------------------------------------------------------------------------- comparison harness


@dataclass
class CriterionComparison:
    """Every criterion's removed set per budget, evaluated under one contract.

    Attributes:
        rows: one dict per (criterion, n): ``criterion``, ``n``, ``removed`` (for
            ``random`` the draws), ``ppl``, ``dppl`` (%), ``dppl_ci`` (paired bootstrap
            95% interval, %), ``removal_kl`` (joint, calibration prompts, nats),
            ``forward_passes``, ``block_passes``, ``evaluator_calls``, ``seconds``; random
            rows add ``dppl_sd``, ``dppl_min``, ``dppl_max``, ``draws``.
        base: the unpruned model's perplexity result (dict).
        contract: the evaluation contract every number was measured under.
        calibration: the calibration set's spec.
        evaluation_method: ``"copy"`` (a deep copy pruned with
            :func:`~hf_layerswap.surgery.remove_layers`) or ``"plan"`` (a removal plan).
        results: ``{criterion: {n: CriterionResult dict}}``.
        model: the model's identity.
        params: budgets, criteria, options, batch size.
        reports: the swap-KL reports the swap-guided criteria and the beam used
            (``{name: SwapReport dict}``).
        evaluation_seconds: wall-clock seconds of each perplexity evaluation, by removed
            set (``"i,j,..."``; ``""`` = the unpruned model).
    """

    rows: list[dict]
    base: dict
    contract: dict
    calibration: dict
    evaluation_method: str
    results: dict
    model: dict
    params: dict = field(default_factory=dict)
    reports: dict = field(default_factory=dict)
    evaluation_seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(_encode(asdict(self)), allow_nan=False))

    def best_by_n(self) -> dict[int, list[str]]:
        """Budget -> criteria with the lowest dPPL% (random excluded; ties listed together)."""
        out: dict[int, list[str]] = {}
        for n in sorted({r["n"] for r in self.rows}):
            rows = [r for r in self.rows if r["n"] == n and r["criterion"] != "random" and r["dppl"] is not None]
            if rows:
                best = min(r["dppl"] for r in rows)
                out[n] = [r["criterion"] for r in rows if r["dppl"] == best]
        return out

    def to_markdown(self) -> str:
        """One table: criterion, n, removed, PPL, dPPL% [CI], joint removal KL, cost."""
        c = self.contract
        bos = c.get("bos", {})
        lines = [
            f"Base PPL {self.base['ppl']:.4f} [{_fmt(self.base.get('ci_low'))}, {_fmt(self.base.get('ci_high'))}]; "
            f"contract `{c.get('name')}`: {c.get('source')} ({c.get('split')}), {c.get('words')} words, "
            f"{c.get('num_input_tokens')} tokens, window {c.get('window')}, stride {c.get('stride')}, "
            f"{c.get('scored_tokens')} scored tokens in {c.get('windows')} windows, BOS "
            f"{'added' if bos.get('add_bos') else 'not added'} ({bos.get('bos_choice')}), dtype {c.get('dtype')}, "
            f"CI: paired bootstrap over windows (2,000 resamples, seed 42) on dPPL%.",
            f"Calibration: {self.calibration.get('description')}, {self.calibration.get('num_prompts')} prompts, "
            f"{self.calibration.get('num_tokens')} tokens (hash {str(self.calibration.get('content_hash'))[:12]}). "
            f"Removed sets evaluated by {'pruning a deep copy (remove_layers)' if self.evaluation_method == 'copy' else 'a removal plan'}.",
            "",
            "| criterion | n | removed (0-based) | PPL | dPPL % | 95% CI (dPPL %) | removal KL (nats) | forward passes | evaluator calls | seconds |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            if r["criterion"] == "random":
                removed = "; ".join(",".join(map(str, s)) for s in r["draws"])
                dppl = f"{r['dppl']:+.1f} (sd {r['dppl_sd']:.1f})"
                ci = f"draws {r['dppl_min']:+.1f} .. {r['dppl_max']:+.1f}"
                ppl = f"{r['ppl']:.3f} (mean)"
                kl = f"{r['removal_kl']:.4f} (mean)" if r.get("removal_kl") is not None else "-"
            else:
                removed = ",".join(map(str, r["removed"]))
                dppl = f"{r['dppl']:+.1f}"
                ci = f"[{r['dppl_ci'][0]:+.1f}, {r['dppl_ci'][1]:+.1f}]" if r.get("dppl_ci") else "-"
                ppl = f"{r['ppl']:.3f}"
                kl = f"{r['removal_kl']:.4f}" if r.get("removal_kl") is not None else "-"
            calls = "-" if r.get("evaluator_calls") is None else str(r["evaluator_calls"])
            lines.append(
                f"| {r['criterion']} | {r['n']} | {removed} | {ppl} | {dppl} | {ci} | {kl} | "
                f"{r['forward_passes']} | {calls} | {r['seconds']:.0f} |"
            )
        return "\n".join(lines) + "\n"


def _public_identity(identity: Mapping | None) -> dict:
    """A model identity without the local path it was read from (results get published)."""
    return {k: v for k, v in dict(identity or {}).items() if k != "path"}


def _public_contract(contract: dict) -> dict:
    out = dict(contract)
    if isinstance(out.get("model"), Mapping):
        out["model"] = _public_identity(out["model"])
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _text_fingerprint(text) -> str:
    if text is None:
        return "embedded"
    path = Path(text) if isinstance(text, (str, Path)) and "\n" not in str(text) and len(str(text)) < 4096 else None
    data = path.read_bytes() if path is not None and path.is_file() else str(text).encode()
    return hashlib.sha256(data).hexdigest()


def _evaluate_removed(model, removed, eval_text, tokenizer, contract, method, eval_kwargs):
    from .evaluation import evaluate_perplexity

    if not removed:
        return evaluate_perplexity(model, eval_text, tokenizer=tokenizer, contract=contract, **eval_kwargs)
    if method == "plan":
        with apply_plan(model, removal_plan(num_blocks(model), removed)):
            return evaluate_perplexity(model, eval_text, tokenizer=tokenizer, contract=contract, **eval_kwargs)
    from .surgery import remove_layers

    pruned = copy.deepcopy(model)
    try:
        remove_layers(pruned, removed)
        return evaluate_perplexity(pruned, eval_text, tokenizer=tokenizer, contract=contract, **eval_kwargs)
    finally:
        del pruned


def compare_criteria(
    model: nn.Module,
    calibration,
    budgets: Sequence[int],
    *,
    criteria: Sequence[str] = DEFAULT_CRITERIA,
    eval_text=None,
    tokenizer=None,
    contract: str = "matched",
    evaluation_options: Mapping | None = None,
    evaluation_method: str = "copy",
    report: SwapReport | None = None,
    options: Mapping[str, Mapping] | None = None,
    joint_kl: bool = True,
    batch_size: int = 8,
    eval_batch_size: int = 2,
    state_path=None,
    log: Callable[[str], None] | None = None,
) -> CriterionComparison:
    """Run every criterion on the same calibration prompts and budgets, then evaluate
    every removed set under one perplexity contract.

    Selection happens first and only ever sees ``calibration``; ``eval_text`` is read only
    afterwards, by :func:`~hf_layerswap.evaluation.evaluate_perplexity`.

    Args:
        model: the causal LM (left unchanged).
        calibration: a CalibrationSet or a source for
            :func:`~hf_layerswap.calibration.build_calibration` (with ``tokenizer``).
        budgets: the n values (blocks removed), each in ``1..L-2``.
        criteria: names from :data:`CRITERIA`.
        eval_text: evaluation text for ``evaluate_perplexity`` (path, string, or ``None``
            = the embedded evaluation split).
        tokenizer: the model's tokenizer (needed for text sources and evaluation).
        contract: ``"matched"`` or ``"full"`` (see :mod:`hf_layerswap.evaluation`).
        evaluation_options: overrides passed to ``evaluate_perplexity`` (``window``,
            ``stride``, ``max_words``, ``add_bos``, ``bootstrap``); recorded in the contract.
        evaluation_method: ``"copy"``: each set is removed from a deep copy with
            :func:`~hf_layerswap.surgery.remove_layers` (the checkpoint a user would
            ship); ``"plan"``: the model runs under a removal plan. Both give the same
            perplexity (tested); ``"plan"`` needs no second copy of the weights.
        report: a shared SwapReport with both protocols (any ``max_gap``); its adjacent
            pairs serve the swap-guided criteria and the beam. Scored here if ``None``
            (one report per protocol, so each criterion's cost is measured).
        options: per-criterion keyword options, e.g. ``{"random": {"draws": 5, "seed": 0},
            "interchange_beam": {"evaluator": "nll"}}``.
        joint_kl: also compute every set's joint removal KL on the calibration prompts.
        batch_size: calibration prompts per forward pass. eval_batch_size: windows per
            forward pass in evaluation.
        state_path: JSON file to resume from and to save progress to (written atomically
            after every step). A state recorded for another model, calibration set,
            evaluation text, contract or options raises instead of mixing results.
            While a protocol is scored, its completed probes are kept in the folder
            ``<state stem>.<protocol>-probes`` beside it (removed once the report is in
            the state), so a run killed mid-scoring loses no finished probe.
        log: progress callback (default: this module's logger at INFO).

    Returns:
        :class:`CriterionComparison`.

    Raises:
        ValueError: an unknown criterion or evaluation method, a bad budget, or a
            mismatching state file.
    """
    from .evaluation import delta_ppl_ci, delta_ppl_percent, PerplexityResult
    from .models import model_identity

    log = log or logger.info
    unknown = [c for c in criteria if c not in CRITERIA]
    if unknown:
        raise ValueError(f"unknown criteria {unknown}: allowed {list(CRITERIA)}")
    if evaluation_method not in ("copy", "plan"):
        raise ValueError(f"evaluation_method={evaluation_method!r}: allowed 'copy' or 'plan'")
    calib, num_layers, budgets, _ = _setup(model, calibration, tokenizer, list(budgets))
    options = {k: dict(v) for k, v in (options or {}).items()}
    fingerprint = {
        "model": model_identity(model).get("name"),
        "num_layers": num_layers,
        "calibration": calib.content_hash,
        "eval_text": _text_fingerprint(eval_text),
        "contract": contract,
        "evaluation_options": _encode(dict(evaluation_options or {})),
        "options": _encode(options),
    }
    state = {"format": "hf_layerswap.compare_criteria/1", "fingerprint": fingerprint, "criteria": {}, "ppl": {},
             "removal_kl": {}, "reports": {}}
    if state_path is not None and Path(state_path).is_file():
        loaded = json.loads(Path(state_path).read_text(encoding="utf-8"))
        if loaded.get("fingerprint") != fingerprint:
            raise ValueError(
                f"state file {state_path} was recorded for {loaded.get('fingerprint')}, not {fingerprint}: "
                "use another state_path or delete it"
            )
        state = loaded
        log(f"resuming from {state_path}")

    def save():
        if state_path is not None:
            write_json_atomic(state, state_path)

    # ---- shared swap-KL reports (one per protocol, so every criterion's cost is its own)
    reports: dict[str, SwapReport] = {}
    wanted = set(criteria) & _REPORT_CRITERIA
    if wanted and report is None:
        protos = set()
        if wanted & ({"interchange", "interchange_beam"} | _BOTH_PROTOCOLS):
            protos.add("interchange")
        if wanted & ({"replacement"} | _BOTH_PROTOCOLS):
            protos.add("replacement")
        for proto in sorted(protos):
            if proto in state["reports"]:
                reports[proto] = SwapReport.from_dict(state["reports"][proto])
            else:
                log(f"scoring {proto} swap-KL (adjacent pairs)")
                # completed probes survive a killed run next to the state file until the report is in it
                probes = None if state_path is None else Path(state_path).with_name(f"{Path(state_path).stem}.{proto}-probes")
                reports[proto] = _score(model, calib, (proto,), batch_size, checkpoint_path=probes)
                reports[proto].metadata["model"] = _public_identity(model_identity(model))
                state["reports"][proto] = reports[proto].to_dict()
                save()
                if probes is not None:
                    shutil.rmtree(probes, ignore_errors=True)

    def report_for(name: str) -> SwapReport:
        if report is not None:
            return report
        if name in _BOTH_PROTOCOLS:
            return merge_reports(reports["replacement"], reports["interchange"])
        return reports["interchange" if name in ("interchange", "interchange_beam") else "replacement"]

    # ---- selection (calibration prompts only)
    results: dict[str, dict[int, CriterionResult]] = {}
    for name in criteria:
        done = {int(k): CriterionResult.from_dict(v) for k, v in state["criteria"].get(name, {}).items()}
        todo = [b for b in budgets if b not in done]
        if todo:
            log(f"criterion {name}: budgets {todo}")
            kwargs = dict(options.get(name, {}))
            if name in _REPORT_CRITERIA:
                kwargs["report"] = report_for(name)
            if name not in ("random", "tail"):
                kwargs.setdefault("batch_size", batch_size)
            earlier = [b for b in done if b < min(todo)]
            if name in ("sleb", "interchange_beam", "single_removal_kl") and earlier:
                # iterative searches continue, not restart; a one-shot ranking reuses its scores
                kwargs["resume"] = done[max(earlier)]
            out = CRITERIA[name](model, calib, todo, **kwargs)
            out = out if isinstance(out, dict) else {todo[0]: out}
            done.update(out)
            state["criteria"][name] = {str(k): v.to_dict() for k, v in sorted(done.items())}
            save()
        results[name] = {b: done[b] for b in budgets}

    # ---- evaluation (the only place eval_text is read)
    def sets_of(res: CriterionResult) -> list[list[int]]:
        return res.details["draws"] if res.name == "random" else [res.removed]

    all_sets = {"": []}
    for per_n in results.values():
        for res in per_n.values():
            for s in sets_of(res):
                all_sets[set_key(s)] = list(s)
    eval_kwargs = {"batch_size": eval_batch_size, **dict(evaluation_options or {})}
    for key, s in all_sets.items():
        if key in state["ppl"]:
            continue
        log(f"perplexity with removed = [{key}]")
        t0 = time.perf_counter()
        res = _evaluate_removed(model, s, eval_text, tokenizer, contract, evaluation_method, eval_kwargs)
        res.contract = _public_contract(res.contract)
        state["ppl"][key] = _encode(res.to_dict())
        state.setdefault("ppl_seconds", {})[key] = time.perf_counter() - t0
        save()
    ppl = {k: PerplexityResult.from_dict(_decode(v)) for k, v in state["ppl"].items()}
    if joint_kl:
        todo = [k for k in all_sets if k and k not in state["removal_kl"]]
        if todo:
            log(f"joint removal KL of {len(todo)} sets on the calibration prompts")
            values, _ = _removal_kl_values(model, calib, [all_sets[k] for k in todo], batch_size)
            state["removal_kl"].update(dict(zip(todo, _encode(values))))
            save()
    kl = {k: _decode(v) for k, v in state["removal_kl"].items()}

    base = ppl[""]
    rows = []
    for name in criteria:
        for b in budgets:
            res = results[name][b]
            row = {"criterion": name, "n": b, "removed": res.removed, "forward_passes": res.forward_passes,
                   "block_passes": res.block_passes, "evaluator_calls": res.evaluator_calls, "seconds": res.seconds}
            if name == "random":
                keys = [set_key(s) for s in res.details["draws"]]
                d = [delta_ppl_percent(base, ppl[k]) for k in keys]
                row.update({"draws": res.details["draws"], "ppl": statistics.fmean(ppl[k].ppl for k in keys),
                            "dppl": statistics.fmean(d), "dppl_sd": statistics.stdev(d) if len(d) > 1 else 0.0,
                            "dppl_min": min(d), "dppl_max": max(d), "dppl_draws": d, "dppl_ci": None,
                            "removal_kl": statistics.fmean(kl[k] for k in keys) if joint_kl else None})
            else:
                k = set_key(res.removed)
                row.update({"ppl": ppl[k].ppl, "dppl": delta_ppl_percent(base, ppl[k]),
                            "dppl_ci": list(delta_ppl_ci(base, ppl[k])), "ppl_ci": [ppl[k].ci_low, ppl[k].ci_high],
                            "removal_kl": kl.get(k) if joint_kl else None})
            rows.append(row)
    return CriterionComparison(
        rows=rows,
        base={"ppl": base.ppl, "ci_low": base.ci_low, "ci_high": base.ci_high, "nll": base.nll, "tokens": base.tokens},
        contract=base.contract,
        calibration=calib.spec(),
        evaluation_method=evaluation_method,
        results={name: {b: r.to_dict() for b, r in per_n.items()} for name, per_n in results.items()},
        model=_public_identity(model_identity(model)),
        params={"budgets": budgets, "criteria": list(criteria), "options": _encode(options), "batch_size": batch_size},
        reports={"shared": report.to_dict()} if report is not None else {k: r.to_dict() for k, r in reports.items()},
        evaluation_seconds={k: state.get("ppl_seconds", {}).get(k) for k in all_sets},
    )


#: Parts of a :func:`compare_criteria` state that several runs can fill independently.
_MERGED_STATE_PARTS = ("ppl", "ppl_seconds", "removal_kl", "reports", "extras")


def merge_criteria_states(sources: Sequence, destination) -> dict:
    """Merge :func:`compare_criteria` state files written by separate runs of the same
    comparison (same model, calibration, evaluation text, contract and options), e.g.
    disjoint ``criteria`` run in parallel processes, into one state file that a final
    ``compare_criteria`` call with every criterion resumes from.

    Selections merge per criterion and budget; perplexities, removal KLs, swap-KL reports
    and any ``extras`` merge per key. Where two sources hold the same entry, the first
    source's is kept (every entry is a deterministic function of the fingerprint).
    Run-level summaries (``comparison``, ``command``, ...) are not carried over.

    Args:
        sources: paths of state files (at least one); ``destination`` may be one of them.
        destination: path of the merged state, written atomically.

    Returns:
        The merged state (the JSON object written).

    Raises:
        ValueError: no sources, a file that is not a compare_criteria state, or states
            recorded for different fingerprints.
        FileNotFoundError: a missing source.
    """
    paths = [Path(s) for s in sources]
    if not paths:
        raise ValueError("merge_criteria_states needs at least one source state file")
    merged = None
    for path in paths:
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not a compare_criteria state file: {err}") from err
        if not isinstance(state, dict) or state.get("format") != "hf_layerswap.compare_criteria/1":
            raise ValueError(f"{path} is not a compare_criteria state file (format hf_layerswap.compare_criteria/1)")
        if merged is None:
            merged = {"format": state["format"], "fingerprint": state["fingerprint"], "criteria": {},
                      **{part: {} for part in _MERGED_STATE_PARTS}}
        elif state.get("fingerprint") != merged["fingerprint"]:
            raise ValueError(
                f"{path} was recorded for {state.get('fingerprint')}, not {merged['fingerprint']} "
                f"(from {paths[0]}): only states of the same comparison merge"
            )
        for name, per_n in state.get("criteria", {}).items():
            target = merged["criteria"].setdefault(name, {})
            for n, result in per_n.items():
                target.setdefault(n, result)
        for part in _MERGED_STATE_PARTS:
            for key, value in state.get(part, {}).items():
                merged[part].setdefault(key, value)
    merged["criteria"] = {name: dict(sorted(per_n.items(), key=lambda kv: int(kv[0])))
                          for name, per_n in merged["criteria"].items()}
    write_json_atomic(merged, destination)
    return merged
