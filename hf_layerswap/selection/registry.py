"""The registry of selection strategies: one name, one function, one module.

A strategy is ``fn(report, num_to_remove, **context) -> list[int]`` (0-based blocks,
ascending); :func:`register_strategy` adds one, :func:`get_strategy` looks one up.
Adding a method = one new module + one ``@register_strategy("name")``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection

__all__ = ["MODEL_STRATEGIES", "STRATEGIES", "STRATEGY_OPTIONS", "check_options", "get_strategy", "keyword_options",
           "register_strategy"]


#: Selection strategy name -> function ``(report, n, **context) -> list[int]``; see
#: :func:`register_strategy`. Each built-in strategy is a module of this package.
STRATEGIES: dict[str, Callable] = {}
#: Strategies that read the model and calibration prompts (not only the report).
MODEL_STRATEGIES: set[str] = set()
#: Strategy name -> the option names it accepts (``select_layers(..., **options)``), or
#: ``None`` where the strategy did not declare them (its options are passed as given).
STRATEGY_OPTIONS: dict[str, tuple[str, ...] | None] = {}


def register_strategy(name: str, *, needs_model: bool = False, options: Collection[str] | None = None):
    """Decorator: register ``fn(report, num_to_remove, **context) -> list[int]`` as a selection
    strategy. ``context`` holds ``protocol``, ``spacing``, ``protect``, ``model``,
    ``calibration`` (a :class:`~hf_layerswap.calibration.CalibrationSet` when
    ``needs_model``), ``batch_size``, ``objective`` and ``options`` (a dict).
    ``options``: the option names the strategy accepts (``()``: none; default: the
    function's ``options`` attribute if it has one); ``select_layers`` refuses any other
    before it runs. ``None``: not declared, passed as given.

    Raises:
        ValueError: the name is already registered.
    """

    def wrap(fn):
        if name in STRATEGIES:
            raise ValueError(f"selection strategy {name!r} is already registered")
        STRATEGIES[name] = fn
        declared = getattr(fn, "options", None) if options is None else options
        STRATEGY_OPTIONS[name] = None if declared is None else tuple(sorted(declared))
        if needs_model:
            MODEL_STRATEGIES.add(name)
        return fn

    return wrap


def keyword_options(fn: Callable, fixed: Collection[str]) -> tuple[str, ...] | None:
    """The keyword parameters of ``fn`` a caller may set, less ``fixed`` (those the
    strategy passes itself); ``None`` when ``fn`` takes ``**kwargs``."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(sorted(p.name for p in params if p.kind in kinds and p.name not in fixed))


def check_options(name: str, options: Collection[str]) -> None:
    """Raise TypeError naming each option of ``options`` that strategy ``name`` does not
    accept, and the ones it does (:data:`STRATEGY_OPTIONS`)."""
    accepted = STRATEGY_OPTIONS.get(name)
    unknown = sorted(set(options) - set(accepted)) if accepted is not None else []
    if unknown:
        allowed = f"it accepts {list(accepted)}" if accepted else "it takes no options"
        raise TypeError(f"strategy={name!r} does not take the option(s) {unknown}: {allowed}")


def get_strategy(name: str) -> Callable:
    """The registered strategy ``name``.

    Raises:
        ValueError: an unknown name (the message lists the allowed ones).
    """
    if not isinstance(name, str) or name not in STRATEGIES:
        raise ValueError(f"strategy={name!r}: allowed {sorted(STRATEGIES)}")
    return STRATEGIES[name]
