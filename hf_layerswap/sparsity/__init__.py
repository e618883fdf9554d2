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
import time
import warnings

import torch
from torch import nn
from tqdm.auto import tqdm

from ..calibration import build_calibration
from ..utils.devices import input_device, offloaded_modules
from ..layerplan import decoder_blocks, run_block
from ..utils.provenance import library_versions
from ..surgery.removal import original_indices, stale_healing
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
from .engine import capture_block_calls, gradient_statistics, prunable_linears, real_rows
from .pruners import METHODS, magnitude_prune, parse_pattern, sparsegpt_prune, wanda_prune, wanda_scores
from .registry import (
    ALLOCATORS,
    PRUNERS,
    AllocationInputs,
    Allocator,
    Pruner,
    get_allocator,
    get_pruner,
    register_allocator,
    register_pruner,
)
from .options import POOLS, SOURCES, SparsifyOptions
from .report import BlockSparsity, LinearSparsity, SparsityReport, config_record
from .stats import ESTIMATORS, ExactQuantile, LogHistogramQuantile
from ..utils.registry import import_package_modules

import_package_modules(__name__, __path__)  # every allocator and pruner module registers its entries

__all__ = [
    "ALLOCATIONS",
    "ALLOCATORS",
    "AllocationInputs",
    "Allocator",
    "PRUNERS",
    "Pruner",
    "get_allocator",
    "get_pruner",
    "register_allocator",
    "register_pruner",
    "CONFIG_ATTRIBUTE",
    "METHODS",
    "BlockSparsity",
    "ExactQuantile",
    "LinearSparsity",
    "LogHistogramQuantile",
    "SparsifyOptions",
    "SparsityReport",
    "check_arguments",
    "check_in_memory",
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

def _parse_options(options: dict, allocation: str, method: str, sparsity: float) -> SparsifyOptions:
    allowed = {f.name for f in dataclasses.fields(SparsifyOptions)}
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise TypeError(f"sparsify() got unknown options {unknown}; allowed: the keywords sparsity, allocation, "
                        f"pruner, pattern, tokenizer and the options {sorted(allowed)}")
    used = set(SparsifyOptions.GENERAL) | set(get_allocator(allocation).options) | set(get_pruner(method).options)
    unused = sorted(set(options) - used)
    if unused:
        warnings.warn(
            f"options {unused} have no effect with allocation={allocation!r}, pruner={method!r}", stacklevel=3
        )
    opts = SparsifyOptions(**options)
    for entry in (get_allocator(allocation), get_pruner(method)):  # their typed options: types and bounds
        entry.parse_options({name: getattr(opts, name) for name in entry.options})
    check_bound(sparsity, allocation, opts.delta)
    return opts


def check_bound(sparsity: float, allocation: str, delta: float = SparsifyOptions.delta) -> None:
    """Refuse, before any forward pass, a bounded allocation (``pals``, ``random``,
    ``gradient``) whose bound ``sparsity + delta`` reaches 1 (a block with every weight zero).

    Raises:
        ValueError: ``sparsity + delta >= 1`` with ``delta > 0`` for a bounded allocation.
    """
    if "delta" in get_allocator(allocation).options:
        fit_budget([0.0], [1], sparsity, delta)


def check_in_memory(model: nn.Module) -> None:
    """Refuse a model with offloaded weights (an accelerate device map that put blocks on the
    CPU or disk between calls): sparsification writes every block's weights in place, which
    an offloaded block does not hold.

    Raises:
        ValueError: naming the offloaded modules and what to do instead.
    """
    offloaded = offloaded_modules(model)
    if offloaded:
        names = {id(m): n for n, m in model.named_modules()}
        listed = [names.get(id(m), type(m).__name__) or "the model" for m in offloaded[:3]]
        more = f" and {len(offloaded) - 3} more" if len(offloaded) > 3 else ""
        raise ValueError(
            f"sparsity on a model with offloaded weights ({', '.join(listed)}{more} are offloaded by its device "
            "map): sparsification writes every block's weights in place; load the model without offloading "
            "(no --offload-folder, a --max-memory that holds it), or sparsify a saved pruned checkpoint that fits"
        )


def check_arguments(sparsity, allocation: str, method: str, pattern: str | None) -> tuple[int, int] | None:
    """Validate :func:`sparsify`'s target, allocation, method and pattern together;
    returns the parsed ``(N, M)`` pattern or ``None``.

    Raises:
        ValueError: the message names the value and what is allowed.
    """
    get_allocator(allocation)
    get_pruner(method)
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
    pruner: str = "wanda",
    pattern: str | None = None,
    tokenizer=None,
    **options,
) -> SparsityReport:
    """Prune every ``nn.Linear`` inside the decoder blocks of ``model``, in place.

    Args:
        model: a transformers causal LM (any family :func:`~hf_layerswap.layerplan.decoder_blocks`
            finds), e.g. after layer removal.
        calibration: a :class:`~hf_layerswap.calibration.CalibrationSet` or anything
            :func:`~hf_layerswap.calibration.build_calibration` accepts (``None`` = the
            embedded prose; text sources need ``tokenizer``).
        sparsity: overall target ``s`` in [0, 1): the parameter-weighted fraction of prunable
            block weights set to zero (for ``pattern="N:M"`` it must equal N/M).
        allocation: per-block sparsity rule, one of ``"uniform"``, ``"pals"`` (default),
            ``"owl"``, ``"random"``, ``"gradient"`` (see :mod:`.allocators`).
        pruner: the pruning method: ``"wanda"`` (default), ``"sparsegpt"``, ``"magnitude"`` or one
            registered with :func:`register_pruner`.
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
        ValueError: a model with offloaded weights (:func:`check_in_memory`), an unknown
            allocation/pruner/pattern, a sparsity outside [0, 1), an N:M
            pattern with another sparsity or a non-uniform allocation, ``sparsity + delta >= 1``
            for a bounded allocation (pals, random, gradient), a linear whose input width is not
            divisible by M (all checked before any forward pass or weight change).
        TypeError: unknown options (``method=``, the pruner's former name, among them) or a text
            calibration without tokenizer.
    """
    t0 = time.perf_counter()
    check_in_memory(model)
    nm = check_arguments(sparsity, allocation, pruner, pattern)
    if nm is not None:
        pattern = f"{nm[0]}:{nm[1]}"
    opts = _parse_options(options, allocation, pruner, sparsity)
    calib = build_calibration(
        calibration, tokenizer, num_prompts=opts.num_prompts, seq_len=opts.seq_len, seed=opts.calibration_seed
    )

    _, _, blocks = decoder_blocks(model)
    module_names = {id(m): n for n, m in model.named_modules()}
    block_linears = _block_linears(blocks, nm, pattern, module_names)
    num_params = [sum(lin.weight.numel() for _, lin in lins) for lins in block_linears]
    device = input_device(model)
    batches = [(ids.to(device), mask.to(device)) for ids, mask in calib.batches(opts.batch_size)]
    timings: dict = {}
    targets, statistic_values, allocator_info, linear_rows = _allocate_and_prune(
        model, blocks, block_linears, batches, num_params, module_names, timings,
        sparsity=sparsity, allocation=allocation, method=pruner, pattern=pattern, opts=opts,
    )
    block_rows = _block_rows(block_linears, linear_rows, targets, num_params, statistic_values)
    timings["total_s"] = time.perf_counter() - t0
    report = SparsityReport(
        target_sparsity=float(sparsity),
        allocation=allocation,
        method=pruner,
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
            "versions": library_versions(),
        },
    )
    _record_on_model(model, report)
    return report


