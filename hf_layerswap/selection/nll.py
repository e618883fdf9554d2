"""SLEB's, the beam's and the search's calibration NLL of removal plans (:func:`plan_nll`):
one identity pass per batch, each plan from its first removed block, plans sharing a
prefix as a tree, and the output head on row slices of the predicted positions sized from
the working-memory budget (:func:`nll_slice_rows`), never the whole ``(B, T, V)`` logits.
An offloaded head (:attr:`~hf_layerswap.scoring.head.Head.streamed`) is read once per head
phase instead of once per row slice: the final rows of a batch's plans are held (a group
under the budget, :class:`NLLSizing`) and the head runs on them vocabulary slice by
vocabulary slice, as the scoring engine's KL does (:func:`~hf_layerswap.scoring.engine.head_blocks`),
with a float64 running log-sum-exp per row (:class:`OnlineNLL`)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..calibration import CalibrationSet
from ..layerplan import StopForward, apply_plan, capture_residual_stream, decoder_blocks, num_blocks, uncompiled
from ..scoring.engine import (FLUSH_BUDGET_FRACTION, HEAD_BUDGET_FRACTION, head_blocks, head_fixed_bytes,
                              KL_BLOCK_ENTRY_BYTES, MAX_KL_CHUNK)
from ..scoring.head import Head, hooks_removed, param_dtype, text_config
from ..scoring.kl import chunk_bounds, KL_SUB_BYTES, row_blocks
from ..scoring.probes import make_probes, position_hooks, schedule, schedule_blocks, walk_schedule
from ..scoring.reference import ReferenceCache
from ..scoring.settings import batch_activation_bytes, resolve_memory, slice_budget
from ..utils.devices import execution_device, input_device

__all__ = ["NLL_ENTRY_BYTES", "NLLSizing", "OnlineNLL", "calibration_sweeps", "nll_slice_rows", "nll_working_bytes",
           "plan_nll", "reference_slots", "stream_bytes"]


def calibration_sweeps(batch_passes: int, num_prompts: int, batch_size: int) -> int:
    """Calibration-set sweeps that ``batch_passes`` identity passes over batches amount to
    (a sweep covers every batch once; a partial one counts whole)."""
    return math.ceil(batch_passes / max(1, math.ceil(num_prompts / batch_size)))


def reference_slots(total_blocks: int) -> list[int]:
    """The streams a later candidate may start from: entering blocks 1..L-1."""
    return list(range(1, total_blocks)) or [0]


def stream_bytes(model: nn.Module, ids: torch.Tensor) -> int:
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


#: Bytes per held row of :class:`OnlineNLL`'s float64 state (running maximum, sum, target logit).
NLL_ROW_STATE_BYTES = 24


@dataclass(frozen=True)
class NLLSizing:
    """How :func:`plan_nll` runs the output head under one working-memory budget.

    A head in memory runs on row slices of a batch's predicted positions over the whole
    vocabulary (:attr:`rows_per_slice`, :func:`nll_slice_rows`). A streamed (offloaded) head
    (:attr:`streamed`) is read once per head phase: the final rows of up to :meth:`group`
    plans (the reference counting as one) are held, and the head runs on them in blocks of
    :attr:`block_rows` positions x :attr:`vocab_chunk` vocabulary entries, vocabulary slices
    outermost (:func:`~hf_layerswap.scoring.engine.head_blocks`, the scoring engine's
    slicing), each slice of the weight read once per phase.

    Attributes:
        budget: the working-memory budget (bytes).
        activation_bytes: a batch's activations (bytes).
        fixed_bytes: the head's fixed working piece (bytes; :func:`~hf_layerswap.scoring.engine.head_fixed_bytes`).
        vocab, hidden: the head's output and input widths.
        element_bytes: bytes per element of a final hidden row (the model's dtype).
        streamed: the head's weight is read from the offload.
        block_rows, vocab_chunk: positions and vocabulary entries per head block of a
            streamed head (the whole vocabulary for a head in memory).
    """

    budget: int
    activation_bytes: int
    fixed_bytes: int
    vocab: int
    hidden: int
    element_bytes: int
    streamed: bool
    block_rows: int
    vocab_chunk: int

    @classmethod
    def of(cls, head: Head, budget: int, activation_bytes: int, fixed_bytes: int, hidden: int, element_bytes: int,
           batch_size: int, seq_len: int) -> NLLSizing:
        """The sizing of ``head`` (:class:`~hf_layerswap.scoring.head.Head`) for batches of
        ``batch_size`` prompts of ``seq_len`` tokens: its blocks as the scoring engine sizes
        its head/KL blocks (at most :data:`~hf_layerswap.scoring.engine.MAX_KL_CHUNK` positions)."""
        streamed = bool(head.streamed)
        rows, chunk = head.vocab, head.vocab
        if streamed:
            share = int(HEAD_BUDGET_FRACTION * slice_budget(budget, activation_bytes, fixed_bytes))
            rows, chunk = head_blocks(head, share, min(MAX_KL_CHUNK, batch_size * seq_len))
        return cls(int(budget), int(activation_bytes), int(fixed_bytes), int(head.vocab), int(hidden),
                   int(element_bytes), streamed, int(rows), int(chunk))

    @property
    def slice_bytes(self) -> int:
        """What the budget leaves after the activations and the fixed piece (:func:`slice_budget`)."""
        return slice_budget(self.budget, self.activation_bytes, self.fixed_bytes)

    @property
    def rows_per_slice(self) -> int:
        """Positions per whole-vocabulary row slice of a head in memory (:func:`nll_slice_rows`)."""
        return nll_slice_rows(self.budget, self.activation_bytes, self.fixed_bytes, self.vocab)

    def group(self, rows: int) -> int:
        """Plans whose final rows (``rows`` predicted positions x ``hidden`` each) a streamed
        head's phase holds: :data:`~hf_layerswap.scoring.engine.FLUSH_BUDGET_FRACTION` of the
        slice budget, as the engine holds its probes' rows before a head/KL flush; at least 1."""
        per = max(1, rows * self.hidden * self.element_bytes)
        return max(1, int(FLUSH_BUDGET_FRACTION * self.slice_bytes) // per)

    def head_loads(self, rows: int, items: int) -> int:
        """Whole reads of a streamed head's weight for one batch with ``rows`` predicted
        positions and ``items`` head passes (the reference's and the plans'): one per phase
        of :meth:`group` passes; 0 for a head in memory (never read from an offload)."""
        return math.ceil(items / self.group(rows)) if self.streamed and items > 0 else 0

    def working_bytes(self, rows: int, passes: int | None = None) -> int:
        """Bytes held at the peak for a batch with ``rows`` predicted positions: the
        activations, the fixed piece and, in memory, one row slice of fp32 logits and
        log-softmax (:func:`nll_working_bytes`); streamed, the held final rows of one
        :meth:`group` (of at most ``passes`` head passes per batch, when given), their
        float64 state and one head block
        (:data:`~hf_layerswap.scoring.engine.KL_BLOCK_ENTRY_BYTES` per entry)."""
        if not self.streamed:
            return nll_working_bytes(self.budget, self.activation_bytes, self.fixed_bytes, self.vocab, rows)
        rows = max(1, rows)
        group = self.group(rows) if passes is None else min(self.group(rows), max(1, passes))
        held = group * rows * (self.hidden * self.element_bytes + NLL_ROW_STATE_BYTES)
        block = KL_BLOCK_ENTRY_BYTES * min(rows, self.block_rows) * self.vocab_chunk
        return self.activation_bytes + self.fixed_bytes + held + block


def _nll_sizing(model: nn.Module, head: Head, batch_size: int, seq_len: int, max_memory) -> NLLSizing:
    """The :class:`NLLSizing` of :func:`plan_nll` on ``model`` and its ``head``; a model without
    an output head or a ``max_memory`` that is no size refused (``ValueError``)."""
    budget = resolve_memory(max_memory, model).bytes
    if head.module is None:
        raise ValueError(f"plan_nll needs the model's output head (get_output_embeddings()); "
                         f"{type(model).__name__} has none")
    es = torch.finfo(param_dtype(model)).bits // 8
    fixed = head_fixed_bytes(head) if head.linear else 0
    cfg = text_config(model)
    activations = batch_activation_bytes(cfg, num_blocks(model), batch_size, seq_len, es)
    return NLLSizing.of(head, budget, activations, fixed, int(getattr(cfg, "hidden_size", 0) or 0), es, batch_size,
                        seq_len)


class OnlineNLL:
    """Next-token NLL of ``n`` passes over the same ``rows`` positions, folded in over
    vocabulary slices (the whole vocabulary being one): per pass and row the running
    maximum m of the logits, s = sum exp(logit - m) and the target token's logit, all in
    float64 (the logits stay fp32); NLL = m + log s - logit[target], the float64
    cross-entropy of the fp32 logits whatever the slicing.

    Args:
        n: passes; targets: the ``(R,)`` target token of each row; device: where the state lives.
    """

    def __init__(self, n: int, targets: torch.Tensor, device):
        rows = targets.numel()
        self.targets = targets.to(device)
        self.max = torch.full((n, rows), -math.inf, dtype=torch.float64, device=device)
        self.sum = torch.zeros(n, rows, dtype=torch.float64, device=device)
        self.target = torch.zeros(n, rows, dtype=torch.float64, device=device)

    def add(self, k: int, a: int, b: int, v0: int, logits: torch.Tensor) -> None:
        """Fold pass ``k``'s fp32 logits ``(b - a, W)`` of rows ``a:b`` and vocabulary entries
        ``v0:v0 + W`` in (row blocks of :data:`~hf_layerswap.scoring.kl.KL_SUB_BYTES` of float64 temporaries)."""
        logits = logits.float()
        width = logits.shape[1]
        for r0, r1 in row_blocks(logits.shape[0], 2 * width, KL_SUB_BYTES):
            part = logits[r0:r1]
            rows = slice(a + r0, a + r1)
            top = torch.maximum(self.max[k, rows], part.amax(dim=-1).double())
            self.sum[k, rows] = (self.sum[k, rows] * (self.max[k, rows] - top).exp()
                                 + (part - top.unsqueeze(-1)).exp_().sum(dim=-1))  # float64 (type promotion)
            self.max[k, rows] = top
            local = self.targets[rows] - v0
            inside = (local >= 0) & (local < width)
            picked = part.gather(1, local.clamp(0, width - 1).unsqueeze(1)).squeeze(1).double()
            self.target[k, rows] = torch.where(inside, picked, self.target[k, rows])

    def result(self) -> torch.Tensor:
        """Per pass and row NLL ``(n, R)`` float64 (nats)."""
        return self.max + self.sum.log() - self.target


def _masked_nll(hidden: torch.Tensor, head: Head, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                rows_per_slice: int, stats: dict) -> torch.Tensor:
    """Per-prompt summed next-token NLL (nats) over real targets: position t predicts t+1
    where both are real. ``hidden``: the final hidden state ``(B, T, H)`` (the head's
    input); the head runs on ``rows_per_slice`` target positions at a time (fp32 logits,
    :class:`~hf_layerswap.scoring.head.Head`), each slice's log-softmax on its own rows, the
    sums in float64 (a row's NLL does not depend on the slice it is in). Returns ``(B,)``
    float64; counts the head calls in ``stats["head_slices"]`` and their rows in ``stats["head_rows"]``."""
    bsz = hidden.shape[0]
    attention_mask, input_ids = attention_mask.to(hidden.device), input_ids.to(hidden.device)
    rows, prompt_of_row = _predicted_rows(attention_mask)
    flat_hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    flat_targets = input_ids[:, 1:].reshape(-1)
    sums = torch.zeros(bsz, dtype=torch.float64)
    for start in range(0, rows.numel(), rows_per_slice):
        idx = rows[start : start + rows_per_slice]
        logits = head(flat_hidden.index_select(0, idx)).float()
        nll = F.cross_entropy(logits, flat_targets.index_select(0, idx).to(logits.device), reduction="none")
        del logits
        sums.index_add_(0, prompt_of_row[start : start + rows_per_slice].cpu(), nll.double().cpu())
        stats["head_slices"] += 1
        stats["head_rows"] += int(idx.numel())
    return sums


def _predicted_rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, prompt_of_row)`` of a ``(B, T)`` mask: the flat indices into ``(B, T - 1)``
    of the positions that predict a real token from a real one, and their prompts."""
    target_mask = (mask[:, 1:] * mask[:, :-1]).bool()
    rows = target_mask.reshape(-1).nonzero().squeeze(1)
    return rows, rows // (mask.shape[1] - 1)


def _final_rows(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The head's input ``(R, H)`` at the predicted positions ``rows`` of the final hidden state ``(B, T, H)``."""
    return hidden[:, :-1].reshape(-1, hidden.shape[-1]).index_select(0, rows.to(hidden.device))


def _streamed_nll(head: Head, finals: list[torch.Tensor], targets: torch.Tensor, prompt_of_row: torch.Tensor,
                  bsz: int, sizing: NLLSizing, stats: dict) -> list[torch.Tensor]:
    """One head phase of a streamed head over the final rows ``(R, H)`` of several passes
    of one batch: vocabulary slices outermost (each slice of the weight read once from the
    offload, :meth:`~hf_layerswap.scoring.head.Head.weight_slice`), blocks of
    ``sizing.block_rows`` rows of every pass inside, folded into one :class:`OnlineNLL`.
    Returns one ``(bsz,)`` float64 CPU tensor of per-prompt NLL sums (nats) per pass; counts
    the GEMM calls in ``stats["head_slices"]``, their rows in ``stats["head_rows"]`` (once
    per pass) and the phase in ``stats["head_loads"]``."""
    device = execution_device(head.module)
    acc = OnlineNLL(len(finals), targets, device)
    rows = targets.numel()
    with torch.autocast(device_type=device.type, enabled=False):  # fp32 logits, float64 sums
        for v0, v1 in chunk_bounds(head.vocab, sizing.vocab_chunk):
            weight, bias = head.weight_slice(v0, v1)
            for k, final in enumerate(finals):
                for a, b in chunk_bounds(rows, sizing.block_rows):
                    acc.add(k, a, b, v0, head.slice_logits(final[a:b], weight, bias).to(device))
                    stats["head_slices"] += 1
            del weight, bias
    stats["head_loads"] += 1
    stats["head_rows"] += rows * len(finals)
    out = []
    for nll in acc.result().unbind(0):
        sums = torch.zeros(bsz, dtype=torch.float64)
        sums.index_add_(0, prompt_of_row.cpu(), nll.cpu())
        out.append(sums)
    return out


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


class _HeadPhases:
    """One batch's output-head work in :func:`plan_nll`: a head in memory runs on each pass's
    final hidden state at once (row slices, :func:`_masked_nll`); a streamed head's final rows
    are held and run in head phases of ``sizing.group`` passes (:func:`_streamed_nll`). The
    reference's NLL of a streamed head is the ``(B,)`` tensor the identity sweep returns
    (the one a :class:`~hf_layerswap.scoring.reference.ReferenceCache` keeps), filled in place
    by the batch's first phase."""

    def __init__(self, head: Head, sizing: NLLSizing, ids: torch.Tensor, mask: torch.Tensor, counters: dict):
        self.head, self.sizing, self.ids, self.mask = head, sizing, ids, mask
        self.rows_per_slice, self.counters = sizing.rows_per_slice, counters
        self.rows, self.prompt_of_row = _predicted_rows(mask)
        self.targets = ids[:, 1:].reshape(-1).index_select(0, self.rows)
        self.pending: list[tuple[Any, torch.Tensor]] = []
        self.done: dict[Any, torch.Tensor] = {}

    def nll_of(self, final: torch.Tensor, key) -> torch.Tensor | None:
        """``(B,)`` NLL sums of the final hidden state ``(B, T, H)`` of one pass (a head in
        memory), or ``None`` with its rows held under ``key`` (a probe's key, or the
        reference's tensor to fill) until a phase runs them."""
        if not self.sizing.streamed:
            return _masked_nll(final, self.head, self.ids, self.mask, self.rows_per_slice, self.counters)
        self.pending.append((key, _final_rows(final, self.rows)))
        if len(self.pending) >= self.sizing.group(self.rows.numel()):
            self.flush()
        return None

    def reference(self, final: torch.Tensor) -> torch.Tensor | None:
        """The reference's ``(B,)`` NLL sums (for a streamed head: the tensor a phase fills)."""
        if not self.sizing.streamed:
            return self.nll_of(final, None)
        ref = torch.zeros(self.ids.shape[0], dtype=torch.float64)
        self.nll_of(final, ref)
        return ref

    @property
    def holds_reference(self) -> bool:
        """Whether the reference's rows wait for a phase (its tensor not filled yet)."""
        return any(isinstance(k, torch.Tensor) for k, _ in self.pending)

    def flush(self) -> None:
        """One head phase over the held rows."""
        sums = _streamed_nll(self.head, [f for _, f in self.pending], self.targets, self.prompt_of_row,
                             self.ids.shape[0], self.sizing, self.counters)
        for (key, _), v in zip(self.pending, sums):
            if isinstance(key, torch.Tensor):
                key.copy_(v)
            else:
                self.done[key] = v
        self.pending.clear()

    def results(self, nll: dict) -> dict:
        """Each probe's NLL sums, the last phase run first (``nll``: what :meth:`nll_of` returned per probe key)."""
        if self.pending:
            self.flush()
        return {k: self.done.get(k, v) for k, v in nll.items()}


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
            unsliced NLL (each row's log-softmax is its own; float64 sums). An offloaded
            head is read once per head phase of :meth:`NLLSizing.group` passes, in the
            engine's vocabulary slices (:class:`NLLSizing`, :class:`OnlineNLL`).

    Returns:
        ``(values, counts, stats)``: ``values[name]`` is a ``(N,)`` float64 tensor of
        per-prompt summed NLL in nats (targets: every real token after the first);
        ``counts`` the ``(N,)`` number of predicted tokens per prompt; ``stats`` has
        ``base`` (``(N,)`` NLL sums of the unmodified model), ``forward_passes``,
        ``block_passes`` (block forward calls per calibration sweep), ``head_passes``,
        ``reference_passes`` (identity sweeps run: 1, or 0 when the cache held every batch),
        ``head_slices`` (head GEMM calls), ``head_rows`` (positions the head ran on: the
        predicted ones), ``head_loads`` (whole reads of an offloaded head: one per head
        phase; 0 in memory), ``head_bytes_read``, ``rows_per_slice``, ``vocab_chunk`` and ``seconds``. Calibration NLL per token of a plan is
        ``values[name].sum() / counts.sum()``.

    The model is left exactly as it was.

    Raises:
        ValueError: a ``max_memory`` that is no size (before any forward pass).
    """
    model = uncompiled(model)
    head = Head(model)
    sizing = _nll_sizing(model, head, batch_size, calibration.seq_len, max_memory)
    counters = {"head_slices": 0, "head_rows": 0, "head_loads": 0}
    read0 = head.bytes_read
    total_blocks = num_blocks(model)
    _, _, blocks = decoder_blocks(model)
    key_of, probes, _ = make_probes(plans, total_blocks)
    order = schedule(list(probes.values()), "shared")
    needed = sorted({p.start for p in probes.values() if p.start > 0})
    values: dict[Hashable, list[torch.Tensor]] = {name: [] for name in plans}
    base, counts = [], []
    was_training = model.training
    model.eval()
    cache = ReferenceCache(0) if reference_cache is None else reference_cache
    misses = cache.misses
    t0 = time.perf_counter()
    try:
        for b, (ids, mask) in enumerate(calibration.batches(batch_size)):
            ids, mask = ids.to(input_device(model)), mask.to(input_device(model))
            phases = _HeadPhases(head, sizing, ids, mask, counters)

            def run_probe(probe, depth0, start_hidden, captures, ids=ids, mask=mask, phases=phases):
                slot = probe.start + depth0
                kwargs = {"start": slot, "start_hidden": start_hidden} if slot > 0 else {}
                with apply_plan(model, probe.key, **kwargs), _head_input(head) as final:
                    captured, handles = position_hooks(blocks, probe.run, depth0, captures)
                    with hooks_removed(handles), contextlib.suppress(StopForward):
                        model(input_ids=ids, attention_mask=mask, use_cache=False)
                return phases.nll_of(final.pop(), probe.key), captured

            def sweep(slots, ids=ids, mask=mask, phases=phases):
                with _head_input(head) as final:
                    streams, _ = capture_residual_stream(model, ids, mask, slots=slots, compute_logits=True)
                return streams, phases.reference(final.pop())

            key = ("nll", b, batch_size, calibration.content_hash)
            streams, ref = cache.get(key, sweep, needed or [0], reference_slots(total_blocks), stream_bytes(model, ids))
            walk = walk_schedule(order, lambda slot, s=streams: s[slot] if slot > 0 else None, run_probe)  # type: ignore[misc]  # mypy infers no lambda with a default argument
            try:
                nll = phases.results({p.key: v for p, v in walk})
            except BaseException:
                if phases.holds_reference:  # never keep a reference left unfilled
                    cache.discard(key)
                raise
            base.append(ref)
            counts.append((mask[:, 1:] * mask[:, :-1]).sum(dim=1).cpu())
            for name in plans:
                key = key_of[name]
                values[name].append(nll[key].clone() if key in nll else ref.clone())
            del streams, nll
    finally:
        model.train(was_training)
    sweeps = calibration_sweeps(cache.misses - misses, calibration.num_prompts, batch_size)
    stats = {
        "base": torch.cat(base),
        "forward_passes": sweeps + len(plans),
        "block_passes": total_blocks * sweeps + schedule_blocks(list(probes.values()), "shared"),
        "head_passes": sweeps + len(probes),
        "reference_passes": sweeps,
        **counters,
        "head_bytes_read": head.bytes_read - read0,
        "rows_per_slice": sizing.rows_per_slice,
        "vocab_chunk": sizing.vocab_chunk,
        "seconds": time.perf_counter() - t0,
    }
    return {name: torch.cat(v) for name, v in values.items()}, torch.cat(counts).long(), stats
