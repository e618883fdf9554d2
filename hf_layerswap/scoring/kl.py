"""The KL arithmetic of scoring. :class:`OnlineKL`: the one-pass online form with float64
log-sum-exps over vocabulary slices (the whole vocabulary being one slice), which the
engine uses for every output head it runs itself; :func:`kl_rows` (per-row KL(p_ref ||
softmax(logits)) in fp32 on row blocks, cache-sized on a CPU, large on an accelerator) and
:func:`masked_kl` over real positions, for the model's own full logits
(``stream_logits=False``). Pure tensor maths, no model."""

from __future__ import annotations

import math

import torch

__all__ = [
    "chunk_bounds", "KL_CHUNK_POSITIONS", "kl_rows", "KL_SUB_BYTES", "masked_kl", "OnlineKL", "row_blocks",
]

#: Positions per chunk in :func:`masked_kl` (bounds temporary memory).
KL_CHUNK_POSITIONS = 256

#: Bytes of one row-block of log-softmax temporaries in the KL on a CPU (cache-sized); the
#: engine takes larger blocks on an accelerator (``Engine._kl_block_bytes``).
KL_SUB_BYTES = 1 << 21


# ----------------------------------------------------------------------------- KL
def kl_rows(ref_logprobs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Per-row KL(p_ref || softmax(logits)) in fp32, clamped at 0. Shapes ``(C, V)`` -> ``(C,)``."""
    lq = torch.log_softmax(logits.float(), dim=-1)  # a new tensor: the in-place steps below are safe
    # in place, (log p - log q) * p summed: the same values as the out-of-place expression, bit
    # for bit, without two more (C, V) temporaries
    return lq.neg_().add_(ref_logprobs).mul_(ref_logprobs.exp()).sum(dim=-1).clamp_min_(0.0)


def row_blocks(rows: int, width: int, block_bytes: int = KL_SUB_BYTES) -> list[tuple[int, int]]:
    """Row blocks ``[(start, stop), ...]`` of a ``(rows, width)`` fp32 array, each at most ``block_bytes`` (default 2 MiB, cache-sized)."""
    step = max(1, block_bytes // (4 * max(1, width)))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def chunk_bounds(total: int, chunk: int) -> list[tuple[int, int]]:
    """``ceil(total / chunk)`` contiguous ranges of near-equal length (none longer than
    ``chunk``), so no small remainder chunk runs the head GEMM inefficiently (position chunks,
    vocabulary slices)."""
    n = max(1, math.ceil(total / chunk))
    edges = [round(k * total / n) for k in range(n + 1)]
    return [(edges[k], edges[k + 1]) for k in range(n) if edges[k + 1] > edges[k]]


class OnlineKL:
    """KL(p_ref || q_n) per row and probe n, accumulated over vocabulary slices in one pass
    (online log-sum-exp: the reference's running maximum rescales what was summed before):

    KL(P || Q) = sum_v p_v (z_v - y_v) - lse(z) + lse(y),   p = softmax(z)

    with z the reference's logits and y a probe's. Per slice and row it keeps the running
    maximum m of z, s = sum exp(z - m) and, per probe, d = sum exp(z - m) (z - y) and lse(y);
    at the end sum_v p_v (z_v - y_v) = d / s. The reference's slice is folded in first
    (:meth:`reference`: it adds sum exp(z - m) (z - m) to every probe's d and returns
    exp(z - m) for that slice), then each probe's (:meth:`add`: it subtracts
    sum exp(z - m) (y - m); m cancels, and centring keeps the two sums near the few nats
    of an entropy instead of the logits' size), so each slice of the head is needed once
    for all rows and probes and the reference's logits are not needed after
    :meth:`reference`. Everything is float64 (the logits stay
    fp32): the terms nearly cancel when the distributions are close, and the result is the
    KL of the fp32 logits to float64 rounding. Numeric contract: those logits are the
    head's fp32 logits (:func:`~hf_layerswap.scoring.head.linear32`: exact products and fp32
    sums also for a bf16/fp16 head), so a half-precision model's pair KLs are the float64
    KL of its final hidden states up to the fp32 GEMM's rounding, whichever device runs it. The whole vocabulary is one slice: the same
    arithmetic whatever the slices (the engine's only KL for a head it runs itself).

    Memory: the float64 weights ``(rows, slice)`` (8 bytes per entry) beside the fp32
    logits of one slice (4 bytes), plus row blocks of ``block_bytes``.

    Args:
        rows: positions ``R``; probes: probes ``N``; block_bytes: the row blocks' fp32 bytes.
    """

    def __init__(self, rows: int, probes: int, device, block_bytes: int = KL_SUB_BYTES):
        self.block_bytes = block_bytes
        self.max = torch.full((rows,), -math.inf, dtype=torch.float64, device=device)
        self.sum = torch.zeros(rows, dtype=torch.float64, device=device)
        self.slice_sum = torch.zeros(rows, dtype=torch.float64, device=device)  # of the current slice
        self.dot = torch.zeros(probes, rows, dtype=torch.float64, device=device)
        self.lse = torch.full((probes, rows), -math.inf, dtype=torch.float64, device=device)

    def reference(self, a: int, b: int, logits: torch.Tensor) -> torch.Tensor:
        """Fold the reference's fp32 logits ``(b - a, W)`` of rows ``a:b`` (one vocabulary
        slice, or the whole vocabulary) in; returns exp(z - m) ``(b - a, W)`` float64 for
        the probes' :meth:`add` (``logits`` may be overwritten once this returns)."""
        logits = logits.float()
        new_max = torch.maximum(self.max[a:b], logits.amax(dim=-1).double())
        scale = (self.max[a:b] - new_max).exp_()  # 0 on the first slice (exp(-inf))
        self.max[a:b] = new_max
        self.sum[a:b] *= scale
        self.dot[:, a:b] *= scale
        weights = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)
        for r0, r1 in row_blocks(logits.shape[0], logits.shape[1], self.block_bytes):
            centred = logits[r0:r1] - new_max[r0:r1].unsqueeze(-1)  # float64 (type promotion)
            torch.exp(centred, out=weights[r0:r1])
            self.dot[:, a + r0:a + r1] += centred.mul_(weights[r0:r1]).sum(dim=-1)
        self.slice_sum[a:b] = weights.sum(dim=-1)
        self.sum[a:b] += self.slice_sum[a:b]
        return weights

    def add(self, n: int, a: int, b: int, weights: torch.Tensor, logits: torch.Tensor) -> None:
        """Fold probe ``n``'s logits ``(b - a, W)`` of the same slice in (``weights`` from
        :meth:`reference`). One float64 pass per row block serves both sums: centred on the
        probe's own maximum M, sum exp(z - m) (y - m) = sum exp(z - m) (y - M) + (M - m) s_slice
        and lse(y) = M + log sum exp(y - M)."""
        logits = logits.float()
        lse = torch.empty(logits.shape[0], dtype=torch.float64, device=logits.device)
        for r0, r1 in row_blocks(logits.shape[0], logits.shape[1], self.block_bytes):
            top = logits[r0:r1].amax(dim=-1).double()
            centred = logits[r0:r1] - top.unsqueeze(-1)  # float64 (type promotion)
            shift = (top - self.max[a + r0:a + r1]) * self.slice_sum[a + r0:a + r1]
            self.dot[n, a + r0:a + r1] -= (centred * weights[r0:r1]).sum(dim=-1) + shift
            lse[r0:r1] = top + centred.exp_().sum(dim=-1).log_()
        self.lse[n, a:b] = torch.logaddexp(self.lse[n, a:b], lse)

    def result(self) -> torch.Tensor:
        """Per probe and row KL ``(N, R)`` float64, clamped at 0."""
        ref_lse = self.max + self.sum.log()
        return (self.dot / self.sum - ref_lse + self.lse).clamp_min(0.0)