def _block_linears(blocks, nm, pattern, module_names) -> list[list[tuple[str, nn.Linear]]]:
    """The prunable linears of every block; raises ``ValueError`` for a block without one
    or (with an ``N:M`` pattern) a linear whose input width M does not divide."""
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
    return block_linears


def _allocate_and_prune(model, blocks, block_linears, batches, num_params, module_names, timings, *, sparsity,
                        allocation, method, pattern, opts):
    """The dense statistics pass, the allocation of per-block targets and the block-by-block
    pruning pass, the model in eval mode throughout (pass times go to ``timings``):
    ``(targets, statistic per block or None, allocator record, per-linear rows)``."""
    was_training = model.training
    model.eval()
    try:
        # ---- pass 1: dense statistics (and every block's call arguments)
        allocator = get_allocator(allocation)
        gradients = None
        if allocator.needs_gradients:
            t = time.perf_counter()
            weights = [[lin.weight for _, lin in lins] for lins in block_linears]
            gradients = gradient_statistics(model, batches, weights)
            timings["gradient_pass_s"] = time.perf_counter() - t
        t = time.perf_counter()
        on_block_input, linear_hooks, collectors = (
            allocator.observe(opts, block_linears) if allocator.observe is not None else (None, None, {})
        )
        cache = capture_block_calls(model, batches, on_block_input=on_block_input, linear_hooks=linear_hooks)
        timings["dense_pass_s"] = time.perf_counter() - t

        # ---- allocation
        targets, statistic_values, info = allocator.allocate(
            AllocationInputs(sparsity, num_params, opts, block_linears, collectors, gradients)
        )
        allocator_info = {"name": allocation, **info}
        allocator_info["targets_weighted_mean"] = sum(n * s for n, s in zip(num_params, targets)) / sum(num_params)
        allocator_info["targets_min"], allocator_info["targets_max"] = min(targets), max(targets)

        # ---- pass 2: prune block by block on propagated (pruned) activations
        t = time.perf_counter()
        linear_rows = _prune_blocks(blocks, block_linears, cache, targets, method, pattern, opts, module_names)
        timings["prune_pass_s"] = time.perf_counter() - t
    finally:
        model.train(was_training)
    return targets, statistic_values, allocator_info, linear_rows


