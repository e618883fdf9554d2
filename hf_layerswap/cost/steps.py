"""The cost of the pipeline's steps after the selection (:func:`~hf_layerswap.prune`'s
repair, healing and sparsity), planned on a meta-device model for
:func:`~hf_layerswap.cost.estimate_cost`.

Each step's passes follow its code, counted as forward calls of a decoder block (one block
over one batch) and of the output head:

- **recovery** (:func:`~hf_layerswap.recovery.recover`): one pass over the batches that
  hold the first ``num_tokens`` real tokens (:func:`~hf_layerswap.recovery.fit.select_rows`),
  each stopping at the last stream slot the method reads (blocks ``0..end-1`` run, ``end``
  the first kept block after the last cut); a method that checks the model on real rows
  first (``"fused"``: each cut's host block) adds the forwards of that check on one batch
  of at most 2 prompts (:meth:`~hf_layerswap.recovery.RecoveryMethod.probe_forwards`). Exact
  when the blocks are given (``layers``); otherwise an upper bound (the last removable block
  taken as the last cut; for the checks, each of the deepest removable blocks a cut of its
  own);
- **sparsity** (:func:`~hf_layerswap.sparsity.sparsify`, batches of 8 prompts): the dense
  pass over every kept block, a gradient pass (forward, head, backward) for allocators that
  need one, then block by block a statistics replay (pruners with statistics) and the
  propagation to the next block. Exact;
- **healing** (:func:`~hf_layerswap.healing.heal`): per optimiser step a student forward
  and backward (the backward as 2 forward FLOPs) and a teacher forward (or, with
  ``teacher_top_k``, one teacher pass over the training prompts before training), over
  transformers' Trainer batches of ``batch_size`` prompts that cycle through the training
  prompts; held-out evaluations (student and teacher forwards) before training (twice: the check of a
  finite start, then the Trainer's), every ``eval_every`` steps and after the last step. Exact when the
  early stop cannot fire before the last step (fewer evaluations before it than ``patience``), otherwise
  an upper bound (no early stop). Its measurements (:func:`heal_measures`): the perplexity stages, each
  the evaluator's own windows and batches over the tokenized text (exact), and the lm-eval tasks before
  and after (an upper bound from the requests lm-eval builds without the model, or named as not
  estimated, with the reason).

Peak memory per step: the weights held then (the dense teacher copy from before the cut until healing
ends), the step's own tensors (captured streams and float64 moments of a repair; the cached block inputs
and per-linear statistics of a sparsification; the trainable parameters' gradients, AdamW's two moments
and step counter, the early stop's best copy, the saved activations of the backward and the logits of a
healing step).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn
from transformers import AutoTokenizer

from ..calibration import CalibrationSet
from ..config import HealConfig, LayerSwapConfig
from ..evaluation.contract import resolve_tokenizer
from ..healing.measure import PERPLEXITY_STAGES, max_positions, perplexity_forwards, start_stage
from ..healing.choice import HEAL_SECONDS, TIMED_FORWARDS, probe_steps, time_budget
from ..healing.methods import get_heal_method
from ..healing.trainer import resolve_patience
from ..models import has_tokenizer_files, is_hub_id
from ..layerplan import ONE_BLOCK, decoder_blocks, resolve_layer_indices
from ..recovery.repair import DEFAULT_NUM_TOKENS
from ..recovery.fit import cut_boundaries, fit_memory, select_rows
from ..recovery.methods import PROBE_PROMPTS, get_recovery_method
from ..scoring.rule import check_budget, resolve_protect
from ..scoring.settings import block_activation_bytes
from ..selection.registry import strategy_entry
from ..sparsity.registry import get_allocator, get_pruner
from ..sparsity.options import SparsifyOptions
from ..evaluation.tasks import check_task_names, request_forwards, task_requests

__all__ = ["ModelShape", "add_forward", "block_flops", "check_removal", "heal_budget", "heal_measures", "healing_phase",
           "lm_eval_passes", "measure_lines", "measure_tokenizer", "recovery_phase", "sparsity_phase",
           "text_tokenizer"]

#: Prompts per forward of :func:`~hf_layerswap.sparsity.sparsify` as :func:`~hf_layerswap.prune` calls it.
SPARSIFY_BATCH = 8
#: Prompts of the healing text for training, at most (:func:`~hf_layerswap.healing.heal`).
HEAL_MAX_TRAIN_PROMPTS = 256
#: fp32 copies of a training batch's ``(B, T, V)`` logits that healing's loss holds at once
#: (:func:`~hf_layerswap.healing.loss.distillation_loss`: the student's and the teacher's
#: logits, their real positions, their log-softmaxes, the teacher's probabilities and the
#: KL's difference); with a top-k cache of the teacher
#: (:func:`~hf_layerswap.healing.loss.top_k_distillation_loss`) the student's alone.
HEAL_LOGIT_COPIES = 8
HEAL_TOP_K_LOGIT_COPIES = 5


def block_flops(block_params: int, positions: int, seq_len: int, hidden: int) -> float:
    """FLOPs of one block's forward over ``positions`` (batches of ``seq_len``): 2 per
    parameter per position plus 4 T H per position for attention scores and their
    weighted sum."""
    return 2.0 * block_params * positions + 4.0 * positions * seq_len * hidden


class ModelShape:
    """What the step costs read of a (meta-device) model: block count, one block's
    parameters and bytes, hidden/intermediate sizes, heads, vocabulary, weight bytes."""

    def __init__(self, model: nn.Module):
        _, _, blocks = decoder_blocks(model)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.model = model
        self.blocks = blocks
        self.num_blocks = len(blocks)
        self.block_params = sum(p.numel() for p in blocks[0].parameters())
        self.block_bytes = sum(p.numel() * p.element_size() for p in blocks[0].parameters())
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.hidden = int(text.hidden_size)
        self.intermediate = int(getattr(text, "intermediate_size", 0) or 4 * self.hidden)
        self.heads = int(getattr(text, "num_attention_heads", 1) or 1)
        head = model.get_output_embeddings()
        self.vocab = int(head.weight.shape[0]) if head is not None else int(text.vocab_size)
        self.es = next(model.parameters()).element_size()

    def forward_flops(self, blocks: int, batch: int, width: int, head: bool = True) -> tuple[float, float]:
        """(block FLOPs, head FLOPs) of a model forward over ``batch`` x ``width`` positions
        through ``blocks`` blocks (and the head over every position)."""
        positions = batch * width
        return (blocks * block_flops(self.block_params, positions, width, self.hidden),
                2.0 * positions * self.hidden * self.vocab if head else 0.0)

    def activation_bytes(self, batch: int, width: int) -> int:
        """One block's forward working memory over ``batch`` x ``width`` positions."""
        return block_activation_bytes(batch * width, width, self.hidden, self.intermediate, self.heads, self.es)


