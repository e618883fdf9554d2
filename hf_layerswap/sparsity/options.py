"""The options of :func:`~hf_layerswap.sparsity.sparsify` beyond its named arguments
(:class:`SparsifyOptions`): each field carries its help and bounds
(:func:`~hf_layerswap.utils.registry.option`), which the allocators' and pruners' typed options
(their registry entries' ``option_class``) are made from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..utils.registry import option
from .allocators import MAPPINGS
from .stats import ESTIMATORS

__all__ = ["POOLS", "SOURCES", "SparsifyOptions"]

SOURCES = ("linear_inputs", "block_input")
POOLS = ("all", "per_token_mean")


@dataclass
class SparsifyOptions:
    """Every option of :func:`~hf_layerswap.sparsity.sparsify` beyond its named arguments, with defaults.

    Calibration (used only when ``calibration`` is not already a ``CalibrationSet``):
        num_prompts (64), seq_len (128), calibration_seed (0).
    Running: batch_size (8 prompts per forward), progress (False).
    PALS (and the mapping of ``gradient``): percentile (0.99, as a fraction), delta (0.05,
        the hard per-block bound), mapping (``"zscore"`` or ``"minmax"``), scale (beta,
        default = delta), invert (False: a higher statistic gives a lower sparsity).
    PALS statistic (the abstract leaves these open; the defaults are our choice):
        source: ``"linear_inputs"`` (default: the inputs of the block's prunable linears,
            each distinct tensor once, i.e. the q/k/v input once, the o input, the gate/up
            input once, the down input; the activations Wanda's score uses) or
            ``"block_input"`` (the residual stream entering the block).
        pool: ``"all"`` (default: every token x channel magnitude) or ``"per_token_mean"``
            (the mean magnitude over channels of each token).
        estimator: ``"histogram"`` (default: streaming log2 histogram, relative error
            <= 2**(1/(2*bins_per_octave)) - 1) or ``"exact"`` (keeps all values).
        bins_per_octave (256).
    OWL: owl_m (5, as in the OWL README's commands; its main.py default is 3),
        owl_lambda (0.08).
    random: seed (0).
    SparseGPT: blocksize (128), percdamp (0.01), as in its reference code.
    """

    num_prompts: int = option(64, help="calibration prompts (a source that is not a CalibrationSet)", ge=1)
    seq_len: int = option(128, help="tokens per calibration prompt", ge=1)
    calibration_seed: int = option(0, help="seed of the calibration prompts' order", ge=0)
    batch_size: int = option(8, help="prompts per forward", ge=1)
    progress: bool = option(False, help="show a progress bar")
    percentile: float = option(0.99, help="the activation percentile of a block's statistic, as a fraction "
                                          "(0.99: the 99th)", gt=0.0, le=1.0)
    delta: float = option(0.05, help="the hard bound of a block's sparsity around the target (target +- delta)",
                          ge=0.0, lt=1.0)
    mapping: str = option("zscore", help="statistic -> sparsity offset: z-scores or min-max scaled to [-scale, scale]",
                          choices=MAPPINGS)
    scale: float | None = option(None, help="beta, the offsets' scale (None: delta)", ge=0.0)
    invert: bool = option(False, help="a higher statistic gives a higher sparsity (default: lower)")
    source: str = option("linear_inputs", help="what the statistic reads: the block's prunable linears' inputs "
                                               "or the residual stream entering it",
                         choices=SOURCES)
    pool: str = option("all", help="every token x channel magnitude, or each token's mean magnitude",
                       choices=POOLS)
    estimator: str = option("histogram", help="the percentile from a streaming log2 histogram or from every value",
                            choices=ESTIMATORS)
    bins_per_octave: int = option(256, help="histogram bins per factor of 2", ge=1)
    owl_m: float = option(5.0, help="OWL's outlier threshold M: a weight score above M times its layer's mean",
                          gt=0.0)
    owl_lambda: float = option(0.08, help="OWL's bound of a block's sparsity around the target (lambda)",
                               ge=0.0, lt=1.0)
    seed: int = option(0, help="seed of the random offsets", ge=0)
    blocksize: int = option(128, help="SparseGPT's column block width", ge=1)
    percdamp: float = option(0.01, help="SparseGPT's Hessian dampening, a fraction of its mean diagonal", ge=0.0)

    def __post_init__(self):
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size!r}: must be an int >= 1")
        if not 0.0 < self.percentile <= 1.0:
            raise ValueError(
                f"percentile={self.percentile!r}: a fraction in (0, 1] (0.99 is the 99th percentile)"
            )
        if self.mapping not in MAPPINGS:
            raise ValueError(f"mapping={self.mapping!r}: allowed {list(MAPPINGS)}")
        if self.source not in SOURCES:
            raise ValueError(f"source={self.source!r}: allowed {list(SOURCES)}")
        if self.pool not in POOLS:
            raise ValueError(f"pool={self.pool!r}: allowed {list(POOLS)}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator={self.estimator!r}: allowed {list(ESTIMATORS)}")
        if not 0.0 <= self.delta < 1.0:
            raise ValueError(f"delta={self.delta!r}: must be in [0, 1)")

    #: options every allocation and method reads (the others: ``Allocator.options``,
    #: ``Pruner.options`` of the registered entries)
    GENERAL = ("num_prompts", "seq_len", "calibration_seed", "batch_size", "progress")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
