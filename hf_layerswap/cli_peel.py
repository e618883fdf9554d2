"""Former location of :mod:`hf_layerswap.cli.peel` (the ``peel`` verb), deprecated; its
names still import from here."""

from .cli.peel import *  # noqa: F403
from .cli.peel import __all__  # noqa: F401
