"""What every part of the card shares: the sidecar file names, the number formats of the
tables and the contract entries that describe the run rather than the measurement."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence


from ..jsonio import encode_float




REPORT_FILE = "layerswap_report.json"
EVALUATION_FILE = "layerswap_evaluation.json"
SPARSITY_FILE = "layerswap_sparsity.json"
#: Above this many scored pairs the card lists adjacent pairs and the lowest-scoring ones
#: (the sidecar JSON always has every pair).
MAX_PAIR_ROWS = 200
_DEFAULT_SPACING, _DEFAULT_PROTECT = 1, [0, -1]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DASH = "—"
#: Contract entries that describe the run rather than the measurement (not compared, not
#: listed in the contract table; versions have their own table).
_NOT_CONTRACT = ("model", "versions", "library_versions", "device")
#: Contract entries repeated as ``model-index`` metric args (the card body has the rest).
_METRIC_ARGS = ("name", "words", "window", "stride", "scored_tokens", "dtype", "text_sha256")




# ---------------------------------------------------------------------- formatting
def _kl(v) -> str:
    """A KL value (nats) for a table: 4 significant digits; NaN/inf kept visible."""
    if v is None:
        return _DASH
    return f"{v:.4g}" if math.isfinite(v) else encode_float(v)


def _ratio(v) -> str:
    return _DASH if v is None else f"{v:.3f}"


def _indices(layers: Sequence[int]) -> str:
    return ", ".join(str(i) for i in layers) if layers else "none"


def _pct(x: float) -> str:
    return f"{x:+.1f}%"


def _cell(value) -> str:
    """A markdown table cell for an arbitrary JSON-able value."""
    if isinstance(value, float):
        return _kl(value)
    if isinstance(value, (dict, list, tuple)):
        value = json.dumps(value, sort_keys=True)
    return str(value).replace("|", "\\|").replace("\n", " ")
