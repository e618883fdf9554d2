"""The evaluation a card shows, checked once: ``{"base": ..., "pruned": ...}`` perplexity
results, each with its contract, both under the same one, ``base`` measured on the scored
base model and ``pruned`` on the model the card describes (by the weight fingerprint each
result records). One ``hf-layerswap eval`` result per model is accepted in place of a
perplexity result."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

from huggingface_hub import EvalResult

from ..evaluation.contract import KNOWN_SOURCES
from ..surgery.history import weights_changed_later
from ..layerplan import model_fingerprint
from ..scoring.report import SwapReport

from .checks import layerswap_record, split_model
from .format import METRIC_ARGS, NOT_CONTRACT

__all__ = [
    "EVAL_RESULT_KEYS", "evaluation_mismatches", "is_eval_result", "measured_contract", "normalize_evaluation",
    "perplexity_eval_results",
]


#: The keys of one ``hf-layerswap eval`` result (:mod:`hf_layerswap.cli.eval`): one model's
#: identity, its perplexity (a ``PerplexityResult`` dict or ``None``) and its lm-eval tasks.
EVAL_RESULT_KEYS = frozenset({"model", "perplexity", "tasks"})


def is_eval_result(value) -> bool:
    """Whether ``value`` is one model's ``hf-layerswap eval`` result (not a perplexity result)."""
    return isinstance(value, Mapping) and bool(value) and set(value) <= EVAL_RESULT_KEYS and "perplexity" in value


def measured_contract(result: Mapping) -> dict:
    """What a perplexity result's contract says about how it was measured: its ``contract``
    without the keys that name the run rather than the measurement (:data:`NOT_CONTRACT`:
    the model, library versions, device)."""
    contract = result.get("contract")
    return {k: v for k, v in contract.items() if k not in NOT_CONTRACT} if isinstance(contract, Mapping) else {}


def normalize_evaluation(evaluation) -> dict[str, dict] | None:
    """``{"base": ..., "pruned": ...}`` of perplexity results -> plain dicts, checked.

    Each value may be a :class:`hf_layerswap.evaluation.PerplexityResult` (anything with
    ``to_dict()``), its dict (keys ``ppl``, ``nll``, ``tokens``, ``windows``, ``ci_low``,
    ``ci_high``, ``contract``), or one model's ``hf-layerswap eval`` result (its
    ``perplexity`` is taken). Either key may be missing. Each result must record its
    contract (how it was measured), and base and pruned the same one (the ΔPPL compares
    them); which weights each measured is checked against the model by
    :func:`evaluation_mismatches`.

    Raises:
        TypeError: ``evaluation`` is not a mapping, or a value is neither a result nor a dict.
        ValueError: an unknown key, a value without a finite positive ``ppl``, an ``eval``
            result without perplexity, a result without a contract, base and pruned
            measured under different contracts.
    """
    if evaluation is None:
        return None
    if not isinstance(evaluation, Mapping):
        raise TypeError(f"evaluation must be a dict {{'base': ..., 'pruned': ...}}, got {type(evaluation).__name__}")
    if is_eval_result(evaluation):
        raise ValueError(
            "evaluation is one model's `hf-layerswap eval` result, not the pair the card compares: give "
            "{'base': <result of the base model>, 'pruned': <result of this model>} (each an `hf-layerswap eval` "
            "result or a perplexity result)"
        )
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
        if is_eval_result(value):
            if value["perplexity"] is None:
                raise ValueError(f"evaluation[{key!r}] is an `hf-layerswap eval` result without perplexity (tasks "
                                 "only): run `hf-layerswap eval` with --text or without --tasks")
            value = value["perplexity"]
            if not isinstance(value, Mapping):
                raise TypeError(f"evaluation[{key!r}]['perplexity'] must be a perplexity result dict, got "
                                f"{type(value).__name__}")
        ppl = value.get("ppl")
        if not isinstance(ppl, (int, float)) or isinstance(ppl, bool) or not math.isfinite(ppl) or ppl <= 0:
            raise ValueError(f"evaluation[{key!r}]['ppl'] must be a finite positive number, got {ppl!r}")
        if not measured_contract(value):
            raise ValueError(
                f"evaluation[{key!r}] (ppl {ppl!r}) records no contract (the text, window, stride, dtype it was "
                "measured under): measure it with hf_layerswap.evaluate_perplexity or `hf-layerswap eval`, whose "
                "results carry it"
            )
        out[key] = json.loads(json.dumps(dict(value), default=str))
    if "base" in out and "pruned" in out:
        base, pruned = measured_contract(out["base"]), measured_contract(out["pruned"])
        differ = sorted(k for k in set(base) | set(pruned) if base.get(k) != pruned.get(k))
        if differ:
            shown = "; ".join(f"{k}: base {base.get(k)!r}, pruned {pruned.get(k)!r}" for k in differ[:4])
            raise ValueError(
                f"evaluation: the base and pruned perplexities were measured under different contracts (differing: "
                f"{', '.join(differ)}; {shown}), so their ΔPPL is not a like-for-like comparison: measure both "
                "under one contract"
            )
    return out or None


