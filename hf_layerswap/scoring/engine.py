"""One module on purpose: both batch paths (depth-first and slot-major) share the engine's
state (budget, reference, head/KL flush, checkpoint, counters, progress bar), which one
class keeps in one place; the per-batch reference cache lives in :mod:`.reference`.

The scoring engine: :func:`plan_kl` runs a set of layer plans over a calibration set
with prefix reuse, streamed KL under a memory budget, optional reduced precision,
checkpointing and the probes partitioned over launched processes (see
:mod:`hf_layerswap.scoring` for what each does).
``Engine`` is one state object (reference pass, prefix tree of probes, memory budget,
checkpoint and ranks) whose passes share that state. Its settings arrive as one
:class:`~hf_layerswap.scoring.settings.EngineSettings`; its building blocks live next
door (:mod:`.settings`, :mod:`.streamed` for the head/KL blocks, :mod:`.kl`, :mod:`.head`,
:mod:`.probes`, :mod:`.checkpoint`, :mod:`.slotmajor` for offloaded blocks), each
importable from its own module.

A batch runs depth-first (probe after probe, prefix reuse) or, when the decoder blocks are
offloaded, slot-major (:mod:`.slotmajor`: every probe advanced slot by slot, each block
moved once per batch and probe group); the head/KL phase, the budget, the checkpoint and
the counters are the same for both. :meth:`Engine.plan` gives the whole schedule before it
runs (:class:`~.engineplan.EnginePlan`: batches, probe groups, head/KL flushes, block
evaluations and loads), built by the same methods the run executes. The summary records the blocks moved (``movement``) and the peak memory
per device (``peak_memory``).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..calibration import CalibrationSet, check_positions, check_token_ids
from ..utils.devices import BlockPrefetcher, execution_device, offloaded_bytes, peak_memory, sliced_calls
from ..layerplan import StopForward, apply_plan, decoder_blocks, model_fingerprint, num_blocks, uncompiled
from ..utils.provenance import library_versions, report_identity
from .checkpoint import ScoringCheckpoint, plans_digest
from .head import decoder_output, Head, hooks_removed, maybe_autocast, param_dtype, text_config
from .kl import chunk_bounds, KL_CHUNK_POSITIONS, masked_kl
from .probes import make_probes, position_hooks, Probe, schedule, schedule_blocks, shard, walk_schedule
from .processes import check_model_replica, Processes, sum_movement
from .engineplan import BatchPlan, EnginePlan
from .reference import ReferenceCache
from .settings import batch_activation_bytes, dtype_name, EngineSettings, kl_block_bytes, slice_budget
from .slotmajor import (blocks_offloaded, capture_block_inputs, final_norm, movable_blocks, PassPlan, plan_pass,
                        probe_groups, run_pass, state_capacity)
from .streamed import StreamedKL

__all__ = ["Engine", "FLUSH_BUDGET_FRACTION", "HEAD_BUDGET_FRACTION", "head_blocks", "head_fixed_bytes", "KL_BLOCK_ENTRY_BYTES", "MAX_KL_CHUNK", "MIN_WHOLE_VOCAB_CHUNK", "plan_engine",
           "plan_kl", "run_plans"]

#: Share of the slice budget (:func:`~.settings.slice_budget`: what ``max_memory`` leaves after
#: a batch's activations) the final rows held before a head/KL flush may take.
FLUSH_BUDGET_FRACTION = 0.25

#: Largest head chunk (positions per output-head GEMM); larger ones gain nothing.
MAX_KL_CHUNK = 1024

#: Share of the slice budget (:func:`~.settings.slice_budget`) a head/KL block (fp32 logits,
#: float64 reference weights) may take; the KL's float64 temporaries take 0.25 of it, the held
#: final rows of probe groups 0.25 (``FLUSH_BUDGET_FRACTION``), and 0.1 is left for the KL's
#: per-row state (``SLICE_SLACK``).
HEAD_BUDGET_FRACTION = 0.4

#: Fewest positions per head/KL block for which the whole vocabulary is kept in one slice
#: when the default block does not fit the budget (one head GEMM per block); below it the
#: vocabulary is sliced. Either way the KL is the same (:class:`.kl.OnlineKL`).
MIN_WHOLE_VOCAB_CHUNK = 128

#: Bytes per position and vocabulary entry of a head/KL block (:class:`.kl.OnlineKL`): the
#: reference's float64 weights exp(z - m) (8) and one fp32 logit block (4), whole
#: vocabulary or slice.
KL_BLOCK_ENTRY_BYTES = 12

#: Fewest vocabulary slices of a streamed (offloaded) head: at most ``1 / STREAMED_HEAD_SLICES``
#: of its weight is read and resident at a time.
STREAMED_HEAD_SLICES = 16


def head_fixed_bytes(head: Head) -> int:
    """The most the output head's GEMM holds beside its logits (:meth:`.head.Head.working_bytes`
    at the widest slice a head/KL block may take: the whole vocabulary, or an offloaded head's
    ``1 / STREAMED_HEAD_SLICES``); 0 for a head without a weight."""
    if getattr(head.module, "weight", None) is None:
        return 0
    vocab = head.vocab
    return head.working_bytes(math.ceil(vocab / STREAMED_HEAD_SLICES) if head.streamed else vocab)


def head_blocks(head: Head, head_budget: int, rows: int, *, kl_chunk: int | None = None,
                vocab_chunk: int | None = None, entry_bytes: int = KL_BLOCK_ENTRY_BYTES) -> tuple[int, int]:
    """(positions, vocabulary entries) per block of output-head work, kept under ``head_budget``
    bytes at ``entry_bytes`` (default :data:`KL_BLOCK_ENTRY_BYTES`, 12) per position and
    entry, the whole vocabulary or a slice of it: the one slicing of the head that the
    scoring engine's KL and the selection's NLL (:func:`~hf_layerswap.selection.nll.plan_nll`)
    share. ``rows``: the positions wanted per block (``kl_chunk`` when given, which is then
    kept). A streamed (offloaded) head is always sliced, in at least
    :data:`STREAMED_HEAD_SLICES` slices (its weight read once per slice per head phase); a
    head in memory keeps the whole vocabulary while ``rows`` fit, else takes fewer positions
    (at least :data:`MIN_WHOLE_VOCAB_CHUNK`) or slices the vocabulary. A head that is no
    plain ``nn.Linear`` in memory runs whole (fewer positions per block instead).

    Raises:
        ValueError: a ``vocab_chunk`` below the vocabulary for a head that runs whole.
    """
    vocab = head.vocab
    if head.sliceable:
        if vocab_chunk is None:
            fit = head_budget // (entry_bytes * vocab)  # positions whose whole-vocabulary block fits
            if head.streamed:  # never the whole head at once: slices under the budget and 1/16
                width = min(max(1, head_budget // (entry_bytes * rows)), math.ceil(vocab / STREAMED_HEAD_SLICES))
                vocab_chunk = math.ceil(vocab / math.ceil(vocab / width))
            elif entry_bytes * rows * vocab <= head_budget:
                vocab_chunk = vocab
            elif kl_chunk is None and fit >= MIN_WHOLE_VOCAB_CHUNK:
                # fewer positions, whole vocabulary: one head GEMM per block instead of one per slice
                rows, vocab_chunk = fit, vocab
            else:
                width = max(1, head_budget // (entry_bytes * rows))
                vocab_chunk = math.ceil(vocab / math.ceil(vocab / width))
        return rows, min(vocab, vocab_chunk)
    if vocab_chunk is not None and vocab_chunk < vocab:
        raise ValueError(
            f"vocab_chunk={vocab_chunk} needs a plain nn.Linear output head with its weight in memory; "
            f"this model's head ({type(head.module).__name__}) runs whole"
        )
    if kl_chunk is None:  # the whole vocabulary at once: fewer positions per block
        rows = max(1, min(rows, head_budget // (entry_bytes * vocab)))
    return rows, vocab


class Engine:
    """Per-batch probe execution with prefix reuse, streamed KL, budget and checkpoints."""

    def __init__(
        self,
        model: nn.Module,
        calibration: CalibrationSet,
        plans: Mapping[Any, Sequence[int]],
        settings: EngineSettings,
        reference_cache: ReferenceCache | None = None,
    ):
        model = uncompiled(model)
        self.reference_cache = reference_cache
        check_model_replica(model)  # before any forward pass
        self.model = model
        self.calib = calibration
        self.num_blocks = num_blocks(model)
        self.key_of, self.probes, self.zero = make_probes(plans, self.num_blocks)
        self.mode = str(settings.prefix_reuse)  # a mode name: EngineSettings normalised it
        self.stream_logits = settings.stream_logits
        self.fallback_reason = None
        self.processes = Processes(settings.distributed)
        self.rank, self.world = self.processes.rank, self.processes.world
        self.param_dtype = param_dtype(model)
        self.autocast = settings.autocast_dtype(self.param_dtype)
        self.compute_dtype = self.autocast or self.param_dtype
        self.input_device = execution_device(model.get_input_embeddings())
        self.budget, self.budget_source = settings.memory_for(model)  # every device the model computes on
        check_token_ids(calibration.input_ids, model, "calibration input_ids")
        length = calibration.input_ids.shape[-1]
        check_positions(model, length, f"a calibration prompt of {length} tokens", "lower seq_len (tokens per prompt)")
        self.head = Head(model)
        owner, _, _ = decoder_blocks(model)
        self.decoder = owner if owner is not model else None
        if self.decoder is None or self.head.module is None:
            self.stream_logits = False
            self.fallback_reason = "no separate decoder module and output head to stop between"
        cfg = text_config(model)
        self.hidden = int(getattr(cfg, "hidden_size", 0) or 0)
        self.my_probes = self.processes.share(shard, list(self.probes.values()))
        self._init_movement(settings.slot_major)  # the held streams or states depend on it
        self.stats = {"block_evaluations": 0, "model_calls": 0, "head_rows": 0, "reference_passes": 0}
        self._size(settings)
        self.progress = settings.progress and self.rank == 0
        self.desc = settings.desc
        self.done: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self.checkpoint = None
        self.resumed = 0
        if settings.checkpoint_path is not None:
            self.checkpoint = ScoringCheckpoint(
                settings.checkpoint_path, self.fingerprint(), is_main=self.rank == 0, barrier=self._barrier
            )
            self.done = self.checkpoint.load()
            self.resumed = len(self.done)
        self.computed: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
        self.seconds = 0.0
        self.verified_head = False

    def _size(self, settings: EngineSettings) -> None:
        """The batch size, the slice budget (what the budget leaves after a batch's
        activations, :meth:`_activation_bytes`, and the head's fixed piece), the head/KL
        blocks and the KL's row blocks under it, and the batches."""
        cfg = text_config(self.model)
        self.batch_size = self._batch_size(settings.batch_size_for(self.input_device), cfg)
        self.slice_budget = slice_budget(self.budget, self._activation_bytes(self.batch_size, cfg), self._head_fixed_bytes())
        self.kl_chunk, self.vocab_chunk = self._kl_chunks(settings.kl_chunk, settings.vocab_chunk)
        self.kl_block_bytes = kl_block_bytes(self.input_device, self.slice_budget)
        self.kl = StreamedKL(self.head, self.kl_chunk, self.vocab_chunk, self.autocast, self.input_device.type,
                              self.stats, self.kl_block_bytes)
        self.batches = list(range(math.ceil(self.calib.num_prompts / self.batch_size)))

    def _init_movement(self, slot_major: bool | None) -> None:
        """Slot-major streaming (:mod:`.slotmajor`) or depth-first, and the counters of
        the blocks moved."""
        _, _, blocks = decoder_blocks(self.model)
        self.movable = movable_blocks(blocks)
        self.norm = final_norm(self.model)
        self.slot_major_setting = slot_major
        self.slot_major = blocks_offloaded(self.model) if slot_major is None else bool(slot_major)
        self.slot_major_note = None
        why = ("the model's logits are not streamed (stream_logits=False or no separate head)"
               if not self.stream_logits else None if self.norm is not None else
               "the decoder has no final norm under a known name")
        if self.slot_major and why:
            if slot_major:
                raise ValueError(f"slot_major=True: {why}; leave slot_major=None")
            self.slot_major, self.slot_major_note = False, f"depth-first: {why}"
        self.moved = {"block_onloads": 0, "bytes_moved": 0, "head_bytes_moved": 0, "embedding_bytes_moved": 0}
        self.onloads_per_batch: list[int] = []

    # -- sizing -----------------------------------------------------------------------
    def _activation_bytes(self, bsz: int, cfg) -> int:
        """What a batch of ``bsz`` prompts holds besides the sliced head/KL work: the streams
        entering every block and one block's forward (:func:`~.settings.batch_activation_bytes`);
        slot-major (:mod:`.slotmajor`) the states a pass holds instead of those streams (its
        :data:`~.slotmajor.STATE_BUDGET_FRACTION` of the budget, at most what one pass over
        every probe holds: :meth:`_pass_states`) and the stream entering slot 0; the whole
        logits where they are not streamed."""
        seq = self.calib.seq_len
        es = torch.finfo(self.compute_dtype).bits // 8
        held = batch_activation_bytes(cfg, self.num_blocks, bsz, seq, es)
        if self.slot_major:
            held += (1 + self._pass_states(bsz) - (self.num_blocks + 1)) * bsz * seq * self.hidden * es
        logits = 0 if self.stream_logits else 3 * bsz * seq * self.head.vocab * 4
        return held + logits

    def _pass_states(self, bsz: int) -> int:
        """States of ``(bsz, T, H)`` a slot-major pass holds at most: the capacity of
        :func:`~.slotmajor.state_capacity` under the budget, or fewer where one pass over
        every probe and the reference holds fewer (:attr:`~.slotmajor.PassPlan.peak_states`)."""
        if "_all_probe_states" not in self.__dict__:
            self._all_probe_states = plan_pass([p.key for p in self.my_probes], self.num_blocks,
                                               reference=True).peak_states
        shape = (bsz, self.calib.seq_len, self.hidden)
        return min(state_capacity(shape, self.compute_dtype, self.budget), self._all_probe_states)

    def _head_fixed_bytes(self) -> int:
        """The head's fixed working piece (:func:`head_fixed_bytes`); 0 where the logits are not streamed."""
        return head_fixed_bytes(self.head) if self.stream_logits else 0

    def _batch_size(self, batch_size, cfg) -> int:
        if batch_size != "auto":
            return batch_size
        cap = min(64, self.calib.num_prompts)
        best = 1
        for b in range(1, cap + 1):
            if self._activation_bytes(b, cfg) <= self.budget // 2:
                best = b
        return best

    def _kl_chunks(self, kl_chunk, vocab_chunk) -> tuple[int, int]:
        """(positions, vocabulary entries) per head/KL block (:func:`head_blocks` under
        :data:`HEAD_BUDGET_FRACTION` of the slice budget, from ``kl_chunk`` positions or a
        batch's, at most :data:`MAX_KL_CHUNK`)."""
        rows = kl_chunk or min(MAX_KL_CHUNK, self.batch_size * self.calib.seq_len)
        return head_blocks(self.head, int(HEAD_BUDGET_FRACTION * self.slice_budget), rows, kl_chunk=kl_chunk,
                           vocab_chunk=vocab_chunk)

    def flush_size(self, real_rows: int) -> int:
        """Probes whose final rows (``real_rows`` x H each, compute dtype) are held before
        their head/KL phase runs: a quarter of the slice budget (``FLUSH_BUDGET_FRACTION``), at
        least 1 (:meth:`.engineplan.EnginePlan.flush_size`)."""
        es = torch.finfo(self.compute_dtype).bits // 8
        per_probe = max(1, real_rows * self.hidden * es)
        return max(1, int(FLUSH_BUDGET_FRACTION * self.slice_budget) // per_probe)

    # -- the plan -----------------------------------------------------------------------
    def plan(self, streamed: bool | None = None) -> EnginePlan:
        """What :meth:`run_batches` over every batch will do, as an :class:`EnginePlan`:
        per batch its reference pass (or the kept reference of the engine's
        :class:`~hf_layerswap.scoring.reference.ReferenceCache`, as it is now and as the
        run fills it, batch by batch), its slot-major passes and probe groups
        (:meth:`_passes`, the ones the run executes) or depth-first schedule, its block
        evaluations and loads, its head/KL flushes and head calls. Nothing runs.

        Args:
            streamed: ``None`` (default): the model as it is (its offloaded blocks move);
                ``True``: plan as if every block were offloaded (a model on the meta device
                whose weights will stream from CPU memory or disk), slot-major where the
                engine can stream; ``False``: nothing moves.

        Returns:
            the :class:`EnginePlan`; its ``block_loads`` equal the run's
            ``movement["block_onloads"]`` and its ``block_evaluations`` the run's.
        """
        every = frozenset(range(self.num_blocks))
        offloaded = self.movable if streamed is None else (self.movable or every) if streamed else frozenset()
        slot_major = self.slot_major
        if streamed and not slot_major and self.slot_major_setting is None and self.slot_major_note is None:
            slot_major = True
        probes = self.my_probes
        cache = self.reference_cache
        held = cache.bytes if cache is not None else 0
        slices = math.ceil(self.head.vocab / self.vocab_chunk)
        batches = []
        for b in self.batches:
            ids, mask = self._batch(b)
            rows = int(mask.sum())
            hit = cache is not None and self._reference_key(b) in cache.entries
            keep = not hit and cache is not None and held + self._reference_entry_bytes(b) <= cache.max_bytes
            held += self._reference_entry_bytes(b) if keep else 0
            if slot_major:
                passes = self._passes(b, probes, hit=hit, cached=keep, offloaded=offloaded)
                evaluations = sum(p.block_evaluations for p, _ in passes)
                loads = sum(p.onloads for p, _ in passes)
                groups = tuple(len(g) for _, g in passes)
            else:
                calls = [] if hit else list(range(self.num_blocks))
                for probe, depth0, _ in schedule(probes, self.mode):
                    calls += probe.key if self.mode == "none" else probe.key[probe.start + depth0:]
                evaluations, loads, groups = len(calls), sum(1 for c in calls if c in offloaded), ()
            per = self.flush_size(rows) if self.stream_logits else max(1, len(probes))
            flushes = tuple(min(per, len(probes) - k) for k in range(0, len(probes), per))
            head_calls, head_rows = self.kl_plan.head_work(rows, len(probes), reference=not hit)
            batches.append(BatchPlan(b, ids.shape[0], ids.shape[1], rows, not hit, groups, flushes, evaluations,
                                     loads, head_calls, head_rows))
        checked = cache is not None and cache.head_check is not None and not slot_major
        head = self.head.module
        cfg = text_config(self.model)
        return EnginePlan(
            batch_size=self.batch_size, num_blocks=self.num_blocks, hidden=self.hidden, vocab=self.head.vocab,
            element_bytes=torch.finfo(self.compute_dtype).bits // 8, probes=len(probes), prefix_reuse=self.mode,
            stream_logits=self.stream_logits, slot_major=slot_major, offloaded_blocks=len(offloaded),
            kl_chunk=self.kl_chunk, vocab_chunk=self.vocab_chunk, kl_block_bytes=self.kl_block_bytes,
            max_memory=self.budget, slice_bytes=self.slice_budget,
            activation_bytes=self._activation_bytes(self.batch_size, cfg),
            flush_bytes=int(FLUSH_BUDGET_FRACTION * self.slice_budget),
            head_working_bytes=self.head.working_bytes(self.vocab_chunk) if getattr(head, "weight", None) is not None else 0,
            head_check_calls=(1 + slices) if self.stream_logits and not self.verified_head and not checked else 0,
            batches=tuple(batches),
        )

    @property
    def kl_plan(self) -> EnginePlan:
        """The plan's settings without its batches (for :meth:`EnginePlan.head_work`)."""
        return EnginePlan(
            batch_size=self.batch_size, num_blocks=self.num_blocks, hidden=self.hidden, vocab=self.head.vocab,
            element_bytes=torch.finfo(self.compute_dtype).bits // 8, probes=len(self.my_probes), prefix_reuse=self.mode,
            stream_logits=self.stream_logits, slot_major=self.slot_major, offloaded_blocks=len(self.movable),
            kl_chunk=self.kl_chunk, vocab_chunk=self.vocab_chunk, kl_block_bytes=self.kl_block_bytes,
            max_memory=self.budget, slice_bytes=self.slice_budget, activation_bytes=0,
            flush_bytes=int(FLUSH_BUDGET_FRACTION * self.slice_budget),
            head_working_bytes=0, head_check_calls=0, batches=())

    # -- provenance -----------------------------------------------------------------
    def settings(self) -> dict:
        return {
            "batch_size": self.batch_size,
            "compute_dtype": dtype_name(self.compute_dtype),
            "autocast": self.autocast is not None,
            "softmax_dtype": "float64" if self.stream_logits else "float32",
            "stream_logits": self.stream_logits,
            "kl_chunk_positions": self.kl_chunk if self.stream_logits else KL_CHUNK_POSITIONS,
            "kl_chunk_vocab": self.vocab_chunk if self.stream_logits else self.head.vocab,
            "kl_streaming": self.kl_streaming,
        }

    @property
    def head_streaming(self) -> str:
        """How the output head's weight is taken: in memory, or (offloaded) read from the
        offload in vocabulary slices."""
        if not self.head.streamed:
            return "in memory"
        return (f"vocabulary slices of {self.vocab_chunk} entries read from the offload "
                f"({math.ceil(self.head.vocab / self.vocab_chunk)} per head phase)")

    @property
    def kl_streaming(self) -> str:
        if not self.stream_logits:
            return "model logits (B, T, V), positions in chunks"
        if self.vocab_chunk >= self.head.vocab:
            return "position chunks, whole vocabulary, float64 online log-sum-exp (one pass)"
        return "vocabulary slices x position chunks, float64 online log-sum-exp (one pass)"

    def fingerprint(self) -> dict:
        return {
            "model": {
                "class": type(self.model).__name__,
                "num_blocks": self.num_blocks,
                "fingerprint": model_fingerprint(self.model),
            },
            "calibration": {
                "content_hash": self.calib.content_hash,
                "num_prompts": self.calib.num_prompts,
                "seq_len": self.calib.seq_len,
            },
            "probes": {"count": len(self.probes), "plans_sha256": plans_digest(self.probes)},
            "settings": self.settings(),
            "libraries": {"torch": torch.__version__, "transformers": library_versions()["transformers"]},
            "info": {"model": report_identity(self.model), "calibration": self.calib.description},
        }

    def _barrier(self):
        self.processes.barrier()

    def _autocast(self):
        return maybe_autocast(self.input_device.type, self.autocast)

    # -- passes -------------------------------------------------------------------------
    def _reference_pass(self, ids, mask, slots: set[int], rows: torch.Tensor):
        """Identity forward: streams entering ``slots`` and the final hidden state (or the
        reference log-probs when not streaming)."""
        _, _, blocks = decoder_blocks(self.model)
        streams: dict[int, torch.Tensor] = {}
        final: dict[str, torch.Tensor] = {}
        handles = []
        verify = self.stream_logits and not self.verified_head

        def pre_hook(slot):
            def hook(module, args, kwargs):
                streams[slot] = (args[0] if args else kwargs["hidden_states"]).detach()

            return hook

        for s in sorted(slots):
            handles.append(blocks[s].register_forward_pre_hook(pre_hook(s), with_kwargs=True))
        if self.stream_logits:

            def dec_hook(module, args, output):
                final["hidden"] = decoder_output(output).detach()
                if not verify:
                    raise StopForward

            handles.append(self.decoder.register_forward_hook(dec_hook))
        logits = None
        with hooks_removed(handles), self._autocast():
            kwargs = {"input_ids": ids, "attention_mask": mask, "use_cache": False}
            try:
                if verify:
                    try:
                        logits = self.model(**kwargs, logits_to_keep=1).logits
                    except TypeError:
                        logits = self.model(**kwargs).logits[:, -1:]
                else:
                    logits = self.model(**kwargs).logits
            except StopForward:
                pass
        self.stats["model_calls"] += 1
        self.stats["block_evaluations"] += self.num_blocks
        self.stats["reference_passes"] += 1
        if not self.stream_logits:
            return streams, torch.log_softmax(logits.float(), dim=-1)
        hidden = final["hidden"]
        if verify:
            self._verify_head(hidden[:, -1:], logits)
            if not self.stream_logits:  # the check failed: recompute the reference the slow way
                return self._reference_pass(ids, mask, slots, rows)
        return streams, hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows.to(hidden.device))

    def _reference(self, b: int, ids, mask, slots: set[int], rows: torch.Tensor):
        """The reference of batch ``b``: one identity pass, or the one kept by the
        :class:`~hf_layerswap.scoring.reference.ReferenceCache` given to the engine (the
        same tensors, so the same values)."""
        if self.reference_cache is None:
            return self._reference_pass(ids, mask, slots, rows)
        return self.reference_cache.engine_reference(self, b, ids, mask, slots, rows, self._reference_pass)

    def _verify_head(self, last_hidden, model_logits) -> None:
        rows = last_hidden.reshape(-1, last_hidden.shape[-1])
        bounds = chunk_bounds(self.head.vocab, self.vocab_chunk)
        ours = torch.cat([self.kl.logits(rows, v0, v1) for v0, v1 in bounds], dim=-1)
        ours = ours.reshape(*last_hidden.shape[:-1], -1)
        theirs = model_logits.float().to(ours.device)
        scale = 1.0 + float(theirs.abs().max())
        tol = 1e-4 if self.compute_dtype == torch.float32 else 2e-2
        if ours.shape != theirs.shape or float((ours - theirs).abs().max()) > tol * scale:
            self.stream_logits = False
            self.fallback_reason = (
                "the output head applied to the decoder output did not reproduce the model's logits; "
                "using the model's own full logits instead (more memory)"
            )
            warnings.warn(f"hf_layerswap scoring: {self.fallback_reason}", stacklevel=3)
        self.kl.release()
        self.verified_head = True

    def _probe_pass(self, probe: Probe, depth0: int, start_hidden, ids, mask, captures: list[int]):
        """Run ``probe`` from ``depth0`` blocks into its run; returns (final hidden or
        logits, {depth: stream entering that run position})."""
        _, _, blocks = decoder_blocks(self.model)
        slot = probe.start + depth0
        plan = list(probe.key)
        kwargs = {"start": slot, "start_hidden": start_hidden} if slot > 0 else {}
        final: dict[str, torch.Tensor] = {}
        with apply_plan(self.model, plan, **kwargs):
            captured, handles = position_hooks(blocks, probe.run, depth0, captures)
            if self.stream_logits:

                def dec_hook(module, args, output):
                    final["hidden"] = decoder_output(output).detach()
                    raise StopForward

                handles.append(self.decoder.register_forward_hook(dec_hook))
            out = None
            with hooks_removed(handles), self._autocast():
                try:
                    out = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                except StopForward:
                    pass
        self.stats["model_calls"] += 1
        self.stats["block_evaluations"] += len(probe.key) - slot
        return (final["hidden"] if self.stream_logits else out), captured

    # -- main loop ----------------------------------------------------------------------
    # -- progress, in the units of the work -------------------------------------------
    def _head_blocks(self) -> float:
        """What one output-head pass over a batch's positions costs in block passes:
        ``V * H`` multiply-adds per position against a block's parameter count (its
        multiply-adds per position, attention scores aside)."""
        if not hasattr(self, "_head_ratio"):
            _, _, blocks = decoder_blocks(self.model)
            params = sum(p.numel() for p in blocks[0].parameters())
            self._head_ratio = self.head.vocab * self.hidden / max(params, 1)
        return self._head_ratio

    def _batch_work(self, b: int, probes: Sequence[Probe]) -> float:
        """Block passes (a block over the batch; head work converted, :meth:`_head_blocks`)
        that ``probes`` and the reference pass cost on batch ``b``: what the bar counts."""
        ids, mask = self._batch(b)
        positions = ids.numel()
        cache = self.__dict__.setdefault("_blocks_of", {})
        key = tuple(p.key for p in probes)
        if self.slot_major:
            work = float(sum(p.block_evaluations for p, _ in self._passes(b, probes)))
        else:
            if key not in cache:  # the schedule is the same for every batch
                cache[key] = schedule_blocks(list(probes), self.mode)
            work = float(self.num_blocks + cache[key])
        if not self.stream_logits:
            return work + self._head_blocks() * (1 + len(probes))
        rows = int(mask.sum())
        refs = math.ceil(len(probes) / self.flush_size(rows))
        return work + self._head_blocks() * rows / positions * (refs + len(probes))

    def run_batches(self, batch_indices: Sequence[int]) -> None:
        """Compute (or take from the checkpoint) every probe of this rank on those batches.

        The progress bar counts block passes (one decoder block over one batch; output-head
        work converted by :meth:`_head_blocks`) and moves after every block's forward (a
        hook on each block while the bar is shown) and every head/KL chunk, so its rate and
        ETA follow the work actually done."""
        was_training = self.model.training
        self.model.eval()
        t0 = time.perf_counter()
        total = sum(self._batch_work(b, self.my_probes) for b in batch_indices)
        bar = _WorkBar(total, self.desc, self.progress)
        _, _, blocks = decoder_blocks(self.model)
        counting = [blk.register_forward_hook(lambda *_: bar.advance(1)) for blk in blocks] if self.progress else []
        # depth-first, every call of an offloaded block reads its weights through its hook
        counting += [blocks[b].register_forward_pre_hook(lambda *_, b=b: None if self.slot_major else self._moved(b))
                     for b in self.movable]
        self._bar = bar
        head_read = self.head.bytes_read
        try:
            # an offloaded embedding reads only the rows of the batch's ids; the model's own call of an
            # offloaded head (the first batch's check, stream_logits=False) reads it in vocabulary slices
            with (torch.no_grad(), hooks_removed(counting),
                  sliced_calls(self.model.get_input_embeddings()) as embedding,
                  sliced_calls(self.head.module if self.head.streamed else None, self.vocab_chunk) as head_call):
                for b in batch_indices:
                    self._run_batch(b, bar)
        finally:
            bar.close()
            self.moved["head_bytes_moved"] += self.head.bytes_read - head_read
            for key, source in (("embedding_bytes_moved", embedding), ("head_bytes_moved", head_call)):
                self.moved[key] += source.bytes_read if source is not None else 0
            self.model.train(was_training)
            self.seconds += time.perf_counter() - t0

    def _batch(self, b: int):
        lo = b * self.batch_size
        ids = self.calib.input_ids[lo : lo + self.batch_size]
        mask = self.calib.attention_mask[lo : lo + self.batch_size]
        width = int(mask.sum(dim=1).max())
        return ids[:, :width], mask[:, :width]

    def _batch_on_device(self, b: int):
        """Batch ``b`` on the input device: ``(ids, mask)`` ``(B, T)``, real tokens per
        prompt ``(B,)`` float64 and the flat indices of the real positions ``(R,)``."""
        ids, mask = self._batch(b)
        ids, mask = ids.to(self.input_device), mask.to(self.input_device)
        mask_cpu = mask.bool().cpu()
        return ids, mask, mask_cpu.sum(dim=1).double(), mask_cpu.reshape(-1).nonzero().squeeze(1)

    def _run_batch(self, b: int, bar) -> None:
        todo = [p for p in self.my_probes if (b, p.key) not in self.done]
        end = bar.pos + self._batch_work(b, self.my_probes)
        if not todo:
            bar.reach(end)
            return
        bar.advance(self._batch_work(b, self.my_probes) - self._batch_work(b, todo))  # resumed from the checkpoint
        before = self.moved["block_onloads"]
        if not (self.slot_major and self._stream_batch(b, todo, bar)):
            self._depth_first_batch(b, todo, bar)
        self.onloads_per_batch.append(self.moved["block_onloads"] - before)
        bar.reach(end)  # float rounding aside, this is where the batch's work took it already

    def _depth_first_batch(self, b: int, todo: list[Probe], bar) -> None:
        """The batch's probes one after another, sharing prefixes (:func:`.probes.schedule`)."""
        ids, mask, counts, rows = self._batch_on_device(b)
        bsz, seqlen = ids.shape
        prompt_of_row = rows // seqlen
        slots = {p.start for p in todo} if self.mode != "none" else set()
        slots.discard(0)
        streams, ref = self._reference(b, ids, mask, slots, rows)
        head = self._head_blocks()
        if not self.stream_logits:  # the model's own head ran inside the pass
            bar.advance(head)
        order = schedule(todo, self.mode)
        group = self.flush_size(rows.numel()) if self.stream_logits else len(order)
        pending: list[tuple[Probe, torch.Tensor]] = []
        flush = self._flusher(b, ref, prompt_of_row, counts, bsz, bar)

        def start_stream(slot):
            return streams[slot] if slot > 0 and self.mode != "none" else None

        def run(probe, depth0, start_hidden, captures):
            if self.mode == "none":
                return self._probe_pass(Probe(probe.key, 0, probe.key), 0, None, ids, mask, [])
            return self._probe_pass(probe, depth0, start_hidden, ids, mask, captures)

        for probe, out in walk_schedule(order, start_stream, run):
            if not self.stream_logits:
                bar.advance(head)
            if self.stream_logits:
                pending.append((probe, out.reshape(-1, out.shape[-1]).index_select(0, rows.to(out.device))))
            else:
                pending.append((probe, masked_kl(ref, out, mask)))
            del out
            if len(pending) >= group:
                flush(pending)
        flush(pending)

    def _flusher(self, b: int, ref, prompt_of_row, counts, bsz: int, bar):
        """``flush(pending)``: the head/KL phase of the held ``(probe, final rows or KL)``
        pairs, their values recorded (and checkpointed as one group), ``pending`` emptied."""
        head = self._head_blocks()
        ids, _ = self._batch(b)
        state = {"group": 0}

        def flush(pending: list) -> None:
            if not pending:
                return
            if self.stream_logits:
                values = self.kl.head_phase(ref, [h for _, h in pending], prompt_of_row, counts, bsz,
                                            lambda n: bar.advance(head * n / ids.numel()))
            else:
                values = [h for _, h in pending]
            keys = [p.key for p, _ in pending]
            for key, v in zip(keys, values):
                self.computed[(b, key)] = v
            if self.checkpoint is not None:
                self.checkpoint.save(b, self.rank, state["group"], keys, torch.stack(values))
            state["group"] += 1
            pending.clear()

        return flush

    # -- slot-major streaming (:mod:`.slotmajor`) ------------------------------------------
    def _passes(self, b: int, probes: Sequence[Probe], *, hit: bool = False, cached: bool = False,
                offloaded: frozenset | None = None) -> list[tuple[PassPlan, list[Probe]]]:
        """The slot-major passes of batch ``b``: ``(pass, its probe group)`` per group,
        cached by the probes, the batch's shape and the reference's state: ``hit`` (a kept
        reference serves the batch: every pass starts from its streams) or not (the first
        pass streams the reference; with ``cached`` its streams are kept and the later
        passes start from them). ``offloaded``: the blocks counted as moved (default the
        model's offloaded ones)."""
        ids, _ = self._batch(b)
        offloaded = self.movable if offloaded is None else offloaded
        key = (tuple(p.key for p in probes), tuple(ids.shape), hit, cached, offloaded)
        cache = self.__dict__.setdefault("_pass_cache", {})
        if key not in cache:
            shape = (*ids.shape, self.hidden)
            groups = probe_groups(list(probes), shape, self.compute_dtype, self.budget, self.num_blocks,
                                  reference=not hit, cached=cached or hit)
            cache[key] = [(plan_pass([p.key for p in g], self.num_blocks, reference=n == 0 and not hit,
                                     cached=hit or (cached and n > 0), offloaded=offloaded), g)
                          for n, g in enumerate(groups)]
        return cache[key]

    def _reference_key(self, b: int) -> tuple:
        """The batch's key in the :class:`~hf_layerswap.scoring.reference.ReferenceCache`
        (the depth-first reference's key: both keep the same tensors)."""
        return ReferenceCache.engine_key(self, b)

    def _reference_entry_bytes(self, b: int) -> int:
        """Bytes a kept reference of batch ``b`` takes: the streams entering blocks
        1..L-1 ``(B, T, H)`` in the compute dtype, and the final rows ``(R, H)`` (streamed
        KL) or the fp32 log-probabilities ``(B, T, V)``."""
        ids, mask = self._batch(b)
        es = torch.finfo(self.compute_dtype).bits // 8
        ref = int(mask.sum()) * self.hidden * es if self.stream_logits else ids.numel() * self.head.vocab * 4
        return (self.num_blocks - 1) * ids.numel() * self.hidden * es + ref

    def _moved(self, block: int, nbytes: int | None = None) -> None:
        self.moved["block_onloads"] += 1
        self.moved["bytes_moved"] += self._block_bytes(block) if nbytes is None else nbytes
        bar = getattr(self, "_bar", None)
        if bar is not None:
            bar.note(moved=f"{self.moved['block_onloads']} blocks/{self.moved['bytes_moved'] / 2**20:.0f} MiB")

    def _block_bytes(self, block: int) -> int:
        cache = self.__dict__.setdefault("_bytes_of", {})
        if block not in cache:
            _, _, blocks = decoder_blocks(self.model)
            cache[block] = offloaded_bytes(blocks[block])
        return cache[block]

    def _stream_batch(self, b: int, todo: list[Probe], bar) -> bool:
        """Batch ``b`` slot by slot: every probe's state advanced together, each block moved
        once per probe group (its passes: :meth:`_passes`, the plan's). False (nothing
        done) when the first batch's check finds that the final norm and head do not
        reproduce the model's logits (then depth-first)."""
        ids, mask, counts, rows = self._batch_on_device(b)
        bsz, seqlen = ids.shape
        verify = not self.verified_head
        with self._autocast():
            inputs = capture_block_inputs(self.model, ids, mask, verify=verify)
        self.stats["model_calls"] += 1
        if verify and not self._verify_streamed(inputs):
            return False
        _, _, blocks = decoder_blocks(self.model)
        identity = tuple(range(self.num_blocks))
        cache, key = self.reference_cache, self._reference_key(b)
        entry = cache.lookup(key) if cache is not None else None
        keep = entry is None and cache is not None and cache.fits(self._reference_entry_bytes(b))
        streams: dict[int, torch.Tensor] = dict(entry[0]) if entry is not None else {}
        per_flush = self.flush_size(rows.numel())
        pending: list[tuple[Probe, torch.Tensor]] = []
        flush = None if entry is None else self._flusher(b, entry[1], rows // seqlen, counts, bsz, bar)
        for plan, group in self._passes(b, todo, hit=entry is not None, cached=keep):
            finals: dict[tuple, torch.Tensor] = {}

            def finish(key, state):
                out = self.norm(state)
                finals[key] = out.reshape(-1, out.shape[-1]).index_select(0, rows.to(out.device))

            loader = self._block_loader(plan, blocks)
            with self._autocast():
                run_pass(plan, blocks, inputs, finish, self._moved, streams=streams,
                         capture=streams.__setitem__ if keep and plan.reference else None,
                         loader=None if loader is None else loader.load)
            self.stats["block_evaluations"] += plan.block_evaluations
            if plan.reference:  # the first pass streams the reference too
                ref = finals.pop(identity)
                flush = self._flusher(b, ref, rows // seqlen, counts, bsz, bar)
                self.stats["reference_passes"] += 1
                if keep:
                    cache.put(key, dict(streams), ref)
            for p in group:
                pending.append((p, finals.pop(p.key)))
                if len(pending) >= per_flush:
                    flush(pending)
            finals.clear()  # no final state kept past its pass (finish, above, reads the name)
        flush(pending)
        return True

    def _block_loader(self, plan: PassPlan, blocks):
        """A :class:`~hf_layerswap.utils.devices.BlockPrefetcher` over the pass's onload order when
        the blocks compute on a CUDA device (pinned host copies, the next block read on a
        side stream); ``None`` elsewhere (accelerate's own onload, one block at a time)."""
        order = plan.onload_order
        if not order or execution_device(blocks[order[0]]).type != "cuda":
            return None
        return BlockPrefetcher(blocks, order)

    def _verify_streamed(self, inputs) -> bool:
        """First batch: the final norm and the head applied to the decoder's input reproduce
        the model's own output on it (the recorders pass the stream through)."""
        with self._autocast():
            ours = self.norm(inputs.hidden[:, -1:]).float()
        theirs = inputs.decoder_output[:, -1:].float().to(ours.device)
        tol = 1e-4 if self.compute_dtype == torch.float32 else 2e-2
        if ours.shape != theirs.shape or float((ours - theirs).abs().max()) > tol * (1.0 + float(theirs.abs().max())):
            self.slot_major = False
            self.slot_major_note = "depth-first: the decoder's final norm did not reproduce its output"
            warnings.warn(f"hf_layerswap scoring: {self.slot_major_note}", stacklevel=3)
            return False
        self._verify_head(inputs.decoder_output[:, -1:], inputs.logits)
        if not self.stream_logits:
            self.slot_major = False
            self.slot_major_note = "depth-first: the model's logits are not streamed (head check failed)"
        return self.slot_major

    # -- results -------------------------------------------------------------------------
    def gather(self) -> None:
        """Share computed values between processes (every one ends with all of them)."""
        if self.world <= 1:
            return
        local = {k: v.cpu() for k, v in self.computed.items()}
        parts = self.processes.gather((local, self.stats, self.seconds, (dict(self.moved), self.onloads_per_batch)))
        stats = {k: 0 for k in self.stats}
        for part_values, part_stats, _, _ in parts:
            self.computed.update(part_values)
            for k in stats:
                stats[k] += part_stats[k]
        self.gathered_stats = stats
        self.seconds_max = max(p[2] for p in parts)
        self.gathered_movement = sum_movement([p[3] for p in parts])

    def values(self, batch_indices: Sequence[int]) -> dict[Hashable, torch.Tensor]:
        out = {}
        cache: dict[tuple[int, ...], torch.Tensor] = {}
        for name, key in self.key_of.items():
            if key not in cache:
                parts = []
                for b in batch_indices:
                    if key in self.zero:
                        ids, _ = self._batch(b)
                        parts.append(torch.zeros(ids.shape[0], dtype=torch.float64))
                    else:
                        v = self.computed.get((b, key))
                        if v is None:
                            v = self.done[(b, key)]
                        parts.append(v)
                cache[key] = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
            out[name] = cache[key]
        return out

    def summary(self, batch_indices: Sequence[int]) -> dict:
        stats = dict(getattr(self, "gathered_stats", self.stats))
        seconds = getattr(self, "seconds_max", self.seconds)
        out = {
            "forward_passes": 1 + len(self.key_of),
            "block_evaluations": stats["block_evaluations"],
            "model_calls": stats["model_calls"],
            "reference_passes": stats["reference_passes"],
            "head_rows": stats["head_rows"],
            "seconds": seconds,
            "prefix_reuse": self.mode,
            "max_memory": self.budget,
            "max_memory_source": self.budget_source,
            "device": str(self.input_device),
            "kl_block_bytes": self.kl_block_bytes,
            "world_size": self.world,
            "distinct_probes": len(self.probes),
            **self.settings(),
        }
        out["slot_major"] = self.slot_major
        out["head_streaming"] = self.head_streaming
        out["movement"] = {
            "offloaded_blocks": len(self.movable),
            "block_onloads": self.moved["block_onloads"],
            "bytes_moved": self.moved["bytes_moved"],
            "head_bytes_moved": self.moved["head_bytes_moved"],
            "embedding_bytes_moved": self.moved["embedding_bytes_moved"],
            "block_onloads_per_batch": list(self.onloads_per_batch),
            **getattr(self, "gathered_movement", {}),
        }
        out["peak_memory"] = peak_memory()
        if self.slot_major_note:
            out["slot_major_note"] = self.slot_major_note
        if self.fallback_reason:
            out["stream_logits_note"] = self.fallback_reason
        if self.checkpoint is not None:
            out["checkpoint"] = {"resumed_values": self.resumed}
        return out


class _WorkBar:
    """A tqdm bar over a float amount of work shown in whole units: fractions (head/KL
    chunks) are carried until they add up to a unit."""

    def __init__(self, total: float, desc: str, enabled: bool, unit: str = "block pass"):
        self.bar = tqdm(total=round(total), desc=desc, unit=f" {unit}", disable=not enabled, dynamic_ncols=True,
                        leave=None)
        self.pos = 0.0

    def advance(self, amount: float) -> None:
        self.pos += amount
        step = min(round(self.pos), self.bar.total) - self.bar.n  # never past the total, never back
        if step > 0:
            self.bar.update(step)

    def note(self, **values) -> None:
        """Show ``values`` in the bar's postfix (e.g. blocks and bytes moved)."""
        self.bar.set_postfix(values, refresh=False)

    def reach(self, pos: float) -> None:
        self.advance(pos - self.pos)

    def close(self) -> None:
        self.bar.close()


@torch.no_grad()
def plan_kl(
    model: nn.Module,
    calibration: CalibrationSet,
    plans: Mapping[Any, Sequence[int]],
    *,
    batch_size: int | str | None = None,
    progress: bool = False,
    desc: str = "swap-KL",
    prefix_reuse: bool | str = True,
    stream_logits: bool = True,
    kl_chunk: int | None = None,
    vocab_chunk: int | None = None,
    max_memory: int | str | None = None,
    dtype: torch.dtype | str | None = None,
    checkpoint_path: str | os.PathLike | None = None,
    distributed: bool | None = None,
    slot_major: bool | None = None,
    reference_cache: ReferenceCache | None = None,
) -> tuple[dict[Hashable, torch.Tensor], dict]:
    """Per-prompt KL(p_M || p_plan) for every plan: the probe engine.

    Args:
        model: a causal LM with L decoder blocks (accelerate-dispatched models included).
        calibration: the prompts (:func:`~hf_layerswap.calibration.build_calibration`).
        plans: probe name -> block plan (see :mod:`hf_layerswap.layerplan`). Equal plans are
            computed once; the identity plan gives exactly 0 without running.
        batch_size, progress, desc, prefix_reuse, stream_logits, kl_chunk, vocab_chunk,
            max_memory, dtype, checkpoint_path, distributed, slot_major: the engine settings, each
            described at :class:`~hf_layerswap.scoring.settings.EngineSettings` (batch
            size, memory budget, precision, prefix reuse, streamed KL, resumable runs,
            probes partitioned over launched processes, slot-major streaming of offloaded
            blocks).
        reference_cache: a :class:`~hf_layerswap.scoring.reference.ReferenceCache` shared
            by calls on the same model and prompts: each batch's reference pass runs once
            and later calls reuse it (exact: the same tensors). ``None``: one per call.
            A slot-major (streamed) run streams the reference in its first pass and keeps
            the streams entering every block there when they fit; later passes and calls
            start each probe from the kept stream entering its start slot.

    Returns:
        ``(values, stats)``: ``values[name]`` is a ``(N,)`` float64 tensor of per-prompt
        mean KL in nats; ``stats`` has ``forward_passes`` (calibration-set sweeps: one
        reference plus one per plan), ``block_evaluations`` (block forward calls over all
        batches), ``model_calls``, ``reference_passes`` (identity passes actually run, one
        per batch without a cache), ``head_rows`` (positions through the output head),
        ``seconds``, the settings used, ``slot_major``, ``movement`` (offloaded blocks,
        block onloads and bytes moved in all and per batch; under several processes the
        sum over them, with each one's own under ``per_process``:
        :func:`~hf_layerswap.scoring.processes.sum_movement`) and ``peak_memory`` (bytes per
        device of this process: :func:`hf_layerswap.utils.devices.peak_memory`).

    Raises:
        ValueError: a bad plan, batch size, chunk, memory or dtype value.
        CheckpointMismatchError: ``checkpoint_path`` holds another run's checkpoint.

    The model is left exactly as it was (blocks, ``layer_idx``, config, train/eval mode).
    """
    settings = EngineSettings(
        batch_size=batch_size, prefix_reuse=prefix_reuse, stream_logits=stream_logits, kl_chunk=kl_chunk,
        vocab_chunk=vocab_chunk, max_memory=max_memory, dtype=dtype, checkpoint_path=checkpoint_path,
        distributed=distributed, progress=progress, desc=desc, slot_major=slot_major,
    )
    return run_plans(model, calibration, plans, settings, reference_cache=reference_cache)


@torch.no_grad()
def run_plans(
    model: nn.Module, calibration: CalibrationSet, plans: Mapping[Any, Sequence[int]], settings: EngineSettings,
    reference_cache: ReferenceCache | None = None,
) -> tuple[dict[Hashable, torch.Tensor], dict]:
    """:func:`plan_kl` with its settings as one :class:`EngineSettings`: what the scoring
    verbs call once they have built theirs."""
    engine = Engine(model, calibration, plans, settings, reference_cache)
    engine.run_batches(engine.batches)
    engine.gather()
    return engine.values(engine.batches), engine.summary(engine.batches)


def plan_engine(model: nn.Module, calibration: CalibrationSet, plans: Mapping[Hashable, Sequence[int]],
                settings: EngineSettings, reference_cache: ReferenceCache | None = None,
                streamed: bool | None = None) -> Engine:
    """The engine as :func:`run_plans` would build it, without running anything: its
    :meth:`Engine.plan` is what :func:`hf_layerswap.cost.estimate_cost` reads. ``model``
    may live on the meta device: a plain ``nn.Linear`` head there is planned as it will be
    once loaded (sliceable, its head/KL chunks chosen accordingly). ``reference_cache``: the
    kept reference the run will use (its entries and budget shape the plan). ``streamed=True``:
    sized as the run on a model whose blocks stream from the offload will be (slot-major,
    where the engine can stream: the states a pass holds in the budget), for
    :meth:`Engine.plan` ``(streamed=True)``."""
    engine = Engine(model, calibration, plans, settings, reference_cache)
    head = engine.head
    resize = False
    if head.linear and not head.sliceable and head.module.weight.device.type == "meta" and not hasattr(head.module, "_hf_hook"):
        head.sliceable = resize = True
    if streamed and not engine.slot_major and engine.slot_major_setting is None and engine.slot_major_note is None:
        engine.slot_major = resize = True  # the blocks will stream: slot-major, its states in the budget
    if resize:
        engine._size(settings)
    return engine
