"""Optional dependencies: which extra of ``hf-layerswap`` installs each, and the one error a
path raises when the package it needs is not installed.

``import hf_layerswap``, pruning, saving and the model card need only the core
dependencies. A module that uses an optional package imports it inside the function that
needs it, through :func:`require` (``tests/test_structure.py`` checks that no module
imports one at module level), so a missing package is refused by name, with the command
that installs it, before the expensive work of that path starts.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtraError", "available", "install_hint", "require"]

#: Optional top-level packages -> the extra of ``hf-layerswap`` that installs them.
EXTRAS = {
    "datasets": "lm-eval",  # the task runner's offline cache (lm-eval depends on it)
    "evaluate": "evaluate",  # the bundled perplexity metric module
    "gguf": "gguf",  # GGUF input and export
    "lm_eval": "lm-eval",  # benchmark tasks
    "llama_cpp": "llama-cpp",  # running exported GGUF files
    "matplotlib": "plots",  # the card's plots
    "mergekit": "mergekit",  # merge round trips
    "optimum": "optimum",  # the optimum-cli command
    "peft": "heal",  # LoRA healing
}


class MissingExtraError(ImportError):
    """An optional package a path needs is not installed; the message names the extra."""


def install_hint(module: str) -> str:
    """``pip install 'hf-layerswap[<extra>]'`` for the optional top-level package ``module``."""
    top = module.split(".")[0]
    if top not in EXTRAS:
        raise ValueError(f"{top!r} is not an optional dependency; the optional ones are {sorted(EXTRAS)}")
    return f"pip install 'hf-layerswap[{EXTRAS[top]}]'"


def require(module: str, purpose: str) -> ModuleType:
    """Import the optional ``module`` (a dotted name is allowed) for ``purpose``.

    Raises:
        MissingExtraError: it cannot be imported; the message names ``purpose``, the
            package and the extra that installs it.
        ValueError: ``module`` is not one of :data:`EXTRAS`.
    """
    hint = install_hint(module)
    top = module.split(".")[0]
    try:
        importlib.import_module(top)  # the package first: a submodule left in sys.modules does not count
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtraError(f"{purpose} needs {top}, which is not installed: {hint}") from err


def available(module: str) -> bool:
    """Whether the optional ``module`` can be imported (it is imported if so)."""
    install_hint(module)
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True
