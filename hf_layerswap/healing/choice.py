"""The settings :func:`~hf_layerswap.healing.heal` chooses when they are left at ``None``:
the training budget for the model and the device, and the learning rate for the model.

- **budget** (``max_tokens=None``): as many whole optimiser steps as fit
  :data:`HEAL_SECONDS` on the student's device (:func:`time_budget`: a step is a student forward
  and backward, the backward as 2 forwards, and a teacher forward, each forward timed there
  on a batch of the run's shape, :func:`time_forwards`: on the CPU its CPU time over torch's
  threads), and no more than one pass over the
  training text (the text is never repeated by default); ``prune --dry-run`` predicts it with
  the same count at the cost model's rates (:func:`~hf_layerswap.cost.steps.heal_budget`);
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

__all__ = ["HEAL_SECONDS", "PROBE_SHARE", "TIMED_FORWARDS", "probe_learning_rate", "probe_steps", "time_budget", "time_forwards"]

#: The default budget's time target (``heal(max_tokens=None)``): seconds of training steps on the device.
HEAL_SECONDS = 600.0
#: The probe's steps per candidate rate, as a share of the run's steps (at least 2, at most the run's).
PROBE_SHARE = 1 / 16
#: Timed forwards of each model for the budget (after one untimed); their median counts.
TIMED_FORWARDS = 3


def time_budget(student_seconds: float, teacher_seconds: float, batch_size: int, width: int,
           seconds: float = HEAL_SECONDS) -> dict:
    """The default training budget: as many whole optimiser steps of ``batch_size`` x
    ``width`` positions as fit ``seconds``, a step costing a student forward and backward
    (the backward as 2 forwards, the cost model's count: 3 x ``student_seconds``) and a
    teacher forward (``teacher_seconds``), each the time of one forward over such a batch; at
    least one step.

    Returns:
        ``{"rule": "time", "seconds": the target, "step_seconds", "steps", "max_tokens":
        steps x batch_size x width, "tokens_per_second"}``.
    """
    step = 3.0 * student_seconds + teacher_seconds
    steps = max(1, math.floor(seconds / step)) if step > 0 else 1
    return {"rule": "time", "seconds": float(seconds), "step_seconds": step, "steps": steps,
            "max_tokens": steps * batch_size * width, "tokens_per_second": batch_size * width / step}


def time_forwards(model, ids: torch.Tensor) -> float:
    """Seconds of one forward of ``model`` over the token ids ``ids`` (``(B, T)``, on its
    input device), without gradients: the median of :data:`TIMED_FORWARDS` after one untimed.
    On an accelerator the wall time (synchronised); on the CPU the process's CPU time over
    torch's threads, the machine's own speed rather than its momentary load (on cores shared
    with other work the wall time of a forward would shrink the budget with everyone else's)."""
    cpu = ids.device.type == "cpu"
    clock = time.process_time if cpu else time.perf_counter
    times = []
    with torch.no_grad():
        for i in range(TIMED_FORWARDS + 1):
            if ids.device.type == "cuda":
                torch.cuda.synchronize(ids.device)
            began = clock()
            model(input_ids=ids)
            if ids.device.type == "cuda":
                torch.cuda.synchronize(ids.device)
            if i:
                times.append((clock() - began) / (torch.get_num_threads() if cpu else 1))
    return sorted(times)[len(times) // 2]


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
