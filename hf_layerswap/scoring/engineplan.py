"""The scoring engine's public plan: what one run of :func:`~hf_layerswap.scoring.plan_kl`
will do, batch by batch, known before it runs (:meth:`~hf_layerswap.scoring.engine.Engine.plan`).

The engine executes this plan (the same batches, the same slot-major passes and probe
groups, the same head/KL flushes), so its counters equal the plan's numbers: block
evaluations, block loads (``movement["block_onloads"]``), head calls and rows. The cost
model (:func:`hf_layerswap.cost.estimate_cost`) reads it and nothing else of the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .slotmajor import STATE_BUDGET_FRACTION

__all__ = ["BatchPlan", "EnginePlan"]


@dataclass(frozen=True)
class BatchPlan:
    """One calibration batch of the plan.

    Attributes:
        index: the batch's index (prompts ``index * batch_size`` on).
        prompts, width: B and T (trailing padding columns trimmed).
        real_positions: R, the batch's real (unpadded) positions.
        reference: whether the batch's identity (reference) pass runs (False: a kept
            reference serves it).
        probe_groups: probes per slot-major pass (``()`` depth-first).
        flush_groups: probes per head/KL flush.
        block_evaluations: decoder-block calls (one block over the batch), reference included.
        block_loads: offloaded blocks brought to the execution device.
        head_calls: output-head calls (one position chunk, the whole vocabulary or one slice).
        head_rows: positions through the head (rows x calls over the whole vocabulary).
    """

    index: int
    prompts: int
    width: int
    real_positions: int
    reference: bool
    probe_groups: tuple[int, ...]
    flush_groups: tuple[int, ...]
    block_evaluations: int
    block_loads: int
    head_calls: int
    head_rows: int

    @property
    def positions(self) -> int:
        """B x T."""
        return self.prompts * self.width


@dataclass(frozen=True)
class EnginePlan:
    """What one engine run does, batch by batch (:meth:`Engine.plan
    <hf_layerswap.scoring.engine.Engine.plan>`).

    Attributes:
        batch_size: prompts per batch.
        num_blocks: L; hidden: H; vocab: V; element_bytes: bytes per element of the
            compute dtype.
        probes: distinct probes this process runs (the identity aside).
        prefix_reuse: the depth-first mode (``"shared"``, ``"start"``, ``"none"``).
        stream_logits: the head/KL phase runs on the decoder's final rows (False: the
            model's own logits).
        slot_major: the batches run slot-major (:mod:`~hf_layerswap.scoring.slotmajor`).
        offloaded_blocks: blocks counted as moved.
        kl_chunk, vocab_chunk: positions and vocabulary entries per head/KL block.
        kl_block_bytes: bytes of one fp32 row block of the KL (:func:`~.settings.kl_block_bytes`).
        max_memory: the engine's working-memory budget (bytes).
        slice_bytes: what the budget leaves after a batch's activations and the head's fixed
            working piece, shared by the head/KL block, the KL's temporaries and the held
            final rows (:func:`~.settings.slice_budget`).
        activation_bytes: activations of one batch of ``batch_size`` prompts (bytes).
        flush_bytes: bytes the final rows held before a head/KL flush may take.
        head_working_bytes: what the head's GEMM holds beside its logits (bytes).
        head_check_calls: head calls of the one-time check of the output head.
        batches: one :class:`BatchPlan` per batch.
    """

    batch_size: int
    num_blocks: int
    hidden: int
    vocab: int
    element_bytes: int
    probes: int
    prefix_reuse: str
    stream_logits: bool
    slot_major: bool
    offloaded_blocks: int
    kl_chunk: int
    vocab_chunk: int
    kl_block_bytes: int
    max_memory: int
    slice_bytes: int
    activation_bytes: int
    flush_bytes: int
    head_working_bytes: int
    head_check_calls: int
    batches: tuple[BatchPlan, ...]

    def flush_size(self, real_rows: int) -> int:
        """Probes whose final rows (``real_rows`` x H each) are held before their head/KL
        phase runs: ``flush_bytes // (real_rows H e)``, at least 1."""
        return max(1, self.flush_bytes // max(1, real_rows * self.hidden * self.element_bytes))

    def state_capacity(self, positions: int) -> int:
        """``(B, T, H)`` states of a batch of ``positions`` (B T) positions a slot-major
        pass may hold (:func:`~hf_layerswap.scoring.slotmajor.state_capacity`)."""
        return max(1, int(STATE_BUDGET_FRACTION * self.max_memory) // max(1, positions * self.hidden * self.element_bytes))

    def head_work(self, real_rows: int, probes: int, *, reference: bool = True) -> tuple[int, int]:
        """``(head calls, head rows)`` of one batch's head/KL phase with ``probes`` probes
        on ``real_rows`` real positions: streamed, per flush group the reference and each
        probe per position chunk and vocabulary slice; else the model's own logits, one
        call per forward (the reference's only when it runs)."""
        if not self.stream_logits:
            calls = int(reference) + probes
            return calls, calls * real_rows
        chunks = math.ceil(real_rows / self.kl_chunk)
        slices = math.ceil(self.vocab / self.vocab_chunk)
        groups = math.ceil(probes / self.flush_size(real_rows)) if probes else 0
        return chunks * slices * (groups + probes), real_rows * (groups + probes)

    @property
    def block_evaluations(self) -> int:
        return sum(b.block_evaluations for b in self.batches)

    @property
    def block_loads(self) -> int:
        """Offloaded blocks moved in the whole run (the report's ``movement["block_onloads"]``)."""
        return sum(b.block_loads for b in self.batches)

    @property
    def head_calls(self) -> int:
        """Head calls of the run, the one-time head check included."""
        return sum(b.head_calls for b in self.batches) + self.head_check_calls

    @property
    def head_rows(self) -> int:
        return sum(b.head_rows for b in self.batches)

    @property
    def block_tokens(self) -> int:
        """Positions through decoder blocks: B T per block evaluation."""
        return sum(b.positions * b.block_evaluations for b in self.batches)

    @property
    def reference_passes(self) -> int:
        return sum(b.reference for b in self.batches)
