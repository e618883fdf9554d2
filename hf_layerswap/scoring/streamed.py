"""Streamed KL: the head/KL phase of a batch. The probes' final hidden rows (real
positions only) and the reference's go through the output head on blocks of
``kl_chunk`` positions x ``vocab_chunk`` vocabulary entries, and KL(p_M || p_probe) is
summed per prompt; logits are never held for a whole batch (see
:mod:`hf_layerswap.scoring`). The phase runs slice by slice of the vocabulary (the whole
vocabulary is one slice) with one float64 online accumulation (:class:`.kl.OnlineKL`), so
the values do not depend on the slicing: each slice of the head's weight is taken once per
phase (read from the offload for a streamed head) and used for every position and probe.
The engine sizes the blocks (:mod:`.engine`); the maths is :mod:`.kl`."""

from __future__ import annotations

import torch

from ..utils.devices import execution_device
from .head import maybe_autocast, Head
from .kl import chunk_bounds, KL_SUB_BYTES, OnlineKL

__all__ = ["StreamedKL"]


class StreamedKL:
    """The output head and KL over blocks of positions x vocabulary entries, with one
    reused whole-vocabulary logit buffer (released after every head phase: the probe
    forwards need the memory).

    Args:
        head: the model's output head (:class:`~hf_layerswap.scoring.head.Head`).
        kl_chunk, vocab_chunk: positions and vocabulary entries per block.
        autocast: the autocast dtype (None: the model's own) and ``device_type`` it runs on.
        stats: the engine's counters; ``head_rows`` grows by the positions each head pass runs.
        block_bytes: bytes of one row block of the KL's fp32 temporaries (:func:`.kl.row_blocks`).
    """

    def __init__(self, head: Head, kl_chunk: int, vocab_chunk: int, autocast: torch.dtype | None,
                 device_type: str, stats: dict, block_bytes: int = KL_SUB_BYTES):
        self.head = head
        self.kl_chunk, self.vocab_chunk = kl_chunk, vocab_chunk
        self.autocast, self.device_type = autocast, device_type
        self.stats = stats
        self.block_bytes = block_bytes
        self._logit_buf: torch.Tensor | None = None

    def release(self) -> None:
        """Free the reused logit buffer (the head's weight is never copied)."""
        self._logit_buf = None
        self.head.release()

    def head_phase(self, ref_hidden, hiddens: list[torch.Tensor], prompt_of_row, counts, bsz,
                   done=None) -> list[torch.Tensor]:
        """Per-prompt mean KL for each probe's final hidden rows ``(R, H)``; ``done(n)`` is
        told the head rows each chunk ran (for the progress bar).

        Slice by slice of the vocabulary (one slice: the whole vocabulary; each slice of
        the head's weight taken once, :meth:`Head.weight_slice`), every block of
        ``kl_chunk`` positions of the reference and then of each probe is folded into one
        :class:`.kl.OnlineKL`: the same float64 arithmetic for every slicing, placement and
        budget. A slice of a half-precision head stays in its dtype (no fp32 copy; the fp32
        logits come from :func:`~hf_layerswap.scoring.head.linear32`). The accumulator is on
        the head's execution device (:func:`~hf_layerswap.utils.devices.execution_device`), where its
        logits are made: a tied head of a model split over GPUs sits on the embedding's device,
        not the final norm's; the hidden rows go there, and the per-prompt sums to the CPU.

        Returns:
            one ``(bsz,)`` float64 CPU tensor per probe: mean KL in nats per real position."""
        done = done or (lambda n: None)
        rows = ref_hidden.shape[0]
        bounds = chunk_bounds(self.head.vocab, self.vocab_chunk)
        self.stats["head_rows"] += rows * (1 + len(hiddens))
        # the accumulator lives where the logits are made: the head's execution device (a tied
        # head split from the final norm sits on the embedding's GPU); only the hidden rows move
        device = execution_device(self.head.module)
        acc = OnlineKL(rows, len(hiddens), device, self.block_bytes)
        with torch.autocast(device_type=ref_hidden.device.type, enabled=False):  # float64 sums, fp32 logits
            for v0, v1 in bounds:
                sliced = self.head.weight_slice(v0, v1) if len(bounds) > 1 else None
                for a, c in chunk_bounds(rows, self.kl_chunk):
                    share = (c - a) * (v1 - v0) / self.head.vocab
                    weights = acc.reference(a, c, self._block_logits(ref_hidden[a:c], sliced).to(device))
                    done(share)
                    for n, h in enumerate(hiddens):
                        acc.add(n, a, c, weights, self._block_logits(h[a:c], sliced).to(device))
                        done(share)
                    del weights
                del sliced
        self.release()
        out = []
        for kl in acc.result().unbind(0):
            sums = torch.zeros(bsz, dtype=torch.float64)
            sums.index_add_(0, prompt_of_row, kl.cpu())
            out.append(sums / counts)
        return out

    def _block_logits(self, hidden, sliced) -> torch.Tensor:
        """fp32 logits of hidden rows ``(R, H)``: of the whole vocabulary (``sliced`` None,
        :meth:`logits`) or of the vocabulary slice whose weight and bias ``sliced`` holds."""
        if sliced is None:
            return self.logits(hidden, 0, self.head.vocab)
        return self.head.slice_logits(hidden, *sliced)

    def logits(self, hidden, v0: int, v1: int) -> torch.Tensor:
        """fp32 logits of vocabulary entries ``v0:v1`` of hidden rows ``(R, H)``.

        A plain ``nn.Linear`` head computes them with exact products and fp32 sums, outside
        any autocast (:func:`~hf_layerswap.scoring.head.linear32`, the half-precision
        contract of :class:`~hf_layerswap.scoring.head.Head`); for the whole vocabulary of a head in
        memory on the rows' device the GEMM writes into the reused buffer (the result is
        valid until the next call). Other heads, and heads with forward hooks, run their own
        forward under the engine's autocast and are upcast."""
        whole = v0 == 0 and v1 == self.head.vocab
        if self.head.own_forward and whole:
            with maybe_autocast(self.device_type, self.autocast):
                return self.head(hidden).float()
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            if whole and self._buffered_head(hidden):
                rows = hidden.shape[0]
                if self._logit_buf is None or self._logit_buf.shape[0] < rows:
                    self._logit_buf = None  # free the smaller one first
                    self._logit_buf = torch.empty(rows, self.head.vocab, dtype=torch.float32, device=hidden.device)
                return self.head.into(hidden, self._logit_buf[:rows])
            return self.head(hidden) if whole else self.head.vocab_slice(hidden, v0, v1)

    def _buffered_head(self, hidden) -> bool:
        """Whole-vocabulary logits can go to one reused buffer (each result is consumed
        before the next is made): a plain ``nn.Linear`` head in memory on the hidden
        rows' device, with no forward hooks and a plain tensor weight."""
        m = self.head.module
        w = getattr(m, "weight", None)
        return (self.head.sliceable and type(w.data) is torch.Tensor and w.device == hidden.device
                and not m._forward_hooks and not m._forward_pre_hooks)
