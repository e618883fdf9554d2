"""Publishing a (pruned) checkpoint with its evidence: one Hub commit, or a local folder.

:func:`push_to_hub` writes the checkpoint (``save_pretrained``, safetensors), the model
card (``README.md``, see :mod:`hf_layerswap.card`), the swap report sidecar
(``layerswap_report.json``), the perplexity sidecar, the sparsity report sidecar
(``layerswap_sparsity.json``, after one-shot pruning) and the plots into a temporary folder,
then calls ``HfApi.create_repo(exist_ok=True)`` and ONE ``HfApi.upload_folder`` commit.
It never calls transformers' ``model.push_to_hub`` (that writes its own generic
``README.md`` over the card).

Guarantees:

- refusal before any network call: a model whose surgery invariants fail
  (:func:`~hf_layerswap.surgery.check_surgery_invariants`), a report that does not belong to the
  model (:func:`~hf_layerswap.card.report_mismatches`), a removal chosen on non-finite
  values (:func:`~hf_layerswap.card.nonfinite_basis`), bad evaluation input (no contract, two
  contracts, or results of other weights: :func:`~hf_layerswap.card.evaluation_mismatches`), a
  bad repo id;
- one commit or none: the commit names the head it was prepared against
  (``parent_commit``), so a concurrent writer or a replayed request cannot stack a second
  commit; transient server errors (408, 429, 5xx, dropped connections) are retried by
  huggingface_hub's own backoff; a request whose answer was lost but whose commit landed
  is recognised by comparing the repository head with the pushed files. (With
  ``HF_HUB_DISABLE_XET=1`` huggingface_hub 2.4 commits through ``create_commit``, which
  retries the preupload call but not the commit call: a failing commit then surfaces at
  once, still as one error and no commit.) The folder is a dozen files, far below the
  size at which huggingface_hub's pipelined upload splits a commit;
- the token is passed to ``HfApi`` only: it is never written to a file or a log line.

:func:`save_for_hub` writes the same folder locally (atomically: a staging sibling folder
moved into place), for the CLI and for publishing by other means. Staging folders are named
:data:`STAGING_PREFIX` ``+ <target name>.<kind>-<random>``, hold ``config.json`` only once
every other file is written (until then it waits as :data:`HELD_CONFIG`, so an interrupted
save is never loadable as a checkpoint), and are locked (``flock``) while their save runs; a
killed save's folder is removed by the next save into the same parent
(:func:`remove_stale_staging`; only names with our exact prefix, only unlocked ones). The ``push`` verb of
``hf-layerswap`` (:mod:`hf_layerswap.cli.push`) calls :func:`push_to_hub` and :func:`save_for_hub`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from huggingface_hub import CommitInfo, HfApi
from huggingface_hub.errors import HFValidationError, HfHubHTTPError
from huggingface_hub.hf_api import RepoFile
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError

from .card import (
    evaluation_mismatches,
    nonfinite_basis,
    normalize_evaluation,
    report_mismatches,
    sparsity_mismatches,
    sparsity_refusal,
    write_card_files,
)
from .card.evaluation import is_eval_result
from .surgery.history import history_problems, probable_cause
from .utils.jsonio import carry_over, move_into_place, remove_stale_staging, staging_folder, unlock
from .utils.provenance import __version__
from .recovery import recovery_entry
from .utils.jsonio import default_mode
from .scoring.report import SwapReport
from .scoring.rule import NONFINITE_ADVICE
from .sparsity import SparsityReport, config_record, sparsity_in_model
from .surgery.removal import check_surgery_invariants

__all__ = [
    "HELD_CONFIG",
    "OWNED_PATTERNS",
    "HubPushError",
    "PushRefusedError",
    "owned_stale",
    "push_to_hub",
    "read_evaluation_file",
    "save_for_hub",
]

logger = logging.getLogger(__name__)

#: Files a push (or ``save_for_hub(..., overwrite=True)``) replaces as a set: stale ones
#: matching these patterns (older weight shards, sidecars, plots) are deleted in the same
#: commit (locally: only such files at the top of the folder, where a save writes them).
#: Other files are left alone.
OWNED_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "layerswap_*"]


#: What ``config.json`` is called inside a folder being written, until every other file is
#: there: without ``config.json`` no loader takes the folder for a checkpoint.
HELD_CONFIG = "config.json.held-until-complete"


class PushRefusedError(ValueError):
    """The model, report or arguments cannot be published; raised before any network call."""


class HubPushError(RuntimeError):
    """The upload failed after huggingface_hub's retries.

    Attributes:
        repo_id, revision: the target.
        committed: ``False`` = the repository is unchanged; ``None`` = unknown (the head
            moved for another reason, or it could not be read back).
    """

    def __init__(self, message: str, *, repo_id: str, revision: str, committed: bool | None):
        super().__init__(message)
        self.repo_id, self.revision, self.committed = repo_id, revision, committed


#: The HTTP clients huggingface_hub has used (``httpx2`` from 2.0, ``httpx`` in 1.x): the
#: base error class of whichever it imported is what a connection failure raises.
_HTTP_CLIENTS = ("httpx2", "httpx")


def _http_client_errors() -> tuple[type[BaseException], ...]:
    """The base error classes (``HTTPError``) of the HTTP clients huggingface_hub imported,
    so a push works with either generation of it without importing a client itself."""
    return tuple(sys.modules[name].HTTPError for name in _HTTP_CLIENTS
                 if name in sys.modules and isinstance(getattr(sys.modules[name], "HTTPError", None), type))


# ---------------------------------------------------------------------- checks
def _preflight(model, repo_id, report, evaluation, revision, commit_message, sparsity_report=None):
    """Every local check; raises PushRefusedError (or TypeError) and returns
    ``(evaluation, sparsity_report)`` (the latter defaulting to the model's own)."""
    if not (hasattr(model, "save_pretrained") and hasattr(model, "config")):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    if repo_id is not None:
        try:
            validate_repo_id(repo_id)
        except HFValidationError as err:
            raise PushRefusedError(f"repo_id={repo_id!r} is not a valid Hub repository id: {err}") from None
        if "/" not in repo_id:
            raise PushRefusedError(f"repo_id={repo_id!r}: give the namespace too, as 'owner/name'")
    if revision is not None and (not isinstance(revision, str) or not revision.strip()):
        raise PushRefusedError(f"revision={revision!r}: a branch name, or None for 'main'")
    if commit_message is not None and (not isinstance(commit_message, str) or not commit_message.strip()):
        raise PushRefusedError(f"commit_message={commit_message!r}: must be a non-empty string")
    problems = check_surgery_invariants(model)
    if problems:
        raise PushRefusedError("the model's surgery invariants do not hold: " + "; ".join(problems))

    problems = history_problems(model)
    if problems:
        raise PushRefusedError(
            "config.layerswap does not describe this model, so its removal history cannot be published as verified ("
            + "; ".join(problems) + f"; probable cause: {probable_cause(problems)}); call "
            "hf_layerswap.surgery.history.mark_history_unverified(model) to publish it as unverified history"
        )
    if report is not None:
        if not isinstance(report, SwapReport):
            raise TypeError(f"report must be a SwapReport, got {type(report).__name__}")
        problems = report_mismatches(model, report)
        if problems:
            raise PushRefusedError("the report does not belong to this model: " + "; ".join(problems))
    problems = nonfinite_basis(model, report)
    if problems:
        raise PushRefusedError(
            "the removal was chosen on non-finite values: " + "; ".join(problems)
            + f"; {NONFINITE_ADVICE}, then select again (or remove explicit layers)"
        )
    if sparsity_report is None:
        sparsity_report = _attached_sparsity_report(model)
    problems = sparsity_mismatches(model, sparsity_report)
    if problems:
        raise PushRefusedError(sparsity_refusal(problems, sparsity_report))
    recovery = (getattr(model.config, "layerswap", None) or {}).get("recovery") or {}
    method = recovery_entry(recovery.get("method"))
    if method is not None and method.attaches(recovery) and not method.attached(model):
        raise PushRefusedError(
            f"config.layerswap records {method.name} recovery modules at boundaries {recovery.get('boundaries')} but none "
            "is attached, so the published folder would lack them: load the checkpoint with hf_layerswap imported "
            "(or call hf_layerswap.surgery.attach_saved_recovery(model, path)), or detach_recovery(model) to publish "
            "the plainly pruned model"
        )
    try:
        evaluation = normalize_evaluation(evaluation)
    except ValueError as err:
        raise PushRefusedError(str(err)) from None
    problems = evaluation_mismatches(model, evaluation, report)
    if problems:
        raise PushRefusedError("the evaluation does not belong to this model: " + "; ".join(problems))
    return evaluation, sparsity_report


def _attached_sparsity_report(model):
    """``model.layerswap_sparsity_report`` when the config's summary still describes it
    (the summary is what ``sparsify`` keeps up to date; a report it no longer matches, or
    one whose summary was deleted, is not published by default)."""
    report = getattr(model, "layerswap_sparsity_report", None)
    recorded = getattr(model.config, "layerswap_sparsity", None)
    if not isinstance(report, SparsityReport) or not isinstance(recorded, dict):
        return None
    mine = config_record(report)
    return report if all(recorded.get(k) == v for k, v in mine.items()) else None


def _write_folder(
    folder: Path, model, *, tokenizer, report, evaluation, base_model, license, repo_id, sparsity_report, tasks=None
) -> list[str]:
    """save_pretrained + tokenizer + card, plots and sidecars; returns the file names.
    ``config.json`` is held back under :data:`HELD_CONFIG` until the last step."""
    model.save_pretrained(folder)
    os.replace(folder / "config.json", folder / HELD_CONFIG)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    stray = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
    if stray:
        raise PushRefusedError(f"save_pretrained wrote non-safetensors weights {stray}; only safetensors are published")
    write_card_files(
        folder, model, report=report, evaluation=evaluation, base_model=base_model, license=license,
        repo_id=repo_id, tokenizer_included=tokenizer is not None, sparsity_report=sparsity_report, tasks=tasks,
    )
    os.replace(folder / HELD_CONFIG, folder / "config.json")  # last: now the folder is a checkpoint
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def default_commit_message(model) -> str:
    """The commit message :func:`push_to_hub` uses when none is given: what was removed
    (0-based blocks of the original count) and how sparse the model is."""
    record = getattr(model.config, "layerswap", None) or {}
    sparse = getattr(model.config, "layerswap_sparsity", None) or {}
    sparsity = ""
    if sparse:
        kept = record.get("kept_layers") or sparse["original_blocks"]
        sparsity = f", {100 * sparsity_in_model(sparse, kept):.1f}% sparse ({sparse['method']})"
    if record.get("removed_layers"):
        return (
            f"Upload layer-pruned model: blocks {record['removed_layers']} of "
            f"{record['original_num_hidden_layers']} removed{sparsity} (hf_layerswap)"
        )
    if sparse:
        return f"Upload sparsified model{sparsity} (hf_layerswap)"
    return "Upload model with swap-KL diagnostics (hf_layerswap)"


_default_message = default_commit_message


# ---------------------------------------------------------------------- push
def push_to_hub(
    model,
    repo_id: str,
    *,
    tokenizer=None,
    report: SwapReport | None = None,
    evaluation=None,
    private: bool = False,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    base_model: str | None = None,
    license: str | None = None,
    sparsity_report=None,
    tasks=None,
):
    """Publish a (pruned) model with its model card and diagnostics in one Hub commit.

    Args:
        model: a transformers causal LM, usually pruned by :func:`~hf_layerswap.remove_layers`
            or ``from_pretrained(..., quantization_config=LayerSwapConfig(...))``.
        repo_id: ``"owner/name"``; created if missing (``private`` applies then).
        tokenizer: saved next to the weights when given.
        report: the :class:`SwapReport` the removal was selected from; written to
            ``layerswap_report.json`` and shown on the card.
        evaluation: ``{"base": ..., "pruned": ...}`` perplexity results
            (``PerplexityResult``, their dicts, or ``hf-layerswap eval`` results), shown on the
            card and in ``model-index``; each must record its contract (both the same one) and
            the weights it measured: ``base`` the scored base model, ``pruned`` this model.
        private: create the repository as private (an existing one keeps its visibility).
        token: Hub token; default: huggingface_hub's (``HF_TOKEN`` or ``hf auth login``).
            It is handed to ``HfApi`` and never written or logged.
        revision: branch to commit to (created from ``main`` if missing); default ``main``.
        commit_message: default names the removed blocks.
        endpoint: Hub URL; default huggingface_hub's (``HF_ENDPOINT``).
        base_model, license: override what the card infers (see :func:`~hf_layerswap.card.render_card`).
        sparsity_report: the :class:`~hf_layerswap.sparsity.SparsityReport` of one-shot
            pruning; default ``model.layerswap_sparsity_report`` (left by ``sparsify``, e.g.
            through ``LayerSwapConfig(sparsity=...)``) while ``config.layerswap_sparsity``
            still summarises it. Written to ``layerswap_sparsity.json`` and
            shown on the card; without one the card still shows the summary ``sparsify``
            left in ``config.layerswap_sparsity``.
        tasks: ``{"base": ..., "pruned": ...}`` lm-eval results from
            :func:`~hf_layerswap.evaluate_tasks`, shown as a table and in ``model-index``.

    Returns:
        The ``huggingface_hub.CommitInfo`` of the commit (``.oid``, ``.commit_url``). When
        nothing changed since the last push, huggingface_hub makes no commit and the
        current head is returned.

    Raises:
        PushRefusedError: failed surgery invariants, a report or sparsity report of
            another model (or of weights changed since), a removal chosen on non-finite
            values (:func:`~hf_layerswap.card.nonfinite_basis`), a bad
            ``repo_id``/``revision``/``commit_message``, an ``evaluation`` without a contract,
            under two contracts or of other weights (:func:`~hf_layerswap.card.evaluation_mismatches`);
            raised before any network call, nothing is written.
        TypeError: ``model``, ``report`` or ``sparsity_report`` of the wrong type.
        HubPushError: the Hub refused or kept failing after huggingface_hub's retries;
            ``.committed`` says whether the repository is unchanged.
    """
    evaluation, sparsity_report = _preflight(
        model, repo_id, report, evaluation, revision, commit_message, sparsity_report
    )
    message = commit_message or _default_message(model)
    branch = revision or "main"
    with tempfile.TemporaryDirectory(prefix="hf_layerswap_push_") as tmp:
        folder = Path(tmp)
        files = _write_folder(
            folder, model, tokenizer=tokenizer, report=report, evaluation=evaluation, base_model=base_model,
            license=license, repo_id=repo_id, sparsity_report=sparsity_report, tasks=tasks,
        )
        api = HfApi(endpoint=endpoint, token=token, library_name="hf_layerswap", library_version=__version__)
        logger.info("pushing %d files to %s/%s@%s", len(files), api.endpoint, repo_id, branch)
        network_errors: tuple[type[BaseException], ...] = (HfHubHTTPError, *_http_client_errors(), OSError, ValueError)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            if branch != "main":
                api.create_branch(repo_id, branch=branch, exist_ok=True)
            parent = api.repo_info(repo_id, revision=branch).sha
        except network_errors as err:
            raise HubPushError(
                f"could not prepare {repo_id}@{branch} on {api.endpoint}: {err}. Nothing was committed.",
                repo_id=repo_id, revision=branch, committed=False,
            ) from err
        try:
            return api.upload_folder(
                repo_id=repo_id, folder_path=folder, commit_message=message, revision=branch,
                parent_commit=parent, delete_patterns=OWNED_PATTERNS,
            )
        except network_errors as err:
            landed, state = _state_after_failure(api, repo_id, branch, parent, folder)
            if landed is not None:
                logger.warning("the answer to the commit request was lost, but %s@%s holds the pushed files", repo_id, branch)
                return landed
            committed = False if state.startswith("no commit") else None
            raise HubPushError(
                f"pushing to {repo_id}@{branch} on {api.endpoint} failed after huggingface_hub's retries: {err}. "
                f"{state}. Re-running push_to_hub is safe.",
                repo_id=repo_id, revision=branch, committed=committed,
            ) from err


def _state_after_failure(api, repo_id, branch, parent, folder):
    """(CommitInfo if our commit landed else None, a sentence on the repository state)."""
    try:
        head = api.repo_info(repo_id, revision=branch).sha
    except Exception as err:  # the state cannot be read back; say so instead of guessing
        return None, f"The repository state could not be read back ({type(err).__name__})"
    if head == parent:
        return None, f"no commit was made: {repo_id}@{branch} is unchanged (head {head[:12]})"
    try:
        matches = _head_matches_folder(api, repo_id, head, folder)
    except Exception:  # listing failed: the head moved, the cause is unknown
        matches = False
    if matches:
        info = CommitInfo(
            commit_url=f"{api.endpoint}/{repo_id}/commit/{head}", commit_message="", commit_description="",
            oid=head, _endpoint=api.endpoint,
        )
        return info, "the commit landed"
    return None, f"The head of {repo_id}@{branch} moved from {parent[:12]} to {head[:12]} and does not hold the pushed files"


def _head_matches_folder(api, repo_id, head, folder: Path) -> bool:
    """Whether every local file is at ``head`` with the same content (git sha1 or LFS sha256)."""
    remote = {
        entry.path: entry
        for entry in api.list_repo_tree(repo_id, revision=head, recursive=True)
        if isinstance(entry, RepoFile)
    }
    for path in folder.rglob("*"):
        if not path.is_file():
            continue
        entry = remote.get(str(path.relative_to(folder)))
        if entry is None:
            return False
        if entry.lfs is not None:
            if _file_digest(path, hashlib.sha256()) != entry.lfs.sha256:
                return False
        elif _file_digest(path, hashlib.sha1(b"blob %d\0" % path.stat().st_size)) != entry.blob_id:
            return False
    return True


def _file_digest(path: Path, digest) -> str:
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------- local folder
def save_for_hub(
    model,
    directory: str | os.PathLike,
    *,
    tokenizer=None,
    report: SwapReport | None = None,
    evaluation=None,
    base_model: str | None = None,
    license: str | None = None,
    repo_id: str | None = None,
    overwrite: bool = False,
    sparsity_report=None,
    tasks=None,
) -> Path:
    """Write the folder :func:`push_to_hub` would upload into ``directory``, atomically.

    The files are written into a temporary sibling folder that is moved into place in
    one rename, so ``directory`` never holds a half-written checkpoint. Without
    ``overwrite`` the target is checked before the work and again by the rename itself
    (:func:`~hf_layerswap.utils.jsonio.move_into_place`): of two processes saving into one folder
    at once, exactly one succeeds and the other raises ``FileExistsError``, leaving the
    first one's folder as it is.

    With ``overwrite`` an existing folder keeps everything this save does not replace
    (a ``notes.md``, a ``data/`` folder): replaced are the files this save writes and,
    at the top of the folder, stale files of an earlier save matching
    :data:`OWNED_PATTERNS` (weight shards and their index, ``layerswap_*`` sidecars,
    plots and operators), as :func:`push_to_hub` replaces them on the Hub. The kept
    entries are hard-linked into the staged folder before the one rename
    (:func:`~hf_layerswap.utils.jsonio.carry_over`), so the swap stays a single step.

    Args:
        directory: target folder; it must not exist or be empty unless ``overwrite``.
        overwrite: save into an existing folder, replacing only what this save writes
            and its own stale files (see above).
        repo_id: the Hub id the folder is meant for (used in the card's loading snippet).
        others: as in :func:`push_to_hub`.

    Returns:
        The folder path.

    Raises:
        PushRefusedError, TypeError: as in :func:`push_to_hub`.
        FileExistsError: ``directory`` is a non-empty folder (or a file) and ``overwrite`` is
            False, before the work or (written meanwhile by another process) at the final rename.
        OSError: a write failed (a full disk, also inside safetensors): the message names
            the folder and says that nothing was written to it.
    """
    target = Path(directory).resolve()
    evaluation, sparsity_report = _preflight(model, repo_id, report, evaluation, None, None, sparsity_report)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise FileExistsError(f"{target} exists and is not an empty folder: choose another folder, or pass "
                              "overwrite=True to save into it (replacing only the files this save writes)")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target.parent)
    tmp, lock = staging_folder(target, "new")
    try:
        default_mode(tmp)
        _write_folder(
            tmp, model, tokenizer=tokenizer, report=report, evaluation=evaluation, base_model=base_model,
            license=license, repo_id=repo_id, sparsity_report=sparsity_report, tasks=tasks,
        )
        if overwrite and target.is_dir():
            carry_over(target, tmp, replaced=owned_stale)
        move_into_place(tmp, target, overwrite=overwrite)  # checks the target again, at the rename
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, (OSError, SafetensorError)) and not isinstance(err, FileExistsError):
            raise _write_failure(err, target) from err
        raise
    finally:
        unlock(lock)
    return target


