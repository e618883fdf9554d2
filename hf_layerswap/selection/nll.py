"""SLEB's, the beam's and the search's calibration NLL of removal plans (:func:`plan_nll`):
one identity pass per batch, each plan from its first removed block, plans sharing a
prefix as a tree, and the output head on row slices of the predicted positions sized from
the working-memory budget (:func:`nll_slice_rows`), never the whole ``(B, T, V)`` logits."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..calibration import CalibrationSet
from ..layerplan import StopForward, apply_plan, capture_residual_stream, decoder_blocks, num_blocks, uncompiled
from ..scoring.engine import HEAD_BUDGET_FRACTION
from ..scoring.head import Head, hooks_removed, param_dtype, text_config
from ..scoring.probes import make_probes, position_hooks, schedule, schedule_blocks, walk_schedule
from ..scoring.reference import ReferenceCache
from ..scoring.settings import batch_activation_bytes, resolve_memory, slice_budget
from ..utils.devices import input_device

__all__ = ["NLL_ENTRY_BYTES", "calibration_sweeps", "nll_slice_rows", "nll_working_bytes", "plan_nll", "reference_slots",
           "stream_bytes"]


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


def _nll_budget(model: nn.Module, head: Head, batch_size: int, seq_len: int, max_memory) -> tuple[int, int, int]:
    """``(budget, activation bytes, head fixed bytes)`` of :func:`plan_nll` on ``model`` and its ``head``."""
    budget = resolve_memory(max_memory, model).bytes
    es = torch.finfo(param_dtype(model)).bits // 8
    fixed = head.working_bytes(head.vocab) if head.linear else 0
    return budget, batch_activation_bytes(text_config(model), num_blocks(model), batch_size, seq_len, es), fixed


def _masked_nll(hidden: torch.Tensor, head: Head, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                rows_per_slice: int, stats: dict) -> torch.Tensor:
    """Per-prompt summed next-token NLL (nats) over real targets: position t predicts t+1
    where both are real. ``hidden``: the final hidden state ``(B, T, H)`` (the head's
    input); the head runs on ``rows_per_slice`` target positions at a time (fp32 logits,
    :class:`~hf_layerswap.scoring.head.Head`), each slice's log-softmax on its own rows, the
    sums in float64 (a row's NLL does not depend on the slice it is in). Returns ``(B,)``
    float64; counts the head calls in ``stats["head_slices"]`` and their rows in ``stats["head_rows"]``."""
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
        stats["head_rows"] += int(idx.numel())
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
        ``head_slices`` (output-head calls on row slices), ``head_rows`` (positions they
        ran on: the predicted ones), ``rows_per_slice`` and ``seconds``. Calibration NLL per token of a plan is
        ``values[name].sum() / counts.sum()``.

    The model is left exactly as it was.

    Raises:
        ValueError: a ``max_memory`` that is no size (before any forward pass).
    """
    model = uncompiled(model)
    head = Head(model)
    budget, activations, fixed = _nll_budget(model, head, batch_size, calibration.seq_len, max_memory)
    if head.module is None:
        raise ValueError(f"plan_nll needs the model's output head (get_output_embeddings()); "
                         f"{type(model).__name__} has none")
    rows_per_slice = nll_slice_rows(budget, activations, fixed, head.vocab)
    counters = {"head_slices": 0, "head_rows": 0}
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
            streams, ref = cache.get(key, sweep, needed or [0], reference_slots(total_blocks), stream_bytes(model, ids))
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
    sweeps = calibration_sweeps(cache.misses - misses, calibration.num_prompts, batch_size)
    stats = {
        "base": torch.cat(base),
        "forward_passes": sweeps + len(plans),
        "block_passes": total_blocks * sweeps + schedule_blocks(list(probes.values()), "shared"),
        "head_passes": sweeps + len(probes),
        "reference_passes": sweeps,
        "head_slices": counters["head_slices"],
        "head_rows": counters["head_rows"],
        "rows_per_slice": rows_per_slice,
        "seconds": time.perf_counter() - t0,
    }
    return {name: torch.cat(v) for name, v in values.items()}, torch.cat(counts).long(), stats
