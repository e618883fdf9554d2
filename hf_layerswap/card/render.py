"""The card verbs: :func:`render_card` (the template filled from the sections),
:func:`check_card` and :func:`write_card_files` (card, plots and JSON sidecars)."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.repocard_data import model_index_to_eval_results

from ..utils.extras import available, install_hint
from ..surgery.history import card_notice, history_status
from ..utils.jsonio import write_json_atomic
from ..plots import PLOT_FILES, planned_plots, write_healing_plot, write_plots, write_sparsity_plot
from ..utils.provenance import __version__
from ..recovery import recovery_entry
from ..scoring.report import SwapReport
from ..sparsity import sparsity_in_model
from ..surgery.removal import original_indices
from ..evaluation.tasks import task_card_section

from .evaluation import evaluation_mismatches, normalize_evaluation
from .checks import current_blocks, weights_identity, parameter_counts, format_pct_plain, protocol_of, step_provenance, step_strategy, layerswap_record, recovery_record, recovery_row, report_mismatches, report_removed, report_step, resolve_base_model, resolve_license, scored_identity, selection_rule, last_decision, sparsity_mismatches, sparsity_refusal, sparsity_section, sparsity_summary, split_model
from .healing import HEALING_FILE, healing_eval_results, healing_section
from .steps import steps_section
from .format import DASH, EVALUATION_FILE, REPORT_FILE, SPARSITY_FILE, format_cell, format_indices, format_pct
from .sections import calibration_rows, candidates_section, cost_rows, evaluation_section, load_snippet, report_section, reproduce_section, unscored_why, versions_section

__all__ = ["CARD_TEMPLATE", "check_card", "render_card", "write_card_files"]

logger = logging.getLogger(__name__)

CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "modelcard_template.md"


# ---------------------------------------------------------------------- the card
def render_card(
    model_or_config,
    *,
    report: SwapReport | None = None,
    evaluation=None,
    base_model: str | None = None,
    license: str | None = None,
    repo_id: str | None = None,
    plots: Sequence[str] | None = None,
    tokenizer_included: bool = True,
    sparsity_report=None,
    tasks=None,
    plots_not_drawn: str | None = None,
):
    """Render the model card of a (pruned, sparsified, repaired) model.

    Args:
        model_or_config: the model (parameter counts from its weights) or its config
            (counts from a meta-device instance). Removal provenance is read from
            ``config.layerswap`` (written by :func:`~hf_layerswap.remove_layers`).
        report: the :class:`SwapReport` the removal was selected from (it must belong to
            the model, see :func:`report_mismatches`); ``None`` = no diagnostics section.
        evaluation: ``{"base": ..., "pruned": ...}`` perplexity results
            (:class:`~hf_layerswap.evaluation.PerplexityResult`, their dicts, or ``hf-layerswap
            eval`` results), each with its contract, both under the same one; ``base`` measured on
            the scored base model and ``pruned`` on this model (see :func:`evaluation_mismatches`).
        base_model: Hub id of the base model; default: from the removal record, the
            loader's identity, the report, or ``config._name_or_path`` when it is a Hub id.
        license: license id; default: the base model's, when its card is in the local Hub
            cache or its folder (otherwise omitted).
        repo_id: where the card will live (used in the loading snippet and as the
            ``model-index`` name).
        plots: keys of :data:`PLOT_FILES` the card references; default
            :func:`planned_plots` (write them with :func:`write_plots`).
        tokenizer_included: whether tokenizer files sit next to the card (else the
            snippet loads the base model's tokenizer).
        sparsity_report: the :class:`~hf_layerswap.sparsity.SparsityReport` of one-shot pruning
            (checked with :func:`sparsity_mismatches`); ``None`` = the summary
            ``sparsify`` stored in ``config.layerswap_sparsity``, if any. Either gives a
            sparsity section (method, pattern, allocation, target and achieved sparsity,
            per-block table in the original numbering); the report adds the allocator's
            per-block statistic.
        tasks: ``{"base": ..., "pruned": ...}`` lm-eval results
            (:class:`~hf_layerswap.evaluation.tasks.TaskResults` from :func:`~hf_layerswap.evaluate_tasks`,
            or their dicts), rendered as a table and ``model-index`` entries; both must be
            measured under the same settings.
        plots_not_drawn: why the plots were not drawn (e.g. matplotlib is not installed);
            the card's Files section says so. :func:`write_card_files` passes it.

    A repair of the cut recorded in ``config.layerswap["recovery"]`` (see
    :mod:`hf_layerswap.recovery`) is named in the removal table; for Ghosted Layers
    operators the loading section says that ``hf_layerswap`` must be imported to apply them.

    Returns:
        A :class:`huggingface_hub.ModelCard`.

    Raises:
        TypeError: ``model_or_config`` is neither a model nor a config; bad ``evaluation``
            or ``sparsity_report`` types.
        ValueError: the report, the sparsity report or the evaluation does not belong to the
            model, a bad ``evaluation`` value (no contract, two contracts), or a ``base_model``
            that is not a Hub id.
    """
    model, config = split_model(model_or_config)
    if report is not None:
        problems = report_mismatches(model_or_config, report)
        if problems:
            raise ValueError("the report does not belong to this model: " + "; ".join(problems))
    problems = sparsity_mismatches(model_or_config, sparsity_report)
    if problems:
        raise ValueError(sparsity_refusal(problems, sparsity_report))
    evaluation = normalize_evaluation(evaluation)
    problems = evaluation_mismatches(model_or_config, evaluation, report)
    if problems:
        raise ValueError("the evaluation does not belong to this model: " + "; ".join(problems))
    f = _card_facts(model, config, report, base_model, license, sparsity_report)
    plot_keys = planned_plots(report, sparsity=f.sparse is not None) if plots is None else list(plots)
    unknown = [k for k in plot_keys if k not in PLOT_FILES]
    if unknown:
        raise ValueError(f"plots={unknown}: allowed {sorted(PLOT_FILES)}")
    name = repo_id or (f"{f.base.split('/')[-1]}-layerswap-{f.current}L" if f.base else f"layerswap-{f.current}L")
    front = _front_matter(f, config, report, sparsity_report)
    eval_section, eval_results = evaluation_section(evaluation) if evaluation else (None, None)
    task_md, task_evals = task_card_section(tasks) if tasks else (None, [])
    eval_results = (eval_results or []) + healing_eval_results(f.record) + task_evals
    tags = ["layerswap", "layer-pruning"] + ([f.protocol] if f.protocol else [])
    if f.sparse is not None:
        tags += ["sparsity", f.sparse["method"]]
    card_data = ModelCardData(
        base_model=f.base,
        library_name="transformers",
        license=f.license,
        pipeline_tag="text-generation",
        tags=tags,
        model_name=name if eval_results else None,
        eval_results=eval_results or None,
        layerswap=front,
    )
    title, summary = _title_and_summary(f, name, front, evaluation, eval_section)
    context = _body(f, config, report, eval_section, sparsity_report, plot_keys, evaluation,
                    repo_id or "path/to/this/checkpoint", tokenizer_included)
    context.update(title=title, summary=summary, plots_not_drawn=plots_not_drawn)
    card = ModelCard.from_template(card_data, template_path=str(CARD_TEMPLATE), **context)
    text = re.sub(r"\n{3,}", "\n\n", str(card)).rstrip("\n") + "\n"
    steps_md = steps_section(f.record)
    if steps_md:
        text += "\n## Steps\n\n" + steps_md + "\n"
    heal_md = healing_section(f.record, plot=PLOT_FILES["healing"] if "healing" in plot_keys else None)
    if heal_md:
        text += "\n## Healing\n\n" + heal_md + "\n"
    if task_md:
        text += "\n## Task evaluation (lm-evaluation-harness)\n\n" + task_md + "\n"
    return ModelCard(text)


def _body(f: SimpleNamespace, config, report, eval_section, sparsity_report, plot_keys, evaluation, repo: str,
          tokenizer_included: bool) -> dict:
    """The template's context for the card body (all but the title and summary)."""
    candidates: list = []
    why, removed_kl = None, None
    scored_removed = report_removed(config, report) if report is not None else []  # in the report's numbering
    if report is not None and f.removed:
        candidates, why, removed_kl = candidates_section(report, scored_removed, f.spacing, f.protect, f.steps)
    unscored = (f.run.get("score") or {}).get("skipped")
    selection_note = None
    if report is None and f.removed and unscored:  # a card states what did not happen, and why
        selection_note = (f"No swap-KL tables were measured for this removal: {unscored}, so the prune scored no "
                          "pair of blocks (`LayerSwapConfig(score_protocols=[...])`, `--score-protocols` on the command line, measures them as well). "
                          f"**Why this set:** {unscored_why(f.steps, f.removed)}")
    reproduce, reproduce_note = reproduce_section(f.base, f.removed, f.steps, report, f.ident) if f.removed else (
        "# nothing was removed: see the diagnostics above", None
    )
    tokenizer_repo = repo if tokenizer_included else f.base
    return dict(
        base_model=f.base,
        removal_rows=_removal_rows(f),
        steps=[
            {
                "before": s.get("num_blocks_before", DASH),
                "removed_local": format_indices(s.get("removed_layers", [])),
                "removed_original": format_indices(s.get("removed_original_layers", [])),
                "selection": format_cell(step_provenance(s).selection) + _step_repair(s),
            }
            for s in f.steps
        ],
        report=_report_context(config, report, scored_removed, f.protect) if report is not None else None,
        plots={k: ([{"file": PLOT_FILES[k], "alt": _PLOT_ALT[k]}] if k in plot_keys else []) for k in PLOT_FILES},
        candidates=candidates,
        selection_note=selection_note,
        budget=f"{len(scored_removed)} block{'s' if len(scored_removed) != 1 else ''}",
        rule=f.rule,
        removed_layers=format_indices(scored_removed),
        removed_kl=removed_kl,
        why=why,
        evaluation=eval_section,
        calibration=calibration_rows(report, f.steps, scored_identity(report, f.record, f.ident)),
        cost=cost_rows(report),
        sparsity=sparsity_section(f.sparse, sparsity_report, config, f.current) if f.sparse is not None else None,
        attached_modules=f.repairer.card_modules if f.attaches else None,
        load_snippet=load_snippet(repo, tokenizer_repo, attaches=f.attaches),
        reproduce_snippet=reproduce,
        reproduce_note=reproduce_note,
        files=_files(f, report, evaluation, sparsity_report, plot_keys),
        versions=versions_section(report, f.steps, evaluation),
        library_version=__version__,
    )


def _report_context(config, report, removed, protect) -> dict:
    """:func:`report_section`, with a note on the numbering when the report scored the
    checkpoint the last of several removal steps started from (not the base model)."""
    context = report_section(report, removed, protect)
    step = report_step(config, report)
    if step is not None:
        context["numbering_note"] = (
            f"These scores were measured on the {report.num_blocks}-block checkpoint that removal step {step} "
            "started from, so the layers below are numbered as in that checkpoint (the step table above maps "
            "them to the original numbering)."
        )
    return context


#: Alt text of each plot the card shows.
_PLOT_ALT = {
    "layer_scores": "Per-layer swap-KL scores of both protocols; removed layers shaded",
    "protocol_gap": "I/R = interchange / replacement per pair",
    "pair_heatmap": "Pair swap-KL heatmap: replacement above, interchange below the diagonal",
    "sparsity": "Per-block target and achieved sparsity",
    "healing": "Healing: training loss and held-out KL against training tokens",
}


def _step_repair(step: Mapping) -> str:
    """The repair of a removal step's cut, for the steps table's selection cell (its
    boundaries in that step's pruned numbering; a later removal drops the top-level
    record, but a fused map stays folded into the weights)."""
    recovery = step.get("recovery")
    method = recovery.get("method") if isinstance(recovery, Mapping) else recovery
    return f"; cut repaired (`{method}` recovery)" if isinstance(method, str) and method else ""


def _card_facts(model, config, report, base_model, license, sparsity_report) -> SimpleNamespace:
    """What the card reads from the model's record, the report and the arguments, once."""
    record = layerswap_record(config)
    steps = [dict(s) for s in record.get("steps", [])]
    current = current_blocks(model, config)
    removed = sorted(record.get("removed_layers", []))
    ident = weights_identity(model, report)
    base = resolve_base_model(base_model, config, record, ident)
    spacing, protect, rule = selection_rule(steps, report)
    chooser, _ = last_decision(steps)
    if chooser is not None and chooser.card_rule is not None:
        rule = chooser.card_rule(spacing, protect)
    strategy, last = step_strategy(steps[-1]) if steps else (None, None)
    before, after = parameter_counts(model, config, len(removed), steps)
    recovery = recovery_record(model, record)
    repairer = recovery_entry(recovery.get("method"))
    return SimpleNamespace(
        record=record, steps=steps, current=current, original=int(record.get("original_num_hidden_layers", current)),
        removed=removed, kept=list(record.get("kept_layers", range(current))), ident=ident, base=base,
        license=resolve_license(license, base, config), protocol=protocol_of(steps), spacing=spacing,
        protect=protect, rule=rule, chooser=chooser, before=before, after=after,
        sparse=sparsity_summary(config, sparsity_report), recovery=recovery, repairer=repairer,
        attaches=repairer is not None and repairer.attaches(recovery), in_model=None,
        history=history_status(config), strategy=strategy, last=last,
        run=_last_run(record, len(steps) - 1),
    )


def _last_run(record: Mapping, step: int) -> dict:
    """The entries of ``config.layerswap["recipe"]`` of removal step ``step`` (the last one),
    by kind (``{"score": {...}, "select": {...}}``): what the prune recorded of its scoring
    and selection."""
    entries = [e for e in record.get("recipe") or [] if isinstance(e, Mapping) and e.get("removal_step") == step]
    return {str(e.get("step")): dict(e) for e in entries}


def _front_matter(f: SimpleNamespace, config, report, sparsity_report) -> dict:
    """The ``layerswap`` entry of the card's YAML front matter (sets ``f.in_model``)."""
    front = {
        "original_num_hidden_layers": f.original,
        "num_hidden_layers": f.current,
        "removed_layers": f.removed,
        "protocol": f.protocol,
        "report": REPORT_FILE if report is not None else None,
    }
    chosen_by = step_provenance(f.steps[-1]).strategy if f.steps else None
    if chosen_by:
        front["strategy"] = chosen_by
    if f.recovery.get("method"):
        front["recovery"] = f.recovery["method"]
    if f.sparse is not None:
        f.in_model = sparsity_in_model(f.sparse, original_indices(config, f.current))
        front["sparsity"] = {k: f.sparse[k] for k in ("method", "allocation", "pattern", "target_sparsity")}
        front["sparsity"]["achieved_sparsity"] = f.in_model
        front["sparsity"]["report"] = SPARSITY_FILE if sparsity_report is not None else None
    if f.history == "unverified":
        front["history"] = "unverified"
    return front


def _title_and_summary(f: SimpleNamespace, name: str, front: dict, evaluation, eval_section) -> tuple[str, str]:
    base_label = _base_label(f.base)
    if f.removed:
        title = f"{name}: {len(f.removed)} of {f.original} decoder blocks removed"
        params = ""
        if f.before and f.after:
            params = f", {100 * (f.before - f.after) / f.before:.1f}% of the parameters"
        summary = (
            f"This checkpoint is {base_label} with decoder blocks **{format_indices(f.removed)}** removed "
            f"({len(f.removed)} of {f.original} blocks, {100 * len(f.removed) / f.original:.1f}% of the depth{params}), "
            f"selected with `hf_layerswap`" + (f" using the **{f.protocol}** swap-KL protocol." if f.protocol else (
                f.strategy.card_summary if f.strategy is not None and f.strategy.card_summary else "."))
        )
    elif f.sparse is not None:
        title = f"{name}: {format_pct_plain(f.sparse['achieved_sparsity'], 1)} sparse linear layers"  # nothing removed
        summary = f"No blocks were removed from {base_label}."
    else:
        title = f"{name}: swap-KL layer-redundancy scores"
        summary = f"No blocks were removed from {base_label}; this card records its swap-KL diagnostics."
    if f.repairer is not None:
        summary += f.repairer.card_summary
    if f.sparse is not None:
        summary += (
            f" The linear layers of its decoder blocks are {format_pct_plain(f.in_model, 2)} sparse (one-shot "
            f"{f.sparse['method']}, {f.sparse['pattern'] or 'unstructured'}, {f.sparse['allocation']} allocation)."
        )
    if evaluation and "base" in evaluation and "pruned" in evaluation:
        summary += (
            f" Perplexity {evaluation['base']['ppl']:.2f} → {evaluation['pruned']['ppl']:.2f} "
            f"({eval_section['delta']}) under the contract below."
        )
    if card_notice(f.record):
        summary += " " + card_notice(f.record)
    return title, summary


def _base_label(base) -> str:
    return f"[{base}](https://huggingface.co/{base})" if base else "the original model"


def _removal_rows(f: SimpleNamespace) -> list[tuple[str, str]]:
    ident_revision = f.ident.get("revision") if isinstance(f.ident.get("source"), Mapping) else None
    rows = [
        ("Base model", _base_label(f.base) + (f" (weights: {ident_revision})" if ident_revision else "")),
        ("Decoder blocks", f"{f.original} → {f.current}" + (f" ({len(f.removed)} removed)" if f.removed else "")),
        ("Removed blocks (0-based, original numbering)", format_indices(f.removed)),
        ("Kept blocks (0-based, original numbering)", format_indices(f.kept)),
    ]
    before, after = f.before, f.after
    if before is not None and after is not None:
        change = f" ({after - before:+,}, {format_pct(100 * (after - before) / before)})" if before != after else ""
        rows.append(("Parameters", f"{before:,} → {after:,}{change}"))
    elif after is not None:
        rows.append(("Parameters", f"{after:,} after removal (blocks differ in size; the count before is not recorded)"))
    unscored = (f.run.get("score") or {}).get("skipped")
    if f.removed:
        rows.append(("Protocol guiding the removal", f.protocol or (
            f"none: {unscored}" if unscored else "none recorded")))
    options = (f.last.config or {}).get("strategy_options") if f.last is not None else None
    if f.removed and options:
        used = (f.run.get("select") or {}).get("options") or {}
        rest = {k: v for k, v in used.items() if k not in options}
        rows.append(("Strategy options", ", ".join(f"`{k}={v!r}`" for k, v in options.items()) + " (given)"
                     + ("; the others at their defaults: " + ", ".join(f"`{k}={v!r}`" for k, v in rest.items())
                        if rest else "")))
    repair = recovery_row(f.recovery)
    if repair is not None:
        rows.append(repair)
    return rows


def _files(f: SimpleNamespace, report, evaluation, sparsity_report, plot_keys) -> list[tuple[str, str]]:
    files = [("README.md", "this card"), ("config.json", "model config; `layerswap` holds the removal record (0-based)"),
             ("*.safetensors", "weights of the kept blocks")]
    if report is not None:
        files.append((REPORT_FILE, "every swap-KL value: `hf_layerswap.SwapReport.from_json(path)`"))
    if evaluation:
        files.append((EVALUATION_FILE, "perplexity results with their contracts"))
    if sparsity_report is not None:
        files.append((SPARSITY_FILE, "per-block and per-linear sparsity: `hf_layerswap.sparsity.SparsityReport.from_json(path)`"))
    if f.attaches:
        files.append((str(f.recovery.get("file")), f.repairer.card_file))
    if "healing" in plot_keys:
        files.append((HEALING_FILE, "the healing run's loss and held-out KL histories: `hf_layerswap.HealReport.from_json(path)`"))
    return files + [(PLOT_FILES[k], "plot") for k in plot_keys]


def check_card(card, directory: str | os.PathLike | None = None) -> list[str]:
    """Offline checks equivalent to the Hub's card validation (empty list = valid).

    Parses the front matter back (:class:`huggingface_hub.ModelCard`), requires
    ``library_name``, a ``base_model`` of the form ``owner/name`` when present, a
    ``model-index`` that huggingface_hub reads back into eval results, and, when
    ``directory`` is given, that every image the card references exists there.
    """
    problems = []
    try:
        parsed = ModelCard(str(card))
    except Exception as err:  # any parse failure is a validation failure
        return [f"the card does not parse: {err}"]
    data = parsed.data.to_dict()
    if data.get("library_name") != "transformers":
        problems.append(f"library_name is {data.get('library_name')!r}, expected 'transformers'")
    base = data.get("base_model")
    if base is not None and not (isinstance(base, str) and re.match(r"^[\w.-]+(/[\w.-]+)?$", base)):
        problems.append(f"base_model {base!r} is not a Hub model id")
    if "model-index" in data:
        try:
            _, results = model_index_to_eval_results(data["model-index"])
            if not results:
                problems.append("model-index has no results")
        except Exception as err:
            problems.append(f"model-index does not parse: {err}")
    if directory is not None:
        for target in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", parsed.text):
            if "://" not in target and not (Path(directory) / target).is_file():
                problems.append(f"the card shows {target} but the folder has no such file")
    return problems


def write_card_files(
    directory: str | os.PathLike,
    model_or_config,
    *,
    report: SwapReport | None = None,
    evaluation=None,
    base_model: str | None = None,
    license: str | None = None,
    repo_id: str | None = None,
    tokenizer_included: bool = True,
    sparsity_report=None,
    tasks=None,
) -> dict[str, Path]:
    """Write ``README.md`` (the card), the plots and the JSON sidecars into ``directory``.

    Writes ``layerswap_report.json`` (when ``report`` is given; it loads back into an equal
    :class:`SwapReport`), ``layerswap_evaluation.json`` (when ``evaluation`` is given) and
    ``layerswap_sparsity.json`` (when ``sparsity_report``, a ``SparsityReport``, is given; it loads
    back with ``SparsityReport.from_json``). The per-block sparsity plot is drawn whenever
    the card has a sparsity section (see :func:`render_card`).
    Without matplotlib (the ``plots`` extra) the card and every sidecar are written without
    the plots, and the card's Files section says that they were not drawn and why (a
    warning is logged too).

    Returns:
        ``{file name: path}`` of everything written.

    Raises:
        ValueError: the card fails :func:`check_card`, or see :func:`render_card`.
    """
    kwargs = dict(report=report, evaluation=evaluation, base_model=base_model, license=license, repo_id=repo_id,
                  tokenizer_included=tokenizer_included, sparsity_report=sparsity_report, tasks=tasks)
    render_card(model_or_config, plots=[], **kwargs)  # every input check, before anything is written
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    # sidecars first: JSON that cannot be written stops here, before the card
    if report is not None:
        written[REPORT_FILE] = report.to_json(directory / REPORT_FILE)
    if sparsity_report is not None:
        sparsity_report.to_json(directory / SPARSITY_FILE)
        written[SPARSITY_FILE] = directory / SPARSITY_FILE
    evaluation = normalize_evaluation(evaluation)
    if evaluation:
        base, pruned = evaluation.get("base"), evaluation.get("pruned")
        payload = dict(evaluation)
        if base and pruned:
            payload["delta_ppl_percent"] = 100 * (pruned["ppl"] / base["ppl"] - 1)
        written[EVALUATION_FILE] = write_json_atomic(payload, directory / EVALUATION_FILE)
    plot_keys: list[str] = []
    model, config = split_model(model_or_config)
    sparse = sparsity_summary(config, sparsity_report)
    draw = available("matplotlib")
    planned = planned_plots(report, sparsity=sparse is not None)
    if draw and report is not None:
        paths = write_plots(report, directory, removed=report_removed(config, report))
        plot_keys = list(paths)
        written.update({p.name: p for p in paths.values()})
    healed = getattr(model, "layerswap_heal_report", None) if model is not None else None
    if healed is not None and (layerswap_record(config).get("healing") or [{}])[-1].get("kl_after") == healed.kl_after:
        written[HEALING_FILE] = healed.to_json(directory / HEALING_FILE)
        planned.append("healing")
        if draw:
            path = write_healing_plot(healed.to_dict(), directory / PLOT_FILES["healing"])
            plot_keys.append("healing")
            written[path.name] = path
    if draw and sparse is not None:
        kept = original_indices(config, current_blocks(model, config))
        path = write_sparsity_plot(sparse, directory / PLOT_FILES["sparsity"], kept=kept)
        plot_keys.append("sparsity")
        written[path.name] = path
    not_drawn = None
    if not draw and planned:
        files = ", ".join(f"`{PLOT_FILES[k]}`" for k in planned)
        not_drawn = (f"The plots ({files}) were not drawn: matplotlib is not installed "
                     f"(`{install_hint('matplotlib')}` draws them).")
        logger.warning("matplotlib is not installed: the card is written without its plots (%s)",
                       install_hint("matplotlib"))
    card = render_card(model_or_config, plots=plot_keys, plots_not_drawn=not_drawn, **kwargs)
    problems = check_card(card, directory)
    if problems:
        raise ValueError("the rendered card is not valid: " + "; ".join(problems))
    card.save(directory / "README.md")
    written["README.md"] = directory / "README.md"
    for path in written.values():  # temporary-file writers leave 0600; these are for publishing
        os.chmod(path, 0o644)
    return written
