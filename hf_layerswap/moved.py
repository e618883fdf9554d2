"""Names that moved to another module and still import from their old one.

:func:`moved_names` builds the old module's ``__getattr__`` (PEP 562): a moved name is
looked up in its new module when first asked for, with a ``DeprecationWarning`` naming the
new home. The new module is imported only then, so the old one may sit below it in the
import graph (the command-line verbs moved out of the library modules they call).
"""

from __future__ import annotations

import importlib
import warnings

__all__ = ["moved_names"]


def moved_names(module: str, moved: dict[str, str]):
    """The ``__getattr__`` of ``module`` for names that moved.

    Args:
        module: the old module's name (``__name__``).
        moved: old name -> the module that now owns it (the name is unchanged).

    Returns:
        A function to bind as the old module's ``__getattr__``; it raises ``AttributeError``
        for any other name.
    """

    def __getattr__(name: str):
        if name in moved:
            warnings.warn(f"{module}.{name} moved to {moved[name]}.{name}", DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(moved[name]), name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
