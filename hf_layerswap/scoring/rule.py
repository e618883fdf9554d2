"""The paper's selection rule on per-layer scores, and the budget checks every selection shares.

No Free Swap (arXiv 2605.16234, Table 17 / App. G): score each layer by
s(i) = min over scored partners of d(i, j), sort ascending, and take layers greedily
while every two selected layers stay more than ``spacing`` apart. Protected layers (by
default the first and the last block) and layers with a non-finite score are never taken.

Pure functions of lists of numbers: the scoring engine's stopping test
(:func:`~hf_layerswap.scoring.selection_stability`) and every selection strategy
(:mod:`hf_layerswap.selection`) use them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..layerplan import ONE_BLOCK, as_index
from .report import score_key

__all__ = ["NONFINITE_ADVICE", "NonFiniteScoresError", "NonFiniteScoresWarning", "check_budget", "greedy_select", "resolve_protect"]

#: What to try when the scores a selection would rest on are non-finite.
NONFINITE_ADVICE = (
    "non-finite values are reported, never a basis for removal: load the model in float32 "
    "(from_pretrained(..., dtype=torch.float32), or --dtype float32 on the command line) or score on "
    "another calibration set"
)


class NonFiniteScoresError(ValueError):
    """A selection refused because it cannot fill its budget with finite values.

    Raised by :func:`greedy_select` and by every strategy of
    :func:`~hf_layerswap.selection.select_layers` (one shared check,
    :mod:`hf_layerswap.selection.finite`).

    Attributes:
        nonfinite: ``{label: value}`` of the non-finite values the selection met (labels
            such as ``"pair (2, 3) interchange"``, ``"layer 4"`` or ``"set 1,3"``).
        first_batch: the 0-based calibration batch where the scoring engine first produced
            a non-finite value, or ``None`` when not known.
    """

    def __init__(self, message: str, nonfinite=None, first_batch: int | None = None):
        super().__init__(message)
        self.nonfinite = dict(nonfinite or {})
        self.first_batch = first_batch


class NonFiniteScoresWarning(UserWarning):
    """Scoring produced non-finite values (NaN, inf): :func:`~hf_layerswap.score_layers`,
    :func:`~hf_layerswap.scoring.removal_kl` and ``hf-layerswap score`` keep them as
    results and warn with this class, naming how many and the first calibration batch."""


def nonfinite_message(what: str, nonfinite, first_batch: int | None = None, *, limit: int = 12) -> str:
    """One message for a refused selection: ``what``, the non-finite values by label (at
    most ``limit`` named, then a count), the first calibration batch when known, the advice."""
    items = [f"{label} = {_shown(v)}" for label, v in dict(nonfinite).items()]
    named = "; ".join(items[:limit]) + (f"; and {len(items) - limit} more" if len(items) > limit else "")
    where = f"; the values first broke at calibration batch {first_batch} (0-based)" if first_batch is not None else ""
    return f"{what}: non-finite values: {named or 'none recorded'}{where}. {NONFINITE_ADVICE}"


def _shown(v) -> str:
    return "None" if v is None else ("NaN" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else f"{v:.4g}")


def resolve_protect(protect: Sequence[int] | None, num_blocks: int) -> set[int]:
    """Resolve protected indices (negative = from the end).

    Raises:
        ValueError: an index outside ``-L..L-1``.
    """
    if isinstance(protect, (int, str)) or (protect is not None and not hasattr(protect, "__iter__")):
        raise ValueError(f"protect={protect!r}: must be a list of 0-based block indices, e.g. [0, -1] (or [] for none)")
    out = set()
    for p in protect or ():
        if as_index(p) is None:
            raise ValueError(f"protect entry {p!r} is not an int: allowed ints in -{num_blocks}..{num_blocks - 1}")
        if not -num_blocks <= as_index(p) < num_blocks:
            raise ValueError(f"protect entry {p!r} is out of range: allowed ints in -{num_blocks}..{num_blocks - 1}")
        out.add(as_index(p) % num_blocks)
    return out


def check_budget(num_to_remove, total: int, *, spacing=1, protect: Sequence[int] | None = (0, -1)) -> int:
    """Refuse a budget no selection can meet, before any scoring is spent on it.

    The most layers the rules allow is the left-to-right count of unprotected blocks kept
    more than ``spacing`` apart; a budget within it may still be refused after scoring
    when the score order leaves gaps (:func:`greedy_select` says so).

    Returns:
        the budget as an int.

    Raises:
        ValueError: ``num_to_remove`` outside ``1..L-1``, a negative ``spacing``, a bad
            ``protect`` entry, or more layers than the rules allow (the message says how
            many).
    """
    if total < 2:
        raise ValueError(f"num_to_remove={num_to_remove!r}: {ONE_BLOCK}")
    if as_index(num_to_remove) is None or not 1 <= as_index(num_to_remove) <= total - 1:
        raise ValueError(f"num_to_remove={num_to_remove!r}: allowed 1..{total - 1} for a model with {total} blocks")
    if as_index(spacing) is None or as_index(spacing) < 0:
        raise ValueError(f"spacing={spacing!r}: must be an int >= 0 (0 allows adjacent layers)")
    protected, most, last = resolve_protect(protect, total), 0, None
    for i in range(total):
        if i not in protected and (last is None or i - last > as_index(spacing)):
            most, last = most + 1, i
    if as_index(num_to_remove) > most:
        raise ValueError(
            f"cannot select {num_to_remove} layers of {total} with spacing={spacing} and protect={sorted(protected)}: "
            f"the rules allow at most {most}; lower num_to_remove or spacing, or protect fewer layers"
        )
    return as_index(num_to_remove)


def greedy_select(scores: Sequence[float], num_to_remove: int, *, spacing: int = 1, protect: Sequence[int] = (0, -1)) -> list[int]:
    """The paper's greedy rule on per-layer scores (low = removable).

    Args:
        scores: length-L per-layer scores.
        num_to_remove: how many layers to select (n).
        spacing: every two selected layers satisfy ``|a - b| > spacing`` (0 allows
            neighbours; 1 = no two adjacent).
        protect: indices never selected (negative = from the end).

    Returns:
        n 0-based indices, ascending.

    Raises:
        NonFiniteScoresError: the budget could be met only by taking layers whose score
            is non-finite (the message names them).
        ValueError: as :func:`check_budget`, or a budget the score order cannot meet
            (gaps; the message says how many layers could be taken).
    """
    total = len(scores)
    num_to_remove, spacing = check_budget(num_to_remove, total, spacing=spacing, protect=protect), as_index(spacing)
    protected = resolve_protect(protect, total)
    order = sorted(range(total), key=lambda i: (score_key(scores[i]), i))

    def take(finite_only: bool) -> list[int]:
        chosen: list[int] = []
        for i in order:
            if len(chosen) == num_to_remove:
                break
            if i in protected or (finite_only and (scores[i] is None or not math.isfinite(scores[i]))):
                continue
            if all(abs(i - k) > spacing for k in chosen):
                chosen.append(i)
        return chosen

    chosen = take(finite_only=True)
    if len(chosen) < num_to_remove:
        if len(take(finite_only=False)) == num_to_remove:  # only non-finite scores could fill it
            skipped = {f"layer {i}": scores[i] for i in range(total)
                       if i not in protected and (scores[i] is None or not math.isfinite(scores[i]))}
            raise NonFiniteScoresError(
                nonfinite_message(f"cannot select {num_to_remove} layers of {total} with finite scores (found "
                                  f"{len(chosen)}: {sorted(chosen)})", skipped), skipped)
        raise ValueError(
            f"cannot select {num_to_remove} layers of {total} with spacing={spacing} and protect={sorted(protected)}: "
            f"the rule found only {len(chosen)} ({sorted(chosen)}); lower num_to_remove or spacing, or protect fewer layers"
        )
    return sorted(chosen)
