"""The built-in allocators (uniform, PALS, OWL, random, gradient) and pruners (Wanda,
SparseGPT, magnitude), each registered with its decorator (:mod:`.registry`). The maths
lives in :mod:`.allocators`, :mod:`.pruners` and :mod:`.stats`; this module says what each
method reads and records."""

from __future__ import annotations

import torch

from .allocators import gradient_allocation, outlier_ratio, owl_allocation, pals_allocation, random_allocation, uniform_allocation
from .engine import real_rows
from .pruners import magnitude_prune, sparsegpt_prune, wanda_prune, wanda_scores
from .registry import AllocationInputs, register_allocator, register_pruner
from .stats import HessianAccumulator, LogHistogramQuantile, RowNormSq, make_estimator

__all__: list[str] = []

_BOUNDED_BUDGET = "parameter-weighted mean = target exactly, every block within +-delta"
_MAPPING_OPTIONS = ("delta", "mapping", "scale", "invert")


def _bound_phrases(info) -> list[str]:
    return [f"bound ±{info['delta']:g} around the target"] if "delta" in info else []


def _mapping_phrases(info) -> list[str]:
    return _bound_phrases(info) + ([f"{info['mapping']} mapping"] if "mapping" in info else [])


def _mapping(opts) -> dict:
    return {"delta": opts.delta, "mapping": opts.mapping, "scale": opts.scale, "invert": opts.invert}


def _mapping_info(opts) -> dict:
    return {**_mapping(opts), "scale": opts.delta if opts.scale is None else opts.scale, "budget": _BOUNDED_BUDGET}


# ----------------------------------------------------------------------------- allocators
@register_allocator("uniform", label="uniform: every block at the target")
def _uniform(inputs: AllocationInputs):
    return uniform_allocation(inputs.num_params, inputs.sparsity), None, {}


def _pool(x: torch.Tensor, pool: str) -> torch.Tensor:
    return x.abs() if pool == "all" else x.float().abs().mean(-1)


def _observe_activations(opts, block_linears):
    """PALS: one percentile estimator per block, fed the block input or each distinct
    linear input (the q/k/v input once, the gate/up input once)."""
    estimators = [make_estimator(opts.estimator, bins_per_octave=opts.bins_per_octave) for _ in block_linears]
    collectors = {"estimators": estimators}
    if opts.source == "block_input":

        def on_block_input(index, hidden, token_mask):
            estimators[index].update(_pool(real_rows(hidden, token_mask), opts.pool))

        return on_block_input, None, collectors
    seen: list = []

    def reset_seen(index, hidden, token_mask):
        seen.clear()

    def linear_hooks(index, mask_ref):
        def hook(module, args):
            x = args[0]
            if any(x is y for y in seen):
                return
            seen.append(x)
            estimators[index].update(_pool(real_rows(x, mask_ref[0]), opts.pool))

        return [lin.register_forward_pre_hook(hook) for _, lin in block_linears[index]]

    return reset_seen, linear_hooks, collectors


#: Bytes per value that one update of a percentile estimator holds at once (fp32): the
#: linear's real input rows, their magnitudes, the estimator's own copy and its non-zero
#: values, two temporaries of the bin index and the int64 index (:meth:`LogHistogramQuantile.update`).
PALS_UPDATE_BYTES = 32


def _pals_memory(opts, linears, hidden, rows) -> tuple[int, int]:
    """PALS's estimators, one per block, kept until the pruning pass ends (a histogram's int64
    counts; ``estimator="exact"``: every value, 4 bytes each), and the largest update's
    temporaries (:data:`PALS_UPDATE_BYTES` per value of the widest input of the largest batch
    and one ``bincount`` of the grid)."""
    inputs = [[hidden]] * len(linears) if opts.source == "block_input" else [sorted({i for _, i in lins})
                                                                             for lins in linears]
    per_row = (lambda width: width) if opts.pool == "all" else (lambda width: 1)
    update = PALS_UPDATE_BYTES * max(rows, default=0) * per_row(max(max(w) for w in inputs))
    if opts.estimator == "histogram":
        bins = 8 * LogHistogramQuantile.bins(opts.bins_per_octave)
        return len(linears) * bins, bins + update
    return 4 * sum(rows) * sum(per_row(w) for ws in inputs for w in ws), update


