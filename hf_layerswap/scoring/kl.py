"""The KL arithmetic of scoring: per-row KL(p_ref || softmax(logits)) in fp32 on row
blocks (cache-sized on a CPU, large on an accelerator: the engine sizes them), the vocabulary-sliced online form with float64 log-sum-exps, and
:func:`masked_kl` over real positions. Pure tensor maths, no model."""

from __future__ import annotations

import math

import torch

__all__ = [
    "chunk_bounds", "KL_CHUNK_POSITIONS", "kl_rows", "KL_SUB_BYTES", "lse64", "masked_kl", "row_blocks", "VocabKL",
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


def lse64(logits: torch.Tensor, block_bytes: int = KL_SUB_BYTES) -> torch.Tensor:
    """Row log-sum-exp of fp32 logits ``(R, V)``, computed in float64 on row blocks of
    ``block_bytes`` fp32 bytes."""
    out = torch.empty(logits.shape[0], dtype=torch.float64, device=logits.device)
    for a, b in row_blocks(*logits.shape, block_bytes):
        z = logits[a:b].double()
        m = z.amax(dim=-1, keepdim=True)
        out[a:b] = (m + (z - m).exp_().sum(dim=-1, keepdim=True).log_()).squeeze(-1)
    return out


class VocabKL:
    """KL(p_ref || q) per row accumulated over vocabulary slices, exactly rearranged:

    sum_v p_v (log p_v - log q_v) = sum_v p_v (z_ref,v - z_v) + (lse(z) - lse(z_ref)) sum_v p_v

    with p = softmax(z_ref). Per slice a probe needs only its logits of that slice. The
    two terms nearly cancel when the distributions are close, so p, the products and the
    log-sum-exps are float64 (the logits stay fp32): the result is the KL of the fp32
    logits to ~1e-7 relative."""

    def __init__(self, rows: int, device, block_bytes: int = KL_SUB_BYTES):
        self.block_bytes = block_bytes
        self.dot = torch.zeros(rows, dtype=torch.float64, device=device)
        self.lse = torch.full((rows,), -math.inf, dtype=torch.float64, device=device)

    def add(self, ref_logits: torch.Tensor, ref_probs: torch.Tensor, logits: torch.Tensor) -> None:
        logits = logits.float()
        for a, b in row_blocks(*logits.shape, self.block_bytes):
            diff = (ref_logits[a:b] - logits[a:b]).double()
            self.dot[a:b] += diff.mul_(ref_probs[a:b]).sum(dim=-1)
        self.lse = torch.logaddexp(self.lse, lse64(logits, self.block_bytes))

    def result(self, ref_lse: torch.Tensor, ref_mass: torch.Tensor) -> torch.Tensor:
        return (self.dot + (self.lse - ref_lse) * ref_mass).clamp_min(0.0)


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
