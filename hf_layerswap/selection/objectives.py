"""Objectives over removal sets on the calibration prompts, each through a prefix-reusing engine.

A candidate removal set S is scored by one partial forward pass per calibration batch: the
identity plan runs once per batch and caches the residual stream entering every needed
slot; a set whose first removed block is s starts there (:mod:`hf_layerswap.layerplan`).

Objectives (:data:`OBJECTIVES`, all on the calibration prompts only, never on
evaluation text; lower is better):

``"removal_kl"``
    Joint removal KL d_skip(S) = E_x KL(p_M || p_{M-S}) in nats, through the scoring
    engine (:func:`~hf_layerswap.scoring.plan_kl`: one reference sweep per batch of
    candidates, each candidate starting at its first removed block from the cached
    stream).
``"nll"``
    Calibration next-token NLL per token of M-S (nats; log perplexity).
``"ghosted"``
    The removal KL *after* the Ghosted Layers repair (arXiv 2605.15491): each removed
    block p gets the closed-form operator W_p = I + M_p fitted on the dense model's
    residual stream (X = stream entering p, Y = stream entering p+1, ridge toward the
    identity, :func:`~hf_layerswap.recovery.ridge_toward_identity` with the default
    epsilon); a cut s..e-1 applies W_s ... W_{e-1} to the stream entering block e, as
    :func:`~hf_layerswap.recovery.recover` does. The operators of every block are fitted
    once from one sweep, so a candidate costs one partial forward pass, like the others.

Cost units: a *forward pass* is one sweep of the model over every calibration prompt
(possibly starting at a later block by prefix reuse); *block passes* count block forward
calls over the calibration set (a full forward of an L-block model is L block passes).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..calibration import CalibrationSet
from ..utils.devices import input_device
from ..layerplan import (
    StopForward, apply_plan, capture_residual_stream, decoder_blocks, first_difference, num_blocks, removal_plan, uncompiled,
)
from ..recovery import cut_boundaries, get_recovery_method, search_objectives
from ..surgery.operators import GhostedOperator
from ..recovery.fit import collect_moments, select_rows
from ..utils.registry import Registry, RegistryEntry
from ..utils.registry_names import RegistryNames
from ..scoring.report import set_key
from ..scoring.rule import resolve_protect
from ..scoring import masked_kl, plan_kl
from ..scoring.engine import HEAD_BUDGET_FRACTION
from ..scoring.head import Head, hooks_removed, param_dtype, text_config
from ..scoring.probes import make_probes, position_hooks, schedule, schedule_blocks, walk_schedule
from ..scoring.reference import ReferenceCache
from ..scoring.settings import MemoryBudget, batch_activation_bytes, parse_memory, resolve_memory, slice_budget
from .finite import record_set_values

__all__ = ["NLL_ENTRY_BYTES", "OBJECTIVES", "SET_OBJECTIVES", "Objective", "SetObjective", "engine_cost",
           "nll_slice_rows", "nll_working_bytes", "objective_entry", "plan_nll", "plans_cost", "register_objective", "removal_kl_values", "removal_nll_values", "repair_objective_cost"]


def _no_extra_cost(counts: dict, plan, exact_sets: list, n_batches: int) -> None:
    """An objective that runs no pass beyond the removal KL's count (the search's bound holds it)."""


@dataclass(frozen=True)
class Objective(RegistryEntry):
    """One set objective of the search (a :class:`~hf_layerswap.utils.registry.RegistryEntry`
    without options).

    Attributes:
        name: the ``objective=`` value.
        score: ``fn(evaluator, sets) -> (values, sweeps, block passes)``: the values of the
            sets (lower is better) on the :class:`SetObjective` ``evaluator``'s calibration
            prompts, with the forward sweeps and block passes it ran.
        help: what it measures, in one line.
        model_head: each sweep also runs the model's own output head (counted in the
            evaluator's ``head_passes``; the removal KL's engine counts its own).
        extra_cost: ``fn(counts, plan, exact_sets, n_batches) -> None``: adds to the search's
            cost bound (:class:`~hf_layerswap.cost.SelectionPlan` ``plan``) what the objective
            runs beyond the removal KL's passes; its :attr:`estimate`.
    """

    name: str
    score: Callable
    help: str = ""
    model_head: bool = False
    extra_cost: Callable = _no_extra_cost
    #: The search it serves counts an upper bound of its passes.
    estimate_exact = False

    @property
    def estimate(self) -> Callable:  # type: ignore[override]
        """The entry's estimate: :attr:`extra_cost`."""
        return self.extra_cost


