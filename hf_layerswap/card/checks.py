"""The checks a card runs once on its inputs (a report or sparsity record that does not
describe the model is refused) and the facts it reads from them: identity, base model,
license, parameter counts, the removal steps and their selection rule."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import torch
from huggingface_hub import ModelCard, try_to_load_from_cache
from transformers import AutoModelForCausalLM

from ..layerplan import decoder_blocks, model_fingerprint, num_blocks
from ..utils.provenance import model_identity
from ..recovery import RECOVERY_METHODS, recovery_entry
from ..surgery.operators import RECOVERY_FILE
from ..utils.jsonio import decode_float, encode_float
from ..scoring.protocols import SWAP_PROTOCOLS
from ..scoring.report import PruneProvenance, SwapReport, set_key
from ..selection.registry import NO_PROTOCOL, Strategy, strategy_entry
from ..sparsity import ALLOCATORS, PRUNERS, config_record, sparsity_in_model, SparsityReport
from ..sparsity.engine import prunable_linears
from ..surgery.removal import original_indices

from .format import DASH, DEFAULT_PROTECT, DEFAULT_SPACING, HUB_ID, format_cell, format_indices

__all__ = [
    "current_blocks", "format_pct_plain", "last_decision", "layerswap_record", "nonfinite_basis",
    "parameter_counts", "protocol_of", "recovery_record", "recovery_row", "report_mismatches", "report_removed", "report_step",
    "resolve_base_model", "resolve_license", "scored_identity", "selection_rule", "sparsity_mismatches",
    "sparsity_refusal", "sparsity_section", "sparsity_summary", "split_model", "step_config", "step_provenance", "step_strategy",
    "weights_identity",
]



# ---------------------------------------------------------------------- inputs
def split_model(model_or_config):
    """(model or None, top-level config)."""
    if hasattr(model_or_config, "config") and hasattr(model_or_config, "parameters"):
        return model_or_config, model_or_config.config
    if hasattr(model_or_config, "to_dict") and hasattr(model_or_config, "model_type"):
        return None, model_or_config
    raise TypeError(
        f"render_card needs a transformers model or its config (PreTrainedConfig), got {type(model_or_config).__name__}"
    )


def _text_config(config):
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def current_blocks(model, config) -> int:
    """Decoder blocks the checkpoint has now: counted on ``model``, else read from ``config``."""
    if model is not None:
        return num_blocks(model)
    return int(_text_config(config).num_hidden_layers)


def layerswap_record(config) -> dict:
    """A copy of ``config.layerswap`` (the removal record), ``{}`` when there is none."""
    record = getattr(config, "layerswap", None)
    return dict(record) if isinstance(record, Mapping) else {}


def report_step(model_or_config, report: SwapReport) -> int | None:
    """The removal step whose starting model ``report`` scored, when that is a model pruned
    before (a re-scored checkpoint): the last step's index when the model has two steps or
    more and ``report.num_blocks`` is that step's ``num_blocks_before`` (not the original
    depth); ``None`` otherwise (the report scored the original blocks, or the model as it
    is when it was never pruned)."""
    model, config = split_model(model_or_config)
    record = layerswap_record(config)
    steps = [s for s in record.get("steps") or [] if isinstance(s, Mapping)]
    original = int(record.get("original_num_hidden_layers", current_blocks(model, config)))
    if len(steps) < 2 or report.num_blocks == original or steps[-1].get("num_blocks_before") != report.num_blocks:
        return None
    return len(steps) - 1


def report_removed(model_or_config, report: SwapReport) -> list[int]:
    """The removed blocks in ``report``'s numbering: every removed block (original
    numbering) for a report of the original model; the last step's ``removed_layers`` (that
    step's numbering) for a report scored on the pruned model that step started from
    (:func:`report_step`)."""
    _, config = split_model(model_or_config)
    record = layerswap_record(config)
    step = report_step(model_or_config, report)
    if step is None:
        return sorted(record.get("removed_layers", []))
    return sorted(record["steps"][step].get("removed_layers", []))


def report_mismatches(model_or_config, report: SwapReport) -> list[str]:
    """Reasons why ``report`` does not describe ``model_or_config`` (empty list = it does).

    A report belongs to a model when it scored the blocks the model was pruned from:
    ``report.num_blocks`` equals ``config.layerswap["original_num_hidden_layers"]`` for a
    pruned model (the current block count otherwise), or, for a model pruned in several
    steps, the blocks its last step started from (a pruned checkpoint scored again and
    pruned again: ``num_blocks_before`` of the last step, :func:`report_step`); every removed
    index is in range (in the report's numbering), when the report carries a weight
    fingerprint (:func:`~hf_layerswap.layerplan.model_fingerprint`) it matches the model's (an
    unpruned model's current one, or the ``fingerprint_before`` of the first removal step,
    or of the last one for a re-scored model), and, when the removal step recorded a score
    summary, the report's per-layer scores are the recorded ones.
    """
    if not isinstance(report, SwapReport):
        return [f"report must be a SwapReport, got {type(report).__name__}"]
    model, config = split_model(model_or_config)
    record = layerswap_record(config)
    current = current_blocks(model, config)
    expected = int(record.get("original_num_hidden_layers", current))
    step = report_step(model_or_config, report)
    steps = list(record.get("steps") or [{}])
    problems = []
    if report.num_blocks != expected and step is None:
        what = "the model was pruned from" if record else "the model has"
        also = ""
        if len(steps) > 1 and isinstance(steps[-1], Mapping) and "num_blocks_before" in steps[-1]:
            also = f" (or {steps[-1]['num_blocks_before']}, the blocks its last removal step started from)"
        problems.append(f"the report scored {report.num_blocks} blocks but {what} {expected} blocks{also}")
        return problems
    expected_fp = (report.metadata.get("model") or {}).get("fingerprint")
    if expected_fp:
        actual_fp = steps[0 if step is None else step].get("fingerprint_before") if record else None
        if not record and model is not None:
            actual_fp = model_fingerprint(model)
        if actual_fp and actual_fp != expected_fp:
            when = "now" if not record else ("before removal" if step is None else f"before removal step {step}")
            problems.append(
                f"the report's weight fingerprint {expected_fp[:16]}... differs from the model's "
                f"{actual_fp[:16]}... ({when}): it was computed on other weights"
            )
    removed = report_removed(model_or_config, report)
    outside = [i for i in removed if not 0 <= i < report.num_blocks]
    if outside:
        problems.append(f"removed layers {outside} are outside the report's 0..{report.num_blocks - 1}")
    for k, summary in enumerate(s.get("scores") if isinstance(s, Mapping) else None for s in record.get("steps", [])):
        if not isinstance(summary, Mapping) or summary.get("num_blocks") != report.num_blocks:
            continue
        for protocol in report.protocols:
            recorded = summary.get(f"{protocol}_layer_scores")
            if recorded is None:
                continue
            mine = [encode_float(v) for v in report.layer_scores(protocol)]
            if list(recorded) != mine:
                problems.append(
                    f"the report's {protocol} layer scores differ from those recorded in config.layerswap "
                    f"(step {k}): this is not the report the removal was selected from"
                )
    return problems


def sparsity_summary(config, sparsity) -> dict | None:
    """The sparsity summary to show: :func:`~hf_layerswap.sparsity.config_record` of the
    report when given, else ``config.layerswap_sparsity`` (written by ``sparsify``)."""
    record = getattr(config, "layerswap_sparsity", None)
    record = dict(record) if isinstance(record, Mapping) else None
    if sparsity is not None:
        summary = config_record(sparsity)
        if record and record.get("previous"):  # the report matches the record (checked): keep its history
            summary["previous"] = record["previous"]
        return summary
    return record


def _weight_mismatches(model_or_config, record: Mapping, what: str) -> list[str]:
    """Block coverage and, for a model, per-block zero counts against ``record``."""
    model, config = split_model(model_or_config)
    original = [int(i) for i in record["original_blocks"]]
    current = original_indices(config, current_blocks(model, config))
    missing = [i for i in current if i not in original]
    if missing:
        return [f"{what} covers blocks {original} (original numbering) but the model also has blocks {missing}"]
    if model is None:
        return []

    problems = []
    expected_zeros = record.get("block_zeros") or [
        round(n * a) for n, a in zip(record["block_params"], record["block_achieved"])
    ]
    _, _, blocks = decoder_blocks(model)
    for block, index in zip(blocks, current):
        zeros = sum(int((lin.weight == 0).sum()) for _, lin in prunable_linears(block))
        expected = expected_zeros[original.index(index)]
        if zeros < expected:  # more is fine: weights below fp16/bf16 resolution flush to zero on conversion
            problems.append(
                f"block {index} (original numbering) has {zeros} zero weights, fewer than the {expected} {what} "
                "records: its weights changed after pruning"
            )
    return problems


def sparsity_mismatches(model_or_config, sparsity=None) -> list[str]:
    """Reasons why the sparsity evidence does not describe ``model_or_config`` (empty
    list = it does).

    With a :class:`~hf_layerswap.sparsity.SparsityReport`: it must agree with
    ``config.layerswap_sparsity`` when the config has one. The report (or, with
    ``sparsity=None``, the config's own summary) must cover every current block (blocks are
    matched in the original, pre-removal numbering, so removal after pruning is allowed),
    and for a model each current block must hold at least the recorded number of zero
    weights in its ``nn.Linear`` layers (weights changed after pruning, e.g. by training
    or a fused repair, are caught; a few more zeros are allowed, as a conversion to
    fp16/bf16 flushes surviving weights below its resolution to zero). No sparsity
    evidence at all: ``[]``.

    Raises:
        TypeError: ``sparsity`` is neither ``None`` nor a ``SparsityReport``.
    """
    model, config = split_model(model_or_config)
    recorded = getattr(config, "layerswap_sparsity", None)
    recorded = recorded if isinstance(recorded, Mapping) else None
    if sparsity is None:
        return _weight_mismatches(model_or_config, recorded, "config.layerswap_sparsity") if recorded else []
    if not isinstance(sparsity, SparsityReport):
        raise TypeError(f"sparsity must be a SparsityReport, got {type(sparsity).__name__}")
    problems = []
    mine = config_record(sparsity)
    if recorded is not None:
        keys = ("method", "allocation", "pattern", "target_sparsity", "num_params", "num_zeros", "original_blocks",
                "block_achieved")
        differ = [k for k in keys if recorded.get(k) != mine[k]]
        if differ:
            problems.append(f"the sparsity report differs from config.layerswap_sparsity in {differ}")
    return problems + _weight_mismatches(model_or_config, mine, "the sparsity report")


def sparsity_refusal(problems: Sequence[str], sparsity_report) -> str:
    """The error message for :func:`sparsity_mismatches` problems."""
    if sparsity_report is not None:
        return "the sparsity report does not belong to this model: " + "; ".join(problems)
    return (
        "the sparsity summary in config.layerswap_sparsity no longer describes this model: " + "; ".join(problems)
        + " (run sparsify again, or delete model.config.layerswap_sparsity if the model is no longer the pruned one)"
    )


def sparsity_section(summary: dict, sparsity, config, current: int) -> dict:
    """Rows of the card's sparsity section (original block numbering)."""
    kept = set(original_indices(config, current))
    allocator = dict(summary.get("allocator") or {})
    statistics = [b.statistic for b in sparsity.blocks] if sparsity is not None else [None] * len(summary["block_targets"])
    blocks = [
        {
            "block": index,
            "target": f"{target:.4f}",
            "achieved": f"{achieved:.4f}",
            "statistic": DASH if stat is None else f"{stat:.4g}",
            "status": "kept" if index in kept else "removed after pruning",
        }
        for index, target, achieved, stat in zip(
            summary["original_blocks"], summary["block_targets"], summary["block_achieved"], statistics
        )
    ]
    allocation = summary["allocation"]
    entry = ALLOCATORS.get(allocation)  # a record from a method this install does not have: its name only
    options = entry.card_options(allocator) if entry is not None and entry.card_options is not None else []
    pruner = PRUNERS.get(summary["method"])
    rows = [
        ("Method", pruner.label if pruner is not None else summary["method"]),
        ("Pattern", summary["pattern"] + " (N:M semi-structured)" if summary["pattern"] else "unstructured"),
        ("Layerwise allocation", (entry.label if entry is not None else allocation)
         + (f"; {', '.join(options)}" if options else "")),
    ]
    if allocator.get("statistic"):
        rows.append(("Allocator statistic", allocator["statistic"]))
    if allocator.get("budget"):
        rows.append(("Budget rule", allocator["budget"]))
    rows += [
        ("Target sparsity", format_pct_plain(summary["target_sparsity"])),
        ("Achieved sparsity", f"{format_pct_plain(summary['achieved_sparsity'], 4)} ({summary['num_zeros']:,} of "
         f"{summary['num_params']:,} weights of the blocks' linear layers are zero)"),
        ("Kept dense", _dense_note(_dense_in_model(summary, kept))),
    ]
    if any(b not in kept for b in summary["original_blocks"]):
        rows.insert(-1, ("Achieved sparsity, blocks still in the model",
                         format_pct_plain(sparsity_in_model(summary, kept), 4) + " (some blocks were removed after pruning)"))
    earlier = summary.get("previous") or []
    if earlier:
        rows.append(("Earlier pruning passes (oldest first)", "; ".join(
            f"{e.get('method')}, {e.get('pattern') or 'unstructured'}, {e.get('allocation')} allocation, target "
            f"{format_pct_plain(e.get('target_sparsity', 0.0))}, achieved {format_pct_plain(e.get('achieved_sparsity', 0.0), 4)}"
            for e in earlier
        ) + " (the zeros they left count in the achieved sparsity above)"))
    cal = summary.get("calibration") or {}
    pruner, rule = PRUNERS.get(summary["method"]), ALLOCATORS.get(allocation)
    weights_only = pruner is not None and pruner.statistics is None  # the mask reads the weights alone
    data_free = weights_only and rule is not None and rule.observe is None and not rule.needs_gradients
    if cal.get("description") and not data_free:
        rows.append(("Calibration", f"{cal['description']} (content hash {str(cal.get('content_hash'))[:12]})"))
    if weights_only:
        intro = ("The linear layers inside the decoder blocks were pruned one-shot by weight magnitude"
                 + ("" if data_free else "; the calibration set only fed the allocator's per-block statistics") + ".")
    else:
        intro = ("The linear layers inside the decoder blocks were pruned one-shot, block by block, each block "
                 "calibrated on the outputs of the already-pruned blocks.")
    intro += " The zeros are stored as ordinary dense safetensors weights."
    return {"intro": intro, "rows": [(key, format_cell(value)) for key, value in rows], "blocks": blocks}


