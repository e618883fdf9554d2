"""Layerwise sparsity allocators: pure functions from per-block statistics to per-block
sparsities (the fraction of a block's prunable weights set to zero).

Notation: L blocks, target sparsity ``s``, ``N_l`` prunable parameters in block l.

- :func:`uniform_allocation`: ``s_l = s`` (Wanda and SparseGPT as published).
- :func:`pals_allocation`: Percentile-Aware Layerwise Sparsity (PALS, Jamshidi & Shvets,
  arXiv 2607.07557). The paper's exact formula is not public; this implements its
  abstract: the statistic is the q-th percentile (q=0.99) of a block's activation
  magnitudes, a higher percentile gives a lower sparsity, the statistic is standardised
  (z-score), and the adjustment is bounded to ``+-delta`` (0.05) around ``s``. The budget
  is met exactly (:func:`fit_budget`): the parameter-weighted mean of ``s_l`` is ``s`` and
  every ``|s_l - s| <= delta``.
- :func:`owl_allocation`: Outlier Weighed Layerwise sparsity (OWL, Yin et al., ICML 2024,
  arXiv 2310.05175), the mapping of its reference code: min-max scaled outlier ratios
  spread over ``2 lambda``, centred on ``1 - s``; unweighted mean ``s``; no per-block bound.
- :func:`random_allocation`: seeded ``d_l ~ U(-delta, delta)`` then :func:`fit_budget`
  (the PALS paper's random baseline).
- :func:`gradient_allocation`: the PALS mapping applied to mean ``|dL/dW|`` per block (the
  paper's gradient baseline, reconstructed).

Each returns a list of L floats in ``[0, 1)``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence


__all__ = [
    "ALLOCATIONS",
    "MAPPINGS",
    "fit_budget",
    "gradient_allocation",
    "outlier_ratio",
    "owl_allocation",
    "pals_allocation",
    "random_allocation",
    "standardised_offsets",
    "uniform_allocation",
]

ALLOCATIONS = ("uniform", "pals", "owl", "random", "gradient")
MAPPINGS = ("zscore", "minmax")


def _check_sparsity(sparsity: float) -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity={sparsity!r}: must be a number in [0, 1)")
    return float(sparsity)


def _check_params(num_params: Sequence[int], length: int | None = None) -> list[int]:
    counts = [int(n) for n in num_params]
    if not counts:
        raise ValueError("num_params is empty: at least one block is needed")
    if any(n <= 0 for n in counts):
        raise ValueError(f"num_params={counts}: every block needs a positive parameter count")
    if length is not None and len(counts) != length:
        raise ValueError(f"num_params has {len(counts)} entries but the statistics have {length}")
    return counts


def _check_delta(delta: float) -> float:
    if not isinstance(delta, (int, float)) or not 0.0 <= delta < 1.0:
        raise ValueError(f"delta={delta!r}: must be a number in [0, 1)")
    return float(delta)


def _check_stats(stats: Sequence[float], what: str) -> list[float]:
    values = [float(v) for v in stats]
    if not values:
        raise ValueError(f"{what} is empty: one value per block is needed")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{what} has non-finite values at blocks {bad}: {[values[i] for i in bad]}")
    return values


def uniform_allocation(num_params: Sequence[int], sparsity: float) -> list[float]:
    """``s_l = sparsity`` for every block."""
    sparsity = _check_sparsity(sparsity)
    return [sparsity] * len(_check_params(num_params))


def fit_budget(offsets: Sequence[float], num_params: Sequence[int], sparsity: float, delta: float) -> list[float]:
    """Exact budget with a hard per-block bound.

    Finds the shift ``tau`` with ``sum_l N_l clip(s + d_l + tau, lo, hi) = s sum_l N_l``,
    ``lo = max(s - delta, 0)``, ``hi = s + delta < 1``, and returns the clipped values.
    The left side is piecewise linear and non-decreasing in ``tau``; it is solved exactly
    on the segment between breakpoints where it crosses the target (no iteration), so the
    parameter-weighted mean equals ``s`` to float rounding and every block is inside
    ``[lo, hi]``.

    Args:
        offsets: ``d_l``, one per block (any scale; the bound is applied after shifting).
        num_params: ``N_l`` > 0.
        sparsity: ``s`` in [0, 1).
        delta: half-width of the bound, in [0, 1).

    Raises:
        ValueError: bad arguments or mismatched lengths, or ``s + delta >= 1`` with ``delta > 0``
            (a block could reach sparsity 1, every weight zero).
    """
    sparsity, delta = _check_sparsity(sparsity), _check_delta(delta)
    d = _check_stats(offsets, "offsets")
    n = _check_params(num_params, len(d))
    if delta > 0.0 and sparsity + delta >= 1.0:
        raise ValueError(
            f"sparsity={sparsity!r} with delta={delta!r} lets a block reach sparsity 1 (every weight zero); "
            f"use delta < 1 - sparsity = {1.0 - sparsity:.6g}"
        )
    lo, hi = max(sparsity - delta, 0.0), sparsity + delta
    if delta == 0.0 or sparsity == 0.0:
        return [sparsity] * len(d)
    total = float(sum(n))
    target = sparsity * total

    def mass(tau: float) -> float:
        return sum(ni * min(max(sparsity + di + tau, lo), hi) for ni, di in zip(n, d))

    points = sorted({lo - sparsity - di for di in d} | {hi - sparsity - di for di in d})
    values = [mass(t) for t in points]
    # mass(points[0]) is all-lo (<= target) and mass(points[-1]) all-hi (>= target)
    k = 0
    while k + 1 < len(points) and values[k + 1] < target:
        k += 1
    if k + 1 == len(points):  # only when all offsets are equal: a single breakpoint pair
        tau = points[k]
    else:
        a, b = points[k], points[k + 1]
        mid = 0.5 * (a + b)
        slope = sum(ni for ni, di in zip(n, d) if lo < sparsity + di + mid < hi)
        tau = a if slope == 0 else a + (target - values[k]) / slope
    return [min(max(sparsity + di + tau, lo), hi) for di in d]


def standardised_offsets(
    statistics: Sequence[float],
    *,
    delta: float = 0.05,
    mapping: str = "zscore",
    scale: float | None = None,
    invert: bool = False,
) -> list[float]:
    """Map a per-block statistic to sparsity offsets ``d_l`` (before :func:`fit_budget`).

    - ``"zscore"``: ``d_l = -beta (p_l - mean p) / std p`` (population std).
    - ``"minmax"`` (OWL-style): ``u_l = (p_l - min) / (max - min)``, ``d_l = -2 beta (u_l - mean u)``.

    ``beta = scale`` (default ``delta``: one standard deviation reaches the bound). A higher
    statistic gives a lower sparsity; ``invert=True`` flips the sign (ablation). Constant
    statistics give all-zero offsets.

    Raises:
        ValueError: an unknown mapping, non-finite statistics, a negative scale.
    """
    p = _check_stats(statistics, "statistics")
    delta = _check_delta(delta)
    beta = delta if scale is None else float(scale)
    if beta < 0:
        raise ValueError(f"scale={scale!r}: must be >= 0")
    sign = 1.0 if invert else -1.0
    mean = sum(p) / len(p)
    if mapping == "zscore":
        std = math.sqrt(sum((v - mean) ** 2 for v in p) / len(p))
        if std == 0.0:
            return [0.0] * len(p)
        return [sign * beta * (v - mean) / std for v in p]
    if mapping == "minmax":
        span = max(p) - min(p)
        if span == 0.0:
            return [0.0] * len(p)
        u = [(v - min(p)) / span for v in p]
        mu = sum(u) / len(u)
        return [sign * 2.0 * beta * (v - mu) for v in u]
    raise ValueError(f"mapping={mapping!r}: allowed {list(MAPPINGS)}")


def pals_allocation(
    percentiles: Sequence[float],
    num_params: Sequence[int],
    sparsity: float,
    *,
    delta: float = 0.05,
    mapping: str = "zscore",
    scale: float | None = None,
    invert: bool = False,
) -> list[float]:
    """PALS: per-block sparsity from a per-block activation percentile (e.g. p99 of ``|x|``).

    ``s_l = fit_budget(standardised_offsets(p), N, s, delta)``: the parameter-weighted mean
    is ``s`` exactly, every block is within ``+-delta``, and a larger percentile never gets
    a larger sparsity (with ``invert=False``).

    Args:
        percentiles: ``p_l`` per block (units of the activations).
        num_params: ``N_l``, prunable parameters per block.
        sparsity: target ``s`` in [0, 1).
        delta: bound, 0.05 in the PALS abstract.
        mapping, scale, invert: see :func:`standardised_offsets`.
    """
    offsets = standardised_offsets(percentiles, delta=delta, mapping=mapping, scale=scale, invert=invert)
    return fit_budget(offsets, num_params, sparsity, delta)


def gradient_allocation(
    gradient_means: Sequence[float], num_params: Sequence[int], sparsity: float, **mapping
) -> list[float]:
    """Gradient baseline: the PALS mapping (:func:`pals_allocation`, same keyword options
    ``delta``, ``mapping``, ``scale``, ``invert`` and the same guarantees) applied to mean
    ``|dL/dW|`` per block: a larger gradient gives a lower sparsity."""
    return pals_allocation(gradient_means, num_params, sparsity, **mapping)


def random_allocation(num_params: Sequence[int], sparsity: float, *, delta: float = 0.05, seed: int = 0) -> list[float]:
    """Random baseline: ``d_l ~ U(-delta, delta)`` from ``random.Random(seed)``, then
    :func:`fit_budget` (exact budget, same bound)."""
    n = _check_params(num_params)
    delta = _check_delta(delta)
    rng = random.Random(seed)
    return fit_budget([rng.uniform(-delta, delta) for _ in n], n, sparsity, delta)


def outlier_ratio(scores, m: float) -> float:
    """OWL's layerwise outlier distribution (LOD) of one block, in percent.

    ``a`` is the concatenation of the block's Wanda scores ``|W_ij| ||X_j||_2`` over all its
    linears; ``LOD = 100 * #{a > m * mean(a)} / |a|``. Scale-invariant.

    Args:
        scores: a sequence of score tensors (any shapes), or a zero-argument callable
            returning a fresh iterable of them; it is read twice (sum, then count), so a
            block's scores never need to be concatenated or held at once.
        m: OWL's outlier multiplier M (> 0).

    Raises:
        ValueError: no scores, or ``m`` not positive.
    """
    if not m > 0:
        raise ValueError(f"owl_m={m!r}: must be > 0")
    produce = scores if callable(scores) else (lambda: scores)
    total, count = 0.0, 0
    for a in produce():
        total += float(a.double().sum())
        count += a.numel()
    if count == 0:
        raise ValueError("outlier_ratio needs at least one non-empty score tensor")
    threshold = m * total / count
    above = sum(int((a.double() > threshold).sum()) for a in produce())
    return 100.0 * above / count


def owl_allocation(outlier_ratios: Sequence[float], sparsity: float, *, lam: float = 0.08) -> list[float]:
    """OWL mapping (luuyin/OWL ``prune_wanda_outlier``), from per-block LOD values.

    ``r_l = 2 lam (LOD_l - min) / (max - min)``, ``keep_l = r_l - mean(r) + (1 - s)``,
    ``s_l = 1 - keep_l``, and ``s_l <= 0`` becomes 0.01. More outliers -> lower sparsity.
    The unweighted mean is ``s`` (when no floor applies) and ``max - min = 2 lam``; there is
    no per-block ``+-lam`` bound (one block can move by almost ``2 lam``). Constant LODs
    (where the reference divides by zero) give the uniform allocation.

    Raises:
        ValueError: bad sparsity, negative lam, non-finite ratios.
    """
    sparsity = _check_sparsity(sparsity)
    lod = _check_stats(outlier_ratios, "outlier_ratios")
    if lam < 0:
        raise ValueError(f"owl_lambda={lam!r}: must be >= 0")
    span = max(lod) - min(lod)
    if span == 0.0:
        return [sparsity] * len(lod)
    r = [2.0 * lam * (v - min(lod)) / span for v in lod]
    mean_r = sum(r) / len(r)
    out = []
    for ri in r:
        s_l = 1.0 - (ri - mean_r + (1.0 - sparsity))
        out.append(0.01 if s_l <= 0 else s_l)
    return out
