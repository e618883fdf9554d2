"""Former location of :mod:`hf_layerswap.cli.eval` (the ``eval`` verb), deprecated; its
names still import from here."""

from .cli.eval import *  # noqa: F403
from .cli.eval import __all__  # noqa: F401
