"""Streamed KL: the head/KL phase of a batch. The probes' final hidden rows (real
positions only) and the reference's go through the output head on blocks of
``kl_chunk`` positions x ``vocab_chunk`` vocabulary entries, and KL(p_M || p_probe) is
summed per prompt; logits are never held for a whole batch (see
:mod:`hf_layerswap.scoring`). The engine sizes the blocks (:mod:`.engine`); the maths is
:mod:`.kl`."""

from __future__ import annotations

import torch

from .head import maybe_autocast, Head
from .kl import chunk_bounds, kl_rows, KL_SUB_BYTES, lse64, row_blocks, VocabKL

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
        sums = [torch.zeros(bsz, dtype=torch.float64) for _ in hiddens]
        for a, b in chunk_bounds(ref_hidden.shape[0], self.kl_chunk):
            kls = self._kl_block(ref_hidden[a:b], [h[a:b] for h in hiddens], done or (lambda n: None))
            idx = prompt_of_row[a:b]
            for n, kl in enumerate(kls):
                sums[n].index_add_(0, idx, kl.double().cpu())
        self.release()
        return [s / counts for s in sums]

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
        """Per-position KL of each probe over a block of positions; ``done(n)`` is told
        after each head GEMM how many whole-vocabulary head rows it was worth.

        With the whole vocabulary in one slice this is :func:`masked_kl`'s arithmetic (fp32
        log-softmax); with several slices, :class:`VocabKL` (float64 accumulation, equal
        to it within the fp32 log-softmax's own rounding)."""
        bounds = chunk_bounds(self.head.vocab, self.vocab_chunk)
        if len(bounds) == 1:
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
        self.stats["head_rows"] += ref_rows.shape[0] * (2 + len(rows))
        # pass 1: the reference log-sum-exp over the whole vocabulary
        ref_lse = torch.logsumexp(torch.stack([lse64(self.logits(ref_rows, v0, v1), self.block_bytes)
                                               for v0, v1 in bounds]), dim=0)
        done(ref_rows.shape[0])
        mass = torch.zeros_like(ref_lse)
        acc = [VocabKL(ref_rows.shape[0], ref_rows.device, self.block_bytes) for _ in rows]
        for v0, v1 in bounds:  # pass 2: every probe against the same reference slice
            share = ref_rows.shape[0] * (v1 - v0) / self.head.vocab
            z_ref = self.logits(ref_rows, v0, v1)
            probs = torch.empty(z_ref.shape, dtype=torch.float64, device=z_ref.device)
            for a, b in row_blocks(*z_ref.shape, self.block_bytes):
                probs[a:b] = (z_ref[a:b].double() - ref_lse[a:b].unsqueeze(-1)).exp_()
            mass += probs.sum(dim=-1)
            done(share)
            for n, h in enumerate(rows):
                acc[n].add(z_ref, probs, self.logits(h, v0, v1))
                done(share)
            del z_ref, probs
        return [a.result(ref_lse, mass) for a in acc]
