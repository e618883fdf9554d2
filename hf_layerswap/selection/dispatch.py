"""``select_layers``: one entry point that dispatches to the registered strategies, and the
check that a report belongs to the model it is applied to."""

from __future__ import annotations

from collections.abc import Sequence

from ..layerplan import model_fingerprint, num_blocks, uncompiled
from ..scoring.protocols import PROTOCOLS, SWAP_PROTOCOLS
from ..scoring.report import SwapReport
from ..scoring.layerscores import calibration_from_args
from .finite import finite_selection
from .registry import MODEL_STRATEGIES, NO_PROTOCOL, check_options, get_strategy, strategy_entry

__all__ = ["SELECTION_PROTOCOLS", "candidates_set", "check_report_matches", "select_layers", "selection_protocols"]

#: The paper's two protocols and ``"auto"`` (see :func:`selection_protocols` for every registered one).
SELECTION_PROTOCOLS = PROTOCOLS + ("auto",)


def selection_protocols() -> tuple[str, ...]:
    """Every registered swap protocol (:func:`~hf_layerswap.scoring.protocols.register_protocol`),
    then ``"auto"`` (the better of the paper's two sets by joint removal KL)."""
    return tuple(SWAP_PROTOCOLS) + ("auto",)


def select_layers(
    report: SwapReport | None,
    num_to_remove: int,
    *,
    protocol: str = "interchange",
    spacing: int | None = None,
    protect: Sequence[int] = (0, -1),
    model=None,
    calibration=None,
    tokenizer=None,
    batch_size: int = 8,
    strategy: str | None = None,
    objective: str | None = None,
    max_memory=None,
    **options,
) -> list[int]:
    """Select ``num_to_remove`` blocks to remove (0-based, ascending).

    Args:
        report: swap-KL scores of the model; ``None`` for a strategy that reads none
            (``guided_by=NO_PROTOCOL``: ``sleb``, ``single_removal_kl``, ``block_influence``,
            ``angular_distance``), which then needs ``model=``.
        num_to_remove: the budget n.
        strategy: a name in :data:`STRATEGIES`. ``None``: ``"auto"`` when
            ``protocol="auto"``, else ``"greedy"`` (the paper's rule on ``protocol``).
            ``"search"`` (:func:`hf_layerswap.selection.search_select`, the default of
            :class:`~hf_layerswap.LayerSwapConfig` and the CLI) scores whole candidate
            sets from both protocols on the calibration prompts and refines them by local
            moves; it, ``"beam"`` and the field's criteria need ``model=`` and
            ``calibration=``. Each model-reading strategy appends its record (chosen set,
            objective value, each protocol's greedy set with its value, trace, cost) to
            ``report.selections``.
        objective: for ``"search"``: ``"removal_kl"`` (default), ``"nll"`` or
            ``"ghosted"`` (removal KL after the Ghosted Layers repair); for ``"beam"``:
            ``"removal_kl"`` or ``"nll"``.
        options: the chosen strategy's own options
            (:data:`~hf_layerswap.selection.registry.STRATEGY_OPTIONS` lists them per
            strategy; ``"greedy"`` and ``"auto"`` take none). For ``"search"`` they are the
            keyword arguments of :func:`~hf_layerswap.search.search_select` it does not set
            itself; its budget of candidate sets: ``max_evaluations`` (most sets scored in
            all, the single-removal sweep included) and ``evaluations_per_budget`` (most
            new sets per budget n >= 2, each protocol's greedy set included; default SLEB's
            schedule, U - (n - 1) for U = L - |protect|), and ``max_rounds``,
            ``moves_per_round``, ``extend_best``, ``exhaustive_below``, ``progress``. The
            calibration size is not an option: it comes from ``calibration=`` (a
            :class:`~hf_layerswap.CalibrationSet`) or the report's ``num_prompts``.
        max_memory: the working-memory budget of the strategy's own engine calls and kept
            reference (bytes, a size such as ``"2GiB"``, a
            :class:`~hf_layerswap.scoring.settings.MemoryBudget`, or ``None``/``"auto"``:
            derived from the model's device as scoring derives it); ``prune`` passes the
            budget it resolved for the scoring, so one budget covers both. Strategies
            receive it as ``max_memory`` in their context.
        spacing: ``None`` = the strategy's default (1 for the paper's greedy rule and
            ``auto``, 0 for the searches).
        protocol: ``"interchange"``, ``"replacement"`` or ``"auto"``. ``"auto"`` takes
            the candidate set of each protocol, evaluates both by their joint removal KL
            d_skip(S) on the calibration prompts and keeps the lower (ties go to
            interchange); both values are recorded in ``report.removal_kl`` when they
            were measured on the report's own prompts (its calibration content hash; of
            other prompts they are neither read from nor written there, only into the
            decision) and the decision in ``report.selections``.
        spacing, protect: see :func:`greedy_select`.
        model, calibration, tokenizer, batch_size: needed by ``"auto"`` when the two
            candidate sets differ and ``report.removal_kl`` lacks them. Pass the same
            calibration source as for scoring (the report keeps its content hash, not
            the prompts); ``num_prompts``, ``seq_len`` and ``seed`` come from the report.

    With ``model=``, the report must belong to it (same block count, and the same weight
    fingerprint when the report records one); without it the report is taken as given,
    since there is nothing to check it against. Every path of the library that applies a
    selection to a model (``LayerSwapConfig``, ``hf-layerswap prune --report``, publishing
    with :func:`~hf_layerswap.save_for_hub`) checks the report against that model.

    Every strategy runs under one check (:mod:`hf_layerswap.selection.finite`): a budget
    the report's layer scores cannot fill with finite values is refused before the
    strategy runs, and a set whose recorded value (objective, joint removal KL) is
    non-finite is refused after it; the report is then left as it was.

    Raises:
        NonFiniteScoresError: (:class:`~hf_layerswap.scoring.rule.NonFiniteScoresError`, a
            ``ValueError``) no finite basis for the budget; the message names the
            non-finite pairs or sets, the first calibration batch where they broke when
            the report records it, and what to try.
        ValueError: ``report=None`` for a strategy that reads swap-KL scores or without
            ``model=``, an unknown protocol, a protocol the report did not score, a model
            whose block count or fingerprint differs from the report's, or an unmeetable
            budget.
        TypeError: an option the chosen strategy does not accept (the message names it
            and the accepted ones), before anything runs.
    """
    if protocol not in selection_protocols():
        raise ValueError(f"protocol={protocol!r}: allowed {list(selection_protocols())}")
    if strategy is None:
        strategy = "auto" if protocol == "auto" else "greedy"
    fn = get_strategy(strategy)
    check_options(strategy, options)
    strategy_entry(strategy).check_option_values(options)
    if report is None:
        report = _unscored_report(strategy, model)
    if model is not None:
        model = uncompiled(model)
        check_report_matches(report, model)
    if spacing is None:
        spacing = strategy_entry(strategy).spacing
    if strategy in MODEL_STRATEGIES:
        if model is None:
            raise ValueError(f"strategy={strategy!r} scores candidate sets on the calibration prompts: pass model= and calibration=")
        calibration = calibration_from_args(
            model, calibration, tokenizer, report.metadata.get("num_prompts", 64), report.metadata.get("seq_len", 128),
            report.metadata.get("seed", 0),
        )
    return finite_selection(
        report, num_to_remove,
        lambda: fn(report, num_to_remove, protocol=protocol, spacing=spacing, protect=protect, model=model,
                   calibration=calibration, tokenizer=tokenizer, batch_size=batch_size, objective=objective,
                   options=options, max_memory=max_memory),
        protocol=protocol, spacing=spacing, protect=protect,
    )