#: ``objective=`` name -> :class:`Objective`: the objectives of their own (removal KL,
#: calibration NLL); a repair registered with ``search_objective = True`` is one too
#: (:func:`objective_entry`).
SET_OBJECTIVES: Registry[Objective] = Registry("set objective", "objective")


def register_objective(name: str, *, help: str, model_head: bool = False, extra_cost: Callable = _no_extra_cost):
    """Decorator registering ``score(evaluator, sets) -> (values, sweeps, block passes)`` as the
    set objective ``name`` (see :class:`Objective`).

    Raises:
        ValueError: ``name`` empty or already registered.
    """
    SET_OBJECTIVES.check_new(name)

    def decorate(score):
        SET_OBJECTIVES.add(name, Objective(name, score, help=help, model_head=model_head, extra_cost=extra_cost))
        return score

    return decorate


#: The objectives now: removal KL, calibration NLL and every recovery method registered with
#: ``search_objective = True`` (a live view: a method registered later is in it).
OBJECTIVES = RegistryNames(lambda: tuple(SET_OBJECTIVES) + search_objectives())


def objective_entry(name: str) -> Objective:
    """The :class:`Objective` of ``name``: a registered one, or the removal KL after the repair
    ``name`` (a recovery method with ``search_objective``).

    Raises:
        ValueError: ``name`` is none of :data:`OBJECTIVES`.
    """
    if name in SET_OBJECTIVES:
        return SET_OBJECTIVES[name]
    if name in search_objectives():
        return Objective(name, SetObjective._ghosted, help=f"the removal KL after the {name} repair of each cut",
                         model_head=True, extra_cost=repair_objective_cost)
    raise SET_OBJECTIVES.unknown(name, OBJECTIVES)


def repair_objective_cost(counts: dict, plan, exact_sets: list, n_batches: int) -> None:
    """Add to the search's bound what a repair-aware objective (``objective="ghosted"``,
    :class:`SetObjective`) runs beyond the removal KL's passes: the one stream-capture sweep
    that fits every block's operator (each batch of
    :func:`~hf_layerswap.recovery.fit.select_rows` over every real token, through all
    blocks, no head), and for the sets that cut through the last block (their operator acts
    after the last kept block, so they run from the embeddings) the blocks before their
    first removed one, which the removal KL's count starts after."""
    cfg, calib, total_blocks = plan.config, plan.calibration, plan.num_blocks
    fit_batches = sum(1 for _ in select_rows(calib, cfg.batch_size, calib.num_tokens))
    fit = fit_batches * total_blocks
    tail = 0
    protected = resolve_protect(cfg.protect, total_blocks)
    if total_blocks - 1 not in protected:
        first = min(plan.allowed)
        # an exact set runs its min(s) blocks more; a bound set, counted from the first
        # removable block, at most that many more
        tail = n_batches * (sum(min(x) for x in exact_sets if total_blocks - 1 in x)
                            + (counts["sets"] - len(exact_sets)) * first)
    counts["block_passes"] += fit + tail
    counts["block_tokens"] += (fit + tail) * calib.input_ids.shape[1] * cfg.batch_size
    counts["sweeps"] = counts["calls"] + 1


def plans_cost(plans: Mapping[Any, Sequence[int]], total_blocks: int, reference_sweeps: int = 1) -> tuple[int, int]:
    """(forward passes, block passes) of ``reference_sweeps`` reference sweeps (1 unless a
    :class:`~hf_layerswap.scoring.reference.ReferenceCache` held them) plus one sweep per
    plan with prefix reuse (the same accounting as :func:`~hf_layerswap.scoring.plan_kl`)."""
    blocks = total_blocks * reference_sweeps
    for plan in plans.values():
        start = first_difference(plan, total_blocks)
        if start >= len(plan) and len(plan) == total_blocks:
            continue
        blocks += len(plan) - min(start, len(plan) - 1)
    return reference_sweeps + len(plans), blocks


