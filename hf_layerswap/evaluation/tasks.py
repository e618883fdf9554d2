"""Zero-/few-shot task evaluation through lm-evaluation-harness, recorded for the model card.

:func:`evaluate_tasks` wraps the in-memory model in lm-eval's ``HFLM`` and runs
``lm_eval.simple_evaluate``: the same code path, prompts and metrics that papers report
with lm-eval, so a pruned model's numbers are comparable with its peers'. The result
(:class:`TaskResults`) records lm-eval's version, each task's version and a task hash (the
hash lm-eval's evaluation tracker computes from the per-sample document, prompt and target
hashes), the few-shot count, limit and seed. ``render_card(..., tasks={"base": ...,
"pruned": ...})`` turns it into a table and ``model-index`` entries; results measured under
different settings are refused there.

Needs the ``lm-eval`` extra (``pip install "hf-layerswap[lm-eval]"``). Tasks are lm-eval task
names, or names in the YAML task folders given as ``include_path`` (lm-eval's built-in
task index is not scanned then, which keeps the call offline-fast).
"""

from __future__ import annotations

import contextlib
import math
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from huggingface_hub import EvalResult
from huggingface_hub import constants as hub_constants

from ..utils.devices import input_device
from .contract import resolve_tokenizer
from ..utils.extras import require
from ..utils.jsonio import JsonResult, decode_tree
from ..utils.provenance import public_identity

__all__ = ["TaskResults", "check_task_names", "evaluate_tasks", "offline_documents", "request_forwards", "task_card_section",
           "task_requests"]


def _require_lm_eval():
    return require("lm_eval", "evaluate_tasks (lm-evaluation-harness tasks)")


@dataclass
class TaskResults(JsonResult):
    """lm-eval results of one model under one setting.

    Attributes:
        results: ``{task: {metric: value}}`` (lm-eval's metric names without the
            ``,none`` filter suffix; ``<metric>_stderr`` next to each where lm-eval gives one).
        settings: ``num_fewshot``, ``limit``, ``seed``, ``batch_size``, ``max_length``,
            ``add_bos_token`` (what must match for two results to be compared).
        versions: ``lm_eval`` and each task's version.
        task_hashes: ``{task: sha256}`` over the samples' doc/prompt/target hashes.
        n_samples: ``{task: number of documents evaluated}``.
        loglikelihoods: ``{task: [per-document rolling loglikelihood, nats]}`` for
            ``loglikelihood_rolling`` tasks (lets a perplexity be cross-checked).
        model: identity of the evaluated model (see :func:`hf_layerswap.utils.provenance.model_identity`).
        higher_is_better: ``{task: {metric: bool}}``, lm-eval's direction of each metric
            (``False`` for perplexities and bits per byte); empty in results recorded before
            it was kept.
    """

    results: dict
    settings: dict
    versions: dict
    task_hashes: dict
    n_samples: dict
    loglikelihoods: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    higher_is_better: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> TaskResults:
        return cls(**{k: decode_tree(data[k]) for k in cls.__dataclass_fields__ if k in data})


