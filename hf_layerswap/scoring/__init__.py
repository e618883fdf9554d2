"""Swap-KL probes over a calibration set; see :mod:`.engine`."""

from .engine import *  # noqa: F403
from .engine import __all__  # noqa: F401
from .engine import (  # noqa: F401
    CHECKPOINT_FORMAT,
    DEFAULT_MAX_MEMORY,
    HEAD_BUDGET_FRACTION,
    KL_CHUNK_POSITIONS,
    MAX_KL_CHUNK,
    MIN_WHOLE_VOCAB_CHUNK,
    PREFIX_REUSE_MODES,
    Head,
    ScoringCheckpoint,
    _calibration_from_args,
    _Checkpoint,
    kl_rows,
    make_probes,
    parse_memory,
    row_blocks,
    schedule,
    shard,
)
