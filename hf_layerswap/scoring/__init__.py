"""Swap-KL probes over a calibration set (No Free Swap, arXiv 2605.16234).

Every probe is a layer plan (:mod:`hf_layerswap.layerplan`) run through the model's own
forward with ``use_cache=False``. The engine (:func:`plan_kl`) does only the work each
probe needs:

- **Prefix reuse.** For each calibration batch the identity plan runs once; it yields the
  reference next-token distribution and the residual stream entering every slot a probe
  starts at. A probe whose plan first differs from identity at slot s starts from the
  cached stream entering s. Probes that start at the same slot and run the same blocks
  first (for an adjacent pair (i, i+1): replacement i<-i+1 and the interchange both run
  block i+1 at slot i) share that computation too: their plans form a prefix tree, and
  the stream at each branch point is captured during the first probe that passes it and
  injected into the others. All of it goes through the model's own forward
  (:func:`~hf_layerswap.layerplan.apply_plan` with a one-shot input hook), for every
  architecture the plan module supports.
- **Streamed KL.** Probes stop at the decoder output (the normalised final hidden state)
  and only real (non-pad) positions are kept. The output head then runs on blocks of
  ``kl_chunk`` positions x ``vocab_chunk`` vocabulary entries (a slice of the head's
  weight rows). The phase runs slice by slice (each slice of the head taken once for all
  positions and probes; the whole vocabulary, when it fits, is one slice) and
  KL(p_M || p_probe) is accumulated per position in one pass with an online log-sum-exp
  (the reference's running maximum rescales the sums so far, :class:`.kl.OnlineKL`):

      KL = sum_v p_v (z_ref,v - z_v) - lse(z_ref) + lse(z),   p = softmax(z_ref)

  (an exact rearrangement of sum_v p_v (log p_v - log q_v), summed in float64: the KL of
  the fp32 logits to float64 rounding, where an fp32 ``log_softmax`` rounds KLs of 1e-3
  nats by up to ~1e-4 relative). It is the one arithmetic for every head the engine runs,
  so a value does not depend on the head's placement (in memory or offloaded), the budget
  or the slicing beyond float64 rounding (about 1e-12 relative). ``stream_logits=False``
  takes the model's own logits through :func:`masked_kl` (fp32 ``log_softmax``) instead.
  Neither logits nor log-probs are
  ever held for a whole batch, let alone the calibration set: peak memory is
  ``O(kl_chunk * vocab_chunk)`` plus the residual streams of one batch, while the head
  GEMM keeps a large row count. An accelerate-offloaded head (CPU or disk offload) is
  read from the offload one vocabulary slice at a time, never whole (at least 16 slices;
  :class:`~hf_layerswap.utils.devices.OffloadedTensor`), and an offloaded input embedding reads
  only the rows of the batch's ids (:func:`~hf_layerswap.utils.devices.sliced_calls`). Heads
  that cannot be sliced (quantized, custom) run whole, on fewer positions per block.
- **Memory budget.** ``max_memory`` (bytes or ``"1.5GB"``; default ``"auto"``: a share of
  the device's free memory, capped at 1 GiB on a CPU and 8 GiB on an accelerator) sizes
  the vocabulary slice (or the position chunk), how many probes' final hidden states are
  held before their heads run, the KL's row blocks on an accelerator, and (with
  ``batch_size="auto"``, or ``None`` on an accelerator) the batch.
- **Reduced precision.** ``dtype=torch.bfloat16`` (or float16) runs the model under
  ``torch.autocast``; the output head runs in fp32 and the KL in float64 (fp32
  ``log_softmax`` with ``stream_logits=False``). The weights are never cast.
- **Resumable.** ``checkpoint_path`` keeps completed (batch, probe) values in a folder,
  each part written atomically; a rerun with the same model, calibration and settings
  skips them and ends with the same numbers, bit for bit.
- **Scale-out.** Models dispatched by accelerate (``device_map``, CPU/disk offload) run
  as they are. Under ``accelerate launch`` (or ``torchrun``) every process, holding one
  whole model replica, takes a disjoint share of the probes and the values are gathered
  (accelerate's ``PartialState``, ``split_between_processes``, ``gather_object``); the
  result equals one process's bit for bit. A model sharded over the processes (tensor
  parallel, FSDP, ZeRO-3) is refused before any forward pass (:mod:`.processes`).
- **Streaming offloaded models.** When accelerate offloads the decoder blocks (CPU or
  disk), every probe of a batch is advanced slot by slot and each block is read once per
  batch and probe group instead of at every call (:mod:`.slotmajor`), the next block read
  ahead from pinned memory on CUDA; the values are the same. The
  report's metadata records how the head was taken (``head_streaming``), the blocks and
  bytes moved and the bytes of the head and embedding read (``movement``; under several
  processes the sum over them, each one's own under ``per_process``) and the peak memory
  per device (``peak_memory``).
- **Adaptive budget.** :class:`AdaptiveBudget` adds prompts in rounds until the set
  selected at a budget is stable under paired standard errors.

Which probes a pair gets is the protocol registry's (:mod:`hf_layerswap.scoring.protocols`,
:func:`register_protocol`): the paper's replacement and interchange are built in.

Layout: :mod:`.layerscores` (the public verbs), :mod:`.engine` (:func:`plan_kl` and the engine
state), :mod:`.engineplan` (the engine's public schedule, ``Engine.plan()``), :mod:`.settings` (:class:`EngineSettings`, the validated settings every verb
hands the engine), :mod:`.streamed` (the head/KL phase on blocks of positions x
vocabulary), :mod:`.kl` (pure KL maths), :mod:`.head` (model plumbing, the output head),
:mod:`.probes` (probe deduplication, order, each process's share), :mod:`.slotmajor`
(slot-major streaming of offloaded blocks), :mod:`.checkpoint`
(resumable runs), :mod:`.processes` (launched processes, sharded-model refusal),
:mod:`.protocols` (the swap-protocol registry), :mod:`.report` (:class:`SwapReport`, the results,
and :class:`PruneProvenance`, a removal step's record), :mod:`.rule` (the paper's greedy rule and
the budget checks every strategy shares).
"""

from __future__ import annotations

from .checkpoint import CHECKPOINT_FORMAT, CheckpointMismatchError, ScoringCheckpoint  # noqa: F401
from .engine import HEAD_BUDGET_FRACTION, MAX_KL_CHUNK, MIN_WHOLE_VOCAB_CHUNK, plan_kl  # noqa: F401
from .settings import DEFAULT_MAX_MEMORY, PREFIX_REUSE_MODES, EngineSettings, parse_memory  # noqa: F401
from .head import Head  # noqa: F401
from .kl import KL_CHUNK_POSITIONS, kl_rows, masked_kl, row_blocks  # noqa: F401
from .probes import make_probes, schedule, shard  # noqa: F401
from .layerscores import (  # noqa: F401
    AdaptiveBudget,
    removal_kl,
    score_layers,
    selection_stability,
    swap_plans,
)

__all__ = [
    "AdaptiveBudget",
    "CheckpointMismatchError",
    "EngineSettings",
    "masked_kl",
    "plan_kl",
    "removal_kl",
    "score_layers",
    "selection_stability",
    "swap_plans",
]
