"""What :func:`~hf_layerswap.healing.heal` did, as a JSON-able report."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields

from ..utils.jsonio import JsonResult, decode_float

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
            removal step repaired its cut; ``repair`` names the method),
            ``after_earlier_healing`` (a second run: the student healed before, where this run
            started; ``earlier_healing`` names that run), ``after_sparsity`` (a student sparsified
            since its cut and not healed since: where this run started) and ``after_healing``, ``None`` for a stage that could not be measured; ``start``
            names the stage healing started from; ``contract``, ``text``,
            ``text_sha256``, ``window``, ``stride``, ``words``: the one contract all stages
            were measured under.
        tasks: when ``eval_tasks`` was given (else empty): ``before`` and ``after``
            (``{task: {metric: value}}`` of :class:`~hf_layerswap.evaluation.tasks.TaskResults`) and the
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
        teacher: ``{"name", "fingerprint", "matches", "note"}`` of the teacher
            (:func:`~hf_layerswap.healing.distill.teacher_origin`): ``matches`` ``True`` when its
            weights are those of the model the student was cut from, ``False`` for another
            teacher accepted with ``allow_foreign_teacher``, ``None`` when the record could not
            tell (``note`` says why). Empty in reports written before it was recorded.
        choice: how the budget and the learning rate were set
            (:mod:`~hf_layerswap.healing.choice`): ``{"max_tokens": {...}, "learning_rate":
            {...}}``, each ``{"rule": "given"}`` when the caller gave the value, else the
            budget's ``{"rule": "time", "seconds", "step_seconds", "steps", "max_tokens",
            "throughput", "tokens_per_second", "device"}`` (``"text_limited": True`` when one
            pass over the text gave fewer steps) and the probe's ``{"rule": "probe",
            "learning_rate", "candidates": [{"learning_rate", "kl"}], "steps", "prompts",
            "kl_before", "seconds"}``. Empty in reports written before it was recorded.
        kept_zeros: for a sparsified student (healed mask-preserving,
            :mod:`~hf_layerswap.healing.mask`): ``{"linears", "zeros"}``, the block linears and
            the zero weights set back after every optimiser step and after the method's finish;
            for a method that merges added parameters (LoRA) also ``kl_after_unmasked``, the
            best held-out KL before the zeros were set back (``kl_after`` is then measured on
            the masked weights). Empty for a dense student.
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
    teacher: dict = field(default_factory=dict)
    choice: dict = field(default_factory=dict)
    kept_zeros: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> HealReport:
        """The report of ``data`` (what :meth:`to_dict` / ``to_json`` wrote), checked.

        Raises:
            ValueError: not a mapping, an unknown or missing field, or a field of the wrong
                type (naming the field, its value and what is allowed); ``from_json`` adds
                the file and the class.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}: allowed {sorted(names)}")
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
                   and f.name not in data]
        if missing:
            raise ValueError(f"missing field(s) {missing}")
        out = dict(data)
        for name in ("method", "data", "heldout", "data_hash"):
            if name in out and not isinstance(out[name], str):
                raise ValueError(f"{name}={out[name]!r}: must be a string")
        for name in ("tokens", "steps", "seed", "distinct_tokens", "patience", "teacher_top_k"):
            value = out.get(name)
            if value is None and name in ("distinct_tokens", "patience", "teacher_top_k"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r}: must be an int >= 0")
        for name in ("learning_rate", "kl_before", "kl_after", "ce_weight", "final_loss", "tokens_per_step", "epochs"):
            if name in out:
                try:
                    out[name] = decode_float(out[name])
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from None
                if out[name] is None and name not in ("final_loss", "epochs"):
                    raise ValueError(f"{name}=None: must be a number")
        for name in ("kl_before", "kl_after"):
            if math.isfinite(out[name]) and out[name] < 0:
                raise ValueError(f"{name}={out[name]!r}: a KL is never negative")
        for name in ("reverted", "packing"):
            if name in out and not isinstance(out[name], bool):
                raise ValueError(f"{name}={out[name]!r}: must be true or false")
        for name in ("options", "perplexity", "tasks", "settings", "teacher", "choice", "kept_zeros"):
            if name in out and not isinstance(out[name], Mapping):
                raise ValueError(f"{name}={out[name]!r}: must be a JSON object")
        for name, key in (("loss_history", "loss"), ("eval_history", "kl")):
            rows = out.get(name, [])
            if not isinstance(rows, list):
                raise ValueError(f"{name}={rows!r}: must be a list of {{'step', {key!r}}} objects")
            checked = []
            for row in rows:
                step = row.get("step") if isinstance(row, Mapping) else None
                if isinstance(step, bool) or not isinstance(step, int) or step < 0 or key not in row:
                    raise ValueError(f"{name} entry {row!r}: must be {{'step': int >= 0, {key!r}: number}}")
                try:
                    checked.append({**row, key: decode_float(row[key])})
                except ValueError as err:
                    raise ValueError(f"{name} entry {row!r}: {err}") from None
            out[name] = checked
        return cls(**out)
