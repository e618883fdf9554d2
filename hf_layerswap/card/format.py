"""What every part of the card shares: the sidecar file names, the number formats of the
tables and the contract entries that describe the run rather than the measurement."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence


from ..utils.jsonio import encode_float

__all__ = [
    "DASH", "DEFAULT_PROTECT", "DEFAULT_SPACING", "EVALUATION_FILE", "format_cell", "format_indices", "format_kl",
    "format_pct", "format_ratio", "HUB_ID", "MAX_PAIR_ROWS", "METRIC_ARGS", "NOT_CONTRACT", "REPORT_FILE",
    "SPARSITY_FILE",
]




REPORT_FILE = "layerswap_report.json"
EVALUATION_FILE = "layerswap_evaluation.json"
SPARSITY_FILE = "layerswap_sparsity.json"
#: Above this many scored pairs the card lists adjacent pairs and the lowest-scoring ones
#: (the sidecar JSON always has every pair).
MAX_PAIR_ROWS = 200
#: The library's default ``(spacing, protect)``, shown when a removal record names neither.
DEFAULT_SPACING, DEFAULT_PROTECT = 1, [0, -1]
#: A Hub repository id ``owner/name``.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: The cell shown for a missing value.
DASH = "—"
#: Contract entries that describe the run rather than the measurement (not compared, not
#: listed in the contract table; versions have their own table).
NOT_CONTRACT = ("model", "versions", "library_versions", "device")
#: Contract entries repeated as ``model-index`` metric args (the card body has the rest).
METRIC_ARGS = ("name", "words", "window", "stride", "scored_tokens", "dtype", "text_sha256")




# ---------------------------------------------------------------------- formatting
def format_kl(v) -> str:
    """A KL value (nats) for a table: 4 significant digits; NaN/inf kept visible."""
    if v is None:
        return DASH
    return f"{v:.4g}" if math.isfinite(v) else encode_float(v)


def format_ratio(v) -> str:
    """A ratio with three decimals (the dash for ``None``)."""
    return DASH if v is None else f"{v:.3f}"


def format_indices(layers: Sequence[int]) -> str:
    """Block indices as ``"1, 4, 7"`` (``"none"`` for an empty list)."""
    return ", ".join(str(i) for i in layers) if layers else "none"


def format_pct(x: float) -> str:
    """A signed percentage with one decimal, e.g. ``"+2.5%"``."""
    return f"{x:+.1f}%"


def format_cell(value) -> str:
    """A markdown table cell for an arbitrary JSON-able value."""
    if isinstance(value, float):
        return format_kl(value)
    if isinstance(value, (dict, list, tuple)):
        value = json.dumps(value, sort_keys=True)
    return str(value).replace("|", "\\|").replace("\n", " ")