def _phase(exact: bool, note: str) -> dict:
    return {"block_passes": 0, "head_passes": 0, "block_flops": 0.0, "head_flops": 0.0, "exact": exact,
            "memory_bytes": 0, "note": note}


def add_forward(phase: dict, shape: ModelShape, blocks: int, batch: int, width: int, head: bool = True,
                 factor: float = 1.0, head_rows: int | None = None, times: int = 1) -> None:
    """``times`` model forwards of ``batch`` x ``width`` positions through ``blocks`` blocks and
    (``head``) the head over every position, or over its last ``head_rows`` per prompt."""
    fb, fh = shape.forward_flops(blocks, batch, width, head)
    phase["block_passes"] += blocks * times
    phase["head_passes"] += int(head) * times
    phase["block_flops"] += times * factor * fb
    phase["head_flops"] += times * factor * (fh if head_rows is None or not head else fh * head_rows / width)


def _removal(shape: ModelShape, cfg: LayerSwapConfig) -> tuple[list[int], bool]:
    """The removed blocks when given (exact), else a worst case for the passes: the
    ``num_to_remove`` last removable blocks (the last cut as deep as it can be)."""
    total = shape.num_blocks
    if cfg.layers is not None:
        return sorted(i % total for i in cfg.layers), True
    allowed = [i for i in range(total) if i not in resolve_protect(cfg.protect, total)]
    return allowed[-cfg.num_to_remove:], False


def check_removal(cfg: LayerSwapConfig, total: int) -> None:
    """Refuse, as :func:`~hf_layerswap.prune` does, a removal the model cannot take: a
    budget outside what the rules allow (:func:`~hf_layerswap.scoring.rule.check_budget`), what the
    strategy refuses after the scoring (its ``check_config``, e.g. a search's
    ``max_evaluations`` below its first sweep), layers out of range or duplicated, or every
    block.

    Raises:
        ValueError: naming the budget or the layers and what the model allows.
    """
    if cfg.layers is None:
        check_budget(cfg.num_to_remove, total, spacing=cfg.spacing, protect=cfg.protect)
        entry = strategy_entry(cfg.strategy)
        strategy_entry(entry.strategy_for(cfg.protocol)).check_config(cfg, total)
        return
    removed = resolve_layer_indices(cfg.layers, total)
    if len(removed) >= total:
        most = ONE_BLOCK if total == 1 else f"at most {total - 1} of {total} can go"
        raise ValueError(f"layers={list(cfg.layers)}: removing {removed} would leave no block: {most}")


