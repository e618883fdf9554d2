"""Streamed KL: the head/KL phase of a batch. The probes' final hidden rows (real
positions only) and the reference's go through the output head on blocks of
``kl_chunk`` positions x ``vocab_chunk`` vocabulary entries, and KL(p_M || p_probe) is
summed per prompt; logits are never held for a whole batch (see
:mod:`hf_layerswap.scoring`). With the vocabulary in several slices the phase runs slice by
slice (:class:`.kl.OnlineKL`): each slice of the head's weight is taken once per phase
(read from the offload for a streamed head) and used for every position and probe. The
engine sizes the blocks (:mod:`.engine`); the maths is :mod:`.kl`."""

from __future__ import annotations

import torch

from .head import maybe_autocast, Head
from .kl import chunk_bounds, kl_rows, KL_SUB_BYTES, OnlineKL, row_blocks

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
        """Free the reused logit buffer and the head's fp32 weight copy."""
        self._logit_buf = None
        self.head.release()

    def head_phase(self, ref_hidden, hiddens: list[torch.Tensor], prompt_of_row, counts, bsz,
                   done=None) -> list[torch.Tensor]:
        """Per-prompt mean KL for each probe's final hidden rows ``(R, H)``; ``done(n)`` is
        told the head rows each chunk ran (for the progress bar)."""
        done = done or (lambda n: None)
        rows = ref_hidden.shape[0]
        bounds = chunk_bounds(self.head.vocab, self.vocab_chunk)
        if len(bounds) > 1:
            per_row = self._sliced_phase(ref_hidden, hiddens, bounds, done)
        else:
            blocks = [self._kl_block(ref_hidden[a:b], [h[a:b] for h in hiddens], done)
                      for a, b in chunk_bounds(rows, self.kl_chunk)]
            per_row = [torch.cat([blk[n] for blk in blocks]) for n in range(len(hiddens))]
        self.release()
        out = []
        for kl in per_row:
            sums = torch.zeros(bsz, dtype=torch.float64)
            sums.index_add_(0, prompt_of_row, kl.double().cpu())
            out.append(sums / counts)
        return out

    def _sliced_phase(self, ref_hidden, hiddens, bounds, done) -> list[torch.Tensor]:
        """Per-row KL ``(R,)`` of each probe with the vocabulary in slices: slice by slice
        (each slice of the head's weight taken once: :meth:`Head.weight_slice`), every block
        of ``kl_chunk`` positions of the reference and then of each probe folded into one
        :class:`.kl.OnlineKL`."""
        rows = ref_hidden.shape[0]
        self.stats["head_rows"] += rows * (1 + len(hiddens))
        acc = OnlineKL(rows, len(hiddens), ref_hidden.device, self.block_bytes)
        for v0, v1 in bounds:
            w, b = self.head.weight_slice(v0, v1)
            for a, c in chunk_bounds(rows, self.kl_chunk):
                share = (c - a) * (v1 - v0) / self.head.vocab
                with torch.autocast(device_type=ref_hidden.device.type, enabled=False):
                    z_ref = self.head.slice_logits(ref_hidden[a:c], w, b)
                    weights = acc.reference(a, c, z_ref)
                    done(share)
                    for n, h in enumerate(hiddens):
                        acc.add(n, a, c, z_ref, weights, self.head.slice_logits(h[a:c], w, b))
                        done(share)
                del z_ref, weights
            del w, b
        return list(acc.result().to(ref_hidden.device).unbind(0))

    def logits(self, hidden, v0: int, v1: int) -> torch.Tensor:
        """fp32 logits of vocabulary entries ``v0:v1`` of hidden rows ``(R, H)``.

        A plain ``nn.Linear`` head computes them in fp32 from the upcast hidden rows and
        weight, outside any autocast (the half-precision contract of
        :class:`~hf_layerswap.scoring.head.Head`); for the whole vocabulary of a head in
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

    def _kl_block(self, ref_rows, rows, done) -> list[torch.Tensor]:
        """Per-position KL of each probe over a block of positions with the whole vocabulary
        in one slice (:func:`masked_kl`'s arithmetic: fp32 log-softmax); ``done(n)`` is told
        after each head GEMM how many whole-vocabulary head rows it was worth."""
        self.stats["head_rows"] += ref_rows.shape[0] * (1 + len(rows))
        ref_lp = torch.log_softmax(self.logits(ref_rows, 0, self.head.vocab), dim=-1)
        done(ref_rows.shape[0])
        out = []
        for h in rows:
            logits = self.logits(h, 0, self.head.vocab)
            kl = torch.empty(logits.shape[0], device=logits.device)
            for a, b in row_blocks(*logits.shape, self.block_bytes):
                kl[a:b] = kl_rows(ref_lp[a:b], logits[a:b])
            out.append(kl)
            done(ref_rows.shape[0])
            del logits  # else the next probe's logits are made while these are still held
        return out