def _dense_in_model(summary: Mapping, kept) -> int | None:
    per_block = summary.get("block_dense_params")
    if not isinstance(per_block, list):
        return None
    return sum(int(n) for b, n in zip(summary["original_blocks"], per_block) if b in kept)


def _dense_note(dense_block_params) -> str:
    note = "everything outside the decoder blocks (embeddings, LM head, any other tower)"
    if isinstance(dense_block_params, int) and dense_block_params > 0:
        note += (f", and the {dense_block_params:,} parameters of the blocks still in the model that are not "
                 "`nn.Linear` weight matrices (biases, norms, fused MoE expert tensors and the like)")
    return note


def format_pct_plain(fraction: float, digits: int = 2) -> str:
    """``fraction`` (0..1) as a percentage with ``digits`` decimals and no sign, e.g. ``"50.00%"``."""
    return f"{100 * fraction:.{digits}f}%"


def recovery_record(model, record: Mapping) -> dict:
    """The repair of the cut: ``config.layerswap["recovery"]``, or for a model the modules a
    method attaches that are actually attached (the record can lag behind a later removal)."""
    recovery = dict(record.get("recovery")) if isinstance(record.get("recovery"), Mapping) else {}
    if model is not None:
        for method in RECOVERY_METHODS.values():
            boundaries = method.attached(model) if method.attaches_at_load else []
            if boundaries:
                recovery.update(method=method.name, boundaries=boundaries, file=recovery.get("file", RECOVERY_FILE))
                break
    return recovery


