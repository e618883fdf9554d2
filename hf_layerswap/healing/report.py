"""What :func:`~hf_layerswap.healing.heal` did, as a JSON-able report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..jsonio import JsonResult

__all__ = ["RUN_SETTINGS", "HealReport"]

#: The :func:`~hf_layerswap.healing.heal` keywords a report keeps in ``settings``.
RUN_SETTINGS = ("max_tokens", "seq_len", "packing", "batch_size", "heldout_prompts", "eval_every")


@dataclass
class HealReport(JsonResult):
    """One healing run.

    Attributes:
        method: the ``method=`` name.
        tokens: real training tokens the student saw.
        steps: optimiser steps taken.
        learning_rate: peak learning rate.
        seed: training seed.
        data: description of the training (calibration) text.
        heldout: description of the held-out prompts the KL is measured on.
        kl_before, kl_after: held-out KL(teacher || student), nats per real token, before
            training and of the returned weights.
        reverted: ``True`` when training never beat the starting held-out KL and the
            starting weights were returned (then ``kl_after == kl_before``).
        loss_history: ``[{"step": s, "loss": nats}]`` training losses as logged.
        eval_history: ``[{"step": s, "kl": nats}]`` held-out KL at each evaluation.
        data_hash: sha256 of the training and held-out token ids
            (:attr:`~hf_layerswap.calibration.CalibrationSet.content_hash`).
        teacher_top_k: ``None`` (the teacher's full logits) or the ``k`` of the cached
            top-k teacher.
        ce_weight: weight of the cross-entropy term.
        final_loss: the last logged training loss (nats), ``None`` without a step.
        tokens_per_step: mean real tokens per optimiser step (converts steps to tokens).
        options: the method's options (``lora_r``, ``k``, ...).
        perplexity: when ``perplexity_text`` was given (else empty): the perplexity of
            each stage (:data:`~hf_layerswap.healing.measure.PERPLEXITY_STAGES`):
            ``dense`` (the teacher), ``after_cut``, ``after_repair`` (only when the last
            removal step repaired its cut; ``repair`` names the method) and
            ``after_healing``, ``None`` for a stage that could not be measured; ``start``
            names the stage healing started from; ``contract``, ``text``,
            ``text_sha256``, ``window``, ``stride``, ``words``: the one contract all stages
            were measured under.
        tasks: when ``eval_tasks`` was given (else empty): ``before`` and ``after``
            (``{task: {metric: value}}`` of :class:`~hf_layerswap.tasks.TaskResults`) and the
            ``settings``, ``versions``, ``task_hashes``, ``n_samples`` and ``higher_is_better``
            (lm-eval's direction of each metric) they share.
        packing: ``True`` when the training text was packed into full windows
            (``heal(packing=True)`` on a text source), ``False`` for one prompt per
            paragraph or given tensors.
        distinct_tokens: real tokens of the distinct training prompts (held-out ones not
            counted); ``None`` in reports written before it was recorded.
        epochs: ``tokens / distinct_tokens``: above 1 when the text was shorter than the
            budget and repeated; ``None`` when not recorded.
        patience: the early stop's patience in held-out evaluations (the ``patience=``
            count, or the one ``None`` resolved to); ``None`` in reports written before it
            was recorded.
        settings: the other :func:`~hf_layerswap.healing.heal` keywords the run was made with
            (:data:`RUN_SETTINGS`: ``max_tokens``, ``seq_len``, ``packing``, ``batch_size``,
            ``heldout_prompts``, ``eval_every``); with the fields above they give the command
            that reproduces the run (the card shows it). Empty in reports written before it
            was recorded.
    """

    method: str
    tokens: int
    steps: int
    learning_rate: float
    seed: int
    data: str
    heldout: str
    kl_before: float
    kl_after: float
    reverted: bool = False
    loss_history: list = field(default_factory=list)
    eval_history: list = field(default_factory=list)
    data_hash: str = ""
    teacher_top_k: int | None = None
    ce_weight: float = 0.0
    final_loss: float | None = None
    tokens_per_step: float = 0.0
    options: dict = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)
    tasks: dict = field(default_factory=dict)
    packing: bool = False
    distinct_tokens: int | None = None
    epochs: float | None = None
    patience: int | None = None
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> HealReport:
        return cls(**data)
