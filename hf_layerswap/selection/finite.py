"""The one check every selection strategy passes through: a removal needs a finite basis.

Non-finite values (NaN, inf: e.g. an fp16 block that overflows) are results to report,
never a basis for removal. :func:`select_layers` runs every registered strategy inside
:func:`finite_selection`, which

1. before the strategy runs (so no search is spent on it), refuses a budget that the
   report's layer scores cannot fill with finite values (for the protocol asked for, or
   every protocol the report scored when it names none of them), under the same
   ``spacing`` and ``protect``;
2. while it runs, collects the value of every removal set a set objective scores
   (:func:`record_set_values`, called by :mod:`.objectives` and angular distance) and the
   values of a per-layer criterion (:func:`record_layer_values`: Block Influence,
   single-removal KL);
3. after it returns set S, refuses S when a value recorded for S (its objective value, or
   its joint removal KL in ``report.removal_kl``) is non-finite: a strategy ranks finite
   values first, so that means it could not fill the budget with finite values. With no
   value recorded for S, each block of S needs a finite per-layer value: the criterion's
   when it recorded them, else the report's layer score (so a strategy that ignores the
   scores cannot remove a block whose score is non-finite).

A refusal raises :class:`~hf_layerswap.scoring.rule.NonFiniteScoresError` naming the non-finite
pairs or sets, the first calibration batch where the scoring engine produced one (when
the report records it) and what to try, and leaves the report's ``selections`` and
``removal_kl`` as they were before the call.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar

from ..scoring.report import SwapReport, set_key
from ..scoring.rule import NonFiniteScoresError, greedy_select, nonfinite_message

__all__ = ["check_report_basis", "finite_selection", "record_layer_values", "record_set_values"]

_LEDGER: ContextVar[dict | None] = ContextVar("hf_layerswap_basis", default=None)


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def record_set_values(values: Mapping[str, float]) -> None:
    """Note the values of removal sets (``{set_key: value}``) for the running selection's
    final check; does nothing outside :func:`finite_selection`."""
    ledger = _LEDGER.get()
    if ledger is not None:
        ledger["sets"].update({k: float(v) for k, v in values.items()})


def record_layer_values(values: Sequence[float | None]) -> None:
    """Note a per-layer criterion's values (length L, the basis of a per-layer rule such as
    Block Influence) for the running selection's final check; does nothing outside
    :func:`finite_selection`."""
    ledger = _LEDGER.get()
    if ledger is not None:
        ledger["layers"] = list(values)


def first_nonfinite_batch(report: SwapReport) -> int | None:
    """The 0-based calibration batch where scoring first produced a non-finite value, as
    the report records it (``metadata["nonfinite"]["first_batch"]``), else ``None``."""
    record = report.metadata.get("nonfinite")
    return record.get("first_batch") if isinstance(record, Mapping) else None


def _checked_protocols(report: SwapReport, protocol: str | None) -> list[str]:
    if protocol in report.protocols:
        return [protocol]
    return list(report.protocols)


def check_report_basis(report: SwapReport, num_to_remove: int, *, protocol: str | None, spacing: int,
                       protect: Sequence[int]) -> None:
    """Refuse a budget the report's layer scores cannot fill with finite values.

    Raises:
        NonFiniteScoresError: under a checked protocol, fewer than ``num_to_remove``
            unprotected layers (kept more than ``spacing`` apart) have a finite score; the
            message names the pairs whose values are non-finite.
    """
    for p in _checked_protocols(report, protocol):
        try:
            greedy_select(report.layer_scores(p), num_to_remove, spacing=spacing, protect=protect)
        except NonFiniteScoresError:
            bad = {f"pair ({r.i}, {r.j}) {p}": r.value(p) for r in report.pairs if not _finite(r.value(p))}
            what = f"cannot select {num_to_remove} block(s) on finite {p} swap-KL scores"
            raise NonFiniteScoresError(nonfinite_message(what, bad, first_nonfinite_batch(report)), bad,
                                       first_nonfinite_batch(report)) from None
        except ValueError:
            return  # not a question of finiteness: the strategy gives its own message


def _nonfinite_basis(report: SwapReport, chosen: Sequence[int], ledger: Mapping, protocol: str | None) -> dict:
    """The non-finite values ``chosen`` rests on: the values recorded for the set itself, or
    (none recorded) each chosen layer's per-layer value (the criterion's when it recorded
    them, else the report's layer score under a checked protocol)."""
    key, label = set_key(chosen), f"set {set_key(chosen) or '{}'}"
    recorded = {}
    if key in ledger["sets"]:
        recorded[f"{label} (objective)"] = ledger["sets"][key]
    if key in report.removal_kl:
        recorded[f"{label} (joint removal KL)"] = report.removal_kl[key]
    if recorded:
        return {k: v for k, v in recorded.items() if not _finite(v)}
    blocks = [i for i in chosen if isinstance(i, int) and 0 <= i < report.num_blocks]  # others: remove_layers says
    if ledger["layers"] is not None:
        return {f"layer {i}": ledger["layers"][i] for i in blocks if not _finite(ledger["layers"][i])}
    scores = {p: report.layer_scores(p) for p in _checked_protocols(report, protocol)}
    return {f"layer {i} ({p} score)": v[i] for i in blocks if not any(_finite(s[i]) for s in scores.values())
            for p, v in scores.items()}


@contextlib.contextmanager
def _restored_on_error(report: SwapReport) -> Iterator[None]:
    selections, removal = list(report.selections), dict(report.removal_kl)
    try:
        yield
    except BaseException:
        report.selections[:] = selections
        report.removal_kl.clear()
        report.removal_kl.update(removal)
        raise


def finite_selection(report: SwapReport, num_to_remove: int, run: Callable[[], list[int]], *, protocol: str | None,
                     spacing: int, protect: Sequence[int]) -> list[int]:
    """Run the strategy call ``run()`` under the finite-basis check (see the module text).

    Returns:
        the strategy's removal set.

    Raises:
        NonFiniteScoresError: no finite basis for the budget; the report is left as it was.
    """
    check_report_basis(report, num_to_remove, protocol=protocol, spacing=spacing, protect=protect)
    token = _LEDGER.set({"sets": {}, "layers": None})
    try:
        with _restored_on_error(report):
            chosen = run()
            bad = _nonfinite_basis(report, chosen, _LEDGER.get(), protocol)
            if bad:
                raise NonFiniteScoresError(
                    nonfinite_message(f"cannot select {num_to_remove} block(s) with a finite value: the best set the "
                                      f"strategy found is {sorted(chosen)}", bad, first_nonfinite_batch(report)),
                    bad, first_nonfinite_batch(report))
    finally:
        _LEDGER.reset(token)
    return chosen
