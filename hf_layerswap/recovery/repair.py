""":func:`recover`: remove blocks from a dense model and repair each cut with the chosen
method (:mod:`.methods`), fitted on one pass over the calibration tokens (:mod:`.fit`)."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Sequence

from torch import nn

from ..calibration import CalibrationSet, CalibrationShortfallWarning, build_calibration
from ..utils.jsonio import encode_float
from ..layerplan import decoder_blocks, model_hidden_size, resolve_layer_indices
from ..surgery.removal import remove_layers
from ..utils.devices import input_device
from ..scoring.head import param_dtype, text_config
from ..scoring.settings import MemoryBudgetWarning, block_activation_bytes, resolve_memory
from .fit import Moments, check_epsilon, collect_moments, cut_boundaries, fit_memory
from .methods import get_recovery_method
from ..surgery.operators import attached_operators
from .report import BoundaryFit, RecoveryReport, encoded_extra

__all__ = ["DEFAULT_NUM_TOKENS", "recover"]

#: Most real calibration tokens a fit uses by default (Ghosted Layers' 65,536).
DEFAULT_NUM_TOKENS = 65536


def recover(
    model: nn.Module,
    removed: Sequence[int],
    calibration=None,
    *,
    method: str = "ghosted",
    num_tokens: int | None = None,
    tokenizer=None,
    epsilon: float | None = None,
    num_prompts: int | None = None,
    seq_len: int = 128,
    batch_size: int = 8,
    seed: int = 0,
    max_memory=None,
) -> RecoveryReport:
    """Remove blocks from a dense model and repair each cut with a closed-form linear map.

    Args:
        model: the *dense* causal LM (before removal); modified in place: the blocks are
            removed with :func:`hf_layerswap.surgery.remove_layers` and the maps attached
            (``"ghosted"``) or folded into weights (``"fused"``).
        removed: 0-based indices of the blocks to remove (negative = from the end). An
            empty set changes nothing and returns an empty report.
        calibration: a :class:`CalibrationSet` or any source :func:`build_calibration`
            accepts (text file, list of strings, ``datasets.Dataset``, tensors mapping,
            ``None`` = embedded prose).
        method: ``"ghosted"`` (Ghosted Layers), ``"fused"`` (ReplaceMe-style, folded into
            ``down_proj``), ``"linearpatch"`` (LinearPatch: Hadamard rotation and channel
            scaling, folded into the embedding at a cut of block 0, operators elsewhere), ``"none"`` (plain removal; fit residuals still reported) or
            any name registered with :func:`~hf_layerswap.recovery.register_recovery_method`.
        num_tokens: use at most this many real calibration tokens; ``None`` (default) =
            every real token of the calibration set, up to :data:`DEFAULT_NUM_TOKENS`
            (65,536, what Ghosted Layers uses). The report records how many were used. An
            explicit ``num_tokens`` the set cannot fill warns
            :class:`~hf_layerswap.calibration.CalibrationShortfallWarning` with both numbers
            and the record keeps ``requested_tokens``.
        tokenizer: needed for text calibration sources.
        epsilon: relative ridge toward the identity, ``λ = epsilon · trace(XᵀX) / H``
            (>= 0; recorded); ``None`` = :data:`DEFAULT_EPSILON` of the method. A method
            without a ridge (``"linearpatch"``) takes only ``None`` or 0.
        num_prompts, seq_len, seed: passed to :func:`build_calibration` for non-
            :class:`CalibrationSet` sources (``num_prompts=None``: ``2·num_tokens/seq_len``).
        batch_size: prompts per forward pass (at most; fewer under ``max_memory``).
        max_memory: the fit's working-memory budget beyond the weights (bytes, a size, a
            ``MemoryBudget``, ``"auto"``: :func:`~hf_layerswap.scoring.settings.resolve_memory`;
            ``None``: none): the float64 moments in host memory on an accelerator when they do
            not fit beside a batch's captures, fewer prompts per batch until these fit (the same
            maps to float64 rounding; :func:`~hf_layerswap.recovery.fit.fit_memory`); what cannot
            warns ``MemoryBudgetWarning`` with its need and the budget before the fit.

    Returns:
        A :class:`RecoveryReport` (also stored, as a dict, in
        ``model.config.layerswap["recovery"]`` for ``"ghosted"``/``"fused"``).

    Raises:
        ValueError: an unknown method, bad indices, ``num_tokens < 1``, ``epsilon < 0`` (or > 0 for a
            method without a ridge), operators already attached (recover from the dense model instead), a
            family ``"fused"`` cannot fold into (the message names it), a singular system, or a model
            :func:`remove_layers` refuses. The model is unchanged when it raises.
        TypeError: a text calibration source without a tokenizer; a ``fit.extra`` value that is no float.
    """
    entry = get_recovery_method(method)
    method = entry.name
    requested = num_tokens is not None
    num_tokens = DEFAULT_NUM_TOKENS if num_tokens is None else num_tokens
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens!r}: must be an int >= 1 (or None for the whole calibration set)")
    if epsilon is None:
        epsilon = entry.default_epsilon
    epsilon = check_epsilon(epsilon)
    if not entry.takes_epsilon and epsilon != entry.default_epsilon:
        raise ValueError(f"epsilon={epsilon!r}: method={method!r} has no ridge; allowed: None or "
                         f"{entry.default_epsilon!r}")
    if entry.fits:  # its typed options (bounds, and a method's own option class)
        entry.parse_options({"num_tokens": num_tokens if requested else None, "epsilon": epsilon},
                            owner=f"method={method!r}")
    _, _, blocks = decoder_blocks(model)
    num_blocks = len(blocks)
    removed = resolve_layer_indices(removed, num_blocks, allow_empty=True)
    if not removed:
        return RecoveryReport(method, [], float(epsilon), 0, model_hidden_size(model))
    if len(removed) >= num_blocks:
        raise ValueError(f"removing {removed} would leave no block: at most {num_blocks - 1} of {num_blocks} can go")
    if attached_operators(model):
        raise ValueError(
            "this model already carries ghosted recovery operators; recover() fits on the dense model: "
            "start from the dense checkpoint (or detach_recovery(model) first)"
        )
    cuts = cut_boundaries(num_blocks, removed)
    entry.check(model, blocks, cuts)
    if not isinstance(calibration, CalibrationSet):
        if num_prompts is None:
            num_prompts = max(1, math.ceil(2 * num_tokens / seq_len))
        calibration = build_calibration(calibration, tokenizer, num_prompts=num_prompts, seq_len=seq_len, seed=seed)
    memory = _fit_memory(model, entry, cuts, calibration, num_tokens, batch_size, max_memory)
    was_training = model.training
    model.eval()
    try:
        entry.probe(model, blocks, cuts, calibration, batch_size, num_tokens)
        moments, used, hidden = collect_moments(model, blocks, cuts, entry, calibration, num_tokens,
                                                memory["batch_size"], "cpu" if memory["moments_on_host"] else None)
    finally:
        model.train(was_training)
    _warn_few_tokens(entry, calibration, used, num_tokens, requested, hidden)

    fits, maps = _fit(moments, cuts, entry, float(epsilon))
    report = RecoveryReport(method, removed, float(epsilon), used, hidden, fits, calibration.spec())

    # everything that can fail has run; now change the model
    old_record = copy.deepcopy((getattr(model.config, "layerswap", None) or {}).get("recovery"))
    host_modules = {cut["boundary"]: (blocks[cut["host"]] if cut["host"] is not None else None) for cut in cuts}
    remove_layers(model, removed, provenance={"recovery": method})
    if entry.fits:
        entry.apply(model, cuts, maps, host_modules)
        record = _recovery_record(model, entry, cuts, removed, fits, calibration, float(epsilon), used,
                                  num_tokens if requested and used < num_tokens else None)
        if old_record:
            record["previous"] = old_record
        model.config.layerswap["recovery"] = record
    return report


def _fit_memory(model, entry, cuts, calibration: CalibrationSet, num_tokens: int, batch_size: int, max_memory) -> dict:
    """:func:`~.fit.fit_memory` of this fit under ``max_memory`` (None: no budget); warns
    :class:`~hf_layerswap.scoring.settings.MemoryBudgetWarning` when it cannot stay within it."""
    cfg = text_config(model)
    hidden = model_hidden_size(model)
    slots: set[int] = set()
    for cut in cuts:
        slots.update((cut["start"], cut["end"]), entry.slots(cut))
    es = param_dtype(model).itemsize
    inter = int(getattr(cfg, "intermediate_size", 0) or 4 * hidden)
    heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
    budget = None if max_memory is None else resolve_memory(max_memory, model).bytes
    memory = fit_memory(calibration, batch_size, num_tokens, slots=len(slots), hidden=hidden, element_bytes=es,
                        moment_bytes=entry.moment_bytes(cuts, hidden, True),
                        activation=lambda b, w: block_activation_bytes(b * w, w, hidden, inter, heads, es),
                        budget=budget, accelerator=input_device(model).type != "cpu")
    if not memory["within_budget"]:
        warnings.warn(MemoryBudgetWarning(
            f"the {entry.name} repair's fit needs {memory['device_bytes'] / 2**20:,.1f} MiB beyond the weights "
            f"(float64 moments {memory['moment_bytes'] / 2**20:,.1f} MiB, which are not sliced"
            f"{' and stay on this device' if not memory['moments_on_host'] else ' (kept in host memory)'}; "
            f"captures of a {memory['batch_size']}-prompt batch {memory['capture_bytes'] / 2**20:,.1f} MiB), "
            f"more than max_memory={budget / 2**20:,.1f} MiB: raise max_memory or repair fewer cuts"), stacklevel=3)
    return memory


def _warn_few_tokens(entry, calibration: CalibrationSet, used: int, num_tokens: int, requested: bool,
                     hidden: int | None) -> None:
    """Warn (at :func:`recover`'s caller) when a fit used fewer tokens than requested
    (:class:`CalibrationShortfallWarning`) or than the hidden size (rank-deficient XᵀX)."""
    if requested and used < num_tokens and entry.fits:
        warnings.warn(
            CalibrationShortfallWarning(
                f"recovery fitted on {used:,} calibration tokens, fewer than the {num_tokens:,} requested "
                f"(num_tokens): the calibration set holds no more ({calibration.num_prompts} prompts); pass a larger "
                "source or num_prompts"
            ),
            stacklevel=3,
        )
    if hidden is not None and used < hidden and entry.fits:
        warnings.warn(
            f"recovery fitted on {used} calibration tokens, fewer than the hidden size {hidden}: XᵀX is rank "
            "deficient and the ridge (epsilon) decides the map; use more calibration tokens (more or longer "
            "prompts: num_prompts / --num-prompts, seq_len / --seq-len, or a longer calibration text)",
            stacklevel=3,
        )


def _recovery_record(model, entry, cuts, removed, fits, calibration: CalibrationSet, epsilon: float, used: int,
                     shortfall_requested: int | None) -> dict:
    """``model.config.layerswap["recovery"]`` after the blocks went: the method, the cuts
    (pruned and original numbering), the ridge, the tokens used, the fit residuals and, when the
    method set any, its own values per cut (``extra``: one dict per cut, :attr:`BoundaryFit.extra`)."""
    record = {
        "method": entry.name,
        "boundaries": [c["boundary"] for c in cuts],
        "removed_layers": removed,
        "removed_original_layers": model.config.layerswap["steps"][-1]["removed_original_layers"],
        "epsilon": epsilon,
        "epsilon_rule": "lambda = epsilon * trace(X^T X) / H, ridge toward the identity",
        "num_tokens": used,
        **({"requested_tokens": shortfall_requested} if shortfall_requested is not None else {}),
        "residual_before": [encode_float(f.residual_before) for f in fits],
        "residual_after": [encode_float(f.residual_after) for f in fits],
        **({"extra": [encoded_extra(f.extra) for f in fits]} if any(f.extra for f in fits) else {}),
        "calibration": calibration.spec(),
    }
    record.update(entry.record(fits))
    return record


def _fit(moments: Moments, cuts, method, epsilon: float) -> tuple[list[BoundaryFit], dict]:
    """Solve every map from the moments (on the CPU, float64); maps are keyed by boundary."""
    moments.gram = {k: v.cpu() for k, v in moments.gram.items()}
    moments.cross = {k: v.cpu() for k, v in moments.cross.items()}
    fits, maps = [], {}
    for cut in cuts:
        s, e, b = cut["start"], cut["end"], cut["boundary"]
        y_sq = moments.sq[("y", e)]
        y_norm = math.sqrt(y_sq) if y_sq > 0 else math.nan
        before = math.sqrt(moments.sq[("delta", s)]) / y_norm
        fit = BoundaryFit(b, list(cut["removed"]), cut["host"], before, before)
        solved = method.solve(moments, cut, fit, epsilon) if method.fits else None
        if solved is not None:
            after, maps[b] = solved
            fit.residual_after = math.sqrt(after) / y_norm
        try:  # the method's own values are recorded once the model changed: checked before it does
            encoded_extra(fit.extra)
        except TypeError as err:
            raise TypeError(f"recovery method {method.name!r}, cut at boundary {b}: {err}") from None
        fits.append(fit)
    return fits, maps
