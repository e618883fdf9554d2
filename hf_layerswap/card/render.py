"""Model cards for layer-pruned checkpoints, with both swap-KL protocols side by side.

:func:`render_card` fills the Jinja template shipped in ``hf_layerswap/templates/``
(``modelcard_template.md``) through :meth:`huggingface_hub.ModelCard.from_template`. The
card carries what a reviewer needs to trust a pruned checkpoint:

- front matter: ``base_model``, ``library_name: transformers``, tags (``layerswap``,
  ``layer-pruning``, the protocol), ``model-index`` perplexity of the pruned and the base
  model under one contract, and the base model's license when it is known;
- what was removed (0-based indices in the original numbering, count, parameters before
  and after), the per-layer scores and the pair table of both protocols (replacement in
  both directions, interchange, I/R = d_inter / d_repl), the set each protocol would remove
  at the same budget, the set actually removed and why;
- after one-shot pruning (:func:`hf_layerswap.sparsity.sparsify`): method, pattern,
  allocation and its options, target and achieved sparsity, and a per-block table in the
  original numbering (from the ``SparsityReport``, or from ``config.layerswap_sparsity``);
- the repair of the cut when ``config.layerswap["recovery"]`` records one, and for Ghosted
  Layers operators that ``hf_layerswap`` must be imported to apply them;
- evaluation (perplexity with its CI, dPPL%, the contract), calibration (source, content
  hash, prompts x tokens, BOS handling, dtype), scoring cost, library versions, a
  reproduction snippet and the loading snippet;
- PNG plots (matplotlib, Agg canvas): per-layer scores of both protocols with the removed
  layers marked, I/R per pair, the pair heatmap when ``max_gap > 1``, and per-block
  sparsity.

:func:`write_card_files` writes the card, the plots and the JSON sidecars
(``layerswap_report.json`` loads back with :meth:`SwapReport.from_json`,
``layerswap_sparsity.json`` with ``SparsityReport.from_json``) into a folder.
Method: No Free Swap (arXiv 2605.16234).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import huggingface_hub
import torch
from huggingface_hub import EvalResult, ModelCard, ModelCardData, try_to_load_from_cache
from huggingface_hub.repocard_data import model_index_to_eval_results
from transformers import AutoModelForCausalLM

from ..calibration import shortfall_text
from ..config import LayerSwapConfig
from ..history import card_notice, history_status
from ..jsonio import write_json_atomic
from ..plan import decoder_blocks, model_fingerprint, num_blocks
from ..plots import PLOT_FILES, planned_plots, write_plots, write_sparsity_plot
from ..provenance import __version__, library_versions, model_identity
from ..recovery import RECOVERY_FILE, attached_operators
from ..report import PROTOCOLS, PruneProvenance, SwapReport, encode_float, set_key
from ..selection import greedy_select, resolve_protect
from ..sparsity import ALLOCATORS, PRUNERS, SparsityReport, config_record, sparsity_in_model
from ..sparsity.engine import prunable_linears
from ..surgery import original_indices
from ..tasks import task_card_section

__all__ = [
    "CARD_TEMPLATE",
    "EVALUATION_FILE",
    "PLOT_FILES",
    "REPORT_FILE",
    "SPARSITY_FILE",
    "check_card",
    "normalize_evaluation",
    "planned_plots",
    "render_card",
    "report_mismatches",
    "sparsity_mismatches",
    "write_card_files",
    "write_plots",
]

logger = logging.getLogger(__name__)

CARD_TEMPLATE = Path(__file__).resolve().parents[1] / "templates" / "modelcard_template.md"
REPORT_FILE = "layerswap_report.json"
EVALUATION_FILE = "layerswap_evaluation.json"
SPARSITY_FILE = "layerswap_sparsity.json"
#: Above this many scored pairs the card lists adjacent pairs and the lowest-scoring ones
#: (the sidecar JSON always has every pair).
MAX_PAIR_ROWS = 200
_DEFAULT_SPACING, _DEFAULT_PROTECT = 1, [0, -1]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_DASH = "—"
#: Contract entries that describe the run rather than the measurement (not compared, not
#: listed in the contract table; versions have their own table).
_NOT_CONTRACT = ("model", "versions", "library_versions", "device")
#: Contract entries repeated as ``model-index`` metric args (the card body has the rest).
_METRIC_ARGS = ("name", "words", "window", "stride", "scored_tokens", "dtype", "text_sha256")


# ---------------------------------------------------------------------- formatting
def _kl(v) -> str:
    """A KL value (nats) for a table: 4 significant digits; NaN/inf kept visible."""
    if v is None:
        return _DASH
    return f"{v:.4g}" if math.isfinite(v) else encode_float(v)


def _ratio(v) -> str:
    return _DASH if v is None else f"{v:.3f}"


def _indices(layers: Sequence[int]) -> str:
    return ", ".join(str(i) for i in layers) if layers else "none"


def _pct(x: float) -> str:
    return f"{x:+.1f}%"


def _cell(value) -> str:
    """A markdown table cell for an arbitrary JSON-able value."""
    if isinstance(value, float):
        return _kl(value)
    if isinstance(value, (dict, list, tuple)):
        value = json.dumps(value, sort_keys=True)
    return str(value).replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------- inputs
def _split_model(model_or_config):
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


def _current_blocks(model, config) -> int:
    if model is not None:
        return num_blocks(model)
    return int(_text_config(config).num_hidden_layers)


def _record(config) -> dict:
    record = getattr(config, "layerswap", None)
    return dict(record) if isinstance(record, Mapping) else {}


def report_mismatches(model_or_config, report: SwapReport) -> list[str]:
    """Reasons why ``report`` does not describe ``model_or_config`` (empty list = it does).

    A report belongs to a model when it scored the blocks the model was pruned from:
    ``report.num_layers`` equals ``config.layerswap["original_num_hidden_layers"]`` for a
    pruned model (the current block count otherwise), every removed index is in range,
    when the report carries a weight fingerprint (:func:`~hf_layerswap.plan.model_fingerprint`)
    it matches the model's (an unpruned model's current one, or the
    ``fingerprint_before`` of the first removal step), and, when the removal step recorded
    a score summary, the report's per-layer scores are the recorded ones.
    """
    if not isinstance(report, SwapReport):
        return [f"report must be a SwapReport, got {type(report).__name__}"]
    model, config = _split_model(model_or_config)
    record = _record(config)
    current = _current_blocks(model, config)
    expected = int(record.get("original_num_hidden_layers", current))
    problems = []
    if report.num_layers != expected:
        what = "the model was pruned from" if record else "the model has"
        problems.append(f"the report scored {report.num_layers} blocks but {what} {expected} blocks")
        return problems
    expected_fp = (report.metadata.get("model") or {}).get("fingerprint")
    if expected_fp:
        steps = record.get("steps") or [{}]
        actual_fp = steps[0].get("fingerprint_before") if record else None
        if not record and model is not None:
            actual_fp = model_fingerprint(model)
        if actual_fp and actual_fp != expected_fp:
            when = "before removal" if record else "now"
            problems.append(
                f"the report's weight fingerprint {expected_fp[:16]}... differs from the model's "
                f"{actual_fp[:16]}... ({when}): it was computed on other weights"
            )
    removed = list(record.get("removed_layers", []))
    outside = [i for i in removed if not 0 <= i < report.num_layers]
    if outside:
        problems.append(f"removed layers {outside} are outside the report's 0..{report.num_layers - 1}")
    for k, step in enumerate(record.get("steps", [])):
        summary = step.get("scores")
        if not isinstance(summary, Mapping) or summary.get("num_layers") != report.num_layers:
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


def _sparsity_summary(config, sparsity) -> dict | None:
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
    model, config = _split_model(model_or_config)
    original = [int(i) for i in record["original_blocks"]]
    current = original_indices(config, _current_blocks(model, config))
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
    model, config = _split_model(model_or_config)
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


def _sparsity_section(summary: dict, sparsity, config, current: int) -> dict:
    """Rows of the card's sparsity section (original block numbering)."""
    kept = set(original_indices(config, current))
    allocator = dict(summary.get("allocator") or {})
    statistics = [b.statistic for b in sparsity.blocks] if sparsity is not None else [None] * len(summary["block_targets"])
    blocks = [
        {
            "block": index,
            "target": f"{target:.4f}",
            "achieved": f"{achieved:.4f}",
            "statistic": _DASH if stat is None else f"{stat:.4g}",
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
        ("Target sparsity", _pct_plain(summary["target_sparsity"])),
        ("Achieved sparsity", f"{_pct_plain(summary['achieved_sparsity'], 4)} ({summary['num_zeros']:,} of "
         f"{summary['num_params']:,} weights of the blocks' linear layers are zero)"),
        ("Kept dense", _dense_note(_dense_in_model(summary, kept))),
    ]
    if any(b not in kept for b in summary["original_blocks"]):
        rows.insert(-1, ("Achieved sparsity, blocks still in the model",
                         _pct_plain(sparsity_in_model(summary, kept), 4) + " (some blocks were removed after pruning)"))
    earlier = summary.get("previous") or []
    if earlier:
        rows.append(("Earlier pruning passes (oldest first)", "; ".join(
            f"{e.get('method')}, {e.get('pattern') or 'unstructured'}, {e.get('allocation')} allocation, target "
            f"{_pct_plain(e.get('target_sparsity', 0.0))}, achieved {_pct_plain(e.get('achieved_sparsity', 0.0), 4)}"
            for e in earlier
        ) + " (the zeros they left count in the achieved sparsity above)"))
    cal = summary.get("calibration") or {}
    data_free = summary["method"] == "magnitude" and allocation in ("uniform", "random")
    if cal.get("description") and not data_free:
        rows.append(("Calibration", f"{cal['description']} (content hash {str(cal.get('content_hash'))[:12]})"))
    if summary["method"] == "magnitude":
        intro = ("The linear layers inside the decoder blocks were pruned one-shot by weight magnitude"
                 + ("" if data_free else "; the calibration set only fed the allocator's per-block statistics") + ".")
    else:
        intro = ("The linear layers inside the decoder blocks were pruned one-shot, block by block, each block "
                 "calibrated on the outputs of the already-pruned blocks.")
    intro += " The zeros are stored as ordinary dense safetensors weights."
    return {"intro": intro, "rows": [(key, _cell(value)) for key, value in rows], "blocks": blocks}


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


def _pct_plain(fraction: float, digits: int = 2) -> str:
    return f"{100 * fraction:.{digits}f}%"


def _recovery_record(model, record: Mapping) -> dict:
    """The repair of the cut: ``config.layerswap["recovery"]``, or for a model the ghosted
    operators actually attached (the record can lag behind a later removal)."""
    recovery = dict(record.get("recovery")) if isinstance(record.get("recovery"), Mapping) else {}
    if model is not None:
        ops = attached_operators(model)
        if ops:
            recovery.update(method="ghosted", boundaries=[b for b, _ in ops], file=recovery.get("file", RECOVERY_FILE))
    return recovery


def _recovery_row(recovery: Mapping) -> tuple[str, str] | None:
    if not recovery.get("method"):
        return None
    boundaries = _indices(recovery.get("boundaries", []))
    if recovery["method"] == "ghosted":
        return ("Repair of the cut", f"Ghosted Layers closed-form operator I + M at boundaries {boundaries} "
                f"(pruned numbering), stored in `{recovery.get('file')}`")
    if recovery["method"] == "fused":
        return ("Repair of the cut", f"ReplaceMe-style least-squares map folded into `down_proj` before boundaries "
                f"{boundaries} (pruned numbering): plain transformers weights")
    return ("Repair of the cut", _cell(recovery["method"]))


def normalize_evaluation(evaluation) -> dict[str, dict] | None:
    """``{"base": ..., "pruned": ...}`` of perplexity results -> plain dicts.

    Each value may be a :class:`hf_layerswap.evaluation.PerplexityResult` (anything with
    ``to_dict()``) or its dict (keys ``ppl``, ``nll``, ``tokens``, ``windows``,
    ``ci_low``, ``ci_high``, ``contract``). Either key may be missing.

    Raises:
        TypeError: ``evaluation`` is not a mapping, or a value is neither a result nor a dict.
        ValueError: an unknown key, or a value without a finite positive ``ppl``.
    """
    if evaluation is None:
        return None
    if not isinstance(evaluation, Mapping):
        raise TypeError(f"evaluation must be a dict {{'base': ..., 'pruned': ...}}, got {type(evaluation).__name__}")
    unknown = sorted(set(evaluation) - {"base", "pruned"})
    if unknown:
        raise ValueError(f"evaluation has unknown keys {unknown}: allowed 'base' and 'pruned'")
    out = {}
    for key, value in evaluation.items():
        if value is None:
            continue
        if hasattr(value, "to_dict"):
            value = value.to_dict()
        if not isinstance(value, Mapping):
            raise TypeError(f"evaluation[{key!r}] must be a PerplexityResult or its dict, got {type(value).__name__}")
        ppl = value.get("ppl")
        if not isinstance(ppl, (int, float)) or isinstance(ppl, bool) or not math.isfinite(ppl) or ppl <= 0:
            raise ValueError(f"evaluation[{key!r}]['ppl'] must be a finite positive number, got {ppl!r}")
        out[key] = json.loads(json.dumps(dict(value), default=str))
    return out or None


def _is_hub_id(name) -> bool:
    return isinstance(name, str) and bool(_HUB_ID.match(name)) and not name.endswith(".gguf") and not os.path.exists(name)


def _identity(model, report) -> dict:
    """What is known about the weights the model came from (see hf_layerswap.models)."""
    ident = {}
    if report is not None:
        ident.update({k: v for k, v in (report.metadata.get("model") or {}).items() if v})
    if model is not None:
        recorded = getattr(model, "layerswap_identity", None)
        if not isinstance(recorded, Mapping):
            try:
                recorded = model_identity(model)
            except Exception:  # identity is best effort (a model without a usable config)
                recorded = None
        if isinstance(recorded, Mapping):
            ident.update({k: v for k, v in recorded.items() if v})
    return ident


def _resolve_base_model(explicit, config, record, ident) -> str | None:
    recorded = record.get("base_model")
    if isinstance(recorded, Mapping):
        recorded = recorded.get("name")
    for candidate in (explicit, recorded, ident.get("base_model"), ident.get("name"), getattr(config, "_name_or_path", None)):
        if _is_hub_id(candidate):
            return candidate
    if explicit is not None:
        raise ValueError(f"base_model={explicit!r} is not a Hub model id of the form 'owner/name'")
    return None


def _resolve_license(explicit, base_model, config) -> str | None:
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


def _parameter_counts(model, config, removed: int, steps) -> tuple[int | None, int | None]:
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


def _provenance(step: Mapping) -> PruneProvenance:
    """The selection record of one removal step (written by :func:`hf_layerswap.pipeline.prune`)."""
    return PruneProvenance.from_dict(step)


def _step_config(steps) -> dict:
    for step in reversed(steps):
        config = _provenance(step).config
        if config is not None:
            return dict(config)
    return {}


def _selection_rule(steps, report) -> tuple[int, list[int], str]:
    cfg = _step_config(steps)
    if "spacing" in cfg and "protect" in cfg:
        return int(cfg["spacing"]), list(cfg["protect"]), f"spacing={cfg['spacing']}, protect={list(cfg['protect'])}"
    if report is not None and report.selections:
        last = report.selections[-1]
        return int(last["spacing"]), list(last["protect"]), f"spacing={last['spacing']}, protect={list(last['protect'])}"
    return (
        _DEFAULT_SPACING,
        list(_DEFAULT_PROTECT),
        f"spacing={_DEFAULT_SPACING}, protect={_DEFAULT_PROTECT}: the library defaults, the removal record names none",
    )


def _protocol_of(steps) -> str | None:
    if _search_record(steps) is not None:
        return None
    for step in reversed(steps):
        record = _provenance(step)
        if record.auto is not None and record.auto.get("chosen_protocol") in PROTOCOLS:
            return record.auto["chosen_protocol"]
        if record.protocol in PROTOCOLS:
            return record.protocol
    return None


# ---------------------------------------------------------------------- sections
def _report_section(report: SwapReport, removed: Sequence[int], protect: Sequence[int]) -> dict:
    protected = resolve_protect(protect, report.num_layers)
    scores = {p: report.layer_scores(p) for p in report.protocols}
    ranks = {p: {layer: n + 1 for n, layer in enumerate(report.ranking(p))} for p in report.protocols}
    layer_rows = []
    for layer in range(report.num_layers):
        status = "**removed**" if layer in removed else ("protected" if layer in protected else "")
        layer_rows.append(
            {
                "layer": layer,
                "scores": [_kl(scores[p][layer]) for p in report.protocols],
                "ranks": [ranks[p][layer] for p in report.protocols],
                "status": status,
            }
        )
    pairs, note = report.pairs, None
    if len(pairs) > MAX_PAIR_ROWS:
        key = "interchange" if "interchange" in report.protocols else "replacement"
        adjacent = [r for r in pairs if r.gap == 1]
        rest = sorted((r for r in pairs if r.gap > 1), key=lambda r: (_nan_last(r.value(key)), r.i, r.j))
        pairs = sorted(adjacent + rest[: max(0, MAX_PAIR_ROWS - len(adjacent))], key=lambda r: (r.i, r.j))
        note = (
            f"{len(report.pairs)} pairs were scored; the table lists the {len(adjacent)} adjacent pairs and the "
            f"lowest-{key} pairs further apart ({len(pairs)} rows). Every pair is in `{REPORT_FILE}`."
        )
    pair_rows = [
        {
            "i": r.i,
            "j": r.j,
            "repl_ij": _kl(r.replacement_ij),
            "repl_ji": _kl(r.replacement_ji),
            "repl": _kl(r.replacement),
            "inter": _kl(r.interchange),
            "ratio": _ratio(r.ratio),
        }
        for r in pairs
    ]
    gap_summary = None
    if set(PROTOCOLS) <= set(report.protocols):
        s = report.protocol_gap()["summary"]
        if s["finite_pairs"]:
            gap_summary = (
                f"mean I/R = {s['mean_ratio']:.3f}, median {s['median_ratio']:.3f} over {s['finite_pairs']} pairs "
                f"with finite values; interchange ≤ replacement on "
                f"{100 * s['fraction_interchange_le_replacement']:.0f}% of them (the paper reports "
                "d_inter ≤ d_repl on every model and pair it measured)."
            )
            if len(s["mean_ratio_by_gap"]) > 1:
                by_gap = ", ".join(f"{g}: {v:.3f}" for g, v in s["mean_ratio_by_gap"].items())
                gap_summary += f" Mean I/R by pair distance j − i: {by_gap}."
        nonfinite = s["pairs"] - s["finite_pairs"]
        if nonfinite:
            gap_summary = (gap_summary or "") + (
                f" {nonfinite} pair(s) have a non-finite value (shown as NaN/inf: a result, not dropped)."
            )
    return {
        "protocols": list(report.protocols),
        "max_gap": report.max_gap,
        "layer_rows": layer_rows,
        "pair_rows": pair_rows,
        "pair_note": note,
        "gap_summary": gap_summary,
    }


def _nan_last(v):
    return (1, 0.0) if v is None or not math.isfinite(v) else (0, v)


def _candidates(report, removed, spacing, protect, steps) -> tuple[list[dict], str, str]:
    rows, sets = [], {}
    search = _search_record(steps)
    if search is not None and list(search.get("selected", [])) == list(removed):
        return _search_candidates(search, report, removed, steps)
    for p in report.protocols:
        try:
            chosen = greedy_select(report.layer_scores(p), len(removed), spacing=spacing, protect=protect)
        except ValueError as err:
            rows.append({"protocol": p, "layers": f"not possible under these rules ({err})", "removal_kl": _DASH})
            continue
        sets[p] = chosen
        rows.append(
            {
                "protocol": p,
                "layers": _indices(chosen),
                "removal_kl": _kl(report.removal_kl.get(set_key(chosen))),
            }
        )
    removed_kl = _kl(report.removal_kl.get(set_key(removed))) if set_key(removed) in report.removal_kl else "not measured"
    return rows, _why(steps, removed, sets), removed_kl


def _search_record(steps) -> Mapping | None:
    rec = _provenance(steps[-1]).search if steps else None
    return rec if rec is not None and rec.get("strategy") == "search" else None


def _search_candidates(search, report, removed, steps) -> tuple[list[dict], str, str]:
    """Rows for each protocol's greedy set (paper's rule, spacing >= 1) as the search scored them."""
    rows, sets = [], {}
    objective = search.get("objective", "removal_kl")
    for p in report.protocols:
        entry = (search.get("protocol_sets") or {}).get(p)
        if entry is None:
            rows.append({"protocol": p, "layers": "not possible under the paper's rule at this budget",
                         "removal_kl": _DASH})
            continue
        sets[p] = list(entry["set"])
        value = entry.get("value")
        if objective != "removal_kl":
            value = report.removal_kl.get(set_key(entry["set"]))
        rows.append({"protocol": p, "layers": _indices(entry["set"]), "removal_kl": _kl(value)})
    removed_kl = _kl(report.removal_kl.get(set_key(removed))) if set_key(removed) in report.removal_kl else "not measured"
    cost = search.get("cost") or {}
    values = {p: (search["protocol_sets"][p] or {}).get("value") for p in sets}
    unit = search.get("unit", "nats")
    reason = (
        f"`strategy='search'`: candidate sets from both protocols (each protocol's greedy set and lowest-scored "
        "layers, low-score contiguous runs, the single-removal ranking) were scored by "
        f"**{objective}** on the calibration prompts and refined by local moves; the chosen set scores "
        f"{_kl(search.get('value'))} {unit}"
    )
    if values:
        reason += " against " + ", ".join(f"{p} {_kl(v)}" for p, v in values.items())
    reason += (f" ({cost.get('evaluator_calls', '?')} candidate sets, {cost.get('forward_passes', '?')} forward "
               "passes). It has the lowest value of every set scored.")
    if len(steps) > 1:
        reason = f"the blocks were removed in {len(steps)} steps (table above); the last step: " + reason
    matching = [p for p, s in sets.items() if s == list(removed)]
    if matching:
        reason += f" It is also the set the {' and '.join(matching)} rule picks."
    else:
        reason += " Neither protocol's greedy rule picks it."
    return rows, reason, removed_kl


def _why(steps, removed, sets) -> str:
    record = _provenance(steps[-1] if steps else {})
    auto = record.auto
    if len(steps) > 1:
        reason = f"the blocks were removed in {len(steps)} steps (table above); the last step: "
    else:
        reason = ""
    if auto:
        kl = auto.get("removal_kl", {})
        reason += (
            "`protocol='auto'`: both candidate sets were evaluated by their joint removal KL on the "
            f"calibration prompts (interchange {_kl(kl.get('interchange'))}, replacement "
            f"{_kl(kl.get('replacement'))} nats) and the **{auto.get('chosen_protocol')}** set was kept "
            f"({auto.get('reason')})."
        )
    elif record.selection == "explicit layers":
        reason += "the blocks were given explicitly (`LayerSwapConfig(layers=...)` or `remove_layers`)."
    elif record.protocol in PROTOCOLS:
        selection = record.selection if record.selection != "not recorded" else "greedy"
        reason += f"greedy selection on the **{record.protocol}** scores ({selection})."
    elif steps:
        reason += "`remove_layers` was called without a selection record."
    else:
        reason += "the model carries no removal record (`config.layerswap`)."
    matching = [p for p, s in sets.items() if list(s) == list(removed)]
    if len(matching) == len(sets) and sets:
        reason += " Both protocols pick this same set at this budget."
    elif matching:
        reason += f" It is the set the {matching[0]} protocol picks; the other protocol picks a different one."
    elif sets:
        reason += " It is neither protocol's greedy set under the rule shown."
    return reason


def _evaluation_section(evaluation: dict) -> tuple[dict, list]:
    rows = []
    for key, label in (("base", "base"), ("pruned", "pruned (this model)")):
        r = evaluation.get(key)
        if r is None:
            continue
        lo, hi = r.get("ci_low"), r.get("ci_high")
        rows.append(
            {
                "name": label,
                "ppl": f"{r['ppl']:.3f}",
                "ci": f"[{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else _DASH,
                "nll": _kl(r["nll"] / r["tokens"]) if r.get("nll") is not None and r.get("tokens") else _DASH,
                "tokens": f"{r['tokens']:,}" if isinstance(r.get("tokens"), int) else _DASH,
                "windows": f"{r['windows']:,}" if isinstance(r.get("windows"), int) else _DASH,
            }
        )
    base, pruned = evaluation.get("base"), evaluation.get("pruned")
    delta = _pct(100 * (pruned["ppl"] / base["ppl"] - 1)) if base and pruned else None
    contracts = [{k: v for k, v in (r.get("contract") or {}).items() if k not in _NOT_CONTRACT} for r in (base, pruned) if r]
    contract = contracts[-1]
    warning = None
    if len(contracts) == 2 and contracts[0] != contracts[1]:
        keys = sorted(k for k in set(contracts[0]) | set(contracts[1]) if contracts[0].get(k) != contracts[1].get(k))
        warning = (
            "the base and pruned perplexities were measured under different contracts (differing: "
            f"{', '.join(keys)}); the ΔPPL is not a like-for-like comparison."
        )
    section = {
        "rows": rows,
        "delta": delta,
        "warning": warning,
        "contract": [(k, _cell(v)) for k, v in contract.items()] or [("contract", "not recorded")],
    }
    return section, _eval_results(evaluation, contract)


def _eval_results(evaluation: dict, contract: Mapping) -> list:
    dataset = str(contract.get("dataset") or "")
    if dataset.startswith("wikitext-"):  # hf_layerswap.evaluation names WikiText files by their config
        dataset_fields = dict(dataset_type="wikitext", dataset_name="WikiText-2 (raw)", dataset_config=dataset)
    else:  # text that is not a Hub dataset: name its source
        source = contract.get("source") or dataset or "text of unrecorded origin (no contract)"
        dataset_fields = dict(dataset_type="text", dataset_name=str(source))
    common = dict(
        task_type="text-generation",
        task_name="Causal language modeling",
        dataset_split=str(contract.get("split") or "test"),
        metric_type="perplexity",
        **dataset_fields,
    )
    args = {k: contract[k] for k in _METRIC_ARGS if isinstance(contract.get(k), (int, float, str, bool))}
    results = []
    for key, name in (("pruned", "Perplexity (this model)"), ("base", "Perplexity (base model, same contract)")):
        if key in evaluation:
            results.append(
                EvalResult(
                    **common,
                    metric_value=round(float(evaluation[key]["ppl"]), 4),
                    metric_name=name,
                    metric_args=args or None,
                )
            )
    return results


def _calibration_rows(report, steps, ident) -> list:
    meta = report.metadata if report is not None else {}
    cal = dict(meta.get("calibration") or {})
    if not cal:
        for step in reversed(steps):
            recorded = _provenance(step).calibration
            if recorded is not None:
                cal = dict(recorded)
                break
    if not cal and not meta:
        return []
    rows = [
        ("Source", cal.get("description", "not recorded")),
        ("Content hash", f"`{cal['content_hash']}`" if cal.get("content_hash") else "not recorded"),
    ]
    n, seq, tokens = cal.get("num_prompts", meta.get("num_prompts")), cal.get("seq_len", meta.get("seq_len")), cal.get(
        "num_tokens", meta.get("num_tokens")
    )
    if n is not None:
        rows.append(("Prompts × tokens", f"{n} prompts × up to {seq} tokens ({tokens:,} real tokens)" if isinstance(tokens, int) else f"{n} × {seq}"))
    if isinstance(cal.get("shortfall"), Mapping):
        rows.append(("Shortfall", f"**fewer prompts than requested**: {shortfall_text(cal['shortfall'])}"))
    if cal.get("add_special_tokens") is not None:
        rows.append(
            (
                "Tokenizer special tokens",
                "`add_special_tokens=True`: the tokenizer's own BOS policy (the source line says whether a BOS was added)"
                if cal["add_special_tokens"]
                else "`add_special_tokens=False`: no BOS/EOS added",
            )
        )
    for key, label in (
        ("dtype", "Model dtype while scoring"),
        ("softmax_dtype", "Softmax dtype"),
        ("seed", "Paragraph shuffle seed"),
        ("batch_size", "Batch size"),
        ("token_averaging", "Averaging"),
        ("kl_direction", "KL direction"),
    ):
        if key in meta:
            rows.append((label, _cell(meta[key])))
    if ident.get("name"):
        rows.append(("Scored model", _display_identity(ident)))
    return rows


def _display_identity(ident: Mapping) -> str:
    """A model identity for the card: Hub id and revision, never a local path."""
    source = ident.get("source") if isinstance(ident.get("source"), Mapping) else {}
    name = str(source.get("upstream") or ident["name"])
    revision = f" @ {ident['revision']}" if ident.get("revision") else ""
    if _HUB_ID.match(name):
        return f"{name}{revision}"
    if os.sep in name or name.startswith((".", "~")):
        return f"local checkpoint `{Path(name).name}`{revision}"
    return f"{name}{revision}"


def _cost_rows(report) -> list:
    if report is None:
        return []
    m = report.metadata
    rows = []
    if "forward_passes" in m:
        rows.append(("Forward passes", f"{m['forward_passes']} sweeps over the calibration set (1 reference + 1 per probe)"))
    if "block_evaluations" in m:
        rows.append(("Block evaluations", f"{m['block_evaluations']:,}" + (" (unchanged prefixes reused)" if m.get("prefix_reuse") else "")))
    if "seconds" in m:
        rows.append(("Wall time", f"{m['seconds']:.1f} s"))
    rows.append(("Hardware", _cell(m.get("hardware", "not recorded"))))
    return rows


def _versions(report, steps, evaluation) -> dict:
    columns = {}
    if report is not None and isinstance(report.metadata.get("library_versions"), Mapping):
        columns["scoring"] = report.metadata["library_versions"]
    if steps and isinstance(steps[-1].get("library_versions"), Mapping):
        columns["removal"] = steps[-1]["library_versions"]
    pruned = (evaluation or {}).get("pruned") or {}
    contract = pruned.get("contract") or {}
    evaluated = contract.get("library_versions") or contract.get("versions")
    if isinstance(evaluated, Mapping):
        columns["evaluation"] = evaluated
    columns["card"] = {**library_versions(), "huggingface_hub": huggingface_hub.__version__}
    names = list(dict.fromkeys(k for col in columns.values() for k in col))
    return {"columns": list(columns), "rows": [(n, [_cell(c.get(n, _DASH)) for c in columns.values()]) for n in names]}


def _load_snippet(repo: str, tokenizer_repo: str | None, *, ghosted: bool = False) -> str:
    lines = ["from transformers import AutoModelForCausalLM, AutoTokenizer", ""]
    if ghosted:
        lines = ["import hf_layerswap  # registers the loader that re-attaches the repair operators", *lines]
    lines.append(f'model = AutoModelForCausalLM.from_pretrained("{repo}")')
    if tokenizer_repo:
        lines.append(f'tokenizer = AutoTokenizer.from_pretrained("{tokenizer_repo}")')
        lines += [
            'inputs = tokenizer("The capital of France is", return_tensors="pt")',
            "print(tokenizer.decode(model.generate(**inputs, max_new_tokens=20)[0]))",
        ]
    return "\n".join(lines)


def _reproduce(base_model, removed, steps, report, ident) -> tuple[str, str | None]:
    cfg = _step_config(steps)
    defaults = LayerSwapConfig().to_dict()
    if cfg and len(steps) == 1:
        keep = ("num_layers", "layers", "protocol")
        args = {k: v for k, v in cfg.items() if k != "quant_method" and (k in keep or v != defaults.get(k)) and v is not None}
        args.pop("progress", None)
    else:
        args = {"layers": list(removed)}
    call = ", ".join(f"{k}={v!r}" for k, v in args.items())
    source = base_model or "<base model id or folder>"
    lines = [
        "from transformers import AutoModelForCausalLM",
        "from hf_layerswap import LayerSwapConfig",
        "",
        "model = AutoModelForCausalLM.from_pretrained(",
        f'    "{source}",',
        f"    quantization_config=LayerSwapConfig({call}),",
        ")",
    ]
    cal = (report.metadata.get("calibration") if report is not None else None) or {}
    if "layers" not in args and cal.get("description"):
        lines.insert(3, f"# calibration used for the scores: {cal['description']} (content hash {cal.get('content_hash')})")
    notes = []
    if "layers" in args and report is not None:
        notes.append(
            "This removes the same blocks without rescoring. To recompute the scores, run "
            f"`hf_layerswap.score_layers(model, calibration, max_gap={report.max_gap}, "
            f"num_prompts={report.metadata.get('num_prompts')}, seq_len={report.metadata.get('seq_len')}, "
            f"seed={report.metadata.get('seed')})` on the base model with the calibration source above."
        )
    source_record = ident.get("source") if isinstance(ident.get("source"), Mapping) else None
    if source_record and source_record.get("bundled_name"):
        notes.append(
            f"The scores were computed on the dequantized GGUF weights ({ident.get('revision')}), not on the "
            f"original release of `{source_record.get('upstream')}`. To reproduce them exactly: "
            f"`model, tokenizer = hf_layerswap.models.load_model(\"{source_record['bundled_name']}\")`, then "
            f"`hf_layerswap.prune_loaded_model(model, LayerSwapConfig({call}))`."
        )
    return "\n".join(lines), " ".join(notes) or None


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
):
    """Render the model card of a (pruned, sparsified, repaired) model.

    Args:
        model_or_config: the model (parameter counts from its weights) or its config
            (counts from a meta-device instance). Removal provenance is read from
            ``config.layerswap`` (written by :func:`~hf_layerswap.remove_layers`).
        report: the :class:`SwapReport` the removal was selected from (it must belong to
            the model, see :func:`report_mismatches`); ``None`` = no diagnostics section.
        evaluation: ``{"base": ..., "pruned": ...}`` perplexity results
            (:class:`~hf_layerswap.evaluation.PerplexityResult` or their dicts).
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
            (:class:`~hf_layerswap.tasks.TaskResults` from :func:`~hf_layerswap.evaluate_tasks`,
            or their dicts), rendered as a table and ``model-index`` entries; both must be
            measured under the same settings.

    A repair of the cut recorded in ``config.layerswap["recovery"]`` (see
    :mod:`hf_layerswap.recovery`) is named in the removal table; for Ghosted Layers
    operators the loading section says that ``hf_layerswap`` must be imported to apply them.

    Returns:
        A :class:`huggingface_hub.ModelCard`.

    Raises:
        TypeError: ``model_or_config`` is neither a model nor a config; bad ``evaluation``
            or ``sparsity_report`` types.
        ValueError: the report or the sparsity report does not belong to the model, a bad
            ``evaluation`` value, or a ``base_model`` that is not a Hub id.
    """
    model, config = _split_model(model_or_config)
    if report is not None:
        problems = report_mismatches(model_or_config, report)
        if problems:
            raise ValueError("the report does not belong to this model: " + "; ".join(problems))
    problems = sparsity_mismatches(model_or_config, sparsity_report)
    if problems:
        raise ValueError(sparsity_refusal(problems, sparsity_report))
    evaluation = normalize_evaluation(evaluation)
    record = _record(config)
    steps = [dict(s) for s in record.get("steps", [])]
    current = _current_blocks(model, config)
    original = int(record.get("original_num_hidden_layers", current))
    removed = sorted(record.get("removed_layers", []))
    kept = list(record.get("kept_layers", range(current)))
    ident = _identity(model, report)
    base = _resolve_base_model(base_model, config, record, ident)
    license_ = _resolve_license(license, base, config)
    protocol = _protocol_of(steps)
    spacing, protect, rule = _selection_rule(steps, report)
    if _search_record(steps) is not None:
        rule = (f"spacing={max(1, spacing)}, protect={protect} for each protocol's rule; the search itself used "
                f"spacing={spacing}")
    before, after = _parameter_counts(model, config, len(removed), steps)
    sparse = _sparsity_summary(config, sparsity_report)
    recovery = _recovery_record(model, record)
    ghosted = recovery.get("method") == "ghosted"
    plot_keys = planned_plots(report, sparsity=sparse is not None) if plots is None else list(plots)
    unknown = [k for k in plot_keys if k not in PLOT_FILES]
    if unknown:
        raise ValueError(f"plots={unknown}: allowed {sorted(PLOT_FILES)}")
    name = repo_id or (f"{base.split('/')[-1]}-layerswap-{current}L" if base else f"layerswap-{current}L")

    # --- front matter
    tags = ["layerswap", "layer-pruning"] + ([protocol] if protocol else [])
    if sparse is not None:
        tags += ["sparsity", sparse["method"]]
    front = {
        "original_num_hidden_layers": original,
        "num_hidden_layers": current,
        "removed_layers": removed,
        "protocol": protocol,
        "report": REPORT_FILE if report is not None else None,
    }
    if recovery.get("method"):
        front["recovery"] = recovery["method"]
    if sparse is not None:
        in_model = sparsity_in_model(sparse, original_indices(config, current))
        front["sparsity"] = {k: sparse[k] for k in ("method", "allocation", "pattern", "target_sparsity")}
        front["sparsity"]["achieved_sparsity"] = in_model
        front["sparsity"]["report"] = SPARSITY_FILE if sparsity_report is not None else None
    eval_section, eval_results = _evaluation_section(evaluation) if evaluation else (None, None)

    task_md, task_evals = task_card_section(tasks) if tasks else (None, [])
    eval_results = (eval_results or []) + task_evals
    card_data = ModelCardData(
        base_model=base,
        library_name="transformers",
        license=license_,
        pipeline_tag="text-generation",
        tags=tags,
        model_name=name if eval_results else None,
        eval_results=eval_results or None,
        layerswap=front,
    )

    # --- body
    base_label = f"[{base}](https://huggingface.co/{base})" if base else "the original model"
    if removed:
        title = f"{name}: {len(removed)} of {original} decoder blocks removed"
        params = ""
        if before and after:
            params = f", {100 * (before - after) / before:.1f}% of the parameters"
        summary = (
            f"This checkpoint is {base_label} with decoder blocks **{_indices(removed)}** removed "
            f"({len(removed)} of {original} blocks, {100 * len(removed) / original:.1f}% of the depth{params}), "
            f"selected with `hf_layerswap`" + (f" using the **{protocol}** swap-KL protocol." if protocol else (
                " by a search over candidate sets guided by both swap-KL protocols." if _search_record(steps) else "."))
        )
    elif sparse is not None:
        title = f"{name}: {_pct_plain(sparse['achieved_sparsity'], 1)} sparse linear layers"  # nothing removed
        summary = f"No blocks were removed from {base_label}."
    else:
        title = f"{name}: swap-KL layer-redundancy scores"
        summary = f"No blocks were removed from {base_label}; this card records its swap-KL diagnostics."
    if ghosted:
        summary += " The cut is repaired with Ghosted Layers operators (load with `import hf_layerswap`, see below)."
    elif recovery.get("method") == "fused":
        summary += " The cut is repaired with a least-squares map folded into the weights."
    if sparse is not None:
        summary += (
            f" The linear layers of its decoder blocks are {_pct_plain(in_model, 2)} sparse (one-shot "
            f"{sparse['method']}, {sparse['pattern'] or 'unstructured'}, {sparse['allocation']} allocation)."
        )
    if evaluation and "base" in evaluation and "pruned" in evaluation:
        summary += (
            f" Perplexity {evaluation['base']['ppl']:.2f} → {evaluation['pruned']['ppl']:.2f} "
            f"({eval_section['delta']}) under the contract below."
        )

    if history_status(config) == "unverified":
        front["history"] = "unverified"
    if card_notice(record):
        summary += " " + card_notice(record)
    ident_revision = ident.get("revision") if isinstance(ident.get("source"), Mapping) else None
    removal_rows = [
        ("Base model", base_label + (f" (weights: {ident_revision})" if ident_revision else "")),
        ("Decoder blocks", f"{original} → {current}" + (f" ({len(removed)} removed)" if removed else "")),
        ("Removed blocks (0-based, original numbering)", _indices(removed)),
        ("Kept blocks (0-based, original numbering)", _indices(kept)),
    ]
    if before is not None and after is not None:
        change = f" ({after - before:+,}, {_pct(100 * (after - before) / before)})" if before != after else ""
        removal_rows.append(("Parameters", f"{before:,} → {after:,}{change}"))
    elif after is not None:
        removal_rows.append(("Parameters", f"{after:,} after removal (blocks differ in size; the count before is not recorded)"))
    if removed:
        removal_rows.append(("Protocol guiding the removal", protocol or "none recorded"))
    repair = _recovery_row(recovery)
    if repair is not None:
        removal_rows.append(repair)
    step_rows = [
        {
            "before": s.get("num_layers_before", _DASH),
            "removed_local": _indices(s.get("removed_layers", [])),
            "removed_original": _indices(s.get("removed_original_layers", [])),
            "selection": _cell(_provenance(s).selection),
        }
        for s in steps
    ]
    candidates, why, removed_kl = ([], None, None)
    if report is not None and removed:
        candidates, why, removed_kl = _candidates(report, removed, spacing, protect, steps)
    reproduce, reproduce_note = _reproduce(base, removed, steps, report, ident) if removed else (
        "# nothing was removed: see the diagnostics above", None
    )
    files = [("README.md", "this card"), ("config.json", "model config; `layerswap` holds the removal record (0-based)"),
             ("*.safetensors", "weights of the kept blocks")]
    if report is not None:
        files.append((REPORT_FILE, "every swap-KL value: `hf_layerswap.SwapReport.from_json(path)`"))
    if evaluation:
        files.append((EVALUATION_FILE, "perplexity results with their contracts"))
    if sparsity_report is not None:
        files.append((SPARSITY_FILE, "per-block and per-linear sparsity: `hf_layerswap.sparsity.SparsityReport.from_json(path)`"))
    if ghosted:
        files.append((str(recovery.get("file")), "Ghosted Layers operators (float32 (H, H) per boundary), applied by `hf_layerswap`"))
    files += [(PLOT_FILES[k], "plot") for k in plot_keys]
    tokenizer_repo = (repo_id or "path/to/this/checkpoint") if tokenizer_included else base
    plot_alt = {
        "layer_scores": "Per-layer swap-KL scores of both protocols; removed layers shaded",
        "protocol_gap": "I/R = interchange / replacement per pair",
        "pair_heatmap": "Pair swap-KL heatmap: replacement above, interchange below the diagonal",
        "sparsity": "Per-block target and achieved sparsity",
    }
    context = dict(
        title=title,
        summary=summary,
        base_model=base,
        removal_rows=removal_rows,
        steps=step_rows,
        report=_report_section(report, removed, protect) if report is not None else None,
        plots={k: ([{"file": PLOT_FILES[k], "alt": plot_alt[k]}] if k in plot_keys else []) for k in PLOT_FILES},
        candidates=candidates,
        budget=f"{len(removed)} block{'s' if len(removed) != 1 else ''}",
        rule=rule,
        removed_layers=_indices(removed),
        removed_kl=removed_kl,
        why=why,
        evaluation=eval_section,
        calibration=_calibration_rows(report, steps, ident),
        cost=_cost_rows(report),
        sparsity=_sparsity_section(sparse, sparsity_report, config, current) if sparse is not None else None,
        ghosted=ghosted,
        load_snippet=_load_snippet(repo_id or "path/to/this/checkpoint", tokenizer_repo, ghosted=ghosted),
        reproduce_snippet=reproduce,
        reproduce_note=reproduce_note,
        files=files,
        versions=_versions(report, steps, evaluation),
        library_version=__version__,
    )
    card = ModelCard.from_template(card_data, template_path=str(CARD_TEMPLATE), **context)
    text = re.sub(r"\n{3,}", "\n\n", str(card)).rstrip("\n") + "\n"
    if task_md:
        text += "\n## Task evaluation (lm-evaluation-harness)\n\n" + task_md + "\n"
    return ModelCard(text)


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
    Without matplotlib the card is written without plots (a warning is logged).

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
    model, config = _split_model(model_or_config)
    sparse = _sparsity_summary(config, sparsity_report)
    try:
        if report is not None:
            paths = write_plots(report, directory, removed=_record(config).get("removed_layers", []))
            plot_keys = list(paths)
            written.update({p.name: p for p in paths.values()})
        if sparse is not None:
            kept = original_indices(config, _current_blocks(model, config))
            path = write_sparsity_plot(sparse, directory / PLOT_FILES["sparsity"], kept=kept)
            plot_keys.append("sparsity")
            written[path.name] = path
    except ImportError as err:
        logger.warning("matplotlib is not installed (%s): the card is written without plots", err)
    card = render_card(model_or_config, plots=plot_keys, **kwargs)
    problems = check_card(card, directory)
    if problems:
        raise ValueError("the rendered card is not valid: " + "; ".join(problems))
    card.save(directory / "README.md")
    written["README.md"] = directory / "README.md"
    for path in written.values():  # temporary-file writers leave 0600; these are for publishing
        os.chmod(path, 0o644)
    return written