# ---------------------------------------------------------------------------- recovery
def recovery_phase(shape: ModelShape, calib: CalibrationSet, cfg: LayerSwapConfig, teacher_bytes: int,
                   budget: int | None = None, accelerator: bool = False) -> dict:
    """Passes, FLOPs and peak bytes of ``cfg.recovery``'s fit (see the module's text) under
    the working-memory ``budget`` (:func:`~hf_layerswap.recovery.fit.fit_memory`: the
    prompts per batch it takes, the moments in host memory on an ``accelerator`` when they do
    not fit beside a batch's captures): ``working_bytes`` beyond the weights on the compute
    device, ``host_bytes`` in host memory, ``batch_size`` and ``within_budget``."""
    rec = cfg.recovery
    entry = get_recovery_method(rec.method)
    removed, exact = _removal(shape, cfg)
    cuts = cut_boundaries(shape.num_blocks, removed)
    slots: set[int] = set()
    for cut in cuts:
        slots.update((cut["start"], cut["end"]), entry.slots(cut))
    blocks = min(max(slots), shape.num_blocks)  # blocks 0..last slot - 1 run (all of them when the last is L)
    phase = _phase(exact, f"{rec.method} fit on the first {rec.num_tokens or DEFAULT_NUM_TOKENS:,} real tokens, "
                          f"each batch up to slot {max(slots)}" + ("" if exact else " (the deepest possible cut)"))
    num_tokens = rec.num_tokens or DEFAULT_NUM_TOKENS
    # the method's check on real rows before the fit (its probe), on one batch; blocks not yet chosen:
    # each of the deepest removable ones a cut of its own (the most checks there can be)
    probe_cuts = cuts if exact else [c for i in removed for c in cut_boundaries(shape.num_blocks, [i])]
    depths = entry.estimate(probe_cuts, shape.hidden, exact)["probe_forwards"]
    if depths:
        ids, _, _ = next(select_rows(calib, min(cfg.batch_size, PROBE_PROMPTS), num_tokens))
        for depth in depths:
            add_forward(phase, shape, depth, ids.shape[0], ids.shape[1], head=False)
    # the method's float64 moments (blocks not yet chosen: up to one cut per removed block)
    memory = fit_memory(calib, cfg.batch_size, num_tokens, slots=len(slots), hidden=shape.hidden,
                        element_bytes=shape.es, moment_bytes=entry.estimate(cuts, shape.hidden, exact)["moment_bytes"],
                        activation=shape.activation_bytes, budget=budget, accelerator=accelerator)
    for ids, _, _ in select_rows(calib, memory["batch_size"], num_tokens):
        add_forward(phase, shape, blocks, ids.shape[0], ids.shape[1], head=False)
    phase["memory_bytes"] = shape.weight_bytes + teacher_bytes + memory["device_bytes"]
    phase.update(working_bytes=memory["device_bytes"], host_bytes=memory["host_bytes"],
                 batch_size=memory["batch_size"], within_budget=memory["within_budget"])
    return phase


# ---------------------------------------------------------------------------- sparsity
def sparsity_phase(shape: ModelShape, calib: CalibrationSet, cfg: LayerSwapConfig, removed: int) -> dict:
    """Passes, FLOPs and peak bytes of ``cfg.sparsity`` on the pruned model (see the module's text)."""
    sp = cfg.sparsity
    kept = shape.num_blocks - removed
    allocator, pruner = get_allocator(sp.allocation), get_pruner(sp.pruner)
    phase = _phase(True, f"{sp.pruner} with {sp.allocation} on {kept} blocks, batches of {SPARSIFY_BATCH} prompts")
    inputs = 0
    gradients, replays = allocator.estimate()["gradient_forwards"], pruner.estimate()["statistics_replays"]
    for ids, _ in calib.batches(SPARSIFY_BATCH):
        b, w = ids.shape
        for _ in range(gradients):  # forward with the head, then a backward (2 forward FLOPs)
            add_forward(phase, shape, kept, b, w, head=True, factor=3.0)
        add_forward(phase, shape, kept, b, w, head=False)  # the dense pass
        for _ in range(replays):  # block by block: the statistics replay
            add_forward(phase, shape, kept, b, w, head=False)
        add_forward(phase, shape, kept - 1, b, w, head=False)  # the propagation to the next block
        inputs += ids.numel() * shape.hidden * shape.es  # each batch's stream entering a block
    linears = [(m.out_features, m.in_features) for m in shape.blocks[0].modules() if isinstance(m, nn.Linear)]
    rows = [int(mask.sum()) for _, mask in calib.batches(SPARSIFY_BATCH)]  # the real positions statistics read
    opts = SparsifyOptions(batch_size=SPARSIFY_BATCH)
    activations = shape.activation_bytes(SPARSIFY_BATCH, calib.seq_len)
    # the allocator's statistics of every block (kept through the pruning pass) and the pruner's of one block
    kept_stats, update = allocator.memory_bytes(opts, [linears] * kept, shape.hidden, rows)
    dense = inputs + kept_stats + update + activations  # block 0's inputs cached, the statistics updated
    pruning = 2 * inputs + kept_stats + pruner.memory_bytes(opts, linears, rows) + activations  # inputs and outputs
    working = max(dense, pruning, _gradient_bytes(shape, calib, kept, linears) if gradients else 0)
    pruned_weights = shape.weight_bytes - removed * shape.block_bytes
    phase["memory_bytes"] = pruned_weights + working
    phase["working_bytes"] = working  # every batch's block inputs and outputs, not sliced
    return phase