def _block_rows(block_linears, linear_rows, targets, num_params, statistic_values) -> list[BlockSparsity]:
    """Per-block target and achieved sparsity (zeros of its linears / their weights)."""
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
    return block_rows


def _record_on_model(model: nn.Module, report: SparsityReport) -> None:
    """Leave ``report`` on the model and its summary in ``model.config`` (an earlier
    pass's summary moves to the ``previous`` list)."""
    record = config_record(report)
    previous = getattr(model.config, CONFIG_ATTRIBUTE, None)
    if isinstance(previous, dict) and previous.get("method"):
        earlier = {k: v for k, v in previous.items() if k != "previous"}
        record["previous"] = list(previous.get("previous") or []) + [earlier]
    setattr(model.config, CONFIG_ATTRIBUTE, record)
    model.layerswap_sparsity_report = report
    layerswap = getattr(model.config, "layerswap", None)
    if isinstance(layerswap, dict) and layerswap.get("healing"):  # its KLs and perplexities describe the dense weights
        note = (f"sparsification ({record.get('method')}, {record.get('allocation')} allocation, achieved sparsity "
                f"{record['achieved_sparsity']:.1%}) came after this healing: its numbers describe the model before "
                "its weights were zeroed")
        model.config.layerswap = {**layerswap, "healing": stale_healing(layerswap["healing"], note=note)}


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


@torch.no_grad()
def _prune_blocks(blocks, block_linears, cache, targets, method, pattern, opts, module_names) -> list[LinearSparsity]:
    inputs = list(cache.hidden)
    rows: list[LinearSparsity] = []
    progress = None
    if opts.progress:
        progress = tqdm(total=len(blocks), desc=f"{method} pruning", unit="block")
    pruner = get_pruner(method)
    for index, (block, lins) in enumerate(zip(blocks, block_linears)):
        accumulators = {}
        if pruner.statistics is not None:
            factory = pruner.statistics
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
            w.copy_(pruner.prune(w, accumulators.pop(name, None), targets[index], pattern, opts))
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