def recovery_row(recovery: Mapping) -> tuple[str, str] | None:
    """The card's "Repair of the cut" row for a recovery record, ``None`` when nothing was repaired."""
    if not recovery.get("method"):
        return None
    method = recovery_entry(recovery["method"])
    cell = method.card_row(recovery, format_indices) if method is not None else format_cell(recovery["method"])
    return ("Repair of the cut", cell)


def _is_hub_id(name) -> bool:
    return isinstance(name, str) and bool(HUB_ID.match(name)) and not name.endswith(".gguf") and not os.path.exists(name)


def weights_identity(model, report) -> dict:
    """What is known about the weights the model came from (see hf_layerswap.models): the
    loader's identity of ``model``, overlaid by the report's (the report names the base that
    was scored; the model may since have been saved and loaded from its pruned folder or repo)."""
    ident = {}
    if model is not None:
        recorded = getattr(model, "layerswap_identity", None)
        if not isinstance(recorded, Mapping):
            try:
                recorded = model_identity(model)
            except Exception:  # identity is best effort (a model without a usable config)
                recorded = None
        if isinstance(recorded, Mapping):
            ident.update({k: v for k, v in recorded.items() if v})
    if report is not None:
        ident.update({k: v for k, v in (report.metadata.get("model") or {}).items() if v})
    return ident


