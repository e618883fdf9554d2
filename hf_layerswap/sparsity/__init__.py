"""Width compression: one-shot pruning of the linear weights inside decoder blocks.

:func:`sparsify` prunes a loaded causal LM in place with Wanda, SparseGPT or magnitude
scores, unstructured or N:M, at a per-block sparsity chosen by an allocator (uniform,
PALS, OWL, random, gradient; see :mod:`.allocators`). Blocks are pruned in order, each
calibrated on the outputs of the already-pruned blocks before it; allocator statistics
come from one dense pass first (OWL's pass 1). Embeddings, norms and the LM head stay
dense. The pruned model is an ordinary transformers model: ``save_pretrained`` writes
plain safetensors with explicit zeros.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..calibration import build_calibration
from ..plan import decoder_blocks
from ..surgery import original_indices
from .allocators import (
    ALLOCATIONS,
    MAPPINGS,
    fit_budget,
    gradient_allocation,
    outlier_ratio,
    owl_allocation,
    pals_allocation,
    random_allocation,
    standardised_offsets,
    uniform_allocation,
)
from .engine import capture_block_calls, gradient_statistics, prunable_linears, real_rows, run_block
from .pruners import METHODS, magnitude_prune, parse_pattern, sparsegpt_prune, wanda_prune, wanda_scores
from .report import BlockSparsity, LinearSparsity, SparsityReport
from .stats import ESTIMATORS, ExactQuantile, HessianAccumulator, LogHistogramQuantile, RowNormSq, make_estimator

__all__ = [
    "ALLOCATIONS",
    "CONFIG_ATTRIBUTE",
    "METHODS",
    "BlockSparsity",
    "ExactQuantile",
    "LinearSparsity",
    "LogHistogramQuantile",
    "SparsifyOptions",
    "SparsityReport",
    "check_arguments",
    "config_record",
    "sparsity_in_model",
    "fit_budget",
    "gradient_allocation",
    "magnitude_prune",
    "outlier_ratio",
    "owl_allocation",
    "pals_allocation",
    "parse_pattern",
    "random_allocation",
    "sparsegpt_prune",
    "sparsify",
    "standardised_offsets",
    "uniform_allocation",
    "wanda_prune",
    "wanda_scores",
]

SOURCES = ("linear_inputs", "block_input")
POOLS = ("all", "per_token_mean")


@dataclass
class SparsifyOptions:
    """Every option of :func:`sparsify` beyond its named arguments, with defaults.

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

    num_prompts: int = 64
    seq_len: int = 128
    calibration_seed: int = 0
    batch_size: int = 8
    progress: bool = False
    percentile: float = 0.99
    delta: float = 0.05
    mapping: str = "zscore"
    scale: float | None = None
    invert: bool = False
    source: str = "linear_inputs"
    pool: str = "all"
    estimator: str = "histogram"
    bins_per_octave: int = 256
    owl_m: float = 5.0
    owl_lambda: float = 0.08
    seed: int = 0
    blocksize: int = 128
    percdamp: float = 0.01

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

    #: which options each allocation / method reads (others are recorded but unused)
    USED_BY = {
        "pals": ("percentile", "delta", "mapping", "scale", "invert", "source", "pool", "estimator", "bins_per_octave"),
        "gradient": ("delta", "mapping", "scale", "invert"),
        "random": ("delta", "seed"),
        "owl": ("owl_m", "owl_lambda"),
        "uniform": (),
        "sparsegpt": ("blocksize", "percdamp"),
    }
    GENERAL = ("num_prompts", "seq_len", "calibration_seed", "batch_size", "progress")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _parse_options(options: dict, allocation: str, method: str, sparsity: float) -> SparsifyOptions:
    allowed = {f.name for f in dataclasses.fields(SparsifyOptions)}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"sparsify() got unknown options {unknown}; allowed: {sorted(allowed)}")
    used = set(SparsifyOptions.GENERAL) | set(SparsifyOptions.USED_BY[allocation])
    used |= set(SparsifyOptions.USED_BY.get(method, ()))
    unused = sorted(set(options) - used)
    if unused:
        warnings.warn(
            f"options {unused} have no effect with allocation={allocation!r}, method={method!r}", stacklevel=3
        )
    opts = SparsifyOptions(**options)
    check_bound(sparsity, allocation, opts.delta)
    return opts


