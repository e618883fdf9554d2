"""The one check every selection strategy passes through: a removal needs a finite basis.

Non-finite values (NaN, inf: e.g. an fp16 block that overflows) are results to report,
never a basis for removal. :func:`select_layers` runs every registered strategy inside
:func:`finite_selection`, which

1. before the strategy runs (so no search is spent on it), refuses a budget that the
   report's layer scores cannot fill with finite values (for the protocol asked for, or
   every protocol the report scored when it names none of them), under the same
   ``spacing`` and ``protect``;
2. while it runs, collects the value of every removal set a set objective scores
   (:func:`record_set_values`, called by :mod:`.objectives` and the stream-geometry
   criteria);
3. after it returns set S, refuses S when a value recorded for S (its objective value, or
   its joint removal KL in ``report.removal_kl``) is non-finite: a strategy ranks finite
   values first, so that means it could not fill the budget with finite values.

A refusal raises :class:`~hf_layerswap.rule.NonFiniteScoresError` naming the non-finite
pairs or sets, the first calibration batch where the scoring engine produced one (when
the report records it) and what to try, and leaves the report's ``selections`` and
``removal_kl`` as they were before the call.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar

from ..report import SwapReport, set_key
from ..rule import NonFiniteScoresError, greedy_select, nonfinite_message

__all__ = ["check_report_basis", "finite_selection", "record_set_values"]

_LEDGER: ContextVar[dict[str, float] | None] = ContextVar("hf_layerswap_set_values", default=None)


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def record_set_values(values: Mapping[str, float]) -> None:
    """Note the values of removal sets (``{set_key: value}``) for the running selection's
    final check; does nothing outside :func:`finite_selection`."""
    ledger = _LEDGER.get()
    if ledger is not None:
        ledger.update({k: float(v) for k, v in values.items()})


def first_nonfinite_batch(report: SwapReport) -> int | None:
    """The 0-based calibration batch where scoring first produced a non-finite value, as
    the report records it (``metadata["nonfinite"]["first_batch"]``), else ``None``."""
    record = report.metadata.get("nonfinite")
    return record.get("first_batch") if isinstance(record, Mapping) else None


def _checked_protocols(report: SwapReport, protocol: str | None) -> list[str]:
    if protocol in report.protocols:
        return [protocol]
    return list(report.protocols)


def check_report_basis(report: SwapReport, num_layers: int, *, protocol: str | None, spacing: int,
                       protect: Sequence[int]) -> None:
    """Refuse a budget the report's layer scores cannot fill with finite values.

    Raises:
        NonFiniteScoresError: under a checked protocol, fewer than ``num_layers``
            unprotected layers (kept more than ``spacing`` apart) have a finite score; the
            message names the pairs whose values are non-finite.
    """
    for p in _checked_protocols(report, protocol):
        try:
            greedy_select(report.layer_scores(p), num_layers, spacing=spacing, protect=protect)
        except NonFiniteScoresError:
            bad = {f"pair ({r.i}, {r.j}) {p}": r.value(p) for r in report.pairs if not _finite(r.value(p))}
            what = f"cannot select {num_layers} block(s) on finite {p} swap-KL scores"
            raise NonFiniteScoresError(nonfinite_message(what, bad, first_nonfinite_batch(report)), bad,
                                       first_nonfinite_batch(report)) from None
        except ValueError:
            return  # not a question of finiteness: the strategy gives its own message


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


def finite_selection(report: SwapReport, num_layers: int, run: Callable[[], list[int]], *, protocol: str | None,
                     spacing: int, protect: Sequence[int]) -> list[int]:
    """Run the strategy call ``run()`` under the finite-basis check (see the module text).

    Returns:
        the strategy's removal set.

    Raises:
        NonFiniteScoresError: no finite basis for the budget; the report is left as it was.
    """
    check_report_basis(report, num_layers, protocol=protocol, spacing=spacing, protect=protect)
    token = _LEDGER.set({})
    try:
        with _restored_on_error(report):
            chosen = run()
            key = set_key(chosen)
            recorded = {}
            if key in _LEDGER.get():
                recorded[f"set {key or '{}'} (objective)"] = _LEDGER.get()[key]
            if key in report.removal_kl:
                recorded[f"set {key or '{}'} (joint removal KL)"] = report.removal_kl[key]
            bad = {label: v for label, v in recorded.items() if not _finite(v)}
            if bad:
                raise NonFiniteScoresError(
                    nonfinite_message(f"cannot select {num_layers} block(s) with a finite value: the best set the "
                                      f"strategy found is {sorted(chosen)}", bad, first_nonfinite_batch(report)),
                    bad, first_nonfinite_batch(report))
    finally:
        _LEDGER.reset(token)
    return chosen