def _sweeps(batch_passes: int, num_prompts: int, batch_size: int) -> int:
    """Calibration-set sweeps that ``batch_passes`` identity passes over batches amount to
    (a sweep covers every batch once; a partial one counts whole)."""
    return math.ceil(batch_passes / max(1, math.ceil(num_prompts / batch_size)))


def engine_cost(stats: Mapping, calibration: CalibrationSet, total_blocks: int, num_plans: int) -> tuple[int, int, int]:
    """(reference sweeps, block passes, head passes) of a :func:`~hf_layerswap.scoring.plan_kl`
    call over ``num_plans`` plans, from the engine's counters.

    Reference sweeps: the identity passes it ran (a partial sweep counts whole). Block
    passes: block forward calls per calibration sweep, prefix-tree sharing included
    (every batch runs the same probes, so their block calls divide evenly by the
    batches). Head passes: output-head passes over the calibration set's real positions;
    with the streamed KL the reference's head runs again for each group of probes
    (``head_rows``), otherwise once per reference sweep and once per plan.
    """
    num_prompts = calibration.num_prompts
    batches = max(1, math.ceil(num_prompts / stats["batch_size"]))
    sweeps = _sweeps(stats["reference_passes"], num_prompts, stats["batch_size"])
    probe_blocks = stats["block_evaluations"] - total_blocks * stats["reference_passes"]
    rows = int(calibration.attention_mask.sum())
    heads = round(stats["head_rows"] / rows) if stats.get("head_rows") else sweeps + num_plans
    return sweeps, total_blocks * sweeps + probe_blocks // batches, heads


def _all_slots(total_blocks: int) -> list[int]:
    """The streams a later candidate may start from: entering blocks 1..L-1."""
    return list(range(1, total_blocks)) or [0]


