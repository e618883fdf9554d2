"""Streaming statistics over calibration activations.

- :class:`LogHistogramQuantile`: quantiles of ``|x|`` over any number of values without
  keeping them (a fixed log2-spaced histogram; ``torch.quantile`` refuses inputs above
  about 16.7M elements and a 7B model's calibration pool is about 1e9 per block).
- :class:`ExactQuantile`: the exact reference (keeps every value; small pools only).
- :class:`RowNormSq` and :class:`HessianAccumulator`: the per-linear input statistics of
  Wanda (sum of squares per input channel) and SparseGPT (``sum x x^T``).

Quantiles follow ``torch.quantile``'s default (``interpolation="linear"``): with ``n``
values sorted ascending, ``Q(q) = v[f] + (pos - f) * (v[f+1] - v[f])`` at ``pos = q (n-1)``,
``f = floor(pos)``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ESTIMATORS", "ExactQuantile", "HessianAccumulator", "LogHistogramQuantile", "RowNormSq", "make_estimator"]

ESTIMATORS = ("histogram", "exact")


class LogHistogramQuantile:
    """Streaming quantile of ``|x|`` on a log2 grid (deterministic, mergeable, O(bins) memory).

    Every non-zero magnitude ``v`` falls in bin ``floor((log2 v - min_exp) * bins_per_octave)``;
    exact zeros are counted apart. A quantile is the linear interpolation (as in
    ``torch.quantile``) between the geometric bin centres of the two order statistics it
    needs, located exactly from the cumulative counts.

    Error bound: for magnitudes in ``[2**min_exp, 2**max_exp)``, the estimate ``E`` and the
    exact quantile ``Q`` satisfy ``|E / Q - 1| <= 2 ** (1 / (2 * bins_per_octave)) - 1``
    (0.136% at the default 256 bins per octave), because each order statistic lies inside
    its bin, within that factor of the bin centre, and interpolation with the same weight
    keeps the factor. Zeros are exact. Magnitudes outside the range are clamped into the
    first/last bin (fp32 normal numbers are all inside the default range).

    Args:
        bins_per_octave: bins per factor of 2, >= 1.
        min_exp, max_exp: the covered range is ``[2**min_exp, 2**max_exp)``.

    Raises:
        ValueError: a bad grid, or (in :meth:`update`) a NaN value.
    """

    name = "histogram"

    def __init__(self, bins_per_octave: int = 256, min_exp: int = -126, max_exp: int = 128):
        if not isinstance(bins_per_octave, int) or bins_per_octave < 1:
            raise ValueError(f"bins_per_octave={bins_per_octave!r}: must be an int >= 1")
        if not min_exp < max_exp:
            raise ValueError(f"min_exp={min_exp} must be below max_exp={max_exp}")
        self.bins_per_octave = bins_per_octave
        self.min_exp = min_exp
        self.max_exp = max_exp
        self.num_bins = self.bins(bins_per_octave, min_exp, max_exp)
        self.counts = torch.zeros(self.num_bins, dtype=torch.int64)
        self.zeros = 0
        self.count = 0

    @staticmethod
    def bins(bins_per_octave: int = 256, min_exp: int = -126, max_exp: int = 128) -> int:
        """Bins of the grid (each an int64 count: 8 bytes held per bin)."""
        return (max_exp - min_exp) * bins_per_octave

    @property
    def relative_error_bound(self) -> float:
        """Largest ``|estimate / exact - 1|`` for magnitudes inside the covered range."""
        return 2.0 ** (1.0 / (2 * self.bins_per_octave)) - 1.0

    def update(self, values: torch.Tensor) -> None:
        """Add ``|values|`` (any shape, any float dtype) to the histogram."""
        v = values.detach().reshape(-1).float().abs()
        if v.numel() == 0:
            return
        if torch.isnan(v).any():
            raise ValueError("NaN in the activations fed to the percentile estimator")
        nonzero = v[v > 0]
        self.zeros += int(v.numel() - nonzero.numel())
        self.count += int(v.numel())
        if nonzero.numel():
            idx = torch.floor((torch.log2(nonzero) - self.min_exp) * self.bins_per_octave)
            idx = idx.clamp_(0, self.num_bins - 1).to(torch.int64)
            self.counts += torch.bincount(idx, minlength=self.num_bins).cpu()

    def merge(self, other: LogHistogramQuantile) -> None:
        """Add another histogram on the same grid."""
        if (other.bins_per_octave, other.min_exp, other.max_exp) != (self.bins_per_octave, self.min_exp, self.max_exp):
            raise ValueError("cannot merge histograms on different grids")
        self.counts += other.counts
        self.zeros += other.zeros
        self.count += other.count

    def _bin_centre(self, b: int) -> float:
        return 2.0 ** (self.min_exp + (b + 0.5) / self.bins_per_octave)

    def _value_at_rank(self, rank: int, cumulative: torch.Tensor) -> float:
        if rank < self.zeros:
            return 0.0
        b = int(torch.searchsorted(cumulative, torch.tensor(rank - self.zeros), right=True))
        return self._bin_centre(b)

    def quantile(self, q: float) -> float:
        """Estimate of the ``q``-quantile of everything seen so far (``0 <= q <= 1``).

        Raises:
            ValueError: ``q`` outside [0, 1] or nothing seen yet.
        """
        pos = _check_quantile_args(q, self.count)
        cumulative = torch.cumsum(self.counts, 0)
        lo, frac = int(math.floor(pos)), pos - math.floor(pos)
        a = self._value_at_rank(lo, cumulative)
        if frac == 0:
            return a
        b = self._value_at_rank(lo + 1, cumulative)
        return a + frac * (b - a)

    def spec(self) -> dict:
        return {
            "estimator": self.name,
            "bins_per_octave": self.bins_per_octave,
            "range_log2": [self.min_exp, self.max_exp],
            "relative_error_bound": self.relative_error_bound,
        }


class ExactQuantile:
    """Exact quantile of ``|x|``: keeps every value (reference for tests and small pools).

    Raises:
        ValueError: more than ``max_elements`` values (use ``estimator="histogram"``).
    """

    name = "exact"

    def __init__(self, max_elements: int = 1 << 27):
        self.max_elements = max_elements
        self.parts: list[torch.Tensor] = []
        self.count = 0

    relative_error_bound = 0.0

    def update(self, values: torch.Tensor) -> None:
        v = values.detach().reshape(-1).float().abs().cpu()
        if self.count + v.numel() > self.max_elements:
            raise ValueError(
                f"estimator='exact' keeps every value and would exceed max_elements={self.max_elements}; "
                "use estimator='histogram' (streaming, bounded relative error)"
            )
        if torch.isnan(v).any():
            raise ValueError("NaN in the activations fed to the percentile estimator")
        self.parts.append(v)
        self.count += int(v.numel())

    def quantile(self, q: float) -> float:
        pos = _check_quantile_args(q, self.count)
        values = torch.sort(torch.cat(self.parts)).values.double()
        lo, frac = int(math.floor(pos)), pos - math.floor(pos)
        a = float(values[lo])
        return a if frac == 0 else a + frac * (float(values[lo + 1]) - a)

    def spec(self) -> dict:
        return {"estimator": self.name, "relative_error_bound": 0.0}


def _check_quantile_args(q: float, count: int) -> float:
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q={q!r}: must be in [0, 1]")
    if count == 0:
        raise ValueError("no values seen: the percentile of an empty pool is undefined")
    return q * (count - 1)


def make_estimator(name: str, *, bins_per_octave: int = 256):
    """``"histogram"`` -> :class:`LogHistogramQuantile`, ``"exact"`` -> :class:`ExactQuantile`."""
    if name == "histogram":
        return LogHistogramQuantile(bins_per_octave=bins_per_octave)
    if name == "exact":
        return ExactQuantile()
    raise ValueError(f"estimator={name!r}: allowed {list(ESTIMATORS)}")


class RowNormSq:
    """Wanda's input statistic for one linear: ``sum_t x_t[j]**2`` over calibration tokens.

    ``||X[:, j]||_2 = sqrt(sum_sq[j])``; shape ``(in_features,)``, fp32.
    """

    def __init__(self, in_features: int, device=None):
        self.sum_sq = torch.zeros(in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    def update(self, x: torch.Tensor) -> None:
        """``x``: ``(tokens, in_features)`` inputs of real (non-pad) positions."""
        x = x.float()
        self.sum_sq += (x * x).sum(0)
        self.tokens += int(x.shape[0])


class HessianAccumulator:
    """SparseGPT's layer Hessian for one linear: ``H = (2 / n) sum_t x_t x_t^T``.

    ``(in_features, in_features)``, fp32; ``n`` counts tokens (the constant cancels in
    SparseGPT because its damping is relative to ``mean(diag H)``).
    """

    def __init__(self, in_features: int, device=None):
        self.sum_outer = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    def update(self, x: torch.Tensor) -> None:
        """``x``: ``(tokens, in_features)`` inputs of real (non-pad) positions."""
        x = x.float()
        self.sum_outer.addmm_(x.T, x)
        self.tokens += int(x.shape[0])

    @property
    def hessian(self) -> torch.Tensor:
        return self.sum_outer * (2.0 / max(self.tokens, 1))
