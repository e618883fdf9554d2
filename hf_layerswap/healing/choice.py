"""The settings :func:`~hf_layerswap.healing.heal` chooses when they are left at ``None``:
the training budget for the model and the device, and the learning rate for the model.

- **budget** (``max_tokens=None``): as many whole optimiser steps as fit
  :data:`~hf_layerswap.cost_steps.HEAL_SECONDS` on the student's device at the cost model's
  rates (:func:`~hf_layerswap.cost.measure_throughput`, the probe ``prune --dry-run`` times;
  :func:`~hf_layerswap.cost_steps.heal_budget`), and no more than one pass over the
  training text (the text is never repeated by default);
- **learning rate** (``learning_rate=None``): a short probe on the held-out KL: each of the
  method's candidate rates (:attr:`~hf_layerswap.healing.methods.HealMethod.learning_rates`,
  ascending) trains :func:`probe_steps` steps at a constant rate from the same starting
  weights on the first training prompts, then the held-out KL is measured; the rate of the
  lowest KL wins (the lower rate on a tie; a non-finite KL never wins), and the starting
  weights are put back before the run.

A run with the chosen values given explicitly (``max_tokens=``, ``learning_rate=``) trains
the same steps on the same prompts and ends with the same weights.
"""

from __future__ import annotations

import math
import tempfile
import time

import torch
from transformers import PrinterCallback

from .trainer import DistillationTrainer, training_arguments

__all__ = ["PROBE_SHARE", "probe_learning_rate", "probe_steps"]

#: The probe's steps per candidate rate, as a share of the run's steps (at least 2, at most the run's).
PROBE_SHARE = 1 / 16


def probe_steps(steps: int) -> int:
    """Optimiser steps the learning-rate probe trains per candidate for a run of ``steps``:
    ``ceil(steps x PROBE_SHARE)``, at least 2 and at most ``steps``."""
    return min(steps, max(2, math.ceil(steps * PROBE_SHARE)))


def probe_learning_rate(student, teacher, train, held, settings: dict, candidates, *, steps: int, device,
                        world: int, rows_type) -> dict:
    """Train ``steps`` steps at each rate of ``candidates`` from the same starting weights on
    the first ``steps x batch_size`` rows of ``train`` and measure the held-out KL of each
    (nats per real token, the run's evaluation); the starting weights are put back after
    each. ``rows_type`` builds the probe's rows (``rows_type(ids, mask)``, with ``cache``).

    Returns:
        ``{"rule": "probe", "learning_rate": the chosen rate, "candidates": [{"learning_rate",
        "kl"}], "steps": steps per candidate, "prompts": the rows trained on, "kl_before":
        the held-out KL at the start, "seconds": the probe's wall time}``.
    """
    began = time.perf_counter()
    params = {n: p for n, p in student.named_parameters() if p.requires_grad}
    start = {n: p.detach().clone() for n, p in params.items()}
    count = min(len(train), steps * settings["batch_size"])
    rows = rows_type(train.ids[:count], train.mask[:count])
    if train.cache is not None:
        rows.cache = {key: values[:count] for key, values in train.cache.items()}
    results, before = [], None
    with tempfile.TemporaryDirectory() as scratch:
        for rate in sorted(candidates):
            args = training_arguments(settings, scratch, steps=steps, device=device, world=world, learning_rate=rate,
                                      lr_scheduler_type="constant", eval_strategy="no", save_strategy="no")
            trainer = DistillationTrainer(model=student, args=args, train_dataset=rows, eval_dataset=held,
                                          teacher=teacher, ce_weight=settings["ce_weight"])
            trainer.remove_callback(PrinterCallback)
            if before is None:
                before = float(trainer.evaluate()["eval_loss"])
            try:
                trainer.train()
                kl = float(trainer.evaluate()["eval_loss"])
            finally:
                with torch.no_grad():
                    for name, param in params.items():
                        param.copy_(start[name])
            results.append({"learning_rate": float(rate), "kl": kl})
    finite = [r for r in results if math.isfinite(r["kl"])]
    chosen = min(finite, key=lambda r: r["kl"])["learning_rate"] if finite else results[0]["learning_rate"]
    return {"rule": "probe", "learning_rate": chosen, "candidates": results, "steps": steps, "prompts": count,
            "kl_before": before, "seconds": time.perf_counter() - began}
