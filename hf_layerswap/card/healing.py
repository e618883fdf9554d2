"""The card's healing section: what :func:`~hf_layerswap.healing.heal` did to the pruned
model, always with its held-out numbers before and after (a healing record without them is
shown as such, never as an improvement)."""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping

from ..healing.methods import HEAL_METHODS

from .evaluation import perplexity_eval_results

__all__ = ["HEALING_FILE", "heal_command", "healing_eval_results", "healing_section", "kl_summary", "tasks_table"]

#: The healing report sidecar (``HealReport.to_json``: the loss and held-out KL histories).
HEALING_FILE = "layerswap_healing.json"
_DASH = "—"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _finite(value) -> bool:
    """A finite number (a bool is not one: ``True`` is no measurement)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _nats(value) -> str:
    return f"{value:.4f}" if _finite(value) else _DASH


def _change(before, after) -> str:
    if not (_finite(before) and _finite(after)) or not before:
        return _DASH
    return f"{100 * (after - before) / before:+.1f}%"


def _not_finite(value) -> str:
    """The cell of a perplexity stage without a finite value: ``nan``/``inf`` kept visible
    (a result to report), anything that is no number (a bool, a string) never printed as
    if it were one."""
    if value is None:
        return "not measured"
    if isinstance(value, float):
        return str(value)
    return "not recorded as a number: cannot be judged"


def kl_summary(entry: Mapping) -> str:
    """A healing record's held-out KL before -> after in words (the card's row; a record
    without both finite values says it cannot be judged, a worse end says so)."""
    before, after = entry.get("kl_before"), entry.get("kl_after")
    if not (_finite(before) and _finite(after)):
        return ("not recorded: this healing cannot be judged (no finite held-out KL before and after: "
                f"{_nats(before)} → {_nats(after)})")
    text = f"{_nats(before)} → {_nats(after)} nats/token ({_change(before, after)})"
    if entry.get("reverted"):
        text += "; no evaluation beat the start, so the starting weights were kept"
    elif after > before:
        text += "; **worse than before healing**"
    return text


#: Row labels of the perplexity stages of a healing record (``{repair}``: the repair method).
_STAGES = {"dense": "Perplexity of the dense model (the teacher)", "after_cut": "Perplexity after the cut",
           "after_repair": "Perplexity after the repair ({repair})",
           "after_earlier_healing": "Perplexity after healing run {earlier} (where this run started)",
           "after_sparsity": "Perplexity after the sparsification (where this run started)",
           "after_healing": "Perplexity after healing"}


def _start_words(ppl: Mapping, start: str) -> str:
    """The stage healing started from, in words (``after the repair``, ``after healing run 1``)."""
    if start == "after_earlier_healing":
        return f"after healing run {ppl.get('earlier_healing') or 'before'}"
    return start.replace("_", " the ")


def _stages(ppl: Mapping, repair: str | None) -> dict:
    """``{stage: value}`` of a record's ``perplexity``; a record of the older form
    (``before``/``after`` only) is read as the start of healing and after healing."""
    if "after_healing" in ppl or "start" in ppl:
        return dict(ppl)
    start = "after_repair" if repair else "after_cut"
    return {start: ppl.get("before"), "after_healing": ppl.get("after"), "start": start, "contract": ppl.get("contract"),
            "text": ppl.get("text"), "repair": repair}


def _contract_text(ppl: Mapping) -> str:
    parts = [f"{ppl.get('contract') or 'unrecorded'} contract"]
    if ppl.get("text"):
        parts.append(str(ppl["text"]) + (f" (sha256 {ppl['text_sha256'][:12]}…)" if ppl.get("text_sha256") else ""))
    parts += [f"{k} {ppl[k]:,}" for k in ("window", "stride", "words") if isinstance(ppl.get(k), int)]
    return ", ".join(parts) + "; one contract and one text for every stage"


def _perplexity_rows(entry: Mapping, repair: str | None) -> list[tuple[str, str]]:
    """One row per perplexity stage (dense, after the cut, after the repair, after
    healing), each with its change against the dense model; the last also against the
    start of healing. A record without the start or the end is flagged, never shown as
    an improvement."""
    ppl = entry.get("perplexity") or {}
    if not ppl:
        return []
    if not isinstance(ppl, Mapping):
        return [("Perplexity before → after healing",
                 "not recorded in a readable form: this healing cannot be judged on perplexity")]
    ppl = _stages(ppl, repair)
    start = ppl.get("start", "after_repair" if repair else "after_cut")
    dense = ppl.get("dense")
    rows = []
    for stage, label in _STAGES.items():
        if stage in ("after_repair", "after_earlier_healing", "after_sparsity") and start != stage \
                and ppl.get(stage) is None:
            continue
        value = ppl.get(stage)
        label = label.format(repair=ppl.get("repair") or "repair", earlier=ppl.get("earlier_healing") or "before")
        if not _finite(value):
            rows.append((label, _not_finite(value)))
            continue
        text = f"{value:.3f}"
        if _finite(dense) and stage != "dense":
            text += f" ({_change(dense, value)} vs the dense model)"
        if stage == "after_healing" and _finite(ppl.get(start)):
            text += f"; {_change(ppl[start], value)} vs the start of healing ({_start_words(ppl, start)})"
            if value > ppl[start]:
                text += ": **worse than before healing**"
        rows.append((label, text))
    if not (_finite(ppl.get(start)) and _finite(ppl.get("after_healing"))):
        rows.append(("Perplexity before → after healing",
                     "not recorded: this healing cannot be judged on perplexity (no value before and after)"))
    rows.append(("Perplexity contract", _contract_text(ppl)))
    return rows


def healing_eval_results(record: Mapping) -> list:
    """The card's ``model-index`` entries of the perplexities ``config.layerswap``'s healing
    runs measured (every stage the ``## Healing`` section states with a finite value, under
    the run's one contract; :func:`~hf_layerswap.card.evaluation.perplexity_eval_results`),
    named as its rows are (``Healing run N: ...`` when there are several runs; the last
    current run's ``after_healing`` as this model's); ``[]`` when no run measured any."""
    runs = [e for e in record.get("healing") or [] if isinstance(e, Mapping)]
    repair = (record.get("recovery") or {}).get("method") if isinstance(record.get("recovery"), Mapping) else None
    current = [n for n, e in enumerate(runs, 1) if not e.get("stale")]
    results = []
    for n, entry in enumerate(runs, 1):
        ppl = entry.get("perplexity")
        if not isinstance(ppl, Mapping) or not ppl:
            continue
        ppl = _stages(ppl, repair)
        prefix = f"Healing run {n}: " if len(runs) > 1 else ""
        values = []
        for stage, label in _STAGES.items():
            label = prefix + label.format(repair=ppl.get("repair") or "repair",
                                          earlier=ppl.get("earlier_healing") or "before")
            if stage == "after_healing" and current and n == current[-1]:
                label += " (this model)"
            elif stage == "after_healing" and entry.get("stale"):
                label += " (stale: a later step changed the model)"
            values.append((label, ppl.get(stage)))
        results += perplexity_eval_results(ppl, values)
    return results


def _distinct(entry: Mapping) -> str:
    """`` (D distinct, packed text, E epochs)`` when the entry records its distinct tokens."""
    if entry.get("distinct_tokens") is None or entry.get("epochs") is None:
        return ""
    text = "packed text" if entry.get("packing") else "one paragraph per prompt"
    return f" ({entry['distinct_tokens']:,} distinct, {text}, {entry['epochs']:.2f} epochs)"


#: lm-eval's direction of its standard metrics, for records that do not carry
#: ``higher_is_better`` (measured before it was kept): ``True`` = higher is better.
_METRIC_DIRECTION = {
    **dict.fromkeys(("acc", "acc_norm", "acc_mutual_info", "exact_match", "f1", "mcc", "bleu", "chrf"), True),
    **dict.fromkeys(("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte", "ter", "brier_score"), False),
}


def _higher_is_better(tasks: Mapping, task: str, metric: str) -> bool | None:
    """The recorded direction of ``metric`` (lm-eval's ``higher_is_better``), else the
    standard one of :data:`_METRIC_DIRECTION`, else ``None`` (unknown: not judged)."""
    recorded = tasks.get("higher_is_better")
    per_task = recorded.get(task) if isinstance(recorded, Mapping) else None
    direction = per_task.get(metric) if isinstance(per_task, Mapping) else None
    return direction if isinstance(direction, bool) else _METRIC_DIRECTION.get(metric)


def _task_change(tasks: Mapping, task: str, metric: str, before, after) -> str:
    """The change cell: ``after - before``, marked **worse than before healing** when the
    metric moved the wrong way (by its direction; none known: not marked)."""
    if not (_finite(before) and _finite(after)):
        return "cannot be judged"
    higher = _higher_is_better(tasks, task, metric)
    worse = higher is not None and (after < before if higher else after > before)
    return f"{after - before:+.4f}" + ("; **worse than before healing**" if worse else "")


def tasks_table(tasks: Mapping) -> str | None:
    """The markdown of a healing record's lm-eval tasks before and after healing (``None``
    when none were measured); a record without both sides is flagged, a metric that moved
    the wrong way (lm-eval's ``higher_is_better``) is marked **worse than before healing**."""
    if not tasks:
        return None
    before, after = tasks.get("before"), tasks.get("after")
    if (not isinstance(before, Mapping) or not isinstance(after, Mapping) or not before
            or not all(isinstance(m, Mapping) for m in before.values())):
        return ("lm-eval tasks: not recorded before and after healing: these task results cannot be judged "
                "and are not shown.")
    lines = ["lm-eval tasks before and after healing:", "",
             "| task | metric | before healing | after healing | change |", "|---|---|---:|---:|---:|"]
    for task, metrics in before.items():
        for metric, value in metrics.items():
            if metric.endswith("_stderr"):
                continue
            later = after.get(task) if isinstance(after.get(task), Mapping) else {}
            new = later.get(metric)
            cells = [_task_value(value, metrics.get(f"{metric}_stderr")), _task_value(new, later.get(f"{metric}_stderr")),
                     _task_change(tasks, task, metric, value, new)]
            lines.append(f"| {_cell(task)} | {_cell(metric)} | " + " | ".join(cells) + " |")
    s, versions = tasks.get("settings") or {}, tasks.get("versions") or {}
    hashes, counts = tasks.get("task_hashes") or {}, tasks.get("n_samples") or {}
    lines += ["", f"lm-evaluation-harness {versions.get('lm_eval', _DASH)} (`simple_evaluate`, HFLM on the in-memory "
                  f"model, the same settings before and after), {s.get('num_fewshot')}-shot, limit {s.get('limit')}, "
                  f"max_length {s.get('max_length')}, seed {s.get('seed')}; documents and task hashes: "
              + ", ".join(f"{t} {counts.get(t)} docs `{str(hashes.get(t))[:12]}` (v{versions.get(t)})" for t in before)
              + "."]
    if tasks.get("mismatch"):
        lines.append(f"**Not like for like**: {tasks['mismatch']}.")
    return "\n".join(lines)


def _task_value(value, err) -> str:
    if not _finite(value):
        return _DASH
    return f"{value:.4f}" + (f" ± {err:.4f}" if _finite(err) and err > 0 else "")


def _setting(value) -> str:
    """A training setting as recorded (the dash for a missing one or a bool, which no setting is)."""
    return _DASH if value is None or isinstance(value, bool) else str(value)


def _count(value) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else _DASH


def _teacher_words(entry: Mapping) -> str:
    """Who taught: the dense model it was cut from only when the teacher's weights were
    checked against the removal record; another teacher by its name and fingerprint."""
    origin = entry.get("teacher")
    if not isinstance(origin, Mapping) or not origin:
        return "the dense model given as teacher (not checked against the removal record when this run was made)"
    name = f"`{origin['name']}`" if origin.get("name") else "an unnamed model"
    fingerprint = f"fingerprint {str(origin['fingerprint'])[:12]}…" if origin.get("fingerprint") else "no fingerprint"
    if origin.get("matches") is True:
        return f"the dense model it was cut from ({name}; its weights match the removal record)"
    if origin.get("matches") is False:
        return (f"**not the model it was cut from**: {name} ({fingerprint}, which differs from the removal record's; "
                "accepted with allow_foreign_teacher)")
    return f"{name} ({fingerprint}; not checked against the removal record: {origin.get('note') or 'no reason recorded'})"


def _method_words(entry: Mapping) -> str:
    """The method's name, options and what it trains, in its registry entry's words."""
    options = ", ".join(f"{k}={v}" for k, v in sorted((entry.get("options") or {}).items()))
    method = entry.get("method", _DASH)
    registered = HEAL_METHODS.get(method)
    text = f"`{method}`" + (f" ({options})" if options else "")
    return text + (f": {registered.describe}" if registered is not None else "")


def _choice_rows(entry: Mapping) -> list[tuple[str, str]]:
    """The row saying how the budget and the learning rate were set (given, or chosen by
    :mod:`~hf_layerswap.healing.choice`: the device's time target, the probe's rates and their
    held-out KL); none for a record written before the choice was recorded."""
    choice = entry.get("choice")
    if not isinstance(choice, Mapping) or not choice:
        return []
    words = []
    budget = choice.get("max_tokens")
    if isinstance(budget, Mapping) and budget.get("rule") == "time":
        text = (f"budget chosen for the device: {_count(budget.get('steps'))} steps ({_count(budget.get('max_tokens'))} "
                f"tokens) to fit {_setting(_minutes(budget.get('seconds')))} min on {_setting(budget.get('device'))} at "
                f"about {_setting(_rounded(budget.get('tokens_per_second')))} tokens/s "
                f"({_setting(budget.get('throughput'))})")
        words.append(text + ("; fewer: one pass over the training text" if budget.get("text_limited") else ""))
    elif isinstance(budget, Mapping) and budget.get("rule") == "given":
        words.append("budget given")
    probe = choice.get("learning_rate")
    if isinstance(probe, Mapping) and probe.get("rule") == "probe":
        rates = ", ".join(f"{_setting(r.get('learning_rate'))} → {_nats(r.get('kl'))}"
                          for r in probe.get("candidates") or [] if isinstance(r, Mapping))
        words.append(f"learning rate {_setting(probe.get('learning_rate'))} chosen by a probe on the held-out KL: "
                     f"{_count(probe.get('steps'))} steps at each rate from the same start (held-out KL "
                     f"{_nats(probe.get('kl_before'))} before): {rates}")
    elif isinstance(probe, Mapping) and probe.get("rule") == "given":
        words.append("learning rate given")
    return [("Budget and learning rate", "; ".join(words))] if words else []


def _minutes(seconds):
    return round(seconds / 60, 1) if _finite(seconds) else None


def _rounded(value):
    return f"{value:,.0f}" if _finite(value) else None


def _entry_rows(entry: Mapping, repair: str | None) -> list[tuple[str, str]]:
    logits = ("its full logits, on the fly" if entry.get("teacher_top_k") is None else
              f"its top-{entry['teacher_top_k']} log-probs plus the rest's mass, cached (a lower bound of the full KL)")
    data = str(entry.get("data", _DASH)) + (f" (sha256 {entry['data_hash'][:12]}…)" if entry.get("data_hash") else "")
    rows = [
        ("Method", _method_words(entry)),
        ("Training", f"{_count(entry.get('tokens'))} tokens{_distinct(entry)}, {_count(entry.get('steps'))} steps, learning rate "
                     f"{_setting(entry.get('learning_rate'))}, seed {_setting(entry.get('seed'))}"),
        *_choice_rows(entry),
        ("Teacher", f"{_teacher_words(entry)}; {logits}"),
        ("Data", data),
        ("Held-out KL(teacher ‖ student) before → after", kl_summary(entry)),
        ("Held-out prompts", str(entry.get("heldout", _DASH))),
        ("Final training loss", _nats(entry.get("final_loss")) + " nats/token"),
    ]
    rows += _perplexity_rows(entry, repair)
    if entry.get("stale"):
        rows.append(("Status", f"**stale**: {entry['stale']}"))
    return rows


def heal_command(entry: Mapping) -> str | None:
    """The ``hf-layerswap heal`` command that reproduces a healing record (its method, rate,
    seed, options, patience and :data:`~hf_layerswap.healing.report.RUN_SETTINGS`), with
    ``PRUNED BASE OUTPUT`` and the training text ``TEXT`` left to the reader; ``None`` for a
    record written before its settings were kept."""
    settings = entry.get("settings")
    if not isinstance(settings, Mapping) or not settings or not isinstance(entry.get("patience"), int):
        return None
    flags = {"method": entry.get("method"), **{k: v for k, v in settings.items() if k != "packing"},
             "learning_rate": entry.get("learning_rate"), "ce_weight": entry.get("ce_weight") or None,
             "patience": entry["patience"], "seed": entry.get("seed"), "teacher_top_k": entry.get("teacher_top_k")}
    words = ["hf-layerswap heal PRUNED BASE OUTPUT --calibration TEXT"]
    words += [f"--{k.replace('_', '-')} {repr(v) if isinstance(v, float) else shlex.quote(str(v))}"
              for k, v in flags.items() if v is not None]
    words += [] if settings.get("packing", True) else ["--no-packing"]
    origin = entry.get("teacher")
    words += ["--allow-foreign-teacher"] if isinstance(origin, Mapping) and origin.get("matches") is False else []
    words += [f"--option {shlex.quote(f'{k}={v}')}" for k, v in sorted((entry.get("options") or {}).items())]
    return " ".join(words)


def healing_section(record: Mapping, *, plot: str | None = None) -> str | None:
    """The card's ``## Healing`` markdown for ``config.layerswap`` (``None`` when it records no
    healing): one table per healing run, newest last, each with its held-out KL before and
    after and, when measured, one perplexity row per stage (the dense model, after the cut,
    after the repair when one ran, after healing; one contract) and its lm-eval tasks
    before and after healing (:func:`tasks_table`); ``plot`` (a PNG file name next to the
    card) under the last run. A run without its before and after numbers is shown as
    "cannot be judged", one that ended worse than it started as such, a stale run as stale.
    """
    runs = [e for e in record.get("healing") or [] if isinstance(e, Mapping)]
    if not runs:
        return None
    repair = (record.get("recovery") or {}).get("method") if isinstance(record.get("recovery"), Mapping) else None
    parts = ["The pruned model was distilled from a teacher (the \"Teacher\" row of each run says which; KL of the "
             "next-token distributions, on calibration text, never the evaluation text), with an early stop on "
             "held-out KL that keeps the best weights. Trained updates are in the weights themselves (the "
             "\"Method\" row says which): no PEFT modules or adapter files are needed."]
    for n, entry in enumerate(runs, 1):
        title = f"### Healing run {n}" if len(runs) > 1 else None
        table = ["| | |", "|---|---|"] + [f"| {_cell(k)} | {_cell(v)} |" for k, v in _entry_rows(entry, repair)]
        parts.append("\n".join(([title, ""] if title else []) + table))
        tasks = tasks_table(entry.get("tasks") or {})
        if tasks:
            parts.append(tasks)
        command = heal_command(entry)
        if command:
            parts.append("To repeat this healing on the pruned checkpoint, with the dense model as `BASE` and the "
                         f"training text above as `TEXT`:\n\n```bash\n{command}\n```")
    if plot:
        parts.append(f"![Healing: training loss and held-out KL against training tokens]({plot})")
    return "\n\n".join(parts)
