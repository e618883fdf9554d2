"""Choosing which blocks to remove from a :class:`~hf_layerswap.report.SwapReport`.

The paper's rule (No Free Swap, arXiv 2605.16234, Table 17 / App. G): score each layer by
s(i) = min over scored partners of d(i, j), sort ascending, and take layers greedily
while every two selected layers stay more than ``spacing`` apart. Protected layers (by
default the first and the last block) and layers with a non-finite score are never taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .plan import ONE_BLOCK, as_index
from .report import PROTOCOLS, SwapReport, _score_key, set_key

__all__ = [
    "SELECTION_PROTOCOLS",
    "STRATEGIES",
    "get_strategy",
    "greedy_select",
    "register_strategy",
    "resolve_protect",
    "select_layers",
]

SELECTION_PROTOCOLS = PROTOCOLS + ("auto",)

#: Selection strategy name -> function ``(report, n, **context) -> list[int]``; see
#: :func:`register_strategy`. ``greedy`` and ``auto`` live here; ``search`` in
#: :mod:`hf_layerswap.search`; the field's criteria (``beam``, ``block_influence``,
#: ``angular_distance``, ``single_removal_kl``, ``sleb``) in :mod:`hf_layerswap.baselines`.
STRATEGIES: dict[str, Callable] = {}
#: Strategies that read the model and calibration prompts (not only the report).
MODEL_STRATEGIES: set[str] = set()


def register_strategy(name: str, *, needs_model: bool = False):
    """Decorator: register ``fn(report, num_layers, **context) -> list[int]`` as a selection
    strategy. ``context`` holds ``protocol``, ``spacing``, ``protect``, ``model``,
    ``calibration`` (a :class:`~hf_layerswap.calibration.CalibrationSet` when
    ``needs_model``), ``batch_size``, ``objective`` and ``options`` (a dict).

    Raises:
        ValueError: the name is already registered.
    """

    def wrap(fn):
        if name in STRATEGIES:
            raise ValueError(f"selection strategy {name!r} is already registered")
        STRATEGIES[name] = fn
        if needs_model:
            MODEL_STRATEGIES.add(name)
        return fn

    return wrap


def get_strategy(name: str) -> Callable:
    """The registered strategy ``name``.

    Raises:
        ValueError: an unknown name (the message lists the allowed ones).
    """
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"strategy={name!r}: allowed {sorted(STRATEGIES)}")
    return STRATEGIES[name]


def resolve_protect(protect: Sequence[int] | None, num_layers: int) -> set[int]:
    """Resolve protected indices (negative = from the end).

    Raises:
        ValueError: an index outside ``-L..L-1``.
    """
    if isinstance(protect, (int, str)) or (protect is not None and not hasattr(protect, "__iter__")):
        raise ValueError(f"protect={protect!r}: must be a list of 0-based block indices, e.g. [0, -1] (or [] for none)")
    out = set()
    for p in protect or ():
        if as_index(p) is None:
            raise ValueError(f"protect entry {p!r} is not an int: allowed ints in -{num_layers}..{num_layers - 1}")
        if not -num_layers <= as_index(p) < num_layers:
            raise ValueError(f"protect entry {p!r} is out of range: allowed ints in -{num_layers}..{num_layers - 1}")
        out.add(as_index(p) % num_layers)
    return out


def check_budget(num_layers, total: int, *, spacing=1, protect: Sequence[int] | None = (0, -1)) -> int:
    """Refuse a budget no selection can meet, before any scoring is spent on it.

    The most layers the rules allow is the left-to-right count of unprotected blocks kept
    more than ``spacing`` apart; a budget within it may still be refused after scoring
    when the score order leaves gaps (:func:`greedy_select` says so).

    Returns:
        the budget as an int.

    Raises:
        ValueError: ``num_layers`` outside ``1..L-1``, a negative ``spacing``, a bad
            ``protect`` entry, or more layers than the rules allow (the message says how
            many).
    """
    if total < 2:
        raise ValueError(f"num_layers={num_layers!r}: {ONE_BLOCK}")
    if as_index(num_layers) is None or not 1 <= as_index(num_layers) <= total - 1:
        raise ValueError(f"num_layers={num_layers!r}: allowed 1..{total - 1} for a model with {total} blocks")
    if as_index(spacing) is None or as_index(spacing) < 0:
        raise ValueError(f"spacing={spacing!r}: must be an int >= 0 (0 allows adjacent layers)")
    protected, most, last = resolve_protect(protect, total), 0, None
    for i in range(total):
        if i not in protected and (last is None or i - last > as_index(spacing)):
            most, last = most + 1, i
    if as_index(num_layers) > most:
        raise ValueError(
            f"cannot select {num_layers} layers of {total} with spacing={spacing} and protect={sorted(protected)}: "
            f"the rules allow at most {most}; lower num_layers or spacing, or protect fewer layers"
        )
    return as_index(num_layers)


def greedy_select(scores: Sequence[float], num_layers: int, *, spacing: int = 1, protect: Sequence[int] = (0, -1)) -> list[int]:
    """The paper's greedy rule on per-layer scores (low = removable).

    Args:
        scores: length-L per-layer scores.
        num_layers: how many layers to select (n).
        spacing: every two selected layers satisfy ``|a - b| > spacing`` (0 allows
            neighbours; 1 = no two adjacent).
        protect: indices never selected (negative = from the end).

    Returns:
        n 0-based indices, ascending.

    Raises:
        ValueError: as :func:`check_budget`, or a budget the score order cannot meet
            (non-finite scores, gaps; the message says how many layers could be taken).
    """
    total = len(scores)
    num_layers, spacing = check_budget(num_layers, total, spacing=spacing, protect=protect), as_index(spacing)
    protected = resolve_protect(protect, total)
    order = sorted(range(total), key=lambda i: (_score_key(scores[i]), i))
    chosen: list[int] = []
    for i in order:
        if len(chosen) == num_layers:
            break
        if i in protected or scores[i] is None or not math.isfinite(scores[i]):
            continue
        if all(abs(i - k) > spacing for k in chosen):
            chosen.append(i)
    if len(chosen) < num_layers:
        raise ValueError(
            f"cannot select {num_layers} layers of {total} with spacing={spacing} and protect={sorted(protected)}: "
            f"the rule found only {len(chosen)} ({sorted(chosen)}); lower num_layers or spacing, or protect fewer layers"
        )
    return sorted(chosen)


def select_layers(
    report: SwapReport,
    num_layers: int,
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
    **options,
) -> list[int]:
    """Select ``num_layers`` blocks to remove (0-based, ascending).

    Args:
        report: swap-KL scores of the model.
        num_layers: the budget n.
        strategy: a name in :data:`STRATEGIES`. ``None``: ``"auto"`` when
            ``protocol="auto"``, else ``"greedy"`` (the paper's rule on ``protocol``).
            ``"search"`` (:func:`hf_layerswap.search.search_select`, the default of
            :class:`~hf_layerswap.LayerSwapConfig` and the CLI) scores whole candidate
            sets from both protocols on the calibration prompts and refines them by local
            moves; it, ``"beam"`` and the field's criteria need ``model=`` and
            ``calibration=``. Each model-reading strategy appends its record (chosen set,
            objective value, each protocol's greedy set with its value, trace, cost) to
            ``report.selections``.
        objective: for ``"search"``: ``"removal_kl"`` (default), ``"nll"`` or
            ``"ghosted"`` (removal KL after the Ghosted Layers repair); for ``"beam"``:
            ``"removal_kl"`` or ``"nll"``.
        options: strategy options (e.g. ``max_evaluations`` for ``"search"``).
        spacing: ``None`` = the strategy's default (1 for the paper's greedy rule and
            ``auto``, 0 for the searches).
        protocol: ``"interchange"``, ``"replacement"`` or ``"auto"``. ``"auto"`` takes
            the candidate set of each protocol, evaluates both by their joint removal KL
            d_skip(S) on the calibration prompts and keeps the lower (ties go to
            interchange); both values are recorded in ``report.removal_kl`` and the
            decision in ``report.selections``.
        spacing, protect: see :func:`greedy_select`.
        model, calibration, tokenizer, batch_size: needed by ``"auto"`` when the two
            candidate sets differ and ``report.removal_kl`` lacks them. Pass the same
            calibration source as for scoring (the report keeps its content hash, not
            the prompts); ``num_prompts``, ``seq_len`` and ``seed`` come from the report.

    Raises:
        ValueError: an unknown protocol, a protocol the report did not score, a model
            whose block count differs from the report's, or an unmeetable budget.
    """
    if protocol not in SELECTION_PROTOCOLS:
        raise ValueError(f"protocol={protocol!r}: allowed {list(SELECTION_PROTOCOLS)}")
    if strategy is None:
        strategy = "auto" if protocol == "auto" else "greedy"
    fn = get_strategy(strategy)
    if model is not None:
        check_report_matches(report, model)
    if spacing is None:
        spacing = 1 if strategy in ("greedy", "auto") else 0
    if strategy in MODEL_STRATEGIES:
        if model is None:
            raise ValueError(f"strategy={strategy!r} scores candidate sets on the calibration prompts: pass model= and calibration=")
        from .scoring import _calibration_from_args

        calibration = _calibration_from_args(
            model, calibration, tokenizer, report.metadata.get("num_prompts", 64), report.metadata.get("seq_len", 128),
            report.metadata.get("seed", 0),
        )
    return fn(report, num_layers, protocol=protocol, spacing=spacing, protect=protect, model=model,
              calibration=calibration, tokenizer=tokenizer, batch_size=batch_size, objective=objective,
              options=options)


@register_strategy("greedy")
def _greedy(report, num_layers, *, protocol, spacing, protect, options, **_):
    """The paper's rule on one protocol's layer scores."""
    if protocol == "auto":
        raise ValueError("strategy='greedy' needs protocol='interchange' or 'replacement' (or use strategy='auto')")
    _no_options("greedy", options)
    return greedy_select(report.layer_scores(protocol), num_layers, spacing=spacing, protect=protect)


def _no_options(strategy, options):
    if options:
        raise TypeError(f"strategy={strategy!r} takes no options; got {sorted(options)}")


@register_strategy("auto")
def _auto(report, num_layers, *, spacing, protect, model, calibration, tokenizer, batch_size, options, **_):
    """Each protocol's greedy set; the one with the lower joint removal KL is kept."""
    _no_options("auto", options)
    candidates = {
        p: greedy_select(report.layer_scores(p), num_layers, spacing=spacing, protect=protect) for p in PROTOCOLS
    }
    keys = {p: set_key(s) for p, s in candidates.items()}
    missing = [k for k in dict.fromkeys(keys.values()) if k not in report.removal_kl]
    if len(set(keys.values())) > 1 and missing:
        if model is None:
            raise ValueError(
                "protocol='auto' needs the joint removal KL of both candidate sets "
                f"{candidates}: pass model= and calibration= (the same prompts used for scoring)"
            )
        from .scoring import removal_kl

        values = removal_kl(
            model, calibration, [candidates_set(k) for k in missing], tokenizer=tokenizer, batch_size=batch_size,
            num_prompts=report.metadata.get("num_prompts", 64), seq_len=report.metadata.get("seq_len", 128),
            seed=report.metadata.get("seed", 0),
        )
        report.removal_kl.update(dict(zip(missing, values)))
    if len(set(keys.values())) == 1:
        chosen_protocol = "interchange"
        reason = "both protocols select the same set"
    else:
        ki, kr = report.removal_kl[keys["interchange"]], report.removal_kl[keys["replacement"]]
        chosen_protocol = "replacement" if _score_key(kr) < _score_key(ki) else "interchange"
        reason = "lower joint removal KL on the calibration prompts"
    record = {
        "num_layers": as_index(num_layers),
        "spacing": as_index(spacing),
        "protect": sorted(resolve_protect(protect, report.num_layers)),
        "candidates": {p: candidates[p] for p in PROTOCOLS},
        "removal_kl": {p: report.removal_kl.get(keys[p]) for p in PROTOCOLS},
        "chosen_protocol": chosen_protocol,
        "selected": candidates[chosen_protocol],
        "reason": reason,
    }
    report.selections.append(record)
    return list(candidates[chosen_protocol])


def check_report_matches(report: SwapReport, model) -> None:
    """Raise ValueError if ``report`` was not computed on ``model`` (block count, and the
    weight fingerprint when the report carries one)."""
    from .plan import model_fingerprint, num_blocks

    if num_blocks(model) != report.num_layers:
        raise ValueError(
            f"the report was computed on a model with {report.num_layers} blocks but this model has "
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
    """Inverse of :func:`~hf_layerswap.report.set_key`."""
    return [int(x) for x in key.split(",")] if key else []
