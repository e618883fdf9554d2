"""``python -m hf_layerswap.cli``: the ``hf-layerswap`` command."""

import sys

from . import main

sys.exit(main())