def _stream_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of one ``(B, T, H)`` residual stream of ``model`` on batch ``ids``."""
    weight = model.get_input_embeddings().weight
    return ids.numel() * weight.shape[-1] * weight.element_size()


#: Bytes per position and vocabulary entry of one row slice of the NLL's head work
#: (:func:`plan_nll`): the fp32 logits and their fp32 log-softmax.
NLL_ENTRY_BYTES = 8


def nll_slice_rows(budget: int, activation_bytes: int, head_fixed_bytes: int, vocab: int) -> int:
    """Positions per row slice of :func:`plan_nll`'s head work under a ``budget``-byte
    working-memory budget: :data:`~hf_layerswap.scoring.engine.HEAD_BUDGET_FRACTION` of the
    slice budget (:func:`~hf_layerswap.scoring.settings.slice_budget`: what the budget leaves
    after a batch's ``activation_bytes`` and the head's ``head_fixed_bytes``, as the KL path
    sizes its head/KL blocks) over :data:`NLL_ENTRY_BYTES` per entry of the ``vocab``-entry
    vocabulary; at least 1."""
    share = int(HEAD_BUDGET_FRACTION * slice_budget(budget, activation_bytes, head_fixed_bytes))
    return max(1, share // (NLL_ENTRY_BYTES * max(1, vocab)))


def nll_working_bytes(budget: int, activation_bytes: int, head_fixed_bytes: int, vocab: int, rows: int) -> int:
    """Bytes :func:`plan_nll` holds at its peak for a batch with ``rows`` predicted positions:
    the batch's ``activation_bytes``, the head's fixed working piece and one row slice
    (:func:`nll_slice_rows`) of fp32 logits and their log-softmax."""
    width = min(max(1, rows), nll_slice_rows(budget, activation_bytes, head_fixed_bytes, vocab))
    return activation_bytes + head_fixed_bytes + NLL_ENTRY_BYTES * width * vocab


def _nll_budget(model: nn.Module, batch_size: int, seq_len: int, max_memory) -> tuple[int, int, int]:
    """``(budget, activation bytes, head fixed bytes)`` of :func:`plan_nll` on ``model``."""
    budget = resolve_memory(max_memory, model).bytes
    es = torch.finfo(param_dtype(model)).bits // 8
    head = Head(model)
    fixed = head.working_bytes(head.vocab) if head.linear else 0
    return budget, batch_activation_bytes(text_config(model), num_blocks(model), batch_size, seq_len, es), fixed


def _masked_nll(hidden: torch.Tensor, head: Head, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                rows_per_slice: int, stats: dict) -> torch.Tensor:
    """Per-prompt summed next-token NLL (nats) over real targets: position t predicts t+1
    where both are real. ``hidden``: the final hidden state ``(B, T, H)`` (the head's
    input); the head runs on ``rows_per_slice`` target positions at a time (fp32 logits,
    :class:`~hf_layerswap.scoring.head.Head`), each slice's log-softmax on its own rows, the
    sums in float64 (a row's NLL does not depend on the slice it is in). Returns ``(B,)``
    float64; counts the head calls in ``stats["head_slices"]``."""
    bsz, seqlen, width = hidden.shape
    attention_mask, input_ids = attention_mask.to(hidden.device), input_ids.to(hidden.device)
    target_mask = (attention_mask[:, 1:] * attention_mask[:, :-1]).bool()
    rows = target_mask.reshape(-1).nonzero().squeeze(1)
    flat_hidden = hidden[:, :-1].reshape(-1, width)
    flat_targets = input_ids[:, 1:].reshape(-1)
    prompt_of_row = rows // (seqlen - 1)
    sums = torch.zeros(bsz, dtype=torch.float64)
    for start in range(0, rows.numel(), rows_per_slice):
        idx = rows[start : start + rows_per_slice]
        logits = head(flat_hidden.index_select(0, idx)).float()
        nll = F.cross_entropy(logits, flat_targets.index_select(0, idx).to(logits.device), reduction="none")
        del logits
        sums.index_add_(0, prompt_of_row[start : start + rows_per_slice].cpu(), nll.double().cpu())
        stats["head_slices"] += 1
    return sums


@contextlib.contextmanager
def _head_input(head: Head):
    """Context manager: every forward of the model stops at its output head (``StopForward``)
    and leaves the head's input (the final hidden state ``(B, T, H)``) in the yielded list."""
    taken: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        taken.append((args[0] if args else kwargs["input"]).detach())
        raise StopForward

    handle = head.module.register_forward_pre_hook(hook, with_kwargs=True)
    with hooks_removed([handle]):
        yield taken


@torch.no_grad()
def plan_nll(
    model: nn.Module,
    calibration: CalibrationSet,
    plans: Mapping[Any, Sequence[int]],
    *,
    batch_size: int = 8,
    reference_cache: ReferenceCache | None = None,
    max_memory=None,
) -> tuple[dict[Hashable, torch.Tensor], torch.Tensor, dict]:
    """Calibration next-token NLL of the model under every plan, with prefix reuse.

    The identity plan runs once per batch (it gives the reference NLL and the residual
    stream entering every slot); a plan that first differs from identity at slot s starts
    from the cached stream entering s, and plans that then run the same blocks share them
    as a prefix tree (:func:`~hf_layerswap.scoring.probes.schedule`, as the scoring engine
    does): the stream at each branch point is captured by the first plan through it. Equal
    plans run once.

    Args:
        model: a causal LM with L decoder blocks.
        calibration: ``N`` right-padded prompts.
        plans: name -> block plan (see :mod:`hf_layerswap.layerplan`).
        batch_size: prompts per forward pass.
        reference_cache: shared by calls on the same model and prompts: each batch's
            identity pass (streams entering every block, reference NLL) runs once
            (:class:`~hf_layerswap.scoring.reference.ReferenceCache`); ``None``: once per call.
        max_memory: the working-memory budget of a call (bytes, a size such as ``"2GiB"``, a
            :class:`~hf_layerswap.scoring.settings.MemoryBudget`, or ``None``/``"auto"``:
            :func:`~hf_layerswap.scoring.settings.resolve_memory` on the model's devices):
            the output head runs on row slices of the predicted positions
            (:func:`nll_slice_rows`: the head/KL share of the same slice budget as the KL
            path's), never on the whole ``(B, T, V)`` logits; the values are those of the
            unsliced NLL (each row's log-softmax is its own; float64 sums).

    Returns:
        ``(values, counts, stats)``: ``values[name]`` is a ``(N,)`` float64 tensor of
        per-prompt summed NLL in nats (targets: every real token after the first);
        ``counts`` the ``(N,)`` number of predicted tokens per prompt; ``stats`` has
        ``base`` (``(N,)`` NLL sums of the unmodified model), ``forward_passes``,
        ``block_passes`` (block forward calls per calibration sweep), ``head_passes``,
        ``reference_passes`` (identity sweeps run: 1, or 0 when the cache held every batch),
        ``head_slices`` (output-head calls on row slices), ``rows_per_slice`` and ``seconds``. Calibration NLL per token of a plan is
        ``values[name].sum() / counts.sum()``.

    The model is left exactly as it was.

    Raises:
        ValueError: a ``max_memory`` that is no size (before any forward pass).
    """
    model = uncompiled(model)
    budget, activations, fixed = _nll_budget(model, batch_size, calibration.seq_len, max_memory)
    head = Head(model)
    if head.module is None:
        raise ValueError(f"plan_nll needs the model's output head (get_output_embeddings()); "
                         f"{type(model).__name__} has none")
    rows_per_slice = nll_slice_rows(budget, activations, fixed, head.vocab)
    counters = {"head_slices": 0}
    total_blocks = num_blocks(model)
    _, _, blocks = decoder_blocks(model)
    key_of, probes, _ = make_probes(plans, total_blocks)
    order = schedule(list(probes.values()), "shared")
    needed = sorted({p.start for p in probes.values() if p.start > 0})
    values: dict[Hashable, list[torch.Tensor]] = {name: [] for name in plans}
    base, counts = [], []
    was_training = model.training
    model.eval()
    device = input_device(model)
    cache = ReferenceCache(0) if reference_cache is None else reference_cache
    misses = cache.misses
    t0 = time.perf_counter()
    try:
        for b, (ids, mask) in enumerate(calibration.batches(batch_size)):
            ids, mask = ids.to(device), mask.to(device)

            def sweep(slots, ids=ids, mask=mask):
                with _head_input(head) as final:
                    streams, _ = capture_residual_stream(model, ids, mask, slots=slots, compute_logits=True)
                return streams, _masked_nll(final.pop(), head, ids, mask, rows_per_slice, counters)

            key = ("nll", b, batch_size, calibration.content_hash)
            streams, ref = cache.get(key, sweep, needed or [0], _all_slots(total_blocks), _stream_bytes(model, ids))
            base.append(ref)
            counts.append((mask[:, 1:] * mask[:, :-1]).sum(dim=1).cpu())

            def run(probe, depth0, start_hidden, captures, ids=ids, mask=mask):
                slot = probe.start + depth0
                kwargs = {"start": slot, "start_hidden": start_hidden} if slot > 0 else {}
                with apply_plan(model, probe.key, **kwargs), _head_input(head) as final:
                    captured, handles = position_hooks(blocks, probe.run, depth0, captures)
                    with hooks_removed(handles), contextlib.suppress(StopForward):
                        model(input_ids=ids, attention_mask=mask, use_cache=False)
                return _masked_nll(final.pop(), head, ids, mask, rows_per_slice, counters), captured

            nll = {p.key: v for p, v in walk_schedule(order, lambda slot, s=streams: s[slot] if slot > 0 else None, run)}  # type: ignore[misc]  # mypy infers no lambda with a default argument
            for name in plans:
                key = key_of[name]
                values[name].append(nll[key].clone() if key in nll else ref.clone())
            del streams, nll
    finally:
        model.train(was_training)
    sweeps = _sweeps(cache.misses - misses, calibration.num_prompts, batch_size)
    stats = {
        "base": torch.cat(base),
        "forward_passes": sweeps + len(plans),
        "block_passes": total_blocks * sweeps + schedule_blocks(list(probes.values()), "shared"),
        "head_passes": sweeps + len(probes),
        "reference_passes": sweeps,
        "head_slices": counters["head_slices"],
        "rows_per_slice": rows_per_slice,
        "seconds": time.perf_counter() - t0,
    }
    return {name: torch.cat(v) for name, v in values.items()}, torch.cat(counts).long(), stats


def removal_kl_values(model, calibration, sets: Sequence[Sequence[int]], batch_size: int,
                      max_memory=None) -> tuple[list[float], dict]:
    """Joint removal KL (nats) of each set, one shared reference sweep (plan_kl) under the
    working-memory budget ``max_memory`` (as :func:`~hf_layerswap.scoring.plan_kl` takes it)."""
    total_blocks = num_blocks(model)
    plans = {k: removal_plan(total_blocks, s) for k, s in enumerate(sets)}
    values, stats = plan_kl(model, calibration, plans, batch_size=batch_size, max_memory=max_memory)
    sweeps, blocks, heads = engine_cost(stats, calibration, total_blocks, len(plans))
    out = [float(values[k].mean()) for k in range(len(sets))]
    record_set_values({set_key(s): v for s, v in zip(sets, out)})
    return out, {
        "forward_passes": sweeps + len(plans),
        "block_passes": blocks,
        "head_passes": heads,
        "seconds": stats["seconds"],
    }


def removal_nll_values(model, calibration, sets: Sequence[Sequence[int]], batch_size: int,
                       reference_cache: ReferenceCache | None = None, max_memory=None) -> tuple[list[float], dict]:
    """Calibration NLL per token (nats) with each set removed, one shared reference sweep
    (none when ``reference_cache`` holds it from an earlier call), under the working-memory
    budget ``max_memory`` (:func:`plan_nll`)."""
    total_blocks = num_blocks(model)
    plans = {k: removal_plan(total_blocks, s) for k, s in enumerate(sets)}
    values, counts, stats = plan_nll(model, calibration, plans, batch_size=batch_size, reference_cache=reference_cache,
                                     max_memory=max_memory)
    total = float(counts.sum())
    out = [float(values[k].sum()) / total for k in range(len(sets))]
    record_set_values({set_key(s): v for s, v in zip(sets, out)})
    return out, stats


class SetObjective:
    """A cached objective f(S) over removal sets on one calibration set.

    Args:
        model: the dense causal LM (left unchanged).
        calibration: the calibration prompts.
        objective: one of :data:`OBJECTIVES`.
        batch_size: prompts per forward pass.
        prefix_reuse: start each candidate at its first removed block from the cached
            identity stream (``False`` runs every candidate from the embeddings; the
            values are the same up to float rounding of the same operations).
        reference_memory: bytes (or ``"2GB"``) the dense reference of the calibration
            batches may keep between calls (:class:`~hf_layerswap.scoring.reference.ReferenceCache`:
            the streams entering every block plus the exact reference, kept per batch while
            they fit; other batches are recomputed once per call; 0 keeps none). Default ``None``:
            :data:`~hf_layerswap.scoring.settings.REFERENCE_SHARE` (half) of ``max_memory``.
        max_memory: the one working-memory budget of the objective (bytes, a size such as
            ``"2GiB"``, a :class:`~hf_layerswap.scoring.settings.MemoryBudget`, or
            ``None``/``"auto"``: what scoring derives for the model's input device,
            :func:`~hf_layerswap.scoring.settings.device_memory_budget`): the kept reference
            takes ``reference_memory`` of it and each engine call
            (:func:`~hf_layerswap.scoring.plan_kl`) the rest, so together they stay within it.

    Attributes:
        calls: distinct sets scored; ``forward_passes`` (calibration sweeps, a candidate
        starting mid-stack counts as one, plus the reference sweeps actually run: one for
        the whole search when the reference fits ``reference_memory``),
        ``reference_passes`` (those reference sweeps), ``block_passes`` (block forward
        calls per calibration sweep: each candidate from its first removed block, candidates
        of one call sharing their common prefixes as a tree, :func:`~hf_layerswap.scoring.probes.schedule`),
        ``head_passes`` (output-head passes over the calibration prompts: one per candidate
        plus the reference's, which the streamed KL runs again per group of candidates),
        ``block_loads`` (offloaded blocks the removal KL's engine calls brought to the
        execution device: their ``movement["block_onloads"]``) and ``seconds``;
        ``reference`` the cache.

    Raises:
        ValueError: an unknown objective or a bad ``reference_memory``.
    """

    def __init__(self, model: nn.Module, calibration: CalibrationSet, objective: str = "removal_kl", *,
                 batch_size: int = 8, prefix_reuse: bool = True, progress=None, reference_memory=None,
                 max_memory=None):
        if objective not in OBJECTIVES:
            raise ValueError(f"objective={objective!r}: allowed {list(OBJECTIVES)}")
        budget = resolve_memory(max_memory, model)
        if reference_memory is None:
            kept, self.engine_memory = budget.split()
            reference_memory = kept.bytes
        else:  # as given (ReferenceCache refuses a bad value); the engine calls get what it leaves
            if isinstance(reference_memory, str):
                reference_memory = parse_memory(reference_memory)
            rest = budget.bytes - reference_memory if isinstance(reference_memory, int) else budget.bytes
            self.engine_memory = MemoryBudget(max(1 << 20, rest), budget.source)
        self.reference = ReferenceCache(reference_memory)
        self.reference_passes = 0
        self.model, self.calibration, self.objective = uncompiled(model), calibration, objective
        self.batch_size, self.prefix_reuse, self.progress = batch_size, prefix_reuse, progress
        self.num_blocks = num_blocks(model)
        self.cache: dict[str, float] = {}
        self.calls = self.forward_passes = self.block_passes = self.head_passes = self.block_loads = 0
        self.seconds = 0.0
        self._operators: dict[int, torch.Tensor] | None = None

    def cost(self) -> dict:
        return {"evaluator_calls": self.calls, "forward_passes": self.forward_passes,
                "block_passes": self.block_passes, "head_passes": self.head_passes,
                "reference_passes": self.reference_passes, "block_loads": self.block_loads,
                "seconds": round(self.seconds, 3)}

    def value(self, s: Sequence[int]) -> float:
        return self.cache[set_key(sorted(s))]

    def __call__(self, sets: Sequence[Sequence[int]]) -> list[float]:
        """Values of ``sets`` (each a list of 0-based blocks); uncached ones are scored in one batch."""
        sets = [sorted(int(i) for i in s) for s in sets]
        todo = list({set_key(s): s for s in sets if set_key(s) not in self.cache}.values())
        if todo:
            t0 = time.perf_counter()
            entry = objective_entry(self.objective)
            values, passes, blocks = entry.score(self, todo)
            if entry.model_head:
                self.head_passes += passes  # the model's own head in every sweep (reference and candidates)
            self.cache.update({set_key(s): float(v) for s, v in zip(todo, values)})
            record_set_values({set_key(s): v for s, v in zip(todo, values)})
            self.calls += len(todo)
            self.forward_passes += passes
            self.block_passes += blocks
            self.seconds += time.perf_counter() - t0
            if self.progress is not None:
                self.progress.update(len(todo))
        return [self.cache[set_key(s)] for s in sets]

    # -- objectives
    def _plans(self, sets):
        return {k: removal_plan(self.num_blocks, s) for k, s in enumerate(sets)}

    def _engine_kl(self, sets):
        plans = self._plans(sets)
        values, stats = plan_kl(self.model, self.calibration, plans, batch_size=self.batch_size,
                                prefix_reuse=self.prefix_reuse, progress=self.progress is not None,
                                desc="removal KL of the candidate sets",  # block passes, under the set bar
                                reference_cache=self.reference, max_memory=self.engine_memory)
        sweeps, blocks, heads = engine_cost(stats, self.calibration, self.num_blocks, len(plans))
        self.reference_passes += sweeps
        self.head_passes += heads
        self.block_loads += stats["movement"]["block_onloads"]
        return [float(values[k].mean()) for k in range(len(sets))], sweeps + len(plans), blocks

    def _nll(self, sets):
        values, counts, stats = plan_nll(self.model, self.calibration, self._plans(sets), batch_size=self.batch_size,
                                         reference_cache=self.reference, max_memory=self.engine_memory)
        self.reference_passes += stats["reference_passes"]
        total = float(counts.sum())
        return [float(values[k].sum()) / total for k in range(len(sets))], stats["forward_passes"], stats["block_passes"]

    @torch.no_grad()
    def _fit_operators(self) -> dict[int, torch.Tensor]:
        """The repair's operator W_p of every block p, fitted by the recovery fit itself from one
        stream-capture sweep over every real calibration token (float64 moments,
        :func:`~hf_layerswap.recovery.fit.collect_moments`; the method's
        :meth:`~hf_layerswap.recovery.RecoveryMethod.cut_operator` at its default epsilon)."""
        method = get_recovery_method(self.objective)
        _, _, blocks = decoder_blocks(self.model)
        cuts = [cut for p in range(self.num_blocks) for cut in cut_boundaries(self.num_blocks, [p])]
        moments, _, _ = collect_moments(self.model, blocks, cuts, method, self.calibration,
                                        self.calibration.num_tokens, self.batch_size)
        self.forward_passes += 1
        self.block_passes += self.num_blocks
        self.reference_passes += 1
        return {p: method.cut_operator(moments, [p], method.default_epsilon).float() for p in range(self.num_blocks)}

    def _cut_operators(self, s: Sequence[int]) -> list[tuple[int, int, torch.Tensor]]:
        """[(s, e, W)] per cut s..e-1: W = W_s ... W_{e-1} acts on the stream entering block e
        (e = L: the stream leaving block s-1, the last kept one)."""
        out, removed = [], sorted(s)
        k = 0
        while k < len(removed):
            start = k
            while k + 1 < len(removed) and removed[k + 1] == removed[k] + 1:
                k += 1
            w = self._operators[removed[start]]
            for p in removed[start + 1 : k + 1]:
                w = w @ self._operators[p]
            out.append((removed[start], removed[k] + 1, w))
            k += 1
        return out

    @torch.no_grad()
    def _ghosted(self, sets):
        if self._operators is None:
            self._operators = self._fit_operators()
        _, _, blocks = decoder_blocks(self.model)
        plans = self._plans(sets)
        sums = [torch.zeros((), dtype=torch.float64) for _ in sets]
        starts = {}
        for k, s in enumerate(sets):
            start = first_difference(plans[k], self.num_blocks)
            tail_cut = max(s) == self.num_blocks - 1
            starts[k] = 0 if (not self.prefix_reuse or tail_cut) else min(start, len(plans[k]) - 1)
        slots = sorted({v for v in starts.values() if v > 0}) or [0]
        device = input_device(self.model)
        was_training = self.model.training
        self.model.eval()
        misses = self.reference.misses
        try:
            for b, (ids, mask) in enumerate(self.calibration.batches(self.batch_size)):
                ids, mask = ids.to(device), mask.to(device)

                def sweep(wanted, ids=ids, mask=mask):
                    streams, logits = capture_residual_stream(self.model, ids, mask, slots=wanted, compute_logits=True)
                    return streams, torch.log_softmax(logits.float(), dim=-1)

                key = ("logprobs", b, self.batch_size, self.calibration.content_hash)
                streams, ref = self.reference.get(key, sweep, slots, _all_slots(self.num_blocks),
                                                  _stream_bytes(self.model, ids))
                for k, s in enumerate(sets):
                    cuts = self._cut_operators(s)
                    handles, kwargs = [], {}
                    for a, e, w in cuts:
                        op = GhostedOperator(w, e).to(device)
                        if starts[k] > 0 and a == cuts[0][0]:  # the first cut acts on the cached stream
                            kwargs = {"start": starts[k], "start_hidden": op(streams[starts[k]])}
                        elif e == self.num_blocks:  # cut through the last block: after the last kept one
                            handles.append(blocks[a - 1].register_forward_hook(op.output_hook))
                        else:
                            handles.append(blocks[e].register_forward_pre_hook(op.input_hook, with_kwargs=True))
                    try:
                        with apply_plan(self.model, plans[k], **kwargs):
                            out = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                    finally:
                        for h in handles:
                            h.remove()
                    sums[k] = sums[k] + masked_kl(ref, out, mask).sum()
                    del out
                del streams, ref
        finally:
            self.model.train(was_training)
        sweeps = _sweeps(self.reference.misses - misses, self.calibration.num_prompts, self.batch_size)
        self.reference_passes += sweeps
        passes, block_count = sweeps, self.num_blocks * sweeps
        for k in range(len(sets)):
            passes += 1
            block_count += len(plans[k]) - starts[k]
        n = self.calibration.num_prompts
        return [float(v) / n for v in sums], passes, block_count


register_objective("removal_kl", help="the joint removal KL d_skip(S) of the set, in nats, through the scoring engine")(
    SetObjective._engine_kl)
def _nll_working(counts: dict, plan, exact_sets: list, n_batches: int) -> None:
    """The NLL objective runs no pass beyond the removal KL's count; its working memory beside
    the kept reference is the NLL's (:meth:`~hf_layerswap.cost.SelectionPlan.nll_working`)."""
    counts["working_bytes"] = plan.nll_working()


register_objective("nll", help="the calibration next-token NLL per token after removing the set, in nats",
                   model_head=True, extra_cost=_nll_working)(SetObjective._nll)