def _measured_weights(result: Mapping) -> str | None:
    """The weight fingerprint a perplexity result records (``contract["model"]["fingerprint"]``)."""
    model = (result.get("contract") or {}).get("model")
    fingerprint = model.get("fingerprint") if isinstance(model, Mapping) else None
    return fingerprint if isinstance(fingerprint, str) and fingerprint else None


def evaluation_mismatches(model_or_config, evaluation: Mapping | None, report: SwapReport | None = None) -> list[str]:
    """Reasons why a normalized evaluation (:func:`normalize_evaluation`) does not describe
    ``model_or_config`` (empty list = it does).

    Each result must record the weights it measured (``contract["model"]["fingerprint"]``,
    :func:`~hf_layerswap.layerplan.model_fingerprint`, as :func:`~hf_layerswap.evaluate_perplexity`
    and ``hf-layerswap eval`` write it). ``base`` must have measured the scored base: the
    weights before the first removal step (``fingerprint_before``), else the report's. ``pruned``
    must have measured this model: its weights now (for a config, the weights recorded after
    the last removal step while no later step changed them).
    """
    if not evaluation:
        return []
    model, config = split_model(model_or_config)
    record = layerswap_record(config)
    steps = [s for s in record.get("steps") or [] if isinstance(s, Mapping)]
    base = steps[0].get("fingerprint_before") if steps else None
    if not base and report is not None:
        base = (report.metadata.get("model") or {}).get("fingerprint")
    if model is not None:
        now = model_fingerprint(model)
    else:
        now = steps[-1].get("fingerprint_after") if steps and not weights_changed_later(config) else None
    expected = {"base": (base, "the scored base model's (before removal)"), "pruned": (now, "this model's")}
    problems = []
    for key in ("base", "pruned"):
        if key not in evaluation:
            continue
        measured = _measured_weights(evaluation[key])
        want, whose = expected[key]
        if measured is None:
            problems.append(
                f"evaluation[{key!r}] does not record the weights it measured (contract['model']['fingerprint'], "
                "written by hf_layerswap.evaluate_perplexity and `hf-layerswap eval`)"
            )
        elif want and measured != want:
            name = (evaluation[key].get("contract") or {}).get("model", {}).get("name")
            problems.append(
                f"evaluation[{key!r}] measured weights {measured[:12]}"
                + (f" ({name})" if name else "")
                + f", not {whose} {want[:12]}: it is another model's result"
                + (" or was measured before the model changed (a repair, healing, sparsity)" if key == "pruned" else "")
            )
    return problems


def _dataset_fields(contract: Mapping) -> dict:
    """The ``model-index`` dataset of a contract: WikiText-2 (raw) by its config and split when
    the contract names it (``dataset``, or a known WikiText file as its ``source``), else the
    text's source by name."""
    source = str(contract.get("source") or "")
    dataset, split = contract.get("dataset"), contract.get("split")
    if not dataset and source.startswith("file:"):
        dataset, split = KNOWN_SOURCES.get(source[len("file:"):], (None, split))
    dataset = str(dataset or "")
    if dataset.startswith("wikitext-"):  # hf_layerswap.evaluation names WikiText files by their config
        fields = dict(dataset_type="wikitext", dataset_name="WikiText-2 (raw)", dataset_config=dataset)
    else:  # text that is not a Hub dataset: name its source
        fields = dict(dataset_type="text", dataset_name=source or dataset or "text of unrecorded origin (no contract)")
    return dict(fields, dataset_split=str(split or "test"))


def perplexity_eval_results(contract: Mapping, values: Sequence[tuple[str, object]]) -> list[EvalResult]:
    """The card's ``model-index`` entries of perplexities measured under one contract.

    Args:
        contract: the perplexity contract (a :class:`~hf_layerswap.evaluation.PerplexityResult`'s
            ``contract``, or a healing record's summary of it: ``contract`` for its name and
            ``text`` for its source are read as ``name`` and ``source``).
        values: ``(metric name, perplexity)`` pairs; a value that is no finite positive number
            (not measured, or ``nan``/``inf``) gets no entry.

    Returns:
        One :class:`huggingface_hub.EvalResult` per measured value: task ``text-generation``,
        the dataset (WikiText-2 raw with its config and split, else the text's source),
        metric ``perplexity`` with the value exactly as measured, the contract's name as
        ``metric_config`` and its settings (:data:`~hf_layerswap.card.format.METRIC_ARGS`) as
        ``metric_args``.
    """
    contract = dict(contract)
    for short, key in (("contract", "name"), ("text", "source")):
        if key not in contract and short in contract:
            contract[key] = contract[short]
    args = {k: contract[k] for k in METRIC_ARGS
            if isinstance(contract.get(k), (int, float, str)) and not isinstance(contract.get(k), bool)}
    name = contract.get("name")
    common = dict(task_type="text-generation", task_name="Causal language modeling", metric_type="perplexity",
                  metric_config=str(name) if isinstance(name, str) and name else None, metric_args=args or None,
                  **_dataset_fields(contract))
    return [EvalResult(**common, metric_name=label, metric_value=float(value)) for label, value in values
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0]