def scored_identity(report, record: Mapping, ident: Mapping) -> dict:
    """The identity of the model the scores were computed on (the card's "Scored model"):
    the report's; without a report, the base model ``config.layerswap`` records for a pruned
    model (``{}`` when it records none: the model's own identity is then the pruned
    checkpoint's, not the scored base's), and the model's own identity while nothing was
    removed from it."""
    if report is not None:
        mine = {k: v for k, v in (report.metadata.get("model") or {}).items() if v}
        if mine.get("name"):
            return mine
    if record.get("steps"):
        base = record.get("base_model")
        base = base.get("name") if isinstance(base, Mapping) else base
        return {"name": base} if isinstance(base, str) and base else {}
    return dict(ident)


def resolve_base_model(explicit, config, record, ident) -> str | None:
    """The Hub id of the base model: ``explicit``, else the recorded one, else the weights' identity; raises ``ValueError`` when ``explicit`` is not ``owner/name``."""
    recorded = record.get("base_model")
    if isinstance(recorded, Mapping):
        recorded = recorded.get("name")
    for candidate in (explicit, recorded, ident.get("base_model"), ident.get("name"), getattr(config, "_name_or_path", None)):
        if _is_hub_id(candidate):
            return candidate
    if explicit is not None:
        raise ValueError(f"base_model={explicit!r} is not a Hub model id of the form 'owner/name'")
    return None