def check_bound(sparsity: float, allocation: str, delta: float = SparsifyOptions.delta) -> None:
    """Refuse, before any forward pass, a bounded allocation (``pals``, ``random``,
    ``gradient``) whose bound ``sparsity + delta`` reaches 1 (a block with every weight zero).

    Raises:
        ValueError: ``sparsity + delta >= 1`` with ``delta > 0`` for a bounded allocation.
    """
    if "delta" in SparsifyOptions.USED_BY.get(allocation, ()):
        fit_budget([0.0], [1], sparsity, delta)


def _pool(x: torch.Tensor, pool: str) -> torch.Tensor:
    return x.abs() if pool == "all" else x.float().abs().mean(-1)


def _versions() -> dict:
    out = {}
    for pkg in ("torch", "transformers"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:  # pragma: no cover
            out[pkg] = None
    return out


def check_arguments(sparsity, allocation: str, method: str, pattern: str | None) -> tuple[int, int] | None:
    """Validate :func:`sparsify`'s target, allocation, method and pattern together;
    returns the parsed ``(N, M)`` pattern or ``None``.

    Raises:
        ValueError: the message names the value and what is allowed.
    """
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation={allocation!r}: allowed {list(ALLOCATIONS)}")
    if method not in METHODS:
        raise ValueError(f"method={method!r}: allowed {list(METHODS)}")
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity={sparsity!r}: must be a number in [0, 1)")
    nm = parse_pattern(pattern)
    if nm is not None:
        if abs(sparsity - nm[0] / nm[1]) > 1e-9:
            raise ValueError(f"pattern={pattern!r} fixes the sparsity at {nm[0] / nm[1]:g}, but sparsity={sparsity!r}")
        if allocation != "uniform":
            raise ValueError(
                f"pattern={pattern!r} gives every block sparsity {nm[0] / nm[1]:g}; use allocation='uniform' "
                f"(got {allocation!r})"
            )
    return nm


def sparsify(
    model: nn.Module,
    calibration=None,
    *,
    sparsity: float = 0.5,
    allocation: str = "pals",
    method: str = "wanda",
    pattern: str | None = None,
    tokenizer=None,
    **options,
) -> SparsityReport:
    """Prune every ``nn.Linear`` inside the decoder blocks of ``model``, in place.

    Args:
        model: a transformers causal LM (any family :func:`~hf_layerswap.plan.decoder_blocks`
            finds), e.g. after layer removal.
        calibration: a :class:`~hf_layerswap.calibration.CalibrationSet` or anything
            :func:`~hf_layerswap.calibration.build_calibration` accepts (``None`` = the
            embedded prose; text sources need ``tokenizer``).
        sparsity: overall target ``s`` in [0, 1): the parameter-weighted fraction of prunable
            block weights set to zero (for ``pattern="N:M"`` it must equal N/M).
        allocation: per-block sparsity rule, one of ``"uniform"``, ``"pals"`` (default),
            ``"owl"``, ``"random"``, ``"gradient"`` (see :mod:`.allocators`).
        method: ``"wanda"`` (default), ``"sparsegpt"`` or ``"magnitude"``.
        pattern: ``None`` (unstructured) or ``"N:M"`` such as ``"2:4"`` (then every block
            has sparsity N/M, so ``allocation`` must be ``"uniform"``).
        tokenizer: for text calibration sources.
        **options: see :class:`SparsifyOptions` (unknown names raise ``TypeError``).

    Returns:
        :class:`SparsityReport` with per-block and per-linear targets and achieved
        sparsity, allocator statistics and every option. The report is also left on
        ``model.layerswap_sparsity_report``, and a compact summary (:func:`config_record`)
        in ``model.config.layerswap_sparsity``, so it travels with ``save_pretrained`` and
        the model card can show it; a summary already there (an earlier pass) moves to its
        ``previous`` list.

    Raises:
        ValueError: an unknown allocation/method/pattern, a sparsity outside [0, 1), an N:M
            pattern with another sparsity or a non-uniform allocation, ``sparsity + delta >= 1``
            for a bounded allocation (pals, random, gradient), a linear whose input width is not
            divisible by M (all checked before any forward pass or weight change).
        TypeError: unknown options or a text calibration without tokenizer.
    """
    t0 = time.perf_counter()
    nm = check_arguments(sparsity, allocation, method, pattern)
    if nm is not None:
        pattern = f"{nm[0]}:{nm[1]}"
    opts = _parse_options(options, allocation, method, sparsity)
    calib = build_calibration(
        calibration, tokenizer, num_prompts=opts.num_prompts, seq_len=opts.seq_len, seed=opts.calibration_seed
    )

    _, _, blocks = decoder_blocks(model)
    module_names = {id(m): n for n, m in model.named_modules()}
    block_linears = [prunable_linears(b) for b in blocks]
    for lins in block_linears:
        if not lins:
            raise ValueError("a decoder block has no nn.Linear to prune")
        for _, lin in lins:
            if nm is not None and lin.in_features % nm[1]:
                raise ValueError(
                    f"{module_names[id(lin)]} has in_features={lin.in_features}, not divisible by M={nm[1]} "
                    f"(pattern {pattern!r})"
                )
    num_params = [sum(lin.weight.numel() for _, lin in lins) for lins in block_linears]
    device = next(model.parameters()).device
    batches = [(ids.to(device), mask.to(device)) for ids, mask in calib.batches(opts.batch_size)]
    was_training = model.training
    model.eval()
    timings = {}
    try:
        # ---- pass 1: dense statistics (and every block's call arguments)
        statistic_values, allocator_info = None, {"name": allocation}
        if allocation == "gradient":
            t = time.perf_counter()
            weights = [[lin.weight for _, lin in lins] for lins in block_linears]
            statistic_values = gradient_statistics(model, batches, weights)
            timings["gradient_pass_s"] = time.perf_counter() - t
        t = time.perf_counter()
        on_block_input, linear_hooks, collectors = _dense_observers(allocation, opts, block_linears)
        cache = capture_block_calls(model, batches, on_block_input=on_block_input, linear_hooks=linear_hooks)
        timings["dense_pass_s"] = time.perf_counter() - t

        # ---- allocation
        targets, statistic_values, allocator_info = _allocate(
            allocation, opts, sparsity, num_params, block_linears, collectors, statistic_values
        )
        allocator_info["targets_weighted_mean"] = sum(n * s for n, s in zip(num_params, targets)) / sum(num_params)
        allocator_info["targets_min"], allocator_info["targets_max"] = min(targets), max(targets)

        # ---- pass 2: prune block by block on propagated (pruned) activations
        t = time.perf_counter()
        linear_rows = _prune_blocks(blocks, block_linears, cache, targets, method, pattern, opts, module_names)
        timings["prune_pass_s"] = time.perf_counter() - t
    finally:
        model.train(was_training)

    block_rows = []
    for index, lins in enumerate(block_linears):
        zeros = sum(r.num_zeros for r in linear_rows if r.block == index)
        block_rows.append(
            BlockSparsity(
                index=index,
                target=targets[index],
                achieved=zeros / num_params[index],
                num_params=num_params[index],
                num_zeros=zeros,
                statistic=None if statistic_values is None else statistic_values[index],
            )
        )
    timings["total_s"] = time.perf_counter() - t0
    report = SparsityReport(
        target_sparsity=float(sparsity),
        allocation=allocation,
        method=method,
        pattern=pattern,
        blocks=block_rows,
        linears=linear_rows,
        allocator=allocator_info,
        options={
            **opts.to_dict(),
            "statistics_pass": "dense (unpruned model), before pruning",
            "pruning_pass": "block by block; each block calibrated on the outputs of the already-pruned blocks; "
            "all linears of a block from one pass over the block's inputs",
            "pruned_modules": "every nn.Linear inside the decoder blocks (embeddings, norms, LM head dense)",
        },
        calibration=calib.spec(),
        metadata={
            "model_class": type(model).__name__,
            "dtype": str(next(model.parameters()).dtype),
            "num_blocks": len(blocks),
            "original_blocks": original_indices(model.config, len(blocks)),
            "block_dense_params": [sum(p.numel() for p in b.parameters()) - n for b, n in zip(blocks, num_params)],
            "seconds": timings,
            "versions": _versions(),
        },
    )
    record = config_record(report)
    previous = getattr(model.config, CONFIG_ATTRIBUTE, None)
    if isinstance(previous, dict) and previous.get("method"):
        earlier = {k: v for k, v in previous.items() if k != "previous"}
        record["previous"] = list(previous.get("previous") or []) + [earlier]
    setattr(model.config, CONFIG_ATTRIBUTE, record)
    model.layerswap_sparsity_report = report
    return report


#: ``config.json`` attribute holding what :func:`sparsify` did (it survives
#: ``save_pretrained`` and a plain-transformers reload, so a card can show it later).
CONFIG_ATTRIBUTE = "layerswap_sparsity"


def sparsity_in_model(record: dict, kept_original_blocks) -> float:
    """Zeros / prunable weights over the sparsified blocks still in the model (``record`` as
    :func:`config_record` returns it; ``kept_original_blocks`` in the original numbering)."""
    kept = set(kept_original_blocks)
    zeros = record.get("block_zeros") or [round(n * a) for n, a in zip(record["block_params"], record["block_achieved"])]
    pairs = [(n, z) for b, n, z in zip(record["original_blocks"], record["block_params"], zeros) if b in kept]
    total = sum(n for n, _ in pairs)
    return sum(z for _, z in pairs) / total if total else 0.0


#: Allocator entries kept in the config record (the report has every one).
_ALLOCATOR_SUMMARY = ("statistic", "percentile", "source", "pool", "delta", "mapping", "owl_m", "owl_lambda", "budget")


def config_record(report: SparsityReport) -> dict:
    """The compact summary :func:`sparsify` stores in ``model.config.layerswap_sparsity``.

    Keys: ``method``, ``allocation``, ``pattern`` (``None`` = unstructured),
    ``target_sparsity``, ``achieved_sparsity`` (zeros / prunable block weights),
    ``num_params``, ``num_zeros``, ``original_blocks`` (0-based indices of the sparsified
    blocks before any layer removal), ``block_params`` (prunable weights), ``block_zeros``,
    ``block_targets`` and ``block_achieved`` (fractions), ``block_dense_params`` (block
    parameters that are not ``nn.Linear`` weight matrices, left dense: biases, norms, fused
    MoE expert tensors), one per block in the same order, ``allocator`` (its statistic, main options and budget
    rule), ``calibration`` (description and content hash) and
    ``hf_layerswap`` (the version that pruned). Every value is JSON (config.json) safe.
    """
    from .. import __version__

    blocks = report.metadata.get("original_blocks") or [b.index for b in report.blocks]
    return {
        "method": report.method,
        "allocation": report.allocation,
        "pattern": report.pattern,
        "target_sparsity": report.target_sparsity,
        "achieved_sparsity": report.achieved_sparsity,
        "num_params": report.num_params,
        "num_zeros": report.num_zeros,
        "original_blocks": [int(i) for i in blocks],
        "block_params": [int(b.num_params) for b in report.blocks],
        "block_zeros": [int(b.num_zeros) for b in report.blocks],
        "block_dense_params": report.metadata.get("block_dense_params"),
        "block_targets": [float(b.target) for b in report.blocks],
        "block_achieved": [float(b.achieved) for b in report.blocks],
        "allocator": {k: report.allocator[k] for k in _ALLOCATOR_SUMMARY if k in report.allocator},
        "calibration": {k: report.calibration.get(k) for k in ("description", "content_hash") if k in report.calibration},
        "hf_layerswap": __version__,
    }


def _dense_observers(allocation: str, opts: SparsifyOptions, block_linears):
    """Hooks for the dense pass: PALS percentile estimators or OWL's Wanda row norms."""
    collectors: dict = {}
    if allocation == "pals":
        estimators = [make_estimator(opts.estimator, bins_per_octave=opts.bins_per_octave) for _ in block_linears]
        collectors["estimators"] = estimators
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
    if allocation == "owl":
        norms = [[RowNormSq(lin.in_features, lin.weight.device) for _, lin in lins] for lins in block_linears]
        collectors["norms"] = norms

        def linear_hooks(index, mask_ref):
            def make(acc):
                return lambda module, args: acc.update(real_rows(args[0], mask_ref[0]))

            pairs = zip(block_linears[index], norms[index])
            return [lin.register_forward_pre_hook(make(acc)) for (_, lin), acc in pairs]

        return None, linear_hooks, collectors
    return None, None, collectors


def _allocate(allocation, opts, sparsity, num_params, block_linears, collectors, statistic_values):
    info: dict = {"name": allocation}
    if allocation == "uniform":
        return uniform_allocation(num_params, sparsity), None, info
    if allocation in ("pals", "gradient"):
        mapping = {"delta": opts.delta, "mapping": opts.mapping, "scale": opts.scale, "invert": opts.invert}
        if allocation == "pals":
            estimators = collectors["estimators"]
            statistic_values = [est.quantile(opts.percentile) for est in estimators]
            info.update(
                statistic=f"quantile {opts.percentile:g} of |activation| ({opts.source}, pool={opts.pool}), "
                "dense model",
                percentile=opts.percentile,
                source=opts.source,
                pool=opts.pool,
                estimator=estimators[0].spec(),
                values_per_block=[est.count for est in estimators],
            )
            targets = pals_allocation(statistic_values, num_params, sparsity, **mapping)
        else:
            info["statistic"] = (
                "mean |dL/dW| over the block's prunable weights (calibration next-token loss), dense model"
            )
            targets = gradient_allocation(statistic_values, num_params, sparsity, **mapping)
        info.update(
            mapping,
            scale=opts.delta if opts.scale is None else opts.scale,
            budget="parameter-weighted mean = target exactly, every block within +-delta",
        )
        return targets, statistic_values, info
    if allocation == "random":
        targets = random_allocation(num_params, sparsity, delta=opts.delta, seed=opts.seed)
        info.update(
            statistic="target - s (the seeded uniform offset after the exact budget fit)",
            delta=opts.delta,
            seed=opts.seed,
            budget="parameter-weighted mean = target exactly, every block within +-delta",
        )
        return targets, [t - sparsity for t in targets], info
    # owl
    norms = collectors["norms"]
    lods = []
    for lins, accs in zip(block_linears, norms):

        def scores(lins=lins, accs=accs):
            return (wanda_scores(lin.weight, acc.sum_sq) for (_, lin), acc in zip(lins, accs))

        lods.append(outlier_ratio(scores, opts.owl_m))
    info.update(
        statistic=f"layerwise outlier distribution (% of Wanda scores > M x block mean, M={opts.owl_m:g}), dense model",
        owl_m=opts.owl_m,
        owl_lambda=opts.owl_lambda,
        budget="unweighted mean = target (OWL reference mapping); spread max-min = 2 lambda; no per-block bound",
    )
    return owl_allocation(lods, sparsity, lam=opts.owl_lambda), lods, info


@torch.no_grad()
def _prune_blocks(blocks, block_linears, cache, targets, method, pattern, opts, module_names) -> list[LinearSparsity]:
    inputs = list(cache.hidden)
    rows: list[LinearSparsity] = []
    progress = None
    if opts.progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(blocks), desc=f"{method} pruning", unit="block")
    for index, (block, lins) in enumerate(zip(blocks, block_linears)):
        accumulators = {}
        if method != "magnitude":
            factory = RowNormSq if method == "wanda" else HessianAccumulator
            mask_ref: list = [None]
            handles = []
            for name, lin in lins:
                acc = accumulators[name] = factory(lin.in_features, lin.weight.device)
                handles.append(
                    lin.register_forward_pre_hook(lambda m, args, acc=acc: acc.update(real_rows(args[0], mask_ref[0])))
                )
            try:
                for b, hidden in enumerate(inputs):
                    mask_ref[0] = cache.token_masks[b]
                    run_block(block, hidden, cache.calls[b][index])
            finally:
                for h in handles:
                    h.remove()
        for name, lin in lins:
            w = lin.weight
            if method == "wanda":
                new, _ = wanda_prune(w, accumulators[name].sum_sq, targets[index], pattern)
            elif method == "sparsegpt":
                new, _ = sparsegpt_prune(
                    w,
                    accumulators.pop(name).hessian,
                    targets[index],
                    pattern,
                    blocksize=opts.blocksize,
                    percdamp=opts.percdamp,
                )
            else:
                new, _ = magnitude_prune(w, targets[index], pattern)
            w.copy_(new)
            rows.append(
                LinearSparsity(
                    name=module_names[id(lin)],
                    block=index,
                    shape=[int(w.shape[0]), int(w.shape[1])],
                    target=targets[index],
                    num_zeros=int((w == 0).sum()),
                )
            )
        if index + 1 < len(blocks):
            inputs = [run_block(block, hidden, cache.calls[b][index]) for b, hidden in enumerate(inputs)]
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    return rows
