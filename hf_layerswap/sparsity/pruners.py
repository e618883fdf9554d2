"""Per-linear one-shot pruners: Wanda, SparseGPT and magnitude (a baseline).

All work on one weight ``W`` of shape ``(out_features, in_features)`` and its calibration
statistic, and return the pruned weight (same dtype) and a boolean mask of the entries set
to zero. Patterns: ``None`` (unstructured) or ``"N:M"`` (N zeros in every group of M
consecutive input columns of each row, e.g. ``"2:4"``).

- Wanda (Sun et al., arXiv 2306.11695): score ``S_ij = |W_ij| ||X_j||_2``; the
  comparison group is each output row (unstructured: the ``round(s in_features)``
  lowest of the row; N:M: the N lowest of each group). No weight update.
- SparseGPT (Frantar & Alistarh, arXiv 2301.00774): OBS with the shared row Hessian
  ``H = 2 X^T X / n``, relative damping, the upper Cholesky factor of ``H^-1``, column
  blocks with adaptive masks and lazy updates; fp32 throughout.
"""

from __future__ import annotations

import re

import torch

from ..utils.registry_names import RegistryNames
from .registry import PRUNERS

__all__ = [
    "METHODS",
    "lowest_k_mask",
    "magnitude_prune",
    "parse_pattern",
    "sparsegpt_prune",
    "wanda_prune",
    "wanda_scores",
]

#: The registered pruner names now, a live view of
#: :data:`~hf_layerswap.sparsity.registry.PRUNERS`: a pruner registered later is in it.
METHODS = RegistryNames(lambda: PRUNERS)


def parse_pattern(pattern: str | None) -> tuple[int, int] | None:
    """``None`` -> ``None``; ``"N:M"`` -> ``(N, M)`` with ``0 < N < M``.

    Raises:
        ValueError: anything else (the message names the value and the allowed form).
    """
    if pattern is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", str(pattern))
    if not match:
        raise ValueError(f"pattern={pattern!r}: allowed None (unstructured) or 'N:M' such as '2:4'")
    n, m = int(match.group(1)), int(match.group(2))
    if not 0 < n < m:
        raise ValueError(f"pattern={pattern!r}: N:M needs 0 < N < M")
    return n, m


def _check_nm(in_features: int, nm: tuple[int, int] | None) -> None:
    if nm is not None and in_features % nm[1]:
        raise ValueError(f"pattern {nm[0]}:{nm[1]} needs in_features divisible by {nm[1]}, got {in_features}")


def lowest_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the ``k`` lowest entries of each row of a 2-D tensor; ties at the
    k-th value go to the lower column index first (what a stable sort gives), found with
    ``kthvalue`` instead of a full sort."""
    rows, cols = scores.shape
    if k <= 0:
        return torch.zeros_like(scores, dtype=torch.bool)
    if k >= cols:
        return torch.ones_like(scores, dtype=torch.bool)
    kth = torch.kthvalue(scores, k, dim=1, keepdim=True).values
    below = scores < kth
    ties = scores == kth
    if int(ties.sum()) == rows:  # the k-th value itself is each row's only tie
        return below | ties
    need = k - below.sum(dim=1, keepdim=True)
    return below | (ties & (ties.cumsum(dim=1) <= need))


def _row_mask(scores: torch.Tensor, sparsity: float, nm: tuple[int, int] | None) -> torch.Tensor:
    """Prune the lowest scores per row (ties: lower column index first)."""
    rows, cols = scores.shape
    if nm is not None:
        n, m = nm
        return lowest_k_mask(scores.reshape(-1, m), n).reshape(rows, cols)
    return lowest_k_mask(scores, int(round(cols * sparsity)))


def wanda_scores(weight: torch.Tensor, row_norm_sq: torch.Tensor) -> torch.Tensor:
    """``|W| * sqrt(row_norm_sq)``, shape ``(out, in)``, fp32 (``row_norm_sq``: ``(in,)``,
    the sum of squared calibration inputs per input channel)."""
    if row_norm_sq.shape != (weight.shape[1],):
        raise ValueError(f"row_norm_sq has shape {tuple(row_norm_sq.shape)}, expected ({weight.shape[1]},)")
    return weight.detach().float().abs() * row_norm_sq.float().to(weight.device).sqrt().unsqueeze(0)


def wanda_prune(
    weight: torch.Tensor, row_norm_sq: torch.Tensor, sparsity: float, pattern: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wanda: zero the lowest ``|W_ij| ||X_j||_2`` per output row.

    Args:
        weight: ``(out_features, in_features)``.
        row_norm_sq: ``(in_features,)``, ``sum_t x_t[j]**2`` over calibration tokens.
        sparsity: fraction per row in [0, 1) (unstructured: ``round(s in_features)`` per row,
            the count nearest the target, where Wanda's reference code floors it; ignored for
            N:M, where it is N/M).
        pattern: ``None`` or ``"N:M"``.

    Returns:
        ``(pruned_weight, mask)``; mask ``True`` = set to zero.
    """
    nm = parse_pattern(pattern)
    _check_nm(weight.shape[1], nm)
    mask = _row_mask(wanda_scores(weight, row_norm_sq), sparsity, nm)
    return weight.detach().masked_fill(mask, 0), mask