#: Bytes per position and vocabulary entry of the gradient pass's loss
#: (:func:`~hf_layerswap.sparsity.engine.gradient_statistics`): the fp32 logits, the loss's
#: shifted copy and log-softmax, and the logits' gradient.
GRADIENT_LOGIT_BYTES = 16


def _gradient_bytes(shape: ModelShape, calib: CalibrationSet, kept: int, linears: list[tuple[int, int]]) -> int:
    """The gradient pass of an allocator that reads gradients: the prunable weights'
    gradients of every kept block (the weights' dtype), and for the largest batch the
    activations each block's backward keeps (one block forward's working memory per block)
    and the loss's logits (:data:`GRADIENT_LOGIT_BYTES` per position and vocabulary entry)."""
    grads = kept * sum(o * i for o, i in linears) * shape.es
    positions = max((ids.numel() for ids, _ in calib.batches(SPARSIFY_BATCH)), default=0)
    return grads + kept * shape.activation_bytes(SPARSIFY_BATCH, calib.seq_len) + GRADIENT_LOGIT_BYTES * positions * shape.vocab


# ----------------------------------------------------------------------------- healing
def _heal_width(cfg: LayerSwapConfig, calibration) -> int:
    """Tokens per healing prompt: given tensors' width (never packed), else ``seq_len``."""
    tensors = cfg.heal.calibration is None and isinstance(calibration, Mapping)
    return int(calibration["input_ids"].shape[1]) if tensors else cfg.heal.seq_len


def _heal_rows(cfg: LayerSwapConfig, calibration, max_tokens: int) -> tuple[int, int, bool]:
    """(prompts of the healing text, their width, whether known exactly): given tensors
    read as :func:`~hf_layerswap.calibration.build_calibration` does, else full prompts
    (a packed text: every window of the budget, one paragraph per prompt: at most
    :data:`HEAL_MAX_TRAIN_PROMPTS`)."""
    heal = cfg.heal
    tensors = heal.calibration is None and isinstance(calibration, Mapping)  # never packed, their own width
    width = _heal_width(cfg, calibration)
    steps = math.ceil(max_tokens / (heal.batch_size * width))
    packed = heal.packing and not tensors
    wanted = (steps * heal.batch_size if packed else min(steps * heal.batch_size, HEAL_MAX_TRAIN_PROMPTS)) \
        + heal.heldout_prompts
    if tensors:
        rows = int(calibration["input_ids"].shape[0])
        if rows <= heal.heldout_prompts:  # heal refuses it the same way
            raise ValueError(f"{rows} calibration prompt(s) with heldout_prompts={heal.heldout_prompts}: "
                             "at least one prompt must remain for healing's training")
        return min(wanted, rows), width, True
    return wanted, width, False


def trainable_parameters(shape: ModelShape, cfg: LayerSwapConfig, removed: list[int],
                         known: bool = True) -> tuple[int, int, int]:
    """(trainable parameters, their tensors, bytes per element) of ``cfg.heal``'s method on
    the pruned model, as its registry entry plans them
    (its entry's estimate, :meth:`~hf_layerswap.healing.methods.HealMethod.trainable`; ``known``: ``removed`` is
    the cut itself, else a worst case).

    Raises:
        ValueError: a healing method whose entry plans no trainable set, or an option value
            it cannot take (a ``last_k`` ``k`` outside 1..(kept blocks)).
    """
    return get_heal_method(cfg.heal.method).estimate(shape, cfg.heal.options, removed, known)


