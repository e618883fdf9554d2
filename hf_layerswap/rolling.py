"""Former location of :mod:`hf_layerswap.evaluation.rolling` (the ``"rolling"`` perplexity
contract); its names still import from here."""

from .evaluation.rolling import *  # noqa: F403
from .evaluation.rolling import __all__  # noqa: F401