def _pals_phrases(info) -> list[str]:
    out = _mapping_phrases(info)
    if "percentile" in info:
        out.append(f"percentile {info['percentile']:g} of |activation| ({info.get('source')}, pool={info.get('pool')})")
    return out


@register_allocator(
    "pals",
    label="PALS: percentile-aware layerwise sparsity (larger activation percentile, lower sparsity)",
    observe=_observe_activations,
    options=("percentile", *_MAPPING_OPTIONS, "source", "pool", "estimator", "bins_per_octave"),
    card_options=_pals_phrases,
    memory=_pals_memory,
)
def _pals(inputs: AllocationInputs):
    opts = inputs.options
    estimators = inputs.collectors["estimators"]
    values = [est.quantile(opts.percentile) for est in estimators]
    info = {
        "statistic": f"quantile {opts.percentile:g} of |activation| ({opts.source}, pool={opts.pool}), dense model",
        "percentile": opts.percentile,
        "source": opts.source,
        "pool": opts.pool,
        "estimator": estimators[0].spec(),
        "values_per_block": [est.count for est in estimators],
        **_mapping_info(opts),
    }
    return pals_allocation(values, inputs.num_params, inputs.sparsity, **_mapping(opts)), values, info


def _observe_row_norms(opts, block_linears):
    """OWL: Wanda's per-input-channel squared norms of every linear's real input rows."""
    norms = [[RowNormSq(lin.in_features, lin.weight.device) for _, lin in lins] for lins in block_linears]

    def linear_hooks(index, mask_ref):
        def make(acc):
            return lambda module, args: acc.update(real_rows(args[0], mask_ref[0]))

        pairs = zip(block_linears[index], norms[index])
        return [lin.register_forward_pre_hook(make(acc)) for (_, lin), acc in pairs]

    return None, linear_hooks, {"norms": norms}


def _row_norm_memory(linears, rows) -> tuple[int, int]:
    """``(kept, update)``: Wanda's statistic of every linear in ``linears`` (one fp32 sum of
    squares per input feature), and one update's temporaries on the widest input of the
    largest batch: its real rows and their squares (fp32)."""
    return 4 * sum(i for _, i in linears), 8 * max(rows, default=0) * max((i for _, i in linears), default=0)


def _owl_memory(opts, linears, hidden, rows) -> tuple[int, int]:
    """OWL's row norms of every linear of every block, kept until the pruning pass ends."""
    return _row_norm_memory([lin for lins in linears for lin in lins], rows)


def _owl_phrases(info) -> list[str]:
    return [f"M = {info['owl_m']:g}, lambda = {info['owl_lambda']:g}"] if "owl_m" in info else []


@register_allocator(
    "owl",
    label="OWL: outlier-weighted layerwise sparsity (Yin et al., 2024)",
    observe=_observe_row_norms,
    options=("owl_m", "owl_lambda"),
    card_options=_owl_phrases,
    memory=_owl_memory,
)
def _owl(inputs: AllocationInputs):
    opts = inputs.options
    lods = []
    for lins, accs in zip(inputs.block_linears, inputs.collectors["norms"]):

        def scores(lins=lins, accs=accs):
            return (wanda_scores(lin.weight, acc.sum_sq) for (_, lin), acc in zip(lins, accs))

        lods.append(outlier_ratio(scores, opts.owl_m))
    info = {
        "statistic": f"layerwise outlier distribution (% of Wanda scores > M x block mean, M={opts.owl_m:g}), dense model",
        "owl_m": opts.owl_m,
        "owl_lambda": opts.owl_lambda,
        "budget": "unweighted mean = target (OWL reference mapping); spread max-min = 2 lambda; no per-block bound",
    }
    return owl_allocation(lods, inputs.sparsity, lam=opts.owl_lambda), lods, info