def _trainer_batches(rows: int, batch: int, steps: int) -> dict[int, int]:
    """``{prompts: batches}`` of ``steps`` Trainer batches cycling through ``rows`` prompts
    (the last batch of an epoch may be short), counted without listing them (a budget of
    billions of steps is estimated at once)."""
    per_epoch = math.ceil(rows / batch)
    epochs, rest = divmod(steps, per_epoch)  # the ``rest`` batches of a last partial epoch are all full
    counts = {batch: epochs * (per_epoch - 1) + rest}
    short = rows - (per_epoch - 1) * batch
    counts[short] = counts.get(short, 0) + epochs
    return {b: n for b, n in counts.items() if n}


def heal_budget(shape: ModelShape, kept: int, throughput, batch_size: int, width: int,
                seconds: float = HEAL_SECONDS) -> dict:
    """The prediction of the default training budget of :func:`~hf_layerswap.healing.heal`
    (:func:`~hf_layerswap.healing.choice.time_budget`, which times the two forwards on the device):
    the student's forward through ``kept`` blocks and the teacher's through ``shape``'s
    blocks, each with the head, at ``throughput``'s rates (a :class:`~hf_layerswap.cost.Throughput`).

    Returns:
        :func:`~hf_layerswap.healing.choice.time_budget`'s record with ``"throughput"``: the rates' source.
    """
    seconds_of = []
    for blocks in (kept, shape.num_blocks):
        fb, fh = shape.forward_flops(blocks, batch_size, width)
        seconds_of.append(fb / throughput.block_flops_per_second + fh / throughput.head_flops_per_second)
    student, teacher = seconds_of
    return {**time_budget(student, teacher, batch_size, width, seconds), "throughput": throughput.source}