def _unscored_report(strategy: str, model) -> SwapReport:
    """``report=None`` (e.g. a ``PruneResult.report`` of a strategy that reads no swap-KL score):
    for such a strategy (registered with ``guided_by=NO_PROTOCOL``) and a ``model``, a report
    of no pair of its blocks, where the decision record lands; refused otherwise."""
    entry = strategy_entry(strategy)
    if entry.guided_by is not NO_PROTOCOL:
        raise ValueError(f"report=None: strategy={strategy!r} reads swap-KL scores; pass the SwapReport of "
                         "score_layers (or a strategy that reads none, e.g. 'sleb')")
    if model is None:
        raise ValueError(f"report=None with strategy={strategy!r}: pass model= (and calibration=), which it reads")
    return SwapReport(num_blocks(uncompiled(model)), [], protocols=())


def check_report_matches(report: SwapReport, model) -> None:
    """Raise ValueError if ``report`` was not computed on ``model`` (block count, and the
    weight fingerprint when the report carries one)."""
    if num_blocks(model) != report.num_blocks:
        raise ValueError(
            f"the report was computed on a model with {report.num_blocks} blocks but this model has "
            f"{num_blocks(model)}: score the model you select for"
        )
    expected = (report.metadata.get("model") or {}).get("fingerprint")
    if expected:
        actual = model_fingerprint(model)
        if actual != expected:
            raise ValueError(
                f"the report belongs to a different model: its fingerprint is {expected[:16]}..., this model's is "
                f"{actual[:16]}... (same depth, different weights or architecture); score this model"
            )


def candidates_set(key: str) -> list[int]:
    """Inverse of :func:`~hf_layerswap.scoring.report.set_key`."""
    return [int(x) for x in key.split(",")] if key else []
