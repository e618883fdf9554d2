"""Per-layer optimisation diagnostics ("peeling" reference bounds); see :mod:`.core`."""

from .core import *  # noqa: F403
from .core import __all__  # noqa: F401