def resolve_license(explicit, base_model, config) -> str | None:
    """The license given, else the base model's (its card in the local Hub cache or its folder)."""
    if explicit:
        return explicit
    candidates = []
    if base_model:
        try:
            cached = try_to_load_from_cache(base_model, "README.md")
            if isinstance(cached, str):
                candidates.append(cached)
        except Exception:  # an unreadable cache only means "unknown"
            pass
    local = getattr(config, "_name_or_path", None)
    if local and os.path.isfile(os.path.join(str(local), "README.md")):
        candidates.append(os.path.join(str(local), "README.md"))
    for path in candidates:
        try:
            license_ = ModelCard.load(path, ignore_metadata_errors=True).data.license
        except Exception:
            continue
        if license_:
            return license_
    return None


def parameter_counts(model, config, removed: int, steps) -> tuple[int | None, int | None]:
    """(parameters before removal, after). Before = after + recorded/derived removed block sizes."""
    owner = model
    if owner is None:
        try:
            with torch.device("meta"):
                owner = AutoModelForCausalLM.from_config(config)
        except Exception:  # a config transformers cannot instantiate: counts unknown
            return None, None
    after = sum(p.numel() for p in owner.parameters())
    recorded = [s.get("removed_parameters") for s in steps]
    if steps and all(isinstance(r, int) for r in recorded):
        return after + sum(recorded), after
    if removed == 0:
        return after, after
    sizes = {sum(p.numel() for p in block.parameters()) for block in decoder_blocks(owner)[2]}
    if len(sizes) != 1:  # blocks differ in size: the removed ones cannot be inferred
        return None, after
    return after + removed * sizes.pop(), after


def step_provenance(step: Mapping) -> PruneProvenance:
    """The selection record of one removal step (written by :func:`hf_layerswap.pipeline.prune`)."""
    return PruneProvenance.from_dict(step)


def step_config(steps) -> dict:
    """The config of the latest removal step that recorded one (``{}`` when none did)."""
    for step in reversed(steps):
        config = step_provenance(step).config
        if config is not None:
            return dict(config)
    return {}


