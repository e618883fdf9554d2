"""Layer-removal criteria, ours and the field's, measured in one harness.

One module on purpose: the harness (:func:`compare_criteria`, one resumable run), the
merging of its states and reports and its result types share one state format; the
criteria it compares live in :mod:`hf_layerswap.selection`.

The criteria that read the model are selection strategies, one module each in
:mod:`hf_layerswap.selection` (and importable from here under their old names); this module
holds the comparison harness (:func:`compare_criteria`), the controls (``random``,
``tail``), report merging and the protocol-gap summary.

Every criterion reads the same calibration prompts (a
:class:`~hf_layerswap.calibration.CalibrationSet`), takes the same budget ``n`` (blocks to
remove) and returns a :class:`CriterionResult`: the removed blocks (0-based, ascending),
per-layer scores where the method has them, and its cost in calibration forward passes
and seconds. :func:`compare_criteria` then evaluates every removed set with one
perplexity contract (:func:`~hf_layerswap.evaluation.evaluate_perplexity`) and one joint
removal KL on the calibration prompts, so the numbers are comparable.

Criteria (:func:`harness_criteria`: each registered strategy's ``criteria``, then the controls): ``block_influence`` (ShortGPT) and ``angular_distance``
(Gromov et al.) in :mod:`hf_layerswap.selection.geometry`; ``single_removal_kl``
(:mod:`~hf_layerswap.selection.single_removal`); ``sleb`` (:mod:`~hf_layerswap.selection.sleb`);
``replacement`` / ``interchange`` / ``auto``, the paper's rule per protocol and the better of
the two (:mod:`~hf_layerswap.selection.greedy`); ``interchange_beam``, the paper's beam
(:mod:`~hf_layerswap.selection.beam`); ``search`` (the default, removal KL) and
``search_<objective>`` for each other objective (``search_nll``, ``search_ghosted``), the
protocol-guided search (:mod:`~hf_layerswap.selection.search`); and two controls defined
here: ``random`` (n blocks drawn uniformly, seeded, ``draws`` draws) and ``tail`` (the last
n blocks before the final one, ``L-1-n .. L-2``). Every searching criterion scores its
candidates on the calibration prompts only, never on the evaluation text.

Cost units: a *forward pass* is one sweep of the model over every calibration prompt
(possibly starting at a later block by prefix reuse, see :mod:`hf_layerswap.scoring`);
*block passes* count block forward calls over the calibration set (a full forward of an
L-block model is L block passes).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import random as _random
import shutil
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torch import nn

from .evaluation import PerplexityResult, delta_ppl_ci, delta_ppl_percent, evaluate_perplexity
from .utils.provenance import model_identity
from .layerplan import apply_plan, num_blocks, removal_plan
from .recovery import RECOVERY_METHODS, recover
from .utils.jsonio import decode_tree, encode_tree, write_json_atomic
from .scoring.report import PairResult, SwapReport, set_key
from .scoring.rule import resolve_protect
from .selection.criterion import CriterionResult, allowed_blocks, parse_budgets, criterion_output, score_adjacent, setup_criterion
from .selection.objectives import removal_kl_values
from .selection.registry import STRATEGIES, Criterion, strategy_entry
from .surgery.removal import remove_layers

__all__ = [
    "CONTROLS",
    "DEFAULT_CRITERIA",
    "CriterionComparison",
    "compare_criteria",
    "evaluate_removed",
    "harness_criteria",
    "merge_criteria_states",
    "merge_reports",
    "protocol_gap_quartiles",
    "random_removal",
    "tail_removal",
]

logger = logging.getLogger(__name__)

# ----------------------------------------------------------------------------- controls


def random_removal(
    model_or_num_blocks,
    n: int | Sequence[int],
    *,
    seed: int = 0,
    draws: int = 5,
    protect: Sequence[int] = (0, -1),
):
    """Random control: ``draws`` independent draws of ``n`` distinct unprotected blocks.

    Draws come from ``random.Random(seed + 1000 * n)`` (Python's Mersenne Twister), so a
    budget's draws are reproducible from the seed and independent of the other budgets.

    Args:
        model_or_num_blocks: a model (its block count is used) or L.
        draws: at least 1 (the benchmark uses 5 and reports mean and spread).

    Returns:
        :class:`CriterionResult`: ``removed`` = the first draw; ``details["draws"]`` all
        draws (each ascending). No forward pass.

    Raises:
        ValueError: ``draws < 1`` or a budget larger than the unprotected blocks.
    """
    total = model_or_num_blocks if isinstance(model_or_num_blocks, int) else num_blocks(model_or_num_blocks)
    budgets, single = parse_budgets(n, total)
    if isinstance(draws, bool) or not isinstance(draws, int) or draws < 1:
        raise ValueError(f"draws={draws!r}: must be an int >= 1")
    allowed = allowed_blocks(total, protect)
    results = {}
    for b in budgets:
        if b > len(allowed):
            raise ValueError(f"n={b} exceeds the {len(allowed)} unprotected blocks (protect={list(protect)})")
        rng = _random.Random(seed + 1000 * b)
        sets = [sorted(rng.sample(allowed, b)) for _ in range(draws)]
        results[b] = CriterionResult(
            "random", b, sets[0], None, 0, 0, 0.0,
            details={"draws": sets, "seed": seed, "rng": "random.Random(seed + 1000 * n)",
                     "protect": sorted(resolve_protect(protect, total))},
        )
    return criterion_output(results, single)


def tail_removal(model_or_num_blocks, n: int | Sequence[int]):
    """Tail control: remove the last ``n`` blocks before the final one, ``L-1-n .. L-2``.

    Raises:
        ValueError: a budget outside ``1..L-2``.
    """
    total = model_or_num_blocks if isinstance(model_or_num_blocks, int) else num_blocks(model_or_num_blocks)
    budgets, single = parse_budgets(n, total)
    if budgets[-1] > total - 1 - 1:
        raise ValueError(f"tail n={budgets[-1]}: at most L-2={total - 2} blocks lie between the first and the last")
    results = {
        b: CriterionResult("tail", b, list(range(total - 1 - b, total - 1)), None, 0, 0, 0.0)
        for b in budgets
    }
    return criterion_output(results, single)


# ----------------------------------------------------------------------------- ours


def merge_reports(*reports: SwapReport) -> SwapReport:
    """Merge swap-KL reports of the same model and calibration prompts (e.g. one per
    protocol, or a gap-1 report and a gap-2..3 extension) into one.

    Pair values present in several reports must agree exactly. ``metadata`` keeps the first
    report's fields, with ``forward_passes``/``block_evaluations``/``seconds`` summed and
    ``merged_from`` recording each part.

    Raises:
        ValueError: reports of different block counts, calibration content or models
            (weight fingerprints, where recorded), or conflicting values for the same pair.
    """
    if not reports:
        raise ValueError("merge_reports needs at least one report")
    first = reports[0]
    hashes = {r.metadata.get("calibration", {}).get("content_hash") for r in reports}
    if len({r.num_blocks for r in reports}) != 1 or len(hashes) != 1:
        raise ValueError("merge_reports: the reports differ in block count or calibration content hash")
    prints = {f for r in reports if (f := (r.metadata.get("model") or {}).get("fingerprint"))}
    if len(prints) > 1:  # the merged report (its values, removal_kl included) would be of one model
        raise ValueError(f"merge_reports: the reports are of {len(prints)} different models (weight fingerprints "
                         f"{', '.join(sorted(f[:16] + '...' for f in prints))}); merge reports of one model")
    pairs: dict[tuple[int, int], dict] = {}
    value_fields = ("replacement_ij", "replacement_ji", "interchange")
    for r in reports:
        for p in r.pairs:
            slot = pairs.setdefault((p.i, p.j), {})
            for f in value_fields:
                v = getattr(p, f)
                if v is None:
                    continue
                if f in slot and not (slot[f] == v or (math.isnan(slot[f]) and math.isnan(v))):
                    raise ValueError(f"merge_reports: pair ({p.i}, {p.j}) has two different {f} values")
                slot[f] = v
                slot[f + "_se"] = getattr(p, f + "_se")
    protocols = tuple(p for p in ("replacement", "interchange") if any(p in r.protocols for r in reports))
    metadata = copy.deepcopy(first.metadata)
    for key in ("forward_passes", "block_evaluations", "seconds"):
        if all(key in r.metadata for r in reports):
            metadata[key] = sum(r.metadata[key] for r in reports)
    metadata["merged_from"] = [
        {"protocols": list(r.protocols), "max_gap": r.max_gap, "pairs": len(r.pairs),
         **{k: r.metadata.get(k) for k in ("forward_passes", "seconds")}}
        for r in reports
    ]
    merged = SwapReport(
        first.num_blocks,
        [PairResult(i, j, **v) for (i, j), v in pairs.items()],
        protocols=protocols,
        max_gap=max(r.max_gap for r in reports),
        metadata=metadata,
    )
    for r in reports:
        merged.removal_kl.update(r.removal_kl)
    return merged


# ----------------------------------------------------------------------------- registry


#: The harness's own controls (not strategies): ``random`` draws, the ``tail`` blocks.
CONTROLS: dict[str, Criterion] = {
    "random": Criterion(lambda model, calib, n, **kw: random_removal(model, n, **kw), batched=False),
    "tail": Criterion(lambda model, calib, n, **kw: tail_removal(model, n), batched=False),
}


def harness_criteria() -> dict[str, Criterion]:
    """Every criterion :func:`compare_criteria` runs, by the name the benchmark pages show:
    each registered strategy's :attr:`~hf_layerswap.selection.registry.Strategy.criteria`
    (registration order), then :data:`CONTROLS`. A strategy registered with ``criteria=``
    is compared at once."""
    out: dict[str, Criterion] = {}
    for name in STRATEGIES:
        out.update(strategy_entry(name).criteria)
    return {**out, **CONTROLS}


#: The criteria of the built-in strategies and the controls (:func:`harness_criteria` at import).
DEFAULT_CRITERIA = tuple(harness_criteria())


# ----------------------------------------------------------------------------- protocol-gap summary


def protocol_gap_quartiles(report: SwapReport) -> dict:
    """Protocol-gap summary by pair distance: for each gap, the number of pairs with
    finite values, the fraction with interchange <= replacement, and the quartiles
    (25/50/75%) of I/R = d_inter / d_repl; plus the same over all pairs.

    Raises:
        ValueError: the report lacks one of the two protocols.
    """
    gap = report.protocol_gap()
    by_gap: dict[int, list] = {}
    for row in gap["pairs"]:
        if row["ratio"] is not None:
            by_gap.setdefault(row["gap"], []).append(row)

    def summary(rows):
        ratios = sorted(r["ratio"] for r in rows)
        q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
        return {
            "pairs": len(rows),
            "fraction_interchange_le_replacement": sum(r["interchange"] <= r["replacement"] for r in rows) / len(rows),
            "ratio_q25": q[0], "ratio_median": q[1], "ratio_q75": q[2],
            "ratio_min": ratios[0], "ratio_max": ratios[-1],
        }

    out = {"by_gap": {g: summary(rows) for g, rows in sorted(by_gap.items())}}
    all_rows = [r for rows in by_gap.values() for r in rows]
    out["all"] = summary(all_rows) if all_rows else None
    out["non_finite_pairs"] = gap["summary"]["pairs"] - gap["summary"]["finite_pairs"]
    return out


# ----------------------------------------------------------------------------- comparison harness


@dataclass
class CriterionComparison:
    """Every criterion's removed set per budget, evaluated under one contract.

    Attributes:
        rows: one dict per (criterion, n): ``criterion``, ``n``, ``removed`` (for
            ``random`` the draws), ``ppl``, ``dppl`` (%), ``dppl_ci`` (paired bootstrap
            95% interval, %), ``removal_kl`` (joint, calibration prompts, nats),
            ``forward_passes``, ``block_passes``, ``evaluator_calls``, ``seconds``; random
            rows add ``dppl_sd``, ``dppl_min``, ``dppl_max``, ``draws``.
        base: the unpruned model's perplexity result (dict).
        contract: the evaluation contract every number was measured under.
        calibration: the calibration set's spec.
        evaluation_method: ``"copy"`` (a deep copy pruned with
            :func:`~hf_layerswap.surgery.remove_layers`) or ``"plan"`` (a removal plan).
        results: ``{criterion: {n: CriterionResult dict}}``.
        model: the model's identity.
        params: budgets, criteria, options, batch size.
        reports: the swap-KL reports the swap-guided criteria and the beam used
            (``{name: SwapReport dict}``).
        evaluation_seconds: wall-clock seconds of each perplexity evaluation, by removed
            set (``"i,j,..."``; ``""`` = the unpruned model).
        recovery: the repair every set was also evaluated after (rows then carry
            ``ppl_recovered``, ``dppl_recovered``, ``dppl_recovered_ci``), or ``None``.
    """

    rows: list[dict]
    base: dict
    contract: dict
    calibration: dict
    evaluation_method: str
    results: dict
    model: dict
    params: dict = field(default_factory=dict)
    reports: dict = field(default_factory=dict)
    evaluation_seconds: dict = field(default_factory=dict)
    recovery: str | None = None

    def to_dict(self) -> dict:
        return json.loads(json.dumps(encode_tree(asdict(self)), allow_nan=False))

    @classmethod
    def from_dict(cls, data: Mapping) -> CriterionComparison:
        """Inverse of :meth:`to_dict` (budgets back to ints in ``results``)."""
        fields_ = decode_tree(dict(data))
        fields_["results"] = {name: {int(b): r for b, r in per_n.items()} for name, per_n in fields_["results"].items()}
        return cls(**fields_)

    def best_by_n(self) -> dict[int, list[str]]:
        """Budget -> criteria with the lowest dPPL% (random excluded; ties listed together)."""
        out: dict[int, list[str]] = {}
        for n in sorted({r["n"] for r in self.rows}):
            rows = [r for r in self.rows if r["n"] == n and r["criterion"] != "random" and r["dppl"] is not None]
            if rows:
                best = min(r["dppl"] for r in rows)
                out[n] = [r["criterion"] for r in rows if r["dppl"] == best]
        return out

    def to_markdown(self) -> str:
        """One table: criterion, n, removed, PPL, dPPL% [CI], joint removal KL, cost."""
        c = self.contract
        bos = c.get("bos", {})
        lines = [
            f"Base PPL {self.base['ppl']:.4f} [{_fmt(self.base.get('ci_low'))}, {_fmt(self.base.get('ci_high'))}]; "
            f"contract `{c.get('name')}`: {c.get('source')} ({c.get('split')}), {c.get('words')} words, "
            f"{c.get('num_input_tokens')} tokens, window {c.get('window')}, stride {c.get('stride')}, "
            f"{c.get('scored_tokens')} scored tokens in {c.get('windows')} windows, BOS "
            f"{'added' if bos.get('add_bos') else 'not added'} ({bos.get('bos_choice')}), dtype {c.get('dtype')}, "
            f"CI: paired bootstrap over windows (2,000 resamples, seed 42) on dPPL%.",
            f"Calibration: {self.calibration.get('description')}, {self.calibration.get('num_prompts')} prompts, "
            f"{self.calibration.get('num_tokens')} tokens (hash {str(self.calibration.get('content_hash'))[:12]}). "
            f"Removed sets evaluated by {'pruning a deep copy (remove_layers)' if self.evaluation_method == 'copy' else 'a removal plan'}.",
            "",
            "| criterion | n | removed (0-based) | PPL | dPPL % | 95% CI (dPPL %) | removal KL (nats) | forward passes | evaluator calls | seconds |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rows:
            if r["criterion"] == "random":
                removed = "; ".join(",".join(map(str, s)) for s in r["draws"])
                dppl = f"{r['dppl']:+.1f} (sd {r['dppl_sd']:.1f})"
                ci = f"draws {r['dppl_min']:+.1f} .. {r['dppl_max']:+.1f}"
                ppl = f"{r['ppl']:.3f} (mean)"
                kl = f"{r['removal_kl']:.4f} (mean)" if r.get("removal_kl") is not None else "-"
            else:
                removed = ",".join(map(str, r["removed"]))
                dppl = f"{r['dppl']:+.1f}"
                ci = f"[{r['dppl_ci'][0]:+.1f}, {r['dppl_ci'][1]:+.1f}]" if r.get("dppl_ci") and None not in r["dppl_ci"] else "-"
                ppl = f"{r['ppl']:.3f}"
                kl = f"{r['removal_kl']:.4f}" if r.get("removal_kl") is not None else "-"
            calls = "-" if r.get("evaluator_calls") is None else str(r["evaluator_calls"])
            lines.append(
                f"| {r['criterion']} | {r['n']} | {removed} | {ppl} | {dppl} | {ci} | {kl} | "
                f"{r['forward_passes']} | {calls} | {r['seconds']:.0f} |"
            )
        return "\n".join(lines) + "\n"


def _public_identity(identity: Mapping | None) -> dict:
    """A model identity without the local path it was read from (results get published)."""
    return {k: v for k, v in dict(identity or {}).items() if k != "path"}


def _public_contract(contract: dict) -> dict:
    out = dict(contract)
    if isinstance(out.get("model"), Mapping):
        out["model"] = _public_identity(out["model"])
    return out


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _text_fingerprint(text) -> str:
    if text is None:
        return "embedded"
    path = Path(text) if isinstance(text, (str, Path)) and "\n" not in str(text) and len(str(text)) < 4096 else None
    data = path.read_bytes() if path is not None and path.is_file() else str(text).encode()
    return hashlib.sha256(data).hexdigest()


def evaluate_removed(model, removed, eval_text, tokenizer, contract, method, eval_kwargs):
    """Perplexity (:func:`~hf_layerswap.evaluation.evaluate_perplexity` under ``contract``,
    with ``eval_kwargs``) of ``model`` without the blocks ``removed`` (0-based; empty = the
    model as is). ``method="plan"`` skips them through a temporary removal plan;
    ``"copy"`` removes them from a deep copy. Both give the same numbers; ``model`` is
    left unchanged."""
    if not removed:
        return evaluate_perplexity(model, eval_text, tokenizer=tokenizer, contract=contract, **eval_kwargs)
    if method == "plan":
        with apply_plan(model, removal_plan(num_blocks(model), removed)):
            return evaluate_perplexity(model, eval_text, tokenizer=tokenizer, contract=contract, **eval_kwargs)
    pruned = copy.deepcopy(model)
    try:
        remove_layers(pruned, removed)
        return evaluate_perplexity(pruned, eval_text, tokenizer=tokenizer, contract=contract, **eval_kwargs)
    finally:
        del pruned


_evaluate_removed = evaluate_removed


def _evaluate_recovered(model, removed, method, calib, eval_text, tokenizer, contract, eval_kwargs, batch_size):
    """Perplexity of a deep copy of the dense model with ``removed`` cut and repaired by ``method``."""
    pruned = copy.deepcopy(model)
    try:
        recover(pruned, removed, calib, method=method, batch_size=batch_size)
        return evaluate_perplexity(pruned, eval_text, tokenizer=tokenizer, contract=contract, **eval_kwargs)
    finally:
        del pruned


_evaluate_removed = evaluate_removed


def compare_criteria(
    model: nn.Module,
    calibration,
    budgets: Sequence[int],
    *,
    criteria: Sequence[str] = DEFAULT_CRITERIA,
    eval_text=None,
    tokenizer=None,
    contract: str = "matched",
    evaluation_options: Mapping | None = None,
    evaluation_method: str = "copy",
    report: SwapReport | None = None,
    options: Mapping[str, Mapping] | None = None,
    joint_kl: bool = True,
    recovery: str | None = None,
    recovery_criteria: Sequence[str] | None = None,
    batch_size: int = 8,
    eval_batch_size: int = 2,
    state_path=None,
    log: Callable[[str], None] | None = None,
) -> CriterionComparison:
    """Run every criterion on the same calibration prompts and budgets, then evaluate
    every removed set under one perplexity contract.

    Selection happens first and only ever sees ``calibration``; ``eval_text`` is read only
    afterwards, by :func:`~hf_layerswap.evaluation.evaluate_perplexity`.

    Args:
        model: the causal LM (left unchanged).
        calibration: a CalibrationSet or a source for
            :func:`~hf_layerswap.calibration.build_calibration` (with ``tokenizer``).
        budgets: the n values (blocks removed), each in ``1..L-2``.
        criteria: names from :func:`harness_criteria` (each registered strategy's
            criteria, and the controls ``random`` and ``tail``).
        eval_text: evaluation text for ``evaluate_perplexity`` (path, string, or ``None``
            = the embedded evaluation split).
        tokenizer: the model's tokenizer (needed for text sources and evaluation).
        contract: ``"matched"`` or ``"full"`` (see :mod:`hf_layerswap.evaluation`).
        evaluation_options: overrides passed to ``evaluate_perplexity`` (``window``,
            ``stride``, ``max_words``, ``add_bos``, ``bootstrap``); recorded in the contract.
        evaluation_method: ``"copy"``: each set is removed from a deep copy with
            :func:`~hf_layerswap.surgery.remove_layers` (the checkpoint a user would
            ship); ``"plan"``: the model runs under a removal plan. Both give the same
            perplexity (tested); ``"plan"`` needs no second copy of the weights.
        report: a shared SwapReport with both protocols (any ``max_gap``); its adjacent
            pairs serve the swap-guided criteria and the beam. Scored here if ``None``
            (one report per protocol, so each criterion's cost is measured).
        options: per-criterion keyword options, e.g. ``{"random": {"draws": 5, "seed": 0},
            "interchange_beam": {"evaluator": "nll"}}``.
        joint_kl: also compute every set's joint removal KL on the calibration prompts.
        recovery: also evaluate every removed set after the same repair of the cut,
            ``"ghosted"`` or ``"fused"`` (:func:`~hf_layerswap.recovery.recover` on a deep
            copy of the dense model, fitted on ``calibration`` with the method's default
            ridge), so criteria are compared after repair as well as without; rows gain
            ``ppl_recovered``, ``dppl_recovered`` and ``dppl_recovered_ci``. ``random``
            is not repaired (its draws are a control of the plain cut). A method that
            cannot repair the model (``"fused"`` on post-norm blocks) raises before any
            evaluation.
        recovery_criteria: the criteria whose sets are repaired (default: every one but
            ``random``); rows of the others carry no repaired numbers.
        batch_size: calibration prompts per forward pass. eval_batch_size: windows per
            forward pass in evaluation.
        state_path: JSON file to resume from and to save progress to (written atomically
            after every step). A state recorded for another model, calibration set,
            evaluation text, contract or options raises instead of mixing results.
            While a protocol is scored, its completed probes are kept in the folder
            ``<state stem>.<protocol>-probes`` beside it (removed once the report is in
            the state), so a run killed mid-scoring loses no finished probe.
        log: progress callback (default: this module's logger at INFO).

    Returns:
        :class:`CriterionComparison`.

    Raises:
        ValueError: an unknown criterion or evaluation method, a bad budget, or a
            mismatching state file.
    """

    log = log or logger.info
    table = harness_criteria()
    repair = _check_harness_arguments(table, criteria, evaluation_method, recovery, recovery_criteria)
    calib, num_blocks, budgets, _ = setup_criterion(model, calibration, tokenizer, list(budgets))
    options = {k: dict(v) for k, v in (options or {}).items()}
    fingerprint = {
        "model": model_identity(model).get("name"),
        "num_blocks": num_blocks,
        "calibration": calib.content_hash,
        "eval_text": _text_fingerprint(eval_text),
        "contract": contract,
        "evaluation_options": encode_tree(dict(evaluation_options or {})),
        "options": encode_tree(options),
    }
    run = _HarnessRun(model, calib, _load_state(fingerprint, state_path, log), state_path, log, batch_size)
    reports = run.shared_reports(table, criteria) if report is None else {}
    results = run.select(table, criteria, budgets, options, report, reports)
    eval_kwargs = {"batch_size": eval_batch_size, **dict(evaluation_options or {})}
    all_sets = run.evaluate(results, eval_text, tokenizer, contract, evaluation_method, eval_kwargs)
    ppl = {k: PerplexityResult.from_dict(decode_tree(v)) for k, v in run.state["ppl"].items()}
    kl = run.joint_kl(all_sets) if joint_kl else {}
    repaired = {}
    if recovery is not None:
        repaired = run.repaired(results, repair, recovery, eval_text, tokenizer, contract, eval_kwargs)
    base = ppl[""]
    rows = [_row(name, b, results[name][b], base, ppl, kl, repaired, joint_kl,
                 recovery_criteria is None or name in recovery_criteria)
            for name in criteria for b in budgets]
    return CriterionComparison(
        rows=rows,
        base={"ppl": base.ppl, "ci_low": base.ci_low, "ci_high": base.ci_high, "nll": base.nll, "tokens": base.tokens},
        contract=base.contract,
        calibration=calib.spec(),
        evaluation_method=evaluation_method,
        results={name: {b: r.to_dict() for b, r in per_n.items()} for name, per_n in results.items()},
        model=_public_identity(model_identity(model)),
        params={"budgets": budgets, "criteria": list(criteria), "options": encode_tree(options), "batch_size": batch_size},
        reports={"shared": report.to_dict()} if report is not None else {k: r.to_dict() for k, r in reports.items()},
        evaluation_seconds={k: run.state.get("ppl_seconds", {}).get(k) for k in all_sets},
        recovery=recovery,
    )


def _check_harness_arguments(table, criteria, evaluation_method, recovery, recovery_criteria) -> list[str]:
    """Refuse bad arguments before any work; returns the criteria whose sets are repaired."""
    unknown = [c for c in criteria if c not in table]
    if unknown:
        raise ValueError(f"unknown criteria {unknown}: allowed {list(table)}")
    if evaluation_method not in ("copy", "plan"):
        raise ValueError(f"evaluation_method={evaluation_method!r}: allowed 'copy' or 'plan'")
    repairs = [name for name, m in RECOVERY_METHODS.items() if m.fits]
    if recovery is not None and recovery not in repairs:
        raise ValueError(f"recovery={recovery!r}: allowed None or one of {repairs}")
    repair = [c for c in (recovery_criteria or criteria) if c != "random"]
    unknown = [c for c in repair if c not in criteria]
    if unknown:
        raise ValueError(f"recovery_criteria {unknown} are not among the criteria run: allowed {list(criteria)}")
    return repair


def _load_state(fingerprint: dict, state_path, log) -> dict:
    """A fresh harness state, or the one at ``state_path`` when it was recorded for ``fingerprint``."""
    state = {"format": "hf_layerswap.compare_criteria/1", "fingerprint": fingerprint, "criteria": {}, "ppl": {},
             "removal_kl": {}, "reports": {}}
    if state_path is not None and Path(state_path).is_file():
        loaded = json.loads(Path(state_path).read_text(encoding="utf-8"))
        if loaded.get("fingerprint") != fingerprint:
            raise ValueError(
                f"state file {state_path} was recorded for {loaded.get('fingerprint')}, not {fingerprint}: "
                "use another state_path or delete it"
            )
        state = loaded
        log(f"resuming from {state_path}")
    return state


def _sets_of(res: CriterionResult) -> list[list[int]]:
    return res.details["draws"] if res.name == "random" else [res.removed]


class _HarnessRun:
    """One :func:`compare_criteria` run: its state (saved after every step) and its steps."""

    def __init__(self, model, calib, state: dict, state_path, log, batch_size: int):
        self.model, self.calib, self.state, self.state_path = model, calib, state, state_path
        self.log, self.batch_size = log, batch_size

    def save(self) -> None:
        if self.state_path is not None:
            write_json_atomic(self.state, self.state_path)

    def shared_reports(self, table, criteria) -> dict[str, SwapReport]:
        """One adjacent-pair report per protocol a criterion reads, so each criterion's cost is its own."""
        reports: dict[str, SwapReport] = {}
        for proto in sorted({p for name in criteria for p in table[name].reads}):
            if proto in self.state["reports"]:
                reports[proto] = SwapReport.from_dict(self.state["reports"][proto])
                continue
            self.log(f"scoring {proto} swap-KL (adjacent pairs)")
            # completed probes survive a killed run next to the state file until the report is in it
            probes = None if self.state_path is None else Path(self.state_path).with_name(
                f"{Path(self.state_path).stem}.{proto}-probes")
            reports[proto] = score_adjacent(self.model, self.calib, (proto,), self.batch_size, checkpoint_path=probes)
            reports[proto].metadata["model"] = _public_identity(model_identity(self.model))
            self.state["reports"][proto] = reports[proto].to_dict()
            self.save()
            if probes is not None:
                shutil.rmtree(probes, ignore_errors=True)
        return reports

    def select(self, table, criteria, budgets, options, report, reports) -> dict[str, dict[int, CriterionResult]]:
        """Every criterion's sets at every budget (calibration prompts only)."""
        results: dict[str, dict[int, CriterionResult]] = {}
        for name in criteria:
            entry = table[name]
            done = {int(k): CriterionResult.from_dict(v) for k, v in self.state["criteria"].get(name, {}).items()}
            todo = [b for b in budgets if b not in done]
            if todo:
                self.log(f"criterion {name}: budgets {todo}")
                kwargs = dict(options.get(name, {}))
                if entry.reads:
                    shared = [reports[p] for p in entry.reads] if report is None else [report]
                    kwargs["report"] = shared[0] if len(shared) == 1 else merge_reports(*shared)
                if entry.batched:
                    kwargs.setdefault("batch_size", self.batch_size)
                earlier = [b for b in done if b < min(todo)]
                if entry.resumes and earlier:
                    # iterative searches continue, not restart; a one-shot ranking reuses its scores
                    kwargs["resume"] = done[max(earlier)]
                out = entry.run(self.model, self.calib, todo, **kwargs)
                out = out if isinstance(out, dict) else {todo[0]: out}
                done.update(out)
                self.state["criteria"][name] = {str(k): v.to_dict() for k, v in sorted(done.items())}
                self.save()
            results[name] = {b: done[b] for b in budgets}
        return results

    def evaluate(self, results, eval_text, tokenizer, contract, evaluation_method, eval_kwargs) -> dict:
        """The perplexity of every removed set (the only place ``eval_text`` is read); returns the sets."""
        all_sets: dict[str, list] = {"": []}
        for per_n in results.values():
            for res in per_n.values():
                for s in _sets_of(res):
                    all_sets[set_key(s)] = list(s)
        for key, s in all_sets.items():
            if key in self.state["ppl"]:
                continue
            self.log(f"perplexity with removed = [{key}]")
            t0 = time.perf_counter()
            res = _evaluate_removed(self.model, s, eval_text, tokenizer, contract, evaluation_method, eval_kwargs)
            res.contract = _public_contract(res.contract)
            self.state["ppl"][key] = encode_tree(res.to_dict())
            self.state.setdefault("ppl_seconds", {})[key] = time.perf_counter() - t0
            self.save()
        return all_sets

    def joint_kl(self, all_sets) -> dict:
        """Every set's joint removal KL on the calibration prompts (nats)."""
        todo = [k for k in all_sets if k and k not in self.state["removal_kl"]]
        if todo:
            self.log(f"joint removal KL of {len(todo)} sets on the calibration prompts")
            values, _ = removal_kl_values(self.model, self.calib, [all_sets[k] for k in todo], self.batch_size)
            self.state["removal_kl"].update(dict(zip(todo, encode_tree(values))))
            self.save()
        return {k: decode_tree(v) for k, v in self.state["removal_kl"].items()}

    def repaired(self, results, repair, recovery, eval_text, tokenizer, contract, eval_kwargs) -> dict:
        """The perplexity of the ``repair`` criteria's sets after ``recovery``."""
        done = self.state.setdefault("ppl_recovered", {}).setdefault(recovery, {})
        keys = {set_key(r.removed): list(r.removed) for name, per_n in results.items() if name in repair
                for r in per_n.values()}
        for key, s in keys.items():
            if key in done:
                continue
            self.log(f"perplexity with removed = [{key}] after {recovery} recovery")
            t0 = time.perf_counter()
            res = _evaluate_recovered(self.model, s, recovery, self.calib, eval_text, tokenizer, contract, eval_kwargs,
                                      self.batch_size)
            res.contract = _public_contract(res.contract)
            done[key] = {**encode_tree(res.to_dict()), "seconds": time.perf_counter() - t0}
            self.save()
        return {k: PerplexityResult.from_dict(decode_tree({f: x for f, x in v.items() if f != "seconds"}))
                for k, v in done.items()}


def _row(name, n, res: CriterionResult, base, ppl, kl, repaired, joint_kl: bool, with_repair: bool) -> dict:
    """One (criterion, n) row of :class:`CriterionComparison`."""
    row = {"criterion": name, "n": n, "removed": res.removed, "forward_passes": res.forward_passes,
           "block_passes": res.block_passes, "evaluator_calls": res.evaluator_calls, "seconds": res.seconds}
    if name == "random":
        keys = [set_key(s) for s in res.details["draws"]]
        d = [delta_ppl_percent(base, ppl[k]) for k in keys]
        row.update({"draws": res.details["draws"], "ppl": statistics.fmean(ppl[k].ppl for k in keys),
                    "dppl": statistics.fmean(d), "dppl_sd": statistics.stdev(d) if len(d) > 1 else 0.0,
                    "dppl_min": min(d), "dppl_max": max(d), "dppl_draws": d, "dppl_ci": None,
                    "removal_kl": statistics.fmean(kl[k] for k in keys) if joint_kl else None})
        return row
    k = set_key(res.removed)
    row.update({"ppl": ppl[k].ppl, "dppl": delta_ppl_percent(base, ppl[k]),
                "dppl_ci": list(delta_ppl_ci(base, ppl[k])), "ppl_ci": [ppl[k].ci_low, ppl[k].ci_high],
                "removal_kl": kl.get(k) if joint_kl else None})
    if k in repaired and with_repair:
        row.update({"ppl_recovered": repaired[k].ppl, "dppl_recovered": delta_ppl_percent(base, repaired[k]),
                    "dppl_recovered_ci": list(delta_ppl_ci(base, repaired[k]))})
    return row


#: Parts of a :func:`compare_criteria` state that several runs can fill independently.
_MERGED_STATE_PARTS = ("ppl", "ppl_seconds", "removal_kl", "reports", "extras")


def merge_criteria_states(sources: Sequence, destination) -> dict:
    """Merge :func:`compare_criteria` state files written by separate runs of the same
    comparison (same model, calibration, evaluation text, contract and options), e.g.
    disjoint ``criteria`` run in parallel processes, into one state file that a final
    ``compare_criteria`` call with every criterion resumes from.

    Selections merge per criterion and budget; perplexities, removal KLs, swap-KL reports
    and any ``extras`` merge per key. Where two sources hold the same entry, the first
    source's is kept (every entry is a deterministic function of the fingerprint).
    Run-level summaries (``comparison``, ``command``, ...) are not carried over.

    Args:
        sources: paths of state files (at least one); ``destination`` may be one of them.
        destination: path of the merged state, written atomically.

    Returns:
        The merged state (the JSON object written).

    Raises:
        ValueError: no sources, a file that is not a compare_criteria state, or states
            recorded for different fingerprints.
        FileNotFoundError: a missing source.
    """
    paths = [Path(s) for s in sources]
    if not paths:
        raise ValueError("merge_criteria_states needs at least one source state file")
    merged = None
    for path in paths:
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not a compare_criteria state file: {err}") from err
        if not isinstance(state, dict) or state.get("format") != "hf_layerswap.compare_criteria/1":
            raise ValueError(f"{path} is not a compare_criteria state file (format hf_layerswap.compare_criteria/1)")
        if merged is None:
            merged = {"format": state["format"], "fingerprint": state["fingerprint"], "criteria": {},
                      **{part: {} for part in _MERGED_STATE_PARTS}}
        elif state.get("fingerprint") != merged["fingerprint"]:
            raise ValueError(
                f"{path} was recorded for {state.get('fingerprint')}, not {merged['fingerprint']} "
                f"(from {paths[0]}): only states of the same comparison merge"
            )
        for name, per_n in state.get("criteria", {}).items():
            target = merged["criteria"].setdefault(name, {})
            for n, result in per_n.items():
                target.setdefault(n, result)
        for part in _MERGED_STATE_PARTS:
            for key, value in state.get(part, {}).items():
                merged[part].setdefault(key, value)
    merged["criteria"] = {name: dict(sorted(per_n.items(), key=lambda kv: int(kv[0])))
                          for name, per_n in merged["criteria"].items()}
    write_json_atomic(merged, destination)
    return merged