def magnitude_prune(
    weight: torch.Tensor, sparsity: float, pattern: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Magnitude baseline: ``|W|`` with Wanda's per-row comparison group (no activations)."""
    ones = torch.ones(weight.shape[1], dtype=torch.float32, device=weight.device)
    return wanda_prune(weight, ones, sparsity, pattern)


def sparsegpt_prune(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float,
    pattern: str | None = None,
    *,
    blocksize: int = 128,
    percdamp: float = 0.01,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT: prune and update the remaining weights to compensate (OBS).

    Steps (fp32): dead inputs (``H_jj = 0``) get ``H_jj = 1`` and ``W[:, j] = 0``;
    ``H += percdamp mean(diag H) I``; ``U`` = upper Cholesky factor of ``H^-1``. For each
    column block ``[i1, i2)`` of width ``blocksize``: unstructured masks prune the
    ``round(s rows width)`` lowest ``W_ij^2 / U_jj^2`` of the block (the reference prunes
    everything up to that rank's value, ties included: one more); N:M masks pick the N
    lowest of each group of M when the column loop reaches it. Per column ``j``:
    ``err = (w_j - q_j) / U_jj``, ``W[:, j:i2] -= err U[j, j:i2]``; then the lazy update
    ``W[:, i2:] -= Err U[i1:i2, i2:]``.

    Args:
        weight: ``(out_features, in_features)``.
        hessian: ``(in_features, in_features)``, e.g. ``2 X^T X / n``.
        sparsity: fraction in [0, 1) (ignored for N:M).
        pattern: ``None`` or ``"N:M"``.
        blocksize: column block width (128 in the reference code); a multiple of M for N:M.
        percdamp: relative damping (0.01 in the reference code).
        mask: optional fixed ``(out, in)`` boolean mask to prune instead of choosing one
            (then only the weight update is computed).

    Returns:
        ``(pruned_weight, mask)`` with ``pruned_weight`` in ``weight``'s dtype.

    Raises:
        ValueError: bad shapes, ``blocksize``, ``percdamp``, or a Hessian that is not
            positive definite after damping (increase ``percdamp``).
    """
    rows, cols = weight.shape
    nm = parse_pattern(pattern)
    _check_nm(cols, nm)
    if hessian.shape != (cols, cols):
        raise ValueError(f"hessian has shape {tuple(hessian.shape)}, expected ({cols}, {cols})")
    if not isinstance(blocksize, int) or blocksize < 1 or (nm is not None and blocksize % nm[1]):
        raise ValueError(f"blocksize={blocksize!r}: must be a positive int (a multiple of M for N:M)")
    if not percdamp > 0:
        raise ValueError(f"percdamp={percdamp!r}: must be > 0")
    if mask is not None and mask.shape != weight.shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {tuple(weight.shape)}")
    W = weight.detach().clone().float()
    H = hessian.detach().clone().float().to(W.device)
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(cols, device=W.device)
    try:
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except RuntimeError as exc:  # torch.linalg.LinAlgError subclasses RuntimeError
        raise ValueError(
            f"the damped Hessian is not positive definite (percdamp={percdamp}); increase percdamp"
        ) from exc
    full_mask = torch.zeros(rows, cols, dtype=torch.bool, device=W.device)
    for i1 in range(0, cols, blocksize):
        i2 = min(i1 + blocksize, cols)
        W1 = W[:, i1:i2].clone()
        U1 = U[i1:i2, i1:i2]
        d1 = torch.diag(U1)
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        if mask is not None:
            mask1 = mask[:, i1:i2].to(W.device).clone()
        elif nm is None:
            scores = (W1 * W1) / (d1 * d1).unsqueeze(0)
            mask1 = lowest_k_mask(scores.reshape(1, -1), int(round(W1.numel() * sparsity))).reshape(W1.shape)
        else:
            mask1 = torch.zeros_like(W1, dtype=torch.bool)
        for i in range(i2 - i1):
            if mask is None and nm is not None and i % nm[1] == 0:
                n, m = nm
                scores = W1[:, i : i + m] ** 2 / (d1[i : i + m] ** 2).unsqueeze(0)
                mask1[:, i : i + m] = lowest_k_mask(scores, n)
            w = W1[:, i]
            q = w.masked_fill(mask1[:, i], 0.0)
            Q1[:, i] = q
            err = (w - q) / d1[i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i1:i2] = Q1
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]
        full_mask[:, i1:i2] = mask1
    full_mask |= dead.unsqueeze(0)
    return W.to(weight.dtype), full_mask
