"""Model cards for layer-pruned checkpoints; see :mod:`.render`."""

from .render import *  # noqa: F403
from .render import __all__  # noqa: F401
from .render import SPARSITY_FILE, sparsity_refusal, write_sparsity_plot  # noqa: F401
