"""Training-free recovery of a cut; see :mod:`.core`."""

from .core import *  # noqa: F403
from .core import __all__  # noqa: F401
from .core import DEFAULT_NUM_TOKENS, LOADER_NOTE, _Moments  # noqa: F401
