"""The public scoring verbs: :func:`score_layers` (the registered swap protocols per pair
into a :class:`~hf_layerswap.scoring.report.SwapReport`), :func:`removal_kl` (joint removal of
sets), :func:`swap_plans`, and the adaptive prompt budget (:class:`AdaptiveBudget`,
:func:`selection_stability`). Each verb builds its
:class:`~hf_layerswap.scoring.settings.EngineSettings` once from its keyword arguments."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..calibration import build_calibration, CalibrationSet
from ..layerplan import ONE_BLOCK, model_fingerprint, num_blocks, removal_plan, uncompiled
from .protocols import check_protocols, get_protocol, protocol_of, PROTOCOLS, SWAP_PROTOCOLS
from ..utils.provenance import library_versions, report_identity
from .report import PairResult, SwapReport
from .rule import NONFINITE_ADVICE, NonFiniteScoresError, NonFiniteScoresWarning, greedy_select, resolve_protect
from .engine import Engine, run_plans
from .settings import dtype_name, EngineSettings, MemoryBudget

__all__ = [
    "AdaptiveBudget", "calibration_from_args", "removal_kl", "score_layers", "selection_stability", "swap_plans",
]


# ----------------------------------------------------------------------------- scoring
def _mean_se(values: torch.Tensor) -> tuple[float, float | None]:
    mean = float(values.mean())
    if values.numel() < 2 or not math.isfinite(mean):
        return mean, None
    return mean, float(values.std(unbiased=True) / math.sqrt(values.numel()))


def _first_nonfinite(values: Mapping, batch_size) -> tuple[list, int | None]:
    """(keys whose per-prompt values ``(N,)`` hold a non-finite entry, the 0-based batch of
    the first such prompt; ``None`` when ``batch_size`` is not an int)."""
    bad, first = [], None
    for key, v in values.items():
        where = (~torch.isfinite(v.reshape(-1))).nonzero()
        if where.numel():
            bad.append(key)
            first = int(where[0]) if first is None else min(first, int(where[0]))
    if first is None or not isinstance(batch_size, int):
        return bad, None
    return bad, first // batch_size


def _warn_nonfinite(what: str, count: int, total: int, first_batch: int | None) -> None:
    where = f", first at calibration batch {first_batch} (0-based)" if first_batch is not None else ""
    warnings.warn(f"{count} of {total} {what} non-finite (NaN or inf){where}; {NONFINITE_ADVICE}",
                  NonFiniteScoresWarning, stacklevel=3)


def _pair_list(num_blocks: int, max_gap: int) -> list[tuple[int, int]]:
    if isinstance(max_gap, bool) or not isinstance(max_gap, int) or not 1 <= max_gap <= num_blocks - 1:
        raise ValueError(f"max_gap={max_gap!r}: allowed 1..{num_blocks - 1} (L-1 = all pairs) for {num_blocks} blocks")
    return [(i, j) for i in range(num_blocks) for j in range(i + 1, min(num_blocks, i + max_gap + 1))]


def swap_plans(num_blocks: int, max_gap: int = 1, protocols: Sequence[str] = PROTOCOLS) -> dict[tuple, list[int]]:
    """The probes of a swap sweep: ``{(kind, i, j): plan}`` for every pair
    ``1 <= j - i <= max_gap`` and every probe kind of the chosen protocols
    (:mod:`hf_layerswap.scoring.protocols`): ``replacement_ij`` (slot i runs block j),
    ``replacement_ji`` (slot j runs block i), ``interchange``, and those of protocols
    registered since. Per pair, protocols come in registration order.

    Raises:
        ValueError: ``max_gap`` outside ``1..L-1`` or an unknown protocol.
    """
    protocols = check_protocols(protocols)
    chosen = [SWAP_PROTOCOLS[p] for p in SWAP_PROTOCOLS if p in protocols]
    plans: dict[tuple, list[int]] = {}
    for i, j in _pair_list(num_blocks, max_gap):
        for protocol in chosen:
            for kind, plan in protocol.pair_plans(num_blocks, i, j).items():
                plans[(kind, i, j)] = plan
    return plans


def calibration_from_args(model, calibration, tokenizer, num_prompts, seq_len, seed) -> CalibrationSet:
    """``calibration`` as a :class:`~hf_layerswap.calibration.CalibrationSet`, built with ``tokenizer`` (else the model's own) and the prompt settings."""
    if tokenizer is None and not isinstance(calibration, (Mapping, CalibrationSet)):
        tokenizer = getattr(model, "layerswap_tokenizer", None)
    return build_calibration(calibration, tokenizer, num_prompts=num_prompts, seq_len=seq_len, seed=seed)


@dataclass
class AdaptiveBudget:
    """Add calibration prompts in rounds until the selection at a budget is stable.

    After each round the layers are selected as :func:`~hf_layerswap.select_layers`
    would (``num_to_remove``, ``protocol``, ``spacing``, ``protect``); the selection is
    *stable* when no single exchange of a selected layer a for an unselected eligible
    layer b (one the spacing rule would allow in a's place) is within the error bars:
    the paired per-prompt difference s_b(x) - s_a(x) has mean > ``z`` x its standard
    error (see :func:`selection_stability`). Scoring stops at the first stable round,
    at the first round whose scores cannot fill the budget with finite values
    (``stopped="nonfinite"``), or when ``num_prompts`` of :func:`score_layers` (the
    maximum) is reached; the rounds and the reason are recorded in
    ``report.metadata["adaptive"]``.

    Attributes:
        num_to_remove: the removal budget n.
        protocol: ``"interchange"`` or ``"replacement"`` (must be scored).
        spacing, protect: the selection rule (see :func:`~hf_layerswap.select_layers`).
        z: error-bar width in standard errors (2.0 ~ 95 %).
        min_prompts: prompts in the first round; step: prompts added per round. Both are
            rounded up to whole batches, so the batches equal those of a full run and an
            adaptive run that reaches the maximum gives the full run's numbers.
    """

    num_to_remove: int
    protocol: str = "interchange"
    spacing: int = 1
    protect: tuple[int, ...] = (0, -1)
    z: float = 2.0
    min_prompts: int = 16
    step: int = 16

    def __post_init__(self):
        if self.protocol not in SWAP_PROTOCOLS:
            raise ValueError(f"AdaptiveBudget protocol={self.protocol!r}: allowed {list(SWAP_PROTOCOLS)}")
        if isinstance(self.num_to_remove, bool) or not isinstance(self.num_to_remove, int) or self.num_to_remove < 1:
            raise ValueError(f"AdaptiveBudget num_to_remove={self.num_to_remove!r}: must be an int >= 1")
        if not (isinstance(self.z, (int, float)) and math.isfinite(self.z) and self.z > 0):
            raise ValueError(f"AdaptiveBudget z={self.z!r}: must be a finite number > 0")
        for name in ("min_prompts", "step"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (2 if name == "min_prompts" else 1):
                raise ValueError(f"AdaptiveBudget {name}={v!r}: must be an int >= {2 if name == 'min_prompts' else 1}")
        self.protect = tuple(self.protect)


def _layer_choices(report: SwapReport, protocol: str) -> list[tuple | None]:
    """For each layer, the probe whose mean defines s(i): ``(kind, i, j)`` or None."""
    best: list[tuple | None] = [None] * report.num_blocks
    best_val = [math.inf] * report.num_blocks
    owner = get_protocol(protocol_of(protocol) or protocol)  # a probe kind stands for its protocol
    for r in report.pairs:
        val = r.value(owner.name)
        if val is None or math.isnan(val):
            continue
        kind = max(owner.probes, key=r.probe_value)  # the probe that sets the pair's value (first of ties)
        for layer in (r.i, r.j):
            if val < best_val[layer]:
                best_val[layer], best[layer] = val, (kind, r.i, r.j)
    return best


def selection_stability(
    report: SwapReport,
    values: Mapping[Any, torch.Tensor],
    num_to_remove: int,
    *,
    protocol: str = "interchange",
    spacing: int = 1,
    protect: Sequence[int] = (0, -1),
    z: float = 2.0,
) -> dict:
    """Is the set selected at budget ``num_to_remove`` distinguishable from its alternatives?

    Args:
        report: the swap-KL report (pair means).
        values: per-prompt probe values ``{(kind, i, j): (N,) tensor}`` with kind in
            ``replacement_ij``, ``replacement_ji``, ``interchange`` (what
            :func:`score_layers` computes).
        num_to_remove, protocol, spacing, protect: the selection rule.
        z: error-bar width in standard errors.

    Returns:
        ``{"selected", "stable", "closest"}``: ``closest`` is the exchange (selected a,
        alternative b) with the smallest ``margin / se`` of the paired difference
        s_b(x) - s_a(x), with ``margin`` and ``se`` in nats (None if no alternative).
        Stable means every such exchange has ``margin > z * se``. With fewer than 2
        prompts nothing is stable.
    """
    scores = report.layer_scores(protocol)
    selected = greedy_select(scores, num_to_remove, spacing=spacing, protect=protect)
    protected = resolve_protect(protect, report.num_blocks)
    choice = _layer_choices(report, protocol)
    closest, stable = None, True
    for b in range(report.num_blocks):
        if b in selected or b in protected or scores[b] is None or not math.isfinite(scores[b]) or choice[b] is None:
            continue
        for a in selected:
            rest = [k for k in selected if k != a]
            if any(abs(b - k) <= spacing for k in rest):
                continue
            diff = values[choice[b]] - values[choice[a]]
            margin = float(diff.mean())
            se = float(diff.std(unbiased=True) / math.sqrt(diff.numel())) if diff.numel() > 1 else math.inf
            ratio = margin / se if se > 0 else (math.inf if margin > 0 else -math.inf)
            if not (margin > z * se):
                stable = False
            if closest is None or ratio < closest["ratio"]:
                closest = {"selected": a, "alternative": b, "margin": margin, "se": se, "ratio": ratio}
    if closest is not None:
        closest.pop("ratio")
    return {"selected": selected, "stable": stable, "closest": closest}


def _build_report(pairs, protocols, values) -> list[PairResult]:
    kinds = [k for p in protocols for k in get_protocol(p).probes]
    return [PairResult.from_probes(i, j, {k: _mean_se(values[(k, i, j)]) for k in kinds}) for i, j in pairs]


def score_layers(
    model: nn.Module,
    calibration=None,
    *,
    tokenizer=None,
    protocols: Sequence[str] = PROTOCOLS,
    max_gap: int = 1,
    num_prompts: int = 64,
    seq_len: int = 128,
    batch_size: int | str | None = None,
    progress: bool = True,
    seed: int = 0,
    prefix_reuse: bool | str = True,
    stream_logits: bool = True,
    kl_chunk: int | None = None,
    vocab_chunk: int | None = None,
    max_memory: int | str | MemoryBudget | None = None,
    dtype: torch.dtype | str | None = None,
    checkpoint_path: str | os.PathLike | None = None,
    adaptive: AdaptiveBudget | None = None,
    distributed: bool | None = None,
    slot_major: bool | None = None,
) -> SwapReport:
    """Score block pairs with the replacement and/or interchange swap-KL.

    Implements No Free Swap (arXiv 2605.16234) Def. 1 / Remark 1: for each pair
    ``1 <= j - i <= max_gap``, replacement runs two probes (slot i runs block j; slot j
    runs block i) and interchange one (slots i and j exchange blocks). Each value is
    E_x KL(p_M || p_probe) in nats: the mean over real tokens of each prompt, then over
    prompts, from fp32 log-softmax, temperature 1. Each value has a standard error over
    prompts (``*_se``).

    Args:
        model: a transformers causal LM (decoder-only; multimodal text towers included;
            accelerate-dispatched with ``device_map``, CPU/disk offload included).
        calibration: ``None``/``"embedded"`` (default prose shipped with Python), a text
            file path, a list of strings, a ``datasets.Dataset`` with a text column, a
            mapping with ``input_ids``/``attention_mask`` ``(B, T)`` long tensors, or a
            :class:`~hf_layerswap.calibration.CalibrationSet`.
        tokenizer: required for text sources.
        protocols: a non-empty subset of the registered protocols (built in:
            ``("replacement", "interchange")``; see :mod:`hf_layerswap.scoring.protocols`).
        max_gap: pair distance bound (1 = adjacent pairs, L-1 = all pairs).
        num_prompts, seq_len, seed: calibration budget and paragraph shuffle seed
            (with ``adaptive``, ``num_prompts`` is the maximum).
        batch_size: prompts per forward pass (int), ``"auto"`` (fits ``max_memory``) or
            ``None`` (by the device: 8 on a CPU, ``"auto"`` on an accelerator).
        progress: show a progress bar with an ETA.
        prefix_reuse, stream_logits, kl_chunk, vocab_chunk, max_memory, dtype, slot_major: engine
            settings, see :class:`~hf_layerswap.scoring.settings.EngineSettings`; all are
            recorded in ``report.metadata``. ``max_memory=None`` (or ``"auto"``) derives
            the working-memory budget from the device's free memory
            (:func:`~hf_layerswap.scoring.settings.device_memory_budget`); the metadata
            records the bytes chosen (``max_memory``, ``max_memory_source``), the batch
            size and the head/KL block sizes (``kl_chunk_positions``, ``kl_chunk_vocab``,
            ``kl_block_bytes``).
        checkpoint_path: a folder. Completed (batch, probe) values are written there
            atomically as they finish; rerunning the same call after an interruption
            (a killed process included) skips them and returns a report with the same
            values as an uninterrupted run. The folder is tied to the model weights,
            the calibration prompts, the probes and the settings.
        adaptive: an :class:`AdaptiveBudget` to stop adding prompts once the selection
            at its budget is stable under the error bars.
        distributed: see :class:`~hf_layerswap.scoring.settings.EngineSettings`: under
            ``accelerate launch`` (or ``torchrun``) with several processes, each holding
            one whole model replica, every process scores a disjoint share of the probes
            and every process returns the full report, equal to one process's bit for bit.

    Returns:
        A :class:`~hf_layerswap.scoring.report.SwapReport`. When any probe value is non-finite
        (NaN, inf: e.g. an fp16 block that overflows) the values are kept, a
        :class:`~hf_layerswap.scoring.rule.NonFiniteScoresWarning` says how many and from which
        calibration batch (0-based), and ``metadata["nonfinite"]["first_batch"]`` records
        that batch; no selection is made on them (:func:`~hf_layerswap.select_layers`).

    Raises:
        ValueError: an unknown protocol, ``max_gap`` outside ``1..L-1``, a model with
            fewer than 2 blocks, bad calibration input (see ``build_calibration``), or a
            bad engine setting.
        CheckpointMismatchError: ``checkpoint_path`` belongs to a different run.
        ShardedModelError: the model is sharded over processes (tensor parallel, FSDP,
            ZeRO-3), raised before any forward pass.
    """
    protocols = check_protocols(protocols)
    settings = EngineSettings(
        batch_size=batch_size, prefix_reuse=prefix_reuse, stream_logits=stream_logits, kl_chunk=kl_chunk,
        vocab_chunk=vocab_chunk, max_memory=max_memory, dtype=dtype, checkpoint_path=checkpoint_path,
        distributed=distributed, progress=progress, desc="swap-KL probes", slot_major=slot_major,
    )
    model = uncompiled(model)
    total = num_blocks(model)
    if total < 2:
        raise ValueError(f"the model has {total} block(s); swap tests need at least 2, and {ONE_BLOCK}")
    pairs = _pair_list(total, max_gap)
    _check_adaptive(adaptive, protocols)
    calib = calibration_from_args(model, calibration, tokenizer, num_prompts, seq_len, seed)
    plans = swap_plans(total, max_gap, protocols)
    engine = Engine(model, calib, plans, settings)
    adaptive_record = None
    if adaptive is None:
        used = engine.batches
        engine.run_batches(used)
        engine.gather()
        values = engine.values(used)
    else:
        used, values, adaptive_record = _run_adaptive(engine, adaptive, calib, total, pairs, protocols, max_gap)
    used_calib = calib.prefix(int(values[next(iter(values))].numel()), "adaptive budget")
    results = _build_report(pairs, protocols, values)
    metadata = _score_metadata(model, engine, used_calib, engine.summary(used), seed)
    if adaptive_record is not None:
        metadata["adaptive"] = adaptive_record
    bad, first_batch = _first_nonfinite(values, engine.batch_size)
    if bad:
        metadata["nonfinite"] = {"first_batch": first_batch}
        _warn_nonfinite("swap-KL probe values are", len(bad), len(values), first_batch)
    return SwapReport(total, results, protocols=protocols, max_gap=max_gap, metadata=metadata)


def _check_adaptive(adaptive: AdaptiveBudget | None, protocols: Sequence[str]) -> None:
    if adaptive is None:
        return
    if not isinstance(adaptive, AdaptiveBudget):
        raise TypeError(f"adaptive must be an AdaptiveBudget, got {type(adaptive).__name__}")
    if adaptive.protocol not in protocols:
        raise ValueError(f"adaptive.protocol={adaptive.protocol!r} is not among the scored protocols {list(protocols)}")


def _run_adaptive(engine: Engine, adaptive: AdaptiveBudget, calib: CalibrationSet, total: int, pairs, protocols,
                  max_gap: int):
    """Run batches in rounds until the selection at ``adaptive.num_to_remove`` is stable, the
    scores cannot fill the budget, or the prompts run out: ``(batches used, values, record)``."""
    bs = engine.batch_size
    first = min(len(engine.batches), math.ceil(adaptive.min_prompts / bs))
    step = max(1, math.ceil(adaptive.step / bs))
    rounds, done_batches, target = [], 0, first
    while True:
        engine.run_batches(range(done_batches, target))
        engine.gather()
        done_batches = target
        used = list(range(done_batches))
        values = engine.values(used)
        partial = SwapReport(total, _build_report(pairs, protocols, values),
                             protocols=protocols, max_gap=max_gap)
        n_used = int(values[next(iter(values))].numel())
        try:
            check = selection_stability(
                partial, values, adaptive.num_to_remove, protocol=adaptive.protocol, spacing=adaptive.spacing,
                protect=adaptive.protect, z=adaptive.z,
            )
        except NonFiniteScoresError:  # a result to report: more prompts cannot make it a selection
            rounds.append({"num_prompts": n_used, "selected": None, "stable": False, "closest": None})
            reason = f"stopped: the {adaptive.protocol} scores cannot fill the budget with finite values"
            stopped = "nonfinite"
            break
        rounds.append({"num_prompts": n_used, **check})
        if check["stable"]:
            reason = f"stable: the selection at budget {adaptive.num_to_remove} is separated by more than z={adaptive.z} standard errors from every alternative"
            stopped = "stable"
            break
        if done_batches >= len(engine.batches):
            reason = f"reached the maximum of {calib.num_prompts} prompts before the selection was stable under z={adaptive.z} standard errors"
            stopped = "max_prompts"
            break
        target = min(len(engine.batches), done_batches + step)
    record = {**asdict(adaptive), "rounds": rounds, "stopped": stopped, "reason": reason}
    record["protect"] = list(adaptive.protect)
    return used, values, record


def _score_metadata(model: nn.Module, engine: Engine, used_calib: CalibrationSet, summary: dict, seed: int) -> dict:
    """``SwapReport.metadata`` of a scoring run: model identity, calibration actually used,
    settings, versions and the engine's cost summary."""
    return {
        "model": {**report_identity(model), "fingerprint": model_fingerprint(model)},
        "calibration": used_calib.spec(),
        "num_prompts": used_calib.num_prompts,
        "num_tokens": used_calib.num_tokens,
        "seq_len": used_calib.seq_len,
        "dtype": dtype_name(engine.param_dtype),
        "seed": seed,
        "token_averaging": "mean over real tokens per prompt, then mean over prompts",
        "kl_direction": "KL(original || modified)",
        "library_versions": library_versions(),
        **summary,
    }


def removal_kl(
    model: nn.Module,
    calibration,
    removed: Sequence[int] | Sequence[Sequence[int]],
    *,
    tokenizer=None,
    num_prompts: int = 64,
    seq_len: int = 128,
    batch_size: int | str | None = None,
    seed: int = 0,
    progress: bool = False,
    max_memory: int | str | None = None,
    dtype: torch.dtype | str | None = None,
):
    """Joint removal KL d_skip(S) = E_x KL(p_M || p_{M-S}) in nats.

    Args:
        removed: one set of 0-based block indices, or a list of sets (then a list of
            floats is returned, one per set, sharing the reference forward passes).
        calibration, tokenizer, num_prompts, seq_len, seed, batch_size: as in
            :func:`score_layers`.
        max_memory, dtype: engine settings, see
            :class:`~hf_layerswap.scoring.settings.EngineSettings`.

    Returns:
        A float (one set) or a list of floats. The empty set gives exactly 0.0. A
        non-finite value is returned as it is, with a
        :class:`~hf_layerswap.scoring.rule.NonFiniteScoresWarning`.

    Raises:
        ValueError: bad indices (out of range, duplicates) or a set leaving no block.
    """
    settings = EngineSettings(batch_size=batch_size, progress=progress, desc="removal KL", max_memory=max_memory,
                              dtype=dtype)
    model = uncompiled(model)
    total = num_blocks(model)
    single = not any(isinstance(x, Iterable) and not isinstance(x, str) for x in removed)
    sets: list[list[int]] = [list(removed)] if single else [list(s) for s in removed]  # type: ignore[arg-type]  # single: flat ints
    plans = {n: removal_plan(total, s) for n, s in enumerate(sets)}
    calib = calibration_from_args(model, calibration, tokenizer, num_prompts, seq_len, seed)
    values, _ = run_plans(model, calib, plans, settings)
    out = [float(values[n].mean()) for n in range(len(sets))]
    bad, first_batch = _first_nonfinite(values, batch_size)
    if bad:
        _warn_nonfinite("removal KL values are", len(bad), len(values), first_batch)
    return out[0] if single else out
