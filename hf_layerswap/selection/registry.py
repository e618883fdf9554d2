"""The registry of selection strategies: one name, one function, one module.

A strategy is ``fn(report, num_layers, **context) -> list[int]`` (0-based blocks,
ascending); :func:`register_strategy` adds one, :func:`get_strategy` looks one up.
Adding a method = one new module + one ``@register_strategy("name")``.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["MODEL_STRATEGIES", "STRATEGIES", "get_strategy", "register_strategy"]


#: Selection strategy name -> function ``(report, n, **context) -> list[int]``; see
#: :func:`register_strategy`. Each built-in strategy is a module of this package.
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
