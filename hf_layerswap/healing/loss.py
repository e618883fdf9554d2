"""The distillation loss: KL(teacher || student) of next-token distributions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["distillation_loss", "next_token_cross_entropy", "teacher_top_k", "top_k_distillation_loss"]


def distillation_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    attention_mask: torch.Tensor,
    input_ids: torch.Tensor | None = None,
    *,
    ce_weight: float = 0.0,
) -> torch.Tensor:
    """Mean KL(teacher || student), nats per real token, at temperature 1, plus
    ``ce_weight`` times the next-token cross-entropy on the text.

    Args:
        student_logits, teacher_logits: ``(B, T, V)``; log-softmax runs in fp32.
        attention_mask: ``(B, T)`` 0/1, 1 = real token; only real positions count.
        input_ids: ``(B, T)``; needed when ``ce_weight > 0``.
        ce_weight: weight of the cross-entropy term (0 = pure distillation).

    Returns:
        A scalar tensor (nats).

    Raises:
        ValueError: mismatched shapes, or ``ce_weight > 0`` without ``input_ids``.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ"
        )
    real = attention_mask.bool()
    log_s = F.log_softmax(student_logits[real].float(), dim=-1)
    log_t = F.log_softmax(teacher_logits[real].float(), dim=-1)
    loss = (log_t.exp() * (log_t - log_s)).sum(-1).mean()
    if ce_weight:
        if input_ids is None:
            raise ValueError(f"ce_weight={ce_weight!r} needs input_ids")
        loss = loss + ce_weight * next_token_cross_entropy(student_logits, input_ids, attention_mask)
    return loss


def next_token_cross_entropy(student_logits: torch.Tensor, input_ids: torch.Tensor,
                             attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy on the text, nats per predicted real token.

    Args:
        student_logits: ``(B, T, V)``; runs in fp32.
        input_ids, attention_mask: ``(B, T)``; a position counts when it and the next are real.

    Returns:
        A scalar tensor (nats).
    """
    real = attention_mask.bool()
    targets = real[:, :-1] & real[:, 1:]
    logits = student_logits[:, :-1][targets].float()
    return F.cross_entropy(logits, input_ids[:, 1:][targets])


def teacher_top_k(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher's ``k`` most likely next tokens and the rest of its mass, for the cache
    :func:`top_k_distillation_loss` reads.

    Args:
        teacher_logits: ``(..., V)``; log-softmax runs in fp32.
        k: tokens kept per position, ``1 <= k <= V``.

    Returns:
        ``(log_probs, indices, rest)``: ``(..., k)`` fp32 log-probabilities of the top-k
        tokens, their ``(..., k)`` int64 token ids, and ``(...)`` the log of the mass of
        the other ``V - k`` tokens (``-inf`` when ``k == V``).

    Raises:
        ValueError: ``k`` outside ``1..V``.
    """
    vocab = teacher_logits.shape[-1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= vocab:
        raise ValueError(f"teacher_top_k={k!r}: must be an int in 1..{vocab} (the vocabulary size)")
    log_t = F.log_softmax(teacher_logits.float(), dim=-1)
    values, indices = log_t.topk(k, dim=-1)
    rest = _rest_log_mass(log_t, indices)
    return values, indices, rest.masked_fill(rest < torch.finfo(rest.dtype).min / 2, float("-inf"))


def _rest_log_mass(log_probs: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """log of the probability mass outside ``indices`` (the masked entries get fp32's
    lowest finite value, not ``-inf``, so the gradient stays finite when nothing is left)."""
    masked = log_probs.scatter(-1, indices, torch.finfo(log_probs.dtype).min)
    return masked.logsumexp(-1)


def top_k_distillation_loss(
    student_logits: torch.Tensor,
    top_log_probs: torch.Tensor,
    top_indices: torch.Tensor,
    rest_log_mass: torch.Tensor,
    attention_mask: torch.Tensor,
) -> torch.Tensor:
    """Mean KL(teacher || student) over ``k + 1`` buckets, nats per real token: the
    teacher's top-k tokens one by one, and every other token together as one bucket.

    This is the loss of a cached teacher (:func:`teacher_top_k`): the cache holds ``k``
    log-probabilities and one remaining mass per position instead of ``V`` logits. Merging
    tokens into one bucket can only lose information, so by the data-processing inequality
    the bucketed KL is a lower bound of the full KL
    (:func:`distillation_loss`), equal to it when ``k == V`` or when the student's
    distribution over the other tokens is proportional to the teacher's.

    Args:
        student_logits: ``(B, T, V)``; log-softmax runs in fp32.
        top_log_probs, top_indices: ``(B, T, k)`` from :func:`teacher_top_k`.
        rest_log_mass: ``(B, T)`` from :func:`teacher_top_k`.
        attention_mask: ``(B, T)`` 0/1, 1 = real token; only real positions count.

    Returns:
        A scalar tensor (nats).

    Raises:
        ValueError: the cache does not match the student's ``(B, T)``.
    """
    if top_log_probs.shape[:-1] != student_logits.shape[:-1] or top_indices.shape != top_log_probs.shape:
        raise ValueError(f"teacher cache {tuple(top_log_probs.shape)} / {tuple(top_indices.shape)} does not match "
                         f"the student logits {tuple(student_logits.shape)}")
    real = attention_mask.bool()
    log_s = F.log_softmax(student_logits[real].float(), dim=-1)
    idx = top_indices[real].long()
    log_t = top_log_probs[real].float()
    top = (log_t.exp() * (log_t - log_s.gather(-1, idx))).sum(-1)
    rest_t = rest_log_mass[real].float()
    has_rest = torch.isfinite(rest_t)
    rest_s = _rest_log_mass(log_s, idx)
    safe_t = torch.where(has_rest, rest_t, torch.zeros_like(rest_t))
    rest = torch.where(has_rest, safe_t.exp() * (safe_t - rest_s), torch.zeros_like(rest_t))
    return (top + rest).mean()