def evaluate_tasks(
    model,
    tasks: str | Sequence[str],
    *,
    tokenizer=None,
    num_fewshot: int = 0,
    limit: int | float | None = None,
    include_path=None,
    batch_size: int = 1,
    max_length: int | None = None,
    add_bos_token: bool | None = None,
    seed: int = 1234,
    bootstrap_iters: int = 1000,
) -> TaskResults:
    """Evaluate ``model`` on lm-eval tasks (``lm_eval.simple_evaluate`` with an ``HFLM``).

    Args:
        model: an in-memory transformers causal LM (pruned or not); evaluated as it is.
        tasks: a task name or a list of them (lm-eval names or names under ``include_path``).
        tokenizer: default ``AutoTokenizer.from_pretrained(model.name_or_path)``.
        num_fewshot: few-shot examples per prompt (0 = zero-shot).
        limit: documents per task (int) or fraction (float < 1); ``None`` = all.
        include_path: folder(s) of task YAML files; given, lm-eval's built-in index is not
            scanned.
        batch_size: requests per forward pass.
        max_length: lm-eval's context length (``HFLM(max_length=...)``); default the
            model's ``max_position_embeddings`` (else 2048), as lm-eval picks it.
        add_bos_token: lm-eval's ``add_bos_token`` (``None`` = tokenizer default).
        seed: lm-eval's random, numpy, torch and few-shot seeds.
        bootstrap_iters: lm-eval's resamples for the stderr of non-mean metrics (0 = no stderr).

    Returns:
        :class:`TaskResults`.

    Raises:
        ImportError: lm-eval is not installed. ValueError: empty or unknown task names,
        a negative ``num_fewshot``. FileNotFoundError: an ``include_path`` that is not a folder.
    """
    _require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.utils import hash_string

    if isinstance(num_fewshot, bool) or not isinstance(num_fewshot, int) or num_fewshot < 0:
        raise ValueError(f"num_fewshot={num_fewshot!r}: must be an int >= 0")
    names, manager = _task_manager(tasks, include_path)
    tokenizer = resolve_tokenizer(model, tokenizer)
    if max_length is None:
        max_pos = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        max_length = int(max_pos) if max_pos else 2048
    was_training = model.training
    model.eval()
    lm = HFLM(
        pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length,
        add_bos_token=add_bos_token, device=str(input_device(model)),
    )
    try:
        out = simple_evaluate(
            model=lm, tasks=names, num_fewshot=num_fewshot, limit=limit, task_manager=manager,
            log_samples=True, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed, bootstrap_iters=bootstrap_iters,
        )
    finally:
        model.train(was_training)

    import lm_eval

    results, hashes, counts, lls = {}, {}, {}, {}
    for task in names:
        metrics = {}
        for key, value in out["results"].get(task, {}).items():
            if key == "alias" or key.startswith("sample_len") or not isinstance(value, (int, float)):
                continue
            metric = key.split(",")[0]
            metrics[metric] = None if isinstance(value, float) and math.isnan(value) else float(value)
        results[task] = metrics
        samples = out["samples"].get(task, [])
        hashes[task] = hash_string("".join(s["doc_hash"] + s["prompt_hash"] + s["target_hash"] for s in samples))
        counts[task] = len(samples)
        if out["configs"][task].get("output_type") == "loglikelihood_rolling":
            lls[task] = [float(_first(s["resps"])) for s in samples]
    return TaskResults(
        results=results,
        settings={
            "num_fewshot": num_fewshot, "limit": limit, "seed": seed, "batch_size": batch_size,
            "max_length": max_length, "add_bos_token": add_bos_token, "bootstrap_iters": bootstrap_iters,
        },
        versions={"lm_eval": lm_eval.__version__, **{t: out["versions"].get(t) for t in names}},
        task_hashes=hashes,
        n_samples=counts,
        loglikelihoods=lls,
        model=public_identity(model),
        higher_is_better={t: {m: bool(v) for m, v in (out.get("higher_is_better", {}).get(t) or {}).items()}
                          for t in names},
    )


def check_task_names(tasks: str | Sequence[str], include_path=None) -> list[str]:
    """``tasks`` as a list, each checked against lm-eval's task index (its own tasks, or the
    YAML folders ``include_path`` only), as :func:`evaluate_tasks` checks them; nothing is
    downloaded (the index is read from the installed task files).

    Raises:
        ImportError: lm-eval is not installed. ValueError: empty or unknown task names (the
        message names them). FileNotFoundError: an ``include_path`` that is not a folder.
    """
    _require_lm_eval()
    return _task_manager(tasks, include_path)[0]