@register_allocator(
    "random", label="random per-block offsets (ablation)", options=("delta", "seed"), card_options=_bound_phrases
)
def _random(inputs: AllocationInputs):
    opts = inputs.options
    targets = random_allocation(inputs.num_params, inputs.sparsity, delta=opts.delta, seed=opts.seed)
    info = {
        "statistic": "target - s (the seeded uniform offset after the exact budget fit)",
        "delta": opts.delta,
        "seed": opts.seed,
        "budget": _BOUNDED_BUDGET,
    }
    return targets, [t - inputs.sparsity for t in targets], info


@register_allocator(
    "gradient",
    label="gradient-based per-block sparsity (ablation)",
    needs_gradients=True,
    options=_MAPPING_OPTIONS,
    card_options=_mapping_phrases,
)
def _gradient(inputs: AllocationInputs):
    opts = inputs.options
    info = {
        "statistic": "mean |dL/dW| over the block's prunable weights (calibration next-token loss), dense model",
        **_mapping_info(opts),
    }
    targets = gradient_allocation(inputs.gradients, inputs.num_params, inputs.sparsity, **_mapping(opts))
    return targets, inputs.gradients, info


# ----------------------------------------------------------------------------- pruners
def _mask_memory(linears) -> int:
    """The per-row mask of the largest linear (:func:`~.pruners.lowest_k_mask`): its fp32
    scores and their magnitudes, the boolean comparisons and the int64 running count of
    ties, and the pruned fp32 weight."""
    return 24 * max((o * i for o, i in linears), default=0)


def _wanda_memory(opts, linears, rows) -> int:
    """The block's row norms and one update (:func:`_row_norm_memory`), and the mask of its
    largest linear (:func:`_mask_memory`)."""
    return sum(_row_norm_memory(linears, rows)) + _mask_memory(linears)


def _sparsegpt_memory(opts, linears, rows) -> int:
    """The block's fp32 Hessians (``in_features^2`` each), one update's real rows, and for its
    largest linear SparseGPT's fp32 work: the weight's copy, the lazy update's product and
    the pruned weight, the boolean mask, the damped Hessian's copy, identity and the
    factors of its inverse (four ``in_features^2`` at once) and one column block's arrays
    and mask scores (:func:`~.pruners.sparsegpt_prune`)."""
    largest_out, largest_in = max(linears, key=lambda lin: lin[0] * lin[1], default=(0, 0))
    widest = max((i for _, i in linears), default=0)
    hessians = 4 * sum(i * i for _, i in linears) + 4 * max(rows, default=0) * widest
    cols = min(opts.blocksize, largest_in)
    work = 13 * largest_out * largest_in + 16 * largest_in**2 + 40 * largest_out * cols
    return hessians + work


@register_pruner("wanda", label="Wanda (Sun et al., 2023): lowest |W| x ||X||_2 per output row", statistics=RowNormSq,
                 memory=_wanda_memory)
def _wanda(weight, norms, target, pattern, opts):
    return wanda_prune(weight, norms.sum_sq, target, pattern)[0]


@register_pruner(
    "sparsegpt",
    label="SparseGPT (Frantar and Alistarh, 2023): OBS mask and weight update, column blocks",
    statistics=HessianAccumulator,
    options=("blocksize", "percdamp"),
    memory=_sparsegpt_memory,
)
def _sparsegpt(weight, hessian, target, pattern, opts):
    return sparsegpt_prune(weight, hessian.hessian, target, pattern, blocksize=opts.blocksize, percdamp=opts.percdamp)[0]


@register_pruner("magnitude", label="magnitude: lowest |W| per output row", memory=lambda opts, linears, rows: _mask_memory(linears))
def _magnitude(weight, statistics, target, pattern, opts):
    return magnitude_prune(weight, target, pattern)[0]