def owned_stale(name: str) -> bool:
    """Whether ``name`` (a path relative to a saved folder) is a file an earlier save of
    this library wrote and a new save replaces even when it does not write it again: a
    top-level file matching :data:`OWNED_PATTERNS` (e.g. ``model-00002-of-00002.safetensors``
    after a save into one shard, a ``layerswap_sparsity.json`` of an earlier sparsified model)."""
    return "/" not in name and any(fnmatch.fnmatchcase(name, pattern) for pattern in OWNED_PATTERNS)


def _write_failure(err: BaseException, target: Path) -> OSError:
    """The ``OSError`` a failed write of the folder ``target`` raises (a full disk while
    transformers or safetensors writes the weights, a failing card write): the cause, the
    folder, and that nothing was written there (the staging folder is already removed)."""
    what = f"nothing was written to {target} (its staging folder was removed)"
    if isinstance(err, OSError) and err.errno is not None:
        return OSError(err.errno, f"{err.strerror} while writing {target}; {what}")
    return OSError(f"writing {target} failed ({type(err).__name__}: {' '.join(str(err).split())}); {what}")


def read_evaluation_file(path: str | os.PathLike) -> dict:
    """Read an evaluation file into ``{"base": dict, "pruned": dict}``, checked by
    :func:`~hf_layerswap.card.normalize_evaluation` (no model needed: run it before loading one).

    Accepted: ``layerswap_evaluation.json`` as :func:`save_for_hub` writes it (``base``,
    ``pruned`` and the ``delta_ppl_percent`` derived from them), or ``{"base": ..., "pruned": ...}``
    whose values are ``hf-layerswap eval`` results. Refused (``ValueError`` naming the file):
    not JSON, not an object, other keys (nothing is dropped silently), one model's
    ``hf-layerswap eval`` result on its own (it holds no pair to compare), and everything
    ``normalize_evaluation`` refuses (no contract, two contracts, no perplexity).
    """
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object with 'base'/'pruned' perplexity results")
    if is_eval_result(data):
        name = (data.get("model") or {}).get("name") if isinstance(data.get("model"), dict) else None
        raise ValueError(
            f"{path} is one model's `hf-layerswap eval` result ({name or 'unnamed model'}), not the base/pruned pair "
            "the card compares: write {\"base\": <eval result of the base model>, \"pruned\": <eval result of this "
            "model>} into one file and pass that"
        )
    unknown = sorted(set(data) - {"base", "pruned", "delta_ppl_percent"})
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}: allowed 'base', 'pruned' (and the derived 'delta_ppl_percent')")
    try:
        return normalize_evaluation({k: v for k, v in data.items() if k in ("base", "pruned")}) or {}
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from None