@torch.no_grad()
def masked_kl(ref_logprobs: torch.Tensor, logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Per-prompt mean KL(p_ref || p_mod) over real positions, in nats.

    Args:
        ref_logprobs: ``(B, T, V)`` float32 log-softmax of the reference logits.
        logits: ``(B, T, V)`` logits of the modified model (any float dtype; promoted to fp32).
        attention_mask: ``(B, T)``, 1 = real position.

    Returns:
        ``(B,)`` float64: for each prompt, the mean over its real positions of
        sum_v p_ref(v) (log p_ref(v) - log p_mod(v)). Per-position values are clamped at
        0 (they are >= 0 in exact arithmetic). NaN/inf propagate. Positions are processed
        in chunks of :data:`KL_CHUNK_POSITIONS`; per-position values are summed per prompt
        in float64, in position order.

    Raises:
        ValueError: shape mismatch or a prompt with no real position.
    """
    if ref_logprobs.shape != logits.shape or attention_mask.shape != logits.shape[:2]:
        raise ValueError(
            f"shape mismatch: ref {tuple(ref_logprobs.shape)}, logits {tuple(logits.shape)}, "
            f"mask {tuple(attention_mask.shape)}"
        )
    bsz, seqlen, vocab = logits.shape
    mask = attention_mask.to(logits.device).bool()
    ref_logprobs = ref_logprobs.to(logits.device)
    counts = mask.sum(dim=1).cpu()
    if bool((counts == 0).any()):
        raise ValueError("a prompt has no real position (all padding)")
    rows = mask.reshape(-1).nonzero().squeeze(1)
    ref_flat = ref_logprobs.reshape(-1, vocab)
    mod_flat = logits.reshape(-1, vocab)
    prompt_of_row = (rows // seqlen).cpu()
    sums = torch.zeros(bsz, dtype=torch.float64)
    for start in range(0, rows.numel(), KL_CHUNK_POSITIONS):
        idx = rows[start : start + KL_CHUNK_POSITIONS]
        kl = kl_rows(ref_flat.index_select(0, idx), mod_flat.index_select(0, idx))
        sums.index_add_(0, prompt_of_row[start : start + KL_CHUNK_POSITIONS], kl.double().cpu())
    return sums / counts.double()
