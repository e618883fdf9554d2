"""Live views of a registry's names: :class:`RegistryNames`.

A registry (strategies, recovery methods, pruners, search objectives) grows when a module
registers a new entry; a tuple of its names taken at import time would miss every entry
registered later. The module-level names that list a registry (``recovery.METHODS``,
``sparsity.METHODS``, ``selection.OBJECTIVES``) are therefore views that read the registry
each time they are used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, overload

__all__ = ["RegistryNames"]


class RegistryNames(Sequence[str]):
    """A read-only, tuple-like view of the names a registry holds now.

    Every use (iteration, ``len``, ``in``, indexing, ``==``, ``+``) reads ``names()``
    afresh, so a name registered after the view was created is in it. It compares equal
    to any sequence of the same names in the same order (``("a", "b") == view``), and
    ``view + ("c",)`` gives a plain tuple.

    Args:
        names: ``() -> iterable of str``: the registry's names, in registration order.
    """

    def __init__(self, names: Callable[[], Iterable[str]]):
        self._names = names

    def snapshot(self) -> tuple[str, ...]:
        """The names now, as a plain tuple."""
        return tuple(self._names())

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self.snapshot()[index]

    def __len__(self) -> int:
        return len(self.snapshot())

    def __iter__(self) -> Iterator[str]:
        return iter(self.snapshot())

    def __contains__(self, name: object) -> bool:
        return name in self.snapshot()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RegistryNames, tuple, list)):
            return self.snapshot() == tuple(other)
        return NotImplemented

    def __add__(self, other: Iterable[str]) -> tuple[str, ...]:
        return self.snapshot() + tuple(other)

    def __radd__(self, other: Iterable[str]) -> tuple[str, ...]:
        return tuple(other) + self.snapshot()

    def __repr__(self) -> str:
        return repr(self.snapshot())

    def __reduce__(self) -> tuple[Any, ...]:  # pickled (e.g. into a process pool) as the names it holds
        return tuple, (self.snapshot(),)