def selection_rule(steps, report) -> tuple[int, list[int], str]:
    """``(spacing, protect, text)`` the removal ran under: from its config, else the report's last selection, else the library defaults."""
    cfg = step_config(steps)
    if "spacing" in cfg and "protect" in cfg:
        return int(cfg["spacing"]), list(cfg["protect"]), f"spacing={cfg['spacing']}, protect={list(cfg['protect'])}"
    if report is not None and report.selections:
        last = report.selections[-1]
        return int(last["spacing"]), list(last["protect"]), f"spacing={last['spacing']}, protect={list(last['protect'])}"
    return (
        DEFAULT_SPACING,
        list(DEFAULT_PROTECT),
        f"spacing={DEFAULT_SPACING}, protect={DEFAULT_PROTECT}: the library defaults, the removal record names none",
    )


def protocol_of(steps) -> str | None:
    """The swap protocol that guided the last removal (``None`` when a strategy with its own card
    summary, e.g. a search over sets, or one guided by no protocol (``NO_PROTOCOL``, e.g.
    ``sleb``) chose it, or no step names one)."""
    entry, last = step_strategy(steps[-1]) if steps else (None, None)
    if entry is not None and last.decision is not None and entry.card_summary is not None:
        return None  # no single protocol guided the last step (e.g. a search over sets)
    if entry is not None and entry.guided_by is NO_PROTOCOL:
        return None  # its own criterion chose the last step: an earlier step's protocol did not
    for step in reversed(steps):
        entry, record = step_strategy(step)
        guided = record.protocol if entry is None else entry.guided_by(record.decision or {}, record.protocol)
        if guided in SWAP_PROTOCOLS:
            return guided
    return None


def step_strategy(step: Mapping) -> tuple[Strategy | None, PruneProvenance]:
    """The entry of the strategy that chose a removal step's blocks (``None`` for explicit
    blocks or a step without a selection record) and the step's record."""
    record = step_provenance(step)
    return (strategy_entry(record.strategy) if record.strategy else None), record


def last_decision(steps) -> tuple[Strategy | None, Mapping | None]:
    """The last step's strategy entry and its decision record (``None`` when it has none)."""
    if not steps:
        return None, None
    entry, record = step_strategy(steps[-1])
    return (entry, record.decision) if entry is not None and record.decision is not None else (None, None)


def _nonfinite(v) -> bool:
    try:
        v = decode_float(v)
    except ValueError:
        return True
    return v is None or not math.isfinite(v)


def nonfinite_basis(model_or_config, report: SwapReport | None = None) -> list[str]:
    """Removal steps of the model chosen on non-finite values (empty list = none).

    A step whose blocks were chosen by a strategy (not given as explicit ``layers``) rests
    on its recorded values: the search's value of the chosen set, ``auto``'s joint removal
    KL of the chosen protocol's set, the chosen set's joint removal KL in ``report``, or
    else the per-layer scores recorded in the step (for ``greedy``/``auto``: each removed
    layer's score under the protocol used; for the other strategies: a removed layer with
    a finite score under some protocol). A non-finite basis is named with its step.
    """
    _, config = split_model(model_or_config)
    steps = layerswap_record(config).get("steps") or []
    problems = []
    for k, step in enumerate(steps):
        entry, record = step_strategy(step)
        if entry is None or not isinstance(step.get("removed_layers"), list):
            continue
        removed = list(step["removed_layers"])
        where = f"step {k} ({record.strategy}) removed {removed}"
        sets = list(entry.values(record.decision)) if record.decision is not None else []
        if report is not None and k == len(steps) - 1 and set_key(removed) in report.removal_kl:
            sets.append(("its joint removal KL in the report", report.removal_kl[set_key(removed)]))
        problems += [f"{where} on {what} = {encode_float(decode_float(v))}" for what, v in sets if _nonfinite(v)]
        if sets:
            continue
        scores = record.scores or {}
        by_protocol = {p: scores[f"{p}_layer_scores"] for p in SWAP_PROTOCOLS
                       if isinstance(scores.get(f"{p}_layer_scores"), list)}
        used = entry.guided_by(record.decision or {}, record.protocol)
        if entry.ranks_by_scores and used in by_protocol:
            bad = [i for i in removed if i >= len(by_protocol[used]) or _nonfinite(by_protocol[used][i])]
        else:
            bad = [i for i in removed if by_protocol and all(
                i >= len(v) or _nonfinite(v[i]) for v in by_protocol.values())]
        if bad:
            problems.append(f"{where}: the recorded layer score of {bad} is non-finite")
    return problems
