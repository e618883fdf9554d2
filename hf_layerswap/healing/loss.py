"""The distillation loss: KL(teacher || student) of next-token distributions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["distillation_loss"]


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
        targets = real[:, :-1] & real[:, 1:]
        logits = student_logits[:, :-1][targets].float()
        loss = loss + ce_weight * F.cross_entropy(logits, input_ids[:, 1:][targets])
    return loss