def healing_phase(shape: ModelShape, cfg: LayerSwapConfig, calibration, removed: int, tokenizer=None, *,
                  rates=None, earlier: bool = False, sparse: bool = False) -> dict:
    """Passes, FLOPs and peak bytes of ``cfg.heal`` (see the module's text), its
    measurements included (:func:`heal_measures`; ``tokenizer`` reads their texts).
    ``max_tokens=None`` takes the budget :func:`heal_budget` predicts at the rates
    ``rates(batch_size, width)`` returns (a :class:`~hf_layerswap.cost.Throughput`; the
    estimate's own), recorded in ``phase["budget"]``; ``learning_rate=None`` adds the
    learning-rate probe (:mod:`~hf_layerswap.healing.choice`: each candidate's steps and
    held-out evaluation), recorded in ``phase["probe"]``. ``earlier``, ``sparse``: the heal
    step comes after an earlier heal, after a sparsify (and no heal since) in a recipe: its
    perplexity starts there (:func:`~hf_layerswap.healing.measure.start_stage`).

    Raises:
        ValueError: ``max_tokens=None`` without ``rates``.
    """
    heal = cfg.heal
    removed_set, removal_known = _removal(shape, cfg)
    kept = shape.num_blocks - removed
    budget = None
    if heal.max_tokens is None:
        if rates is None:
            raise ValueError("heal max_tokens=None: predicting the budget heal chooses needs the device's rates")
        width = _heal_width(cfg, calibration)
        budget = heal_budget(shape, kept, rates(heal.batch_size, width), heal.batch_size, width)
        budget["timed_forwards"] = TIMED_FORWARDS + 1  # per model, heal's timing of the two forwards
        if isinstance(calibration, Mapping) and heal.calibration is None:  # given rows: at most one pass over them
            rows = min(int(calibration["input_ids"].shape[0]) - heal.heldout_prompts, HEAL_MAX_TRAIN_PROMPTS)
            if budget["steps"] * heal.batch_size > rows > 0:
                budget.update(steps=max(1, rows // heal.batch_size), text_limited=True)
                budget["max_tokens"] = budget["steps"] * heal.batch_size * width
    max_tokens = heal.max_tokens if budget is None else budget["max_tokens"]
    prompts, width, rows_known = _heal_rows(cfg, calibration, max_tokens)
    train, held = prompts - heal.heldout_prompts, heal.heldout_prompts
    steps = math.ceil(max_tokens / (heal.batch_size * width))  # as heal counts them: given tensors, their width
    # before training, every eval_every steps and after the last step (transformers' DefaultFlowCallback)
    evaluations = 1 + math.ceil(steps / heal.eval_every)
    patience = resolve_patience(heal.patience, steps, heal.eval_every)
    no_early_stop = math.ceil(steps / heal.eval_every) - 1 < patience  # a stop at the last one changes nothing
    phase = _phase(no_early_stop and rows_known,
                   f"{heal.method}: {steps} steps of {heal.batch_size} prompts x {width} tokens, {evaluations} "
                   f"held-out evaluations" + ("" if no_early_stop else " (no early stop: an upper bound)"))
    if budget is not None:  # the forwards heal times for the budget (one untimed first), each model
        for blocks in (kept, shape.num_blocks):
            add_forward(phase, shape, blocks, heal.batch_size, width, times=budget["timed_forwards"])
    if heal.teacher_top_k is not None:  # the teacher once over the training prompts
        for b, n in _trainer_batches(train, heal.batch_size, math.ceil(train / heal.batch_size)).items():
            add_forward(phase, shape, shape.num_blocks, b, width, times=n)
    for b, n in _trainer_batches(train, heal.batch_size, steps).items():
        if heal.teacher_top_k is None:
            add_forward(phase, shape, shape.num_blocks, b, width, times=n)
        add_forward(phase, shape, kept, b, width, factor=3.0, times=n)  # forward + backward (2 forward FLOPs)
    probe: dict[str, Any] | None = None
    if heal.learning_rate is None:  # the probe: per candidate its steps, and a held-out evaluation (one more first)
        candidates = get_heal_method(heal.method).learning_rates
        per = probe_steps(steps)
        probe = {"candidates": list(candidates), "steps": per, "prompts": min(train, per * heal.batch_size)}
        for b, n in _trainer_batches(probe["prompts"], heal.batch_size, per).items():
            if heal.teacher_top_k is None:
                add_forward(phase, shape, shape.num_blocks, b, width, times=n * len(candidates))
            add_forward(phase, shape, kept, b, width, factor=3.0, times=n * len(candidates))
    for b, n in _trainer_batches(held, heal.batch_size, math.ceil(held / heal.batch_size)).items():
        # the evaluations, and one more before anything: the finite-start check (healing.teacher.check_finite_start);
        # the probe's: one per candidate and its start
        times = n * (evaluations + 1 + (len(probe["candidates"]) + 1 if probe else 0))
        add_forward(phase, shape, shape.num_blocks, b, width, times=times)
        add_forward(phase, shape, kept, b, width, times=times)
    params, tensors, es = trainable_parameters(shape, cfg, removed_set, removal_known)
    # gradients, AdamW's exp_avg and exp_avg_sq (parameter dtype), a 4-byte step per tensor, the best copy
    optimizer = 4 * params * es + 4 * tensors
    adapters = params * es if get_heal_method(heal.method).adds_parameters else 0
    b = heal.batch_size
    saved = kept * (b * width * (16 * shape.hidden + 2 * shape.intermediate) * shape.es
                    + 2 * b * shape.heads * width**2 * 4)  # what the backward keeps per block
    # fp32 copies of a batch's logits at the loss (with a top-k cache of the teacher, fewer)
    logits = (HEAL_LOGIT_COPIES if heal.teacher_top_k is None else HEAL_TOP_K_LOGIT_COPIES) * b * width * shape.vocab * 4
    phase.update(trainable_params=params, trainable_tensors=tensors, optimizer_bytes=optimizer,
                 removal_known=removal_known)
    if budget is not None:
        phase["budget"] = budget
        phase["note"] += (f"; budget {budget['max_tokens']:,} tokens: {budget['steps']} steps of about "
                          f"{budget['step_seconds']:.2f} s in {budget['seconds'] / 60:g} min ({budget['throughput']}; "
                          "an upper bound: heal stops at one pass over its text)")
        phase["exact"] = False if not rows_known else phase["exact"]
    if probe is not None:
        phase["probe"] = probe
        phase["note"] += (f"; learning-rate probe: {len(probe['candidates'])} rates "
                          f"({', '.join(f'{r:g}' for r in probe['candidates'])}) x {probe['steps']} steps")
    phase["memory_bytes"] = (2 * shape.weight_bytes - removed * shape.block_bytes + adapters + optimizer
                             + saved + logits)
    heal_measures(phase, shape, cfg, kept, tokenizer, earlier=earlier, sparse=sparse)
    # beyond the weights: the dense teacher, the adapters, gradients and optimizer state, the backward's
    # saved activations and the logits; training slices none of them
    phase["working_bytes"] = phase["memory_bytes"] - shape.weight_bytes
    return phase


def heal_measures(phase: dict, shape: ModelShape, cfg: LayerSwapConfig, kept: int, tokenizer, *,
                  earlier: bool = False, sparse: bool = False) -> None:
    """Add to the healing ``phase`` what :class:`~hf_layerswap.healing.measure.HealMeasures`
    runs for ``cfg.heal``'s ``perplexity_text`` and ``eval_tasks`` (on a student of ``kept``
    blocks):

    - **perplexity**: the forwards of one evaluation under its contract
      (:func:`~hf_layerswap.healing.measure.perplexity_forwards`: the text tokenized, the
      windows and batches the evaluator makes), once on the dense teacher (every block),
      then on the kept blocks after the cut (the teacher under the removal plan), after the
      repair (when one is configured; after the earlier healing or the sparsification instead,
      ``earlier``, ``sparse``) and after healing; the head over the kept logits of each window. Exact; recorded in
      ``phase["perplexity"]``;
    - **lm-eval tasks** (:func:`lm_eval_passes`), before and after healing; recorded in
      ``phase["tasks"]``, with ``phase["not_estimated"]`` naming what could not be counted.

    Raises:
        ValueError: measurements without a tokenizer; a text or task the measurement
            would refuse.
    """
    heal = cfg.heal
    if heal.perplexity_text is None and heal.eval_tasks is None:
        return
    if tokenizer is None:
        raise ValueError(f"heal perplexity_text={heal.perplexity_text!r} / eval_tasks={heal.eval_tasks!r}: counting "
                         "their passes needs the tokenizer; pass tokenizer=")
    if heal.perplexity_text is not None:
        forwards = perplexity_forwards(heal.perplexity_text, tokenizer, max_positions(shape.model))
        repaired = cfg.recovery is not None and get_recovery_method(cfg.recovery.method).fits
        start = start_stage(earlier, sparse, repaired)
        stages = [s for s in PERPLEXITY_STAGES  # the stage healing starts from, and the cut replayed before it
                  if s in ("dense", "after_cut", start, "after_healing")]
        before = (phase["block_passes"], phase["head_passes"])
        for stage in stages:
            depth = shape.num_blocks if stage == "dense" else kept
            for windows, length, keep in forwards:
                add_forward(phase, shape, depth, windows, length, head_rows=keep)
        phase["perplexity"] = {"stages": stages, "forwards_per_stage": len(forwards),
                               "block_passes": phase["block_passes"] - before[0],
                               "head_passes": phase["head_passes"] - before[1]}
        widest = max(w * length for w, length, _ in forwards)
        logits = max(w * keep for w, _, keep in forwards) * shape.vocab * 4 * 2  # the logits and their fp32 copy
        ppl_peak = 2 * shape.weight_bytes + shape.activation_bytes(1, widest) + logits
        phase["memory_bytes"] = max(phase["memory_bytes"], ppl_peak)
        phase["note"] += f"; perplexity at {len(stages)} stages, {len(forwards)} forwards each"
    if heal.eval_tasks is not None:
        lm_eval_passes(phase, shape, cfg, kept, tokenizer)


def text_tokenizer(model, cfg: LayerSwapConfig, tokenizer, required: bool = True):
    """The tokenizer that reads a prune's texts (its calibration, healing's measurements):
    ``tokenizer`` (an object, a folder or Hub id), else ``cfg.tokenizer``, else the model's
    own; ``None`` when none is given and the model's own cannot be loaded, unless ``required``.

    Raises:
        ValueError: ``required`` and none given nor loaded (the message says to pass one).
        FileNotFoundError: a ``tokenizer`` path that is neither a folder nor a Hub id.
    """
    tokenizer = tokenizer if tokenizer is not None else cfg.tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        name = os.fspath(tokenizer)
        if not Path(name).expanduser().is_dir() and not is_hub_id(name):
            raise FileNotFoundError(f"tokenizer={name!r} is not a folder, and not a Hub id of the form 'owner/name'")
        return AutoTokenizer.from_pretrained(name)
    if tokenizer is not None:
        return tokenizer
    source = getattr(model, "name_or_path", None)
    if source and os.path.isdir(source) and not has_tokenizer_files(source):  # transformers would build an empty one
        if required:
            raise ValueError(f"no tokenizer given and the checkpoint {source!r} has none; pass tokenizer=...")
        return None
    try:
        return resolve_tokenizer(model, None)
    except ValueError:
        if required:
            raise
        return None


def measure_tokenizer(model, cfg: LayerSwapConfig, tokenizer):
    """The tokenizer that reads healing's measurement texts (:func:`text_tokenizer`);
    ``None`` when no heal step (a ``heal`` field or a recipe's heal) measures anything.

    Raises:
        ValueError: none given and none can be loaded (the message says to pass one).
        FileNotFoundError: a ``tokenizer`` path that is neither a folder nor a Hub id.
    """
    heals = [step for step in cfg.after_removal() if isinstance(step, HealConfig)]
    if not any(heal.perplexity_text is not None or heal.eval_tasks is not None for heal in heals):
        return None
    return text_tokenizer(model, cfg, tokenizer)


def measure_lines(phase: dict) -> list[str]:
    """Terminal lines of a healing ``phase``: its measurements' share of the passes, and
    what is not estimated (and why)."""
    out = []
    if "budget" in phase:
        b = phase["budget"]
        out.append(f"    budget chosen: {b['max_tokens']:,} tokens, {b['steps']} steps of about {b['step_seconds']:.2f} s "
                   f"({b['seconds'] / 60:g} min at {b['throughput']}; fewer when the text holds less)")
    if "probe" in phase:
        p = phase["probe"]
        out.append(f"    learning-rate probe: {len(p['candidates'])} rates ({', '.join(f'{r:g}' for r in p['candidates'])}) "
                   f"x {p['steps']} steps on {p['prompts']} prompts, the lowest held-out KL chosen")
    if "perplexity" in phase:
        ppl = phase["perplexity"]
        out.append(f"    of which perplexity: {ppl['block_passes']:,} block passes, {ppl['head_passes']:,} head passes "
                   f"({len(ppl['stages'])} stages x {ppl['forwards_per_stage']} forwards: {', '.join(ppl['stages'])})")
    if phase.get("tasks", {}).get("forwards"):
        tasks = phase["tasks"]
        out.append(f"    of which lm-eval: at most {tasks['block_passes']:,} block passes, {tasks['head_passes']:,} head "
                   f"passes ({sum(tasks['forwards'].values())} forwards per run, before and after healing)")
    out += [f"  not estimated: {why}" for why in phase.get("not_estimated", ())]
    return out


def lm_eval_passes(phase: dict, shape: ModelShape, cfg: LayerSwapConfig, kept: int, tokenizer) -> None:
    """Add an upper bound of the lm-eval task evaluations (before and after healing) to
    ``phase``: the requests lm-eval builds without a model
    (:func:`~hf_layerswap.evaluation.tasks.task_requests`, over the local task folder and documents)
    and the forwards ``HFLM`` runs for them at most
    (:func:`~hf_layerswap.evaluation.tasks.request_forwards`: one per ``loglikelihood`` request, one
    per rolling window of a ``loglikelihood_rolling`` document), each through the ``kept``
    blocks and the head over every position. Not estimated, with the reason in
    ``phase["not_estimated"]``: lm-eval's own tasks (no ``eval_tasks_path``: their documents
    come from the Hub, and an estimate downloads nothing; their names are still checked
    against lm-eval's index), ``generate_until`` tasks (one forward per generated token), tasks
    whose documents cannot be loaded, every task when lm-eval is not installed.

    Raises:
        ValueError: a task name lm-eval does not know (:func:`~hf_layerswap.evaluation.tasks.check_task_names`).
    """
    heal = cfg.heal
    phase["exact"] = False
    skipped = phase.setdefault("not_estimated", [])
    if heal.eval_tasks_path is None:
        try:  # a name lm-eval does not know would stop the real run after the scoring
            check_task_names(heal.eval_tasks)
        except ImportError:
            pass  # said below: the requests are not built either way
        skipped.append(f"lm-eval tasks {heal.eval_tasks}: lm-eval's own tasks read their documents from the Hub; "
                       "the estimate builds requests only from a local task folder (eval_tasks_path)")
        return
    try:
        built = task_requests(heal.eval_tasks, limit=heal.eval_tasks_limit, include_path=heal.eval_tasks_path)
    except ImportError:
        skipped.append(f"lm-eval tasks {heal.eval_tasks}: lm-eval is not installed (pip install "
                       "'hf-layerswap[lm-eval]'), so their requests cannot be built")
        return
    text = shape.model.config.get_text_config() if hasattr(shape.model.config, "get_text_config") else shape.model.config
    max_length = int(getattr(text, "max_position_embeddings", 0) or 2048)  # evaluate_tasks' default
    counted = {}
    before = (phase["block_passes"], phase["head_passes"])
    for name, task in built.items():
        if "error" in task:
            skipped.append(f"lm-eval task {name!r}: its requests could not be built here ({task['error']})")
            continue
        widths = request_forwards(tokenizer, task["output_type"], task["requests"], max_length)
        if widths is None:
            skipped.append(f"lm-eval task {name!r} ({task['output_type']}): its forwards depend on the generated "
                           "lengths, not known without the model")
            continue
        counted[name] = len(widths)
        for width in widths:
            for _ in range(2):  # before and after healing
                add_forward(phase, shape, kept, 1, width)
    phase["tasks"] = {"forwards": counted, "runs": 2, "block_passes": phase["block_passes"] - before[0],
                      "head_passes": phase["head_passes"] - before[1]}
    if counted:
        phase["note"] += f"; lm-eval forwards at most {counted} per run, before and after healing"
