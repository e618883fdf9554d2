"""The dense reference of each calibration batch, computed once and reused across calls.

Every objective over removal sets compares the modified model with the unmodified one on
the same prompts, and every candidate starts from the residual stream the unmodified
model leaves at its first removed block. A search scores its candidates in many calls
(one per budget and round); without a cache each call sweeps the dense model
over the calibration set again. :class:`ReferenceCache` keeps, per batch, what one sweep
yields and hands it back to later calls: the values are the same tensors, so every KL,
NLL and selected set is bit-identical to the recomputed run.

What is kept (the rule):

- the residual stream entering every block ``1..L-1`` (``(B, T, H)`` each, the model's
  compute dtype), so a candidate starting at any block finds its stream;
- the reference itself in its exact form, whichever the consumer needs and is smaller:
  for the scoring engine's streamed KL (a separate output head, the default) the final
  hidden rows of the real positions, ``(R, H)``, through which the head runs again for
  each group of candidates exactly as before (H/V of the log-probabilities' size: 576 vs
  49,152 on SmolLM2); where the engine uses the model's own logits, and for the ghosted
  objective, the fp32 log-probabilities ``(B, T, V)``; for the NLL objective the
  per-prompt reference NLL sums ``(B,)``.

The scoring engine's slot-major path (offloaded blocks, :mod:`.slotmajor`) fills the same
entries from its first pass (:meth:`ReferenceCache.lookup`, :meth:`ReferenceCache.put`) and
starts every later pass from their streams, so a streamed search does not stream the dense
model again per call.

A batch's entry is kept only whole and only while all entries together stay within
``max_bytes``; batches beyond it are recomputed by one identity sweep per call (the
fewest: a call needs every batch's reference once). The KL is never approximated.

The cache belongs to one model and one calibration set left unchanged while it lives
(:class:`~hf_layerswap.selection.objectives.SetObjective` owns one); its keys name the
batch, the batch size and the numeric settings of the consumer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

import torch

__all__ = ["ReferenceCache", "tensor_bytes"]


def tensor_bytes(obj) -> int:
    """Bytes held by the tensors in ``obj`` (a tensor, or dicts/lists/tuples of them)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class ReferenceCache:
    """Per-batch dense references (residual streams + exact reference) under a byte budget.

    Args:
        max_bytes: most bytes the kept entries take together (an int >= 0; 0 keeps
            nothing, every call recomputes).

    Attributes:
        hits, misses: lookups served from the cache / computed by a sweep of one batch.
        bytes: bytes held now.
        head_check: ``None`` until the scoring engine verified its output head on this
            model; then ``(streamed, reason)`` so later engines skip the check and take
            the same path (:meth:`engine_reference`).

    Raises:
        ValueError: a negative or non-integer ``max_bytes``.
    """

    def __init__(self, max_bytes: int):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes={max_bytes!r}: give an int >= 0 (bytes)")
        self.max_bytes = max_bytes
        self.entries: dict[Hashable, tuple[dict[int, torch.Tensor], object]] = {}
        self.bytes = 0
        self.hits = self.misses = 0
        self.head_check: tuple[bool, str | None] | None = None

    def get(self, key: Hashable, compute: Callable[[list[int]], tuple[dict[int, torch.Tensor], object]],
            slots: Iterable[int], all_slots: Iterable[int], bytes_per_slot: int = 0):
        """``(streams, reference)`` of the batch named by ``key``.

        Args:
            key: the batch and the consumer's settings (hashable).
            compute: ``compute(slots) -> (streams, reference)``, one identity sweep that
                captures the streams entering ``slots``.
            slots: the streams this call needs.
            all_slots: every stream a later call may need; captured and kept when the
                entry fits.
            bytes_per_slot: the size of one captured stream, to decide before the sweep
                whether the whole entry can fit (0: try).
        """
        entry = self.entries.get(key)
        if entry is not None:
            self.hits += 1
            return entry
        self.misses += 1
        every = sorted(set(all_slots))
        keep = self.bytes + bytes_per_slot * len(every) <= self.max_bytes
        streams, ref = compute(every if keep else sorted(set(slots)))
        size = tensor_bytes(streams) + tensor_bytes(ref)
        if keep and self.bytes + size <= self.max_bytes:
            self.entries[key] = (streams, ref)
            self.bytes += size
        return streams, ref

    def lookup(self, key: Hashable):
        """``(streams, reference)`` held for ``key``, or ``None``; counted as a hit or a miss
        (a slot-major pass computes a missing entry itself and hands it to :meth:`put`)."""
        entry = self.entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self.hits += 1
        return entry

    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` more bytes stays within ``max_bytes``."""
        return self.bytes + nbytes <= self.max_bytes

    def put(self, key: Hashable, streams: dict[int, torch.Tensor], reference) -> bool:
        """Keep ``(streams, reference)`` under ``key`` if it fits (whole or not at all);
        returns whether it is kept."""
        size = tensor_bytes(streams) + tensor_bytes(reference)
        if key in self.entries or not self.fits(size):
            return False
        self.entries[key] = (streams, reference)
        self.bytes += size
        return True

    @staticmethod
    def engine_key(engine, b: int) -> tuple:
        """The key of the scoring engine's batch ``b``: the batch, the batch size, whether
        the reference is final rows (streamed KL) or log-probabilities, the compute dtype
        and the calibration set's content."""
        return ("engine", b, engine.batch_size, engine.stream_logits, str(engine.compute_dtype),
                engine.calib.content_hash)

    def discard(self, key: Hashable) -> None:
        """Drop one entry (if held)."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= tensor_bytes(entry[0]) + tensor_bytes(entry[1])

    def engine_reference(self, engine, b: int, ids, mask, slots: set[int], rows: torch.Tensor, sweep):
        """The scoring engine's reference of batch ``b``: what ``sweep(ids, mask, slots,
        rows)`` (the engine's identity pass) returns, the streams entering ``slots`` and the
        final hidden rows (streamed KL) or fp32 log-probabilities, computed once for every
        engine that shares this cache. The engine's one-time output-head check runs in the
        first sweep; later engines take its outcome (``head_check``)."""
        if engine.stream_logits and not engine.verified_head and self.head_check is not None:
            engine.verified_head = True
            if not self.head_check[0]:
                engine.stream_logits, engine.fallback_reason = False, self.head_check[1]

        def compute(wanted):
            was_verified = engine.verified_head
            out = sweep(ids, mask, set(wanted), rows)
            if engine.verified_head and not was_verified:
                self.head_check = (engine.stream_logits, engine.fallback_reason)
            return out

        key = self.engine_key(engine, b)
        es = torch.finfo(engine.compute_dtype).bits // 8
        streams, ref = self.get(key, compute, slots, range(1, engine.num_blocks), ids.numel() * engine.hidden * es)
        if key[3] != engine.stream_logits:  # the head check failed in this very sweep: keyed by what it holds
            self.discard(key)
        return streams, ref
