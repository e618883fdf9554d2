"""Healing a sparsified student without filling its zeros.

A student that :func:`~hf_layerswap.sparsity.sparsify` pruned (``config.layerswap_sparsity``
records it) is healed mask-preserving: the zero weights of every ``nn.Linear`` inside its
decoder blocks (the weights the sparsity record counts) are found before training and set
back to zero after every optimiser step (:class:`KeepZeros`, a ``TrainerCallback``, so the
held-out evaluations and the early stop's best weights see the sparse model) and once more
after the method's ``finish`` (LoRA's merge adds a dense update). The sparsity record stays
true: the healed model has exactly the zeros it had.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import TrainerCallback

from ..layerplan import decoder_blocks
from ..sparsity.engine import prunable_linears
from .measure import sparsified
from .report import HealReport
from .teacher import heldout_kl

__all__ = ["KeepZeros", "ZeroMask", "keep_zeros"]


class ZeroMask:
    """The zero weights of a sparsified model's block linears, to set back to zero.

    Attributes:
        linears: ``[(module, zeros)]``: each ``nn.Linear`` inside a decoder block and its
            boolean ``(out_features, in_features)`` mask of the weights that are zero.
    """

    def __init__(self, linears: list[tuple[nn.Linear, torch.Tensor]]):
        self.linears = linears

    @classmethod
    def of(cls, model: nn.Module) -> ZeroMask | None:
        """The mask of ``model`` when it is sparsified (``config.layerswap_sparsity`` names a
        method), else ``None``."""
        if not sparsified(model):
            return None
        _, _, blocks = decoder_blocks(model)
        return cls([(lin, lin.weight.detach() == 0) for block in blocks for _, lin in prunable_linears(block)])

    def apply(self) -> None:
        """Set the masked weights back to zero (in place)."""
        with torch.no_grad():
            for lin, zeros in self.linears:
                lin.weight.masked_fill_(zeros.to(lin.weight.device), 0)

    def zeros(self) -> int:
        """How many weights the mask holds at zero."""
        return int(sum(int(zeros.sum()) for _, zeros in self.linears))

    def record(self) -> dict:
        """``{"linears", "zeros"}``: what the healing record keeps of the mask."""
        return {"linears": len(self.linears), "zeros": self.zeros()}


class KeepZeros(TrainerCallback):
    """Sets the mask's weights back to zero after every optimiser step."""

    def __init__(self, mask: ZeroMask):
        self.mask = mask

    def on_step_end(self, args, state, control, **kwargs):
        self.mask.apply()


def keep_zeros(zeros: ZeroMask | None, merges: bool, healed: nn.Module, teacher: nn.Module, held, batch_size: int,
               report: HealReport) -> None:
    """Set a sparsified student's zeros back after the method's ``finish`` and record them in
    ``report.kept_zeros``; a method that ``merges`` added parameters (LoRA) trained a dense
    update, so its held-out KL after (nats per real token over the ``held`` prompts, in
    batches of ``batch_size``) is measured again on the masked weights, the unmasked value
    kept as ``kl_after_unmasked``. Nothing for a dense student (``zeros`` ``None``)."""
    if zeros is None:
        return
    zeros.apply()
    report.kept_zeros = zeros.record()
    if merges:
        report.kept_zeros["kl_after_unmasked"] = report.kl_after
        report.kl_after = heldout_kl(healed, teacher, held, batch_size)[0]