def _task_manager(tasks, include_path):
    """``(names, TaskManager)``: the task names checked, and lm-eval's task index over
    ``include_path`` only (or lm-eval's own tasks)."""
    from lm_eval.tasks import TaskManager

    names = [tasks] if isinstance(tasks, str) else list(tasks)
    if not names or not all(isinstance(t, str) and t for t in names):
        raise ValueError(f"tasks={tasks!r}: give one or more lm-eval task names")
    if include_path is not None:
        paths = [str(p) for p in include_path] if isinstance(include_path, (list, tuple)) else [str(include_path)]
        missing = [p for p in paths if not Path(p).is_dir()]
        if missing:
            raise FileNotFoundError(f"include_path={missing[0]!r} is not a folder: give folders of task YAML files")
        manager = TaskManager(include_path=paths, include_defaults=False)
    else:
        manager = TaskManager()
    unknown = [t for t in names if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; known here: {sorted(manager.all_tasks)[:20]}")
    return names, manager


def task_requests(tasks: str | Sequence[str], *, limit: int | float | None = None, include_path=None,
                  num_fewshot: int = 0, seed: int = 1234) -> dict[str, dict]:
    """The requests :func:`evaluate_tasks` sends the model, built by lm-eval without one
    (``Task.build_all_requests`` over the documents ``limit`` selects, zero-shot, as
    ``simple_evaluate`` does).

    Returns:
        ``{task: {"output_type": lm-eval's output type, "requests": [(request_type,
        arguments), ...]}}``: ``arguments`` are the request's strings (``(context,
        continuation)`` of a ``loglikelihood`` request); ``{task: {"error": reason}}`` for a
        task lm-eval could not build here (its documents could not be loaded).

    The documents load offline (the Hub switched off for ``huggingface_hub`` and
    ``datasets``: a task whose documents are on the Hub gets an error, nothing is
    downloaded) into a throwaway ``datasets`` cache (nothing is written to the user's
    cache); both are restored on return (:func:`offline_documents`).

    Raises:
        ImportError: lm-eval is not installed. ValueError, FileNotFoundError: as
        :func:`evaluate_tasks` (empty or unknown task names, a missing ``include_path``).
    """
    _require_lm_eval()
    names, manager = _task_manager(tasks, include_path)
    with offline_documents():
        return _built_requests(names, manager, limit, num_fewshot, seed)


@contextlib.contextmanager
def offline_documents():
    """Within: the Hub offline (``huggingface_hub``'s and ``datasets``' switches, so any
    request raises instead of downloading) and ``datasets``' cache and downloads in a
    temporary folder removed on exit; the settings before are restored on exit."""
    settings = require("datasets.config", "reading lm-eval task documents offline")
    names = ("HF_DATASETS_CACHE", "DOWNLOADED_DATASETS_PATH", "EXTRACTED_DATASETS_PATH", "HF_HUB_OFFLINE")
    saved = hub_constants.HF_HUB_OFFLINE, {n: getattr(settings, n) for n in names}
    with tempfile.TemporaryDirectory(prefix="layerswap-documents-") as folder:
        hub_constants.HF_HUB_OFFLINE = settings.HF_HUB_OFFLINE = True
        settings.HF_DATASETS_CACHE = Path(folder)
        settings.DOWNLOADED_DATASETS_PATH = Path(folder) / "downloads"
        settings.EXTRACTED_DATASETS_PATH = Path(folder) / "downloads" / "extracted"
        try:
            yield
        finally:
            hub_constants.HF_HUB_OFFLINE = saved[0]
            for name, value in saved[1].items():
                setattr(settings, name, value)


def _built_requests(names, manager, limit, num_fewshot: int, seed: int) -> dict[str, dict]:
    from lm_eval.evaluator_utils import get_sample_size

    out: dict[str, dict] = {}
    for name in names:
        try:  # the task's documents load here (offline: lm-eval's own tasks get an error)
            built = manager.load([name])["tasks"]
        except Exception as err:  # noqa: BLE001 - lm-eval and datasets raise many kinds; the reason is kept
            out[name] = {"error": f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"}
            continue
        for task_name, task in built.items():
            if task.get_config("num_fewshot") != 0:  # simple_evaluate sets num_fewshot on every task
                task.set_config(key="num_fewshot", value=num_fewshot)
            task.set_fewshot_seed(seed=seed)
            task.build_all_requests(limit=get_sample_size(task, limit), rank=0, world_size=1)
            out[task_name] = {"output_type": task.OUTPUT_TYPE,
                              "requests": [(inst.request_type, tuple(inst.arguments)) for inst in task.instances]}
    return out


def request_forwards(tokenizer, output_type: str, requests, max_length: int) -> list[int] | None:
    """The forwards ``HFLM`` (batch size 1) runs for one task's ``requests``
    (:func:`task_requests`), at most: one per ``loglikelihood`` request (``multiple_choice``
    included; requests sharing a context and a one-token continuation share one), one per
    rolling window of a ``loglikelihood_rolling`` document (lm-eval's own
    ``get_rolling_token_windows`` over the document's tokens, ``max_length`` positions
    each); ``None`` for output types whose forwards depend on the model
    (``generate_until``: one per generated token).

    Returns:
        the positions of each forward (tokens, at most ``max_length``), or ``None``.
    """
    _require_lm_eval()
    from lm_eval.utils import get_rolling_token_windows

    if output_type in ("loglikelihood", "multiple_choice"):
        return [min(max_length, len(tokenizer.encode(context + continuation))) for _, (context, continuation, *_)
                in requests]
    if output_type == "loglikelihood_rolling":
        prefix = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        out = []
        for _, (text, *_) in requests:
            windows = get_rolling_token_windows(token_list=tokenizer.encode(text), prefix_token=prefix or 0,
                                                max_seq_len=max_length, context_len=1)
            out += [min(max_length, len(context) + len(pred)) for context, pred in windows]
        return out
    return None


def _first(value):
    while isinstance(value, (list, tuple)):
        value = value[0]
    return value


def _as_results(value) -> TaskResults:
    if isinstance(value, TaskResults):
        return value
    if isinstance(value, Mapping):
        return TaskResults.from_dict(value)
    raise TypeError(f"task results must be TaskResults or their dict, got {type(value).__name__}")


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def task_card_section(tasks: Mapping) -> tuple[str, list]:
    """The card's lm-eval section and ``model-index`` entries for ``{"base": ..., "pruned": ...}``.

    Returns ``(markdown, [huggingface_hub.EvalResult, ...])``.

    Raises:
        ValueError: unknown keys, or base and pruned measured under different settings,
            task versions or task hashes (the comparison would not be like for like).
    """
    unknown = sorted(set(tasks) - {"base", "pruned"})
    if unknown or not tasks:
        raise ValueError(f"tasks= takes 'base' and/or 'pruned' TaskResults, got keys {sorted(tasks)}")
    runs = {k: _as_results(v) for k, v in tasks.items()}
    if len(runs) == 2:
        base, pruned = runs["base"], runs["pruned"]
        for name in ("settings", "versions", "task_hashes"):
            if getattr(base, name) != getattr(pruned, name):
                raise ValueError(
                    f"base and pruned task results differ in {name} ({getattr(base, name)} vs "
                    f"{getattr(pruned, name)}): evaluate both under the same lm-eval settings"
                )
    ref = runs.get("pruned") or runs["base"]
    columns = [k for k in ("base", "pruned") if k in runs]
    lines = [
        "| task | metric | " + " | ".join("base" if c == "base" else "pruned (this model)" for c in columns) + " |",
        "|---|---|" + "---:|" * len(columns),
    ]
    evals = []
    for task, metrics in ref.results.items():
        for metric in metrics:
            if metric.endswith("_stderr"):
                continue
            cells = []
            for c in columns:
                value = runs[c].results.get(task, {}).get(metric)
                err = runs[c].results.get(task, {}).get(f"{metric}_stderr")
                cells.append(_fmt(value) + (f" ± {err:.4f}" if isinstance(err, float) and err > 0 else ""))
            lines.append(f"| {task} | {metric} | " + " | ".join(cells) + " |")
            for c in columns:
                value = runs[c].results.get(task, {}).get(metric)
                if value is None:
                    continue
                evals.append(EvalResult(
                    task_type="text-generation", task_name=task, dataset_type=task, dataset_name=task,
                    metric_type=metric, metric_value=round(value, 4),
                    metric_name=f"{metric} ({'this model' if c == 'pruned' else 'base model, same settings'})",
                    metric_args={"num_fewshot": ref.settings.get("num_fewshot"), "lm_eval": ref.versions["lm_eval"]},
                ))
    s = ref.settings
    lines += [
        "",
        f"lm-evaluation-harness {ref.versions['lm_eval']} (`simple_evaluate`, HFLM on the in-memory model), "
        f"{s.get('num_fewshot')}-shot, limit {s.get('limit')}, max_length {s.get('max_length')}, seed {s.get('seed')}; "
        "documents and task hashes: "
        + ", ".join(f"{t} {ref.n_samples.get(t)} docs `{str(ref.task_hashes.get(t))[:12]}` (v{ref.versions.get(t)})"
                    for t in ref.results) + ".",
    ]
    return "\n".join(lines), evals
