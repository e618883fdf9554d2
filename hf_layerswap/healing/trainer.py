"""transformers' ``Trainer`` with the distillation loss and a best-weights early stop."""

from __future__ import annotations

import torch
from transformers import Trainer, TrainerCallback

from .loss import distillation_loss

__all__ = ["BestWeights", "DistillationTrainer"]


class DistillationTrainer(Trainer):
    """A ``Trainer`` whose loss is :func:`~hf_layerswap.healing.loss.distillation_loss`
    against ``teacher``'s logits, computed on the fly (teacher in eval mode, no grad). The
    evaluation loss is the same KL with ``ce_weight=0``."""

    def __init__(self, *args, teacher, ce_weight: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval()
        self.ce_weight = ce_weight

    def _loss(self, model, inputs, ce_weight):
        with torch.no_grad():
            teacher_logits = self.teacher(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
        return distillation_loss(logits, teacher_logits, inputs["attention_mask"], inputs["input_ids"], ce_weight=ce_weight)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = self._loss(model, inputs, self.ce_weight)
        return (loss, None) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            return self._loss(model, inputs, 0.0).detach(), None, None


class BestWeights(TrainerCallback):
    """Keeps the trainable weights of the best held-out KL seen (starting with ``start_kl``
    and the weights before training) and stops after ``patience`` evaluations without an
    improvement of more than ``min_delta`` nats."""

    def __init__(self, model, start_kl: float, patience: int, min_delta: float = 0.0):
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.best_kl = start_kl
        self.best = self.snapshot()
        self.improved = False
        self.patience, self.min_delta, self.waited = patience, min_delta, 0
        self.history: list[dict] = []

    def snapshot(self) -> dict:
        return {n: p.detach().clone() for n, p in self.params.items()}

    def restore(self) -> None:
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(self.best[name])

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        kl = float(metrics["eval_loss"])
        self.history.append({"step": state.global_step, "kl": kl})
        if kl < self.best_kl - self.min_delta:
            self.best_kl, self.best, self.improved, self.waited = kl, self.snapshot(), True, 0
        else:
            self.waited += 1
            if self.waited >= self.patience:
                control.should_training_stop = True
