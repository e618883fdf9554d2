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

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..calibration import CalibrationSet
from ..utils.devices import input_device
from ..layerplan import (
    apply_plan, capture_residual_stream, decoder_blocks, first_difference, num_blocks, removal_plan, uncompiled,
)
from ..recovery import cut_boundaries, get_recovery_method, search_objectives
from ..surgery.operators import GhostedOperator
from ..recovery.fit import collect_moments, select_rows
from ..utils.registry import Registry, RegistryEntry
from ..utils.registry_names import RegistryNames
from ..scoring.report import set_key
from ..scoring.rule import resolve_protect
from ..scoring import masked_kl, plan_kl
from ..scoring.reference import ReferenceCache
from ..scoring.settings import MemoryBudget, parse_memory, resolve_memory
from .finite import record_set_values
from .nll import calibration_sweeps, plan_nll, reference_slots, stream_bytes

__all__ = ["OBJECTIVES", "SET_OBJECTIVES", "Objective", "SetObjective", "engine_cost", "objective_entry", "plans_cost", "register_objective", "removal_kl_values", "removal_nll_values", "repair_objective_cost"]


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
    sweeps = calibration_sweeps(stats["reference_passes"], num_prompts, stats["batch_size"])
    probe_blocks = stats["block_evaluations"] - total_blocks * stats["reference_passes"]
    rows = int(calibration.attention_mask.sum())
    heads = round(stats["head_rows"] / rows) if stats.get("head_rows") else sweeps + num_plans
    return sweeps, total_blocks * sweeps + probe_blocks // batches, heads


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
        known: values of this objective already measured on this model and these prompts
            (``{set_key: value}``, e.g. an earlier search's, kept in
            :attr:`~hf_layerswap.SwapReport.removal_kl`): a set found there is taken from it
            and not scored again. It still counts in ``calls`` (so a search given them
            decides exactly as one that scored them) and in ``reused``, with no pass.

    Attributes:
        calls: distinct sets valued (scored, or taken from ``known``: ``reused``); ``forward_passes`` (calibration sweeps, a candidate
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
                 max_memory=None, known: Mapping[str, float] | None = None):
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
        self.known = {k: float(v) for k, v in (known or {}).items() if v is not None and math.isfinite(v)}
        self.reused = 0
        self.calls = self.forward_passes = self.block_passes = self.head_passes = self.block_loads = 0
        self.seconds = 0.0
        self._operators: dict[int, torch.Tensor] | None = None

    def cost(self) -> dict:
        return {"evaluator_calls": self.calls, "reused": self.reused, "forward_passes": self.forward_passes,
                "block_passes": self.block_passes, "head_passes": self.head_passes,
                "reference_passes": self.reference_passes, "block_loads": self.block_loads,
                "seconds": round(self.seconds, 3)}

    def value(self, s: Sequence[int]) -> float:
        return self.cache[set_key(sorted(s))]

    def __call__(self, sets: Sequence[Sequence[int]]) -> list[float]:
        """Values of ``sets`` (each a list of 0-based blocks); uncached ones are scored in one batch."""
        sets = [sorted(int(i) for i in s) for s in sets]
        todo = list({set_key(s): s for s in sets if set_key(s) not in self.cache}.values())
        taken = [s for s in todo if set_key(s) in self.known]
        if taken:  # measured before on these prompts: valued without a pass
            self.cache.update({set_key(s): self.known[set_key(s)] for s in taken})
            self.calls += len(taken)
            self.reused += len(taken)
            todo = [s for s in todo if set_key(s) not in self.known]
            if self.progress is not None:
                self.progress.update(len(taken))
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
                streams, ref = self.reference.get(key, sweep, slots, reference_slots(self.num_blocks),
                                                  stream_bytes(self.model, ids))
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
        sweeps = calibration_sweeps(self.reference.misses - misses, self.calibration.num_prompts, self.batch_size)
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
    the kept reference is the NLL's (:meth:`~hf_layerswap.cost.SelectionPlan.nll_working`).
    An offloaded head is read once per head phase (:meth:`~hf_layerswap.cost.SelectionPlan.nll_head_loads`):
    the first call's (the reference and ``exact_sets``) exactly; of the further calls only
    those that score a set read it (at most one per further set), each bounded by one phase
    per batch plus its share of the further sets and references."""
    rest = counts["sets"] - len(exact_sets)
    runs = min(counts["calls"] - 1, rest)  # further calls that score a set: the others run nothing
    counts["working_bytes"] = plan.nll_working(passes=max(1 + len(exact_sets), 1 + rest))
    counts["head_loads"] = (plan.nll_head_loads([1 + len(exact_sets)]) + plan.nll_head_loads([1] * runs)
                            + plan.nll_head_loads([rest + runs] if runs else []))


register_objective("nll", help="the calibration next-token NLL per token after removing the set, in nats",
                   model_head=True, extra_cost=_nll_working)(SetObjective._nll)
